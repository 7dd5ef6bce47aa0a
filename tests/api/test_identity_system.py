"""System scope: role grants on the system, system-scoped tokens, and the system reader who
reads every identity resource and changes none."""

from __future__ import annotations

from typing import Any

import httpx
from tests.api.cloudproc import RunningCloud
from tests.api.test_identity import Admin, unique


def _system_token(cloud: RunningCloud, user_id: str, password: str) -> httpx.Response:
    body: dict[str, Any] = {
        "auth": {
            "identity": {
                "methods": ["password"],
                "password": {"user": {"id": user_id, "password": password}},
            },
            "scope": {"system": {"all": True}},
        }
    }
    return httpx.post(f"{cloud.base_url}/identity/v3/auth/tokens", json=body)


def test_a_system_reader_reads_everything_and_changes_nothing(cloud: RunningCloud) -> None:
    admin = Admin(cloud)
    user = admin.user(unique("sysreader"), "system-secret")
    assert _system_token(cloud, user["id"], "system-secret").status_code == 401
    path = f"/system/users/{user['id']}/roles/{admin.role_id('reader')}"
    assert admin("PUT", path).status_code == 204
    assert admin("HEAD", path).status_code == 204
    issued = _system_token(cloud, user["id"], "system-secret")
    assert issued.status_code == 201, issued.text
    token = issued.json()["token"]
    assert token["system"] == {"all": True}
    assert "project" not in token
    assert {r["name"] for r in token["roles"]} == {"reader"}
    reader = Admin(cloud, issued.headers["x-subject-token"])
    assert reader("GET", "/auth/system").json()["system"] == [{"all": True}]
    users = {u["name"] for u in reader("GET", "/users").json()["users"]}
    assert {"admin", "demo", user["name"]} <= users
    assert reader("GET", "/domains/default").status_code == 200
    assert reader("GET", "/endpoints").status_code == 200
    refused = reader("POST", "/projects", {"project": {"name": unique("no")}})
    assert refused.status_code == 403
    listed = admin("GET", "/role_assignments", **{"scope.system": "all"}).json()
    assert {"user": {"id": user["id"]}, "role": {"id": admin.role_id("reader")}} in [
        {"user": r["user"], "role": r["role"]} for r in listed["role_assignments"]
    ]
    # Revoking the grant revokes the system-scoped tokens that carried it.
    assert admin("DELETE", path).status_code == 204
    assert reader("GET", "/users").status_code == 401
    assert admin("DELETE", path).status_code == 404


def test_a_groups_system_role_gives_its_members_system_tokens(cloud: RunningCloud) -> None:
    admin = Admin(cloud)
    user = admin.user(unique("sysgroup"), "system-secret")
    group = cloud.osc_json("group", "create", unique("auditors"))
    cloud.osc("group", "add", "user", group["id"], user["id"])
    assert _system_token(cloud, user["id"], "system-secret").status_code == 401
    cloud.osc("role", "add", "--group", group["id"], "--system", "all", "reader")
    reader = admin.role_id("reader")
    assert admin("HEAD", f"/system/groups/{group['id']}/roles/{reader}").status_code == 204
    listed = admin("GET", f"/system/groups/{group['id']}/roles").json()["roles"]
    assert [r["name"] for r in listed] == ["reader"]
    issued = _system_token(cloud, user["id"], "system-secret")
    assert issued.status_code == 201, issued.text
    token = issued.headers["x-subject-token"]
    assert {r["name"] for r in issued.json()["token"]["roles"]} == {"reader"}
    # A system reader reads every user, and changes nothing.
    as_reader = Admin(cloud, token)
    assert as_reader("GET", "/users").status_code == 200
    assert as_reader("PUT", f"/system/groups/{group['id']}/roles/{reader}").status_code == 403
    # Leaving the group ends the system tokens it gave.
    cloud.osc("group", "remove", "user", group["id"], user["id"])
    assert as_reader("GET", "/users").status_code == 401
    cloud.osc("group", "add", "user", group["id"], user["id"])
    token = _system_token(cloud, user["id"], "system-secret").headers["x-subject-token"]
    cloud.osc("role", "remove", "--group", group["id"], "--system", "all", "reader")
    assert Admin(cloud, token)("GET", "/users").status_code == 401
    assert _system_token(cloud, user["id"], "system-secret").status_code == 401
    assert admin("HEAD", f"/system/groups/{group['id']}/roles/{reader}").status_code == 404
