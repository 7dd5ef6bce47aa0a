"""The admin, member and reader personas against Keystone's, Neutron's, Cinder's and Nova's
default policies (Nova's volume proxy at 2.35 with Cinder's rules):
one request per rule, the status each persona gets (project-scoped tokens)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
from tests.api.cloudproc import RunningCloud
from tests.api.personas import Personas, personas
from tests.api.test_identity import unique

# (what, method, path under the cloud, body, {persona: status}); {P} is the personas' project,
# {U} the persona's own user id, {A} the bootstrap admin's user id.
Row = tuple[str, str, str, Any, dict[str, int]]
_ALL_OK = {"admin": 200, "member": 200, "reader": 200}
_ADMIN_ONLY_READ = {"admin": 200, "member": 403, "reader": 403}
_ADMIN_ONLY_CREATE = {"admin": 201, "member": 403, "reader": 403}
_MEMBER_ACCEPTED = {"admin": 202, "member": 202, "reader": 403}
_ALL_404 = {"admin": 404, "member": 404, "reader": 404}
# A change to what does not exist: the reader is refused before the lookup, as by the policy.
_NO_SUCH_OR_403 = {"admin": 404, "member": 404, "reader": 403}
_NO_SUCH = "00000000-0000-0000-0000-00000000beef"
ROWS: tuple[Row, ...] = (
    # identity
    ("identity:get_user (own)", "GET", "/identity/v3/users/{U}", None, _ALL_OK),
    ("identity:get_user (another)", "GET", "/identity/v3/users/{A}", None, _ADMIN_ONLY_READ),
    ("identity:get_project (own)", "GET", "/identity/v3/projects/{P}", None, _ALL_OK),
    ("identity:list_projects", "GET", "/identity/v3/projects", None, _ADMIN_ONLY_READ),
    ("identity:list_roles", "GET", "/identity/v3/roles", None, _ALL_OK),
    ("identity:list_regions", "GET", "/identity/v3/regions", None, _ALL_OK),
    ("identity:list_services", "GET", "/identity/v3/services", None, _ADMIN_ONLY_READ),
    ("identity:list_endpoints", "GET", "/identity/v3/endpoints", None, _ADMIN_ONLY_READ),
    ("identity:list_groups", "GET", "/identity/v3/groups", None, _ADMIN_ONLY_READ),
    (
        "identity:create_project",
        "POST",
        "/identity/v3/projects",
        lambda: {"project": {"name": unique("rbac")}},
        _ADMIN_ONLY_CREATE,
    ),
    (
        "identity:create_group",
        "POST",
        "/identity/v3/groups",
        lambda: {"group": {"name": unique("rbac")}},
        _ADMIN_ONLY_CREATE,
    ),
    (
        "identity:create_application_credential (own)",
        "POST",
        "/identity/v3/users/{U}/application_credentials",
        lambda: {"application_credential": {"name": unique("rbac"), "roles": [{"name": "reader"}]}},
        {"admin": 201, "member": 201, "reader": 201},
    ),
    (
        "identity:list_application_credentials (another)",
        "GET",
        "/identity/v3/users/{A}/application_credentials",
        None,
        _ADMIN_ONLY_READ,
    ),
    # network
    ("get_quota (own)", "GET", "/networking/v2.0/quotas/{P}", None, _ALL_OK),
    (
        "update_quota",
        "PUT",
        "/networking/v2.0/quotas/{P}",
        {"quota": {"network": 100}},
        _ADMIN_ONLY_READ,
    ),
    ("get_network", "GET", "/networking/v2.0/networks", None, _ALL_OK),
    (
        "create_network",
        "POST",
        "/networking/v2.0/networks",
        lambda: {"network": {"name": unique("rbac")}},
        {"admin": 201, "member": 201, "reader": 403},
    ),
    (
        "create_router",
        "POST",
        "/networking/v2.0/routers",
        lambda: {"router": {"name": unique("rbac")}},
        {"admin": 201, "member": 201, "reader": 403},
    ),
    (
        "create_network:provider:network_type",
        "POST",
        "/networking/v2.0/networks",
        lambda: {"network": {"provider:network_type": "vxlan"}},
        {"admin": 201, "member": 403, "reader": 403},
    ),
    # compute, through its network proxy
    ("os-floating-ips list (2.35)", "GET", "/compute/v2.1/os-floating-ips", None, _ALL_OK),
    # block storage, and compute's volume proxy (2.35): the same rule for both
    ("volume:get_all", "GET", "/volume/v3/{P}/volumes", None, _ALL_OK),
    ("volume:create", "POST", "/volume/v3/{P}/volumes", {"volume": {"size": 1}}, _MEMBER_ACCEPTED),
    (
        "volume:delete (no such)",
        "DELETE",
        f"/volume/v3/{{P}}/volumes/{_NO_SUCH}",
        None,
        _NO_SUCH_OR_403,
    ),
    ("os-volumes list (2.35)", "GET", "/compute/v2.1/os-volumes", None, _ALL_OK),
    ("os-volumes show (no such)", "GET", f"/compute/v2.1/os-volumes/{_NO_SUCH}", None, _ALL_404),
    (
        "os-volumes create (2.35)",
        "POST",
        "/compute/v2.1/os-volumes",
        {"volume": {"size": 1}},
        {"admin": 200, "member": 200, "reader": 403},
    ),
    (
        "os-volumes delete (no such)",
        "DELETE",
        f"/compute/v2.1/os-volumes/{_NO_SUCH}",
        None,
        _NO_SUCH_OR_403,
    ),
    ("os-snapshots list (2.35)", "GET", "/compute/v2.1/os-snapshots/detail", None, _ALL_OK),
    (
        "os-snapshots create (no such volume)",
        "POST",
        "/compute/v2.1/os-snapshots",
        {"snapshot": {"volume_id": _NO_SUCH}},
        _NO_SUCH_OR_403,
    ),
    (
        "os-snapshots delete (no such)",
        "DELETE",
        f"/compute/v2.1/os-snapshots/{_NO_SUCH}",
        None,
        _NO_SUCH_OR_403,
    ),
)


def _body(spec: Any) -> Any:
    return spec() if isinstance(spec, Callable) else spec  # type: ignore[arg-type]


def test_each_persona_gets_keystones_and_neutrons_default_answer(cloud: RunningCloud) -> None:
    team: Personas = personas(cloud, "rbac")
    admin_id = httpx.get(
        f"{cloud.base_url}/identity/v3/users",
        params={"name": "admin"},
        headers={"X-Auth-Token": cloud.token()},
    ).json()["users"][0]["id"]
    got: dict[tuple[str, str], int] = {}
    want: dict[tuple[str, str], int] = {}
    for role in ("admin", "member", "reader"):
        headers = {
            "X-Auth-Token": team.token(role),
            "OpenStack-API-Version": "compute 2.35",
        }
        for what, method, path, body, expected in ROWS:
            url = cloud.base_url + path.format(
                P=team.project["id"], U=team.users[role]["id"], A=admin_id
            )
            response = httpx.request(method, url, headers=headers, json=_body(body), timeout=30)
            got[(what, role)] = response.status_code
            want[(what, role)] = expected[role]
    assert got == want
