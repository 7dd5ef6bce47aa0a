"""Network quotas (Neutron's quotas, quota_details, quota-check-limit), availability zones,
extension names, and server security groups by name: the real CLI as each persona."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import httpx
import pytest
from tests.api.cloudproc import RunningCloud
from tests.api.personas import Personas, personas
from tests.api.test_identity import unique


@pytest.fixture(scope="module")
def team(cloud: RunningCloud) -> Personas:
    return personas(cloud, "netq")


def _json(result: subprocess.CompletedProcess[str]) -> Any:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _limits(rows: list[dict[str, object]]) -> dict[str, object]:
    return {str(row["Resource"]): row["Limit"] for row in rows}


def test_quota_show_default_and_usage_through_the_cli(cloud: RunningCloud, team: Personas) -> None:
    pid = team.project["id"]
    shown = _limits(cloud.osc_json("quota", "show", "--network", pid))
    expected = {"networks": 100, "subnets": 100, "ports": 500, "security_groups": 10}
    assert {k: shown[k] for k in expected} == expected
    assert _limits(cloud.osc_json("quota", "show", "--network", "--default", pid))["ports"] == 500
    team.osc("member", "network", "create", unique("counted"))
    usage = {row["Resource"]: row for row in cloud.osc_json("quota", "show", "--usage", pid)}
    assert usage["networks"]["In Use"] == 1
    assert usage["networks"]["Limit"] == 100
    # The reader of the project reads its quota; not another project's.
    reader = {"X-Auth-Token": team.token("reader")}
    base = f"{cloud.base_url}/networking/v2.0/quotas"
    assert httpx.get(f"{base}/{pid}/details", headers=reader).json()["quota"]["network"] == {
        "limit": 100,
        "used": 1,
        "reserved": 0,
    }
    denied = httpx.get(f"{base}/{cloud.osc_json('project', 'show', 'admin')['id']}", headers=reader)
    assert denied.status_code == 403
    assert denied.json()["NeutronError"]["type"] == "PolicyNotAuthorized"


def test_a_network_quota_is_enforced_and_only_an_admin_sets_it(
    cloud: RunningCloud, team: Personas
) -> None:
    pid = team.project["id"]
    base = f"{cloud.base_url}/networking/v2.0"
    admin = {"X-Auth-Token": cloud.token()}
    member = {"X-Auth-Token": team.token("member")}
    refused = httpx.put(f"{base}/quotas/{pid}", headers=member, json={"quota": {"network": 7}})
    assert refused.status_code == 403
    assert "update_quota is disallowed by policy" in refused.text
    used = httpx.get(f"{base}/quotas/{pid}/details", headers=admin).json()["quota"]
    in_use = used["network"]["used"]
    cloud.osc("quota", "set", "--networks", str(in_use + 1), pid)
    last = httpx.post(f"{base}/networks", headers=member, json={"network": {"name": "last"}})
    assert last.status_code == 201, last.text
    over = team.osc("member", "network", "create", unique("over"))
    assert over.returncode != 0
    assert "Quota exceeded for resources: ['network']" in over.stderr
    # check_limit (the CLI's default) refuses a limit below the usage; force sets it.
    below = cloud.osc("quota", "set", "--networks", "0", pid, check=False)
    assert below.returncode != 0
    assert "greater than the limit" in below.stderr
    forced = httpx.put(
        f"{base}/quotas/{pid}", headers=admin, json={"quota": {"network": 0, "force": True}}
    )
    assert forced.json()["quota"]["network"] == 0
    # DELETE resets to the defaults; the admin's list holds the projects that differ.
    listed = httpx.get(f"{base}/quotas", headers=admin).json()["quotas"]
    assert pid in {q["project_id"] for q in listed}
    assert httpx.delete(f"{base}/quotas/{pid}", headers=admin).status_code == 204
    assert httpx.get(f"{base}/quotas/{pid}", headers=admin).json()["quota"]["network"] == 100
    bad = httpx.put(f"{base}/quotas/{pid}", headers=admin, json={"quota": {"x": 1}})
    assert bad.status_code == 400
    assert bad.json()["NeutronError"]["message"] == "Unrecognized attribute(s) 'x'"


def test_ports_and_security_groups_count_against_their_quotas(
    cloud: RunningCloud, team: Personas
) -> None:
    pid = team.project["id"]
    base = f"{cloud.base_url}/networking/v2.0"
    admin = {"X-Auth-Token": cloud.token()}
    used = httpx.get(f"{base}/quotas/{pid}/details", headers=admin).json()["quota"]
    limits = {"security_group": used["security_group"]["used"], "port": used["port"]["used"]}
    assert httpx.put(f"{base}/quotas/{pid}", headers=admin, json={"quota": limits}).is_success
    try:
        over = team.osc("member", "security", "group", "create", unique("sg"))
        assert over.returncode != 0
        assert "Quota exceeded for resources: ['security_group']" in over.stderr
        member = {"X-Auth-Token": team.token("member")}
        net = httpx.post(f"{base}/networks", headers=member, json={"network": {}}).json()
        port = {"port": {"network_id": net["network"]["id"]}}
        refused = httpx.post(f"{base}/ports", headers=member, json=port)
        assert refused.status_code == 409
        assert refused.json()["NeutronError"]["type"] == "OverQuota"
    finally:
        httpx.delete(f"{base}/quotas/{pid}", headers=admin)


def test_availability_zones_and_extension_names_as_neutron_spells_them(
    cloud: RunningCloud, team: Personas
) -> None:
    zones = _json(team.osc("reader", "availability", "zone", "list", "--network", "-f", "json"))
    assert zones == [{"Zone Name": "nova", "Zone Status": "available"}]
    names = {e["Alias"]: e["Name"] for e in cloud.osc_json("extension", "list", "--network")}
    assert names["external-net"] == "Neutron external network"
    assert names["quotas"] == "Quota management support"
    assert names["availability_zone"] == "Availability Zone"
    token = cloud.token()
    bad = httpx.get(
        f"{cloud.base_url}/networking/v2.0/availability_zones",
        params={"colour": "red"},
        headers={"X-Auth-Token": token},
    )
    assert bad.status_code == 400


def test_a_servers_security_groups_are_shown_by_name(cloud: RunningCloud) -> None:
    group = cloud.osc_json("security", "group", "create", unique("web"))
    server = cloud.boot(unique("sg-vm"), "--security-group", group["id"])
    shown = cloud.osc_json("server", "show", server["id"])
    assert shown["security_groups"] == [{"name": group["name"]}]
    flavor = cloud.osc_json("flavor", "show", "m1.tiny")["id"]
    image = cloud.osc_json("image", "show", "cirros-0.6.2-x86_64-disk")["id"]
    body = {
        "server": {
            "name": unique("x"),
            "flavorRef": flavor,
            "imageRef": image,
            "networks": "none",
            "security_groups": [{"name": "no-such-group"}],
        }
    }
    missing = cloud.compute("POST", "/servers", json=body)
    assert missing.status_code == 400
    assert "no-such-group" in missing.text
    cloud.osc("server", "delete", "--wait", server["id"])
