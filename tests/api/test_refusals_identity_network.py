"""What identity and network do not offer is refused as Keystone and Neutron refuse it: core
Keystone APIs with a 501, missing extensions (Keystone's and Neutron's) with a 404, and no
extension advertised that is not served."""

from __future__ import annotations

import httpx
import pytest
from tests.api.cloudproc import RunningCloud

_KEYSTONE_CORE = ("/domains/default/config",)
_KEYSTONE_EXTENSIONS = ("/OS-EP-FILTER/endpoint_groups", "/OS-TRUST/trusts")
_NEUTRON_MISSING = {
    "qos": "/qos/policies",
    "address-scope": "/address-scopes",
}


@pytest.fixture(scope="module")
def headers(cloud: RunningCloud) -> dict[str, str]:
    return {"X-Auth-Token": cloud.token()}


def test_keystone_core_apis_not_offered_are_501_and_extensions_404(
    cloud: RunningCloud, headers: dict[str, str]
) -> None:
    base = f"{cloud.base_url}/identity/v3"
    for path in _KEYSTONE_CORE:
        response = httpx.get(f"{base}{path}", headers=headers)
        assert response.status_code == 501, path
        assert response.json()["error"]["title"] == "Not Implemented"
    for path in _KEYSTONE_EXTENSIONS:
        assert httpx.get(f"{base}{path}", headers=headers).status_code == 404, path


def test_neutron_resources_of_extensions_not_advertised_are_404(
    cloud: RunningCloud, headers: dict[str, str]
) -> None:
    base = f"{cloud.base_url}/networking/v2.0"
    aliases = {
        e["alias"] for e in httpx.get(f"{base}/extensions", headers=headers).json()["extensions"]
    }
    for alias, path in _NEUTRON_MISSING.items():
        assert alias not in aliases
        response = httpx.get(f"{base}{path}", headers=headers)
        assert response.status_code == 404, path
        assert "NeutronError" in response.json()
    # What is advertised answers.
    for alias, path in {
        "quotas": "/quotas",
        "availability_zone": "/availability_zones",
        "router": "/routers",
        "network-ip-availability": "/network-ip-availabilities",
        "auto-allocated-topology": "/auto-allocated-topology/x?fields=dry-run",
        "subnet_allocation": "/subnetpools",
    }.items():
        assert alias in aliases
        assert httpx.get(f"{base}{path}", headers=headers).status_code == 200, path
