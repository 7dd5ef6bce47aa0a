"""Groups: members, group role grants that reach the members' tokens, and effective role
assignments through groups, through the real CLI and the identity API."""

from __future__ import annotations

import httpx
from tests.api.cloudproc import RunningCloud
from tests.api.test_identity import Admin, login, osc_as, unique


def test_a_groups_grant_gives_its_members_the_role_until_they_leave(cloud: RunningCloud) -> None:
    admin = Admin(cloud)
    project = admin.project(unique("gproject"))
    user = admin.user(unique("guser"), "group-secret")
    group = cloud.osc_json("group", "create", unique("team"))
    cloud.osc("group", "add", "user", group["id"], user["id"])
    cloud.osc("role", "add", "--group", group["id"], "--project", project["id"], "member")
    # The member logs in with the group's role only; the CLI then works as it.
    token = login(cloud, user["name"], "group-secret", project["name"])
    listed = osc_as(cloud, user["name"], "group-secret", project["name"], "network", "list")
    assert listed.returncode == 0, listed.stderr
    effective = cloud.osc_json(
        "role",
        "assignment",
        "list",
        "--effective",
        "--user",
        user["id"],
        "--project",
        project["id"],
        "--names",
    )
    assert {row["Role"] for row in effective} == {"member", "reader"}
    direct = cloud.osc_json("role", "assignment", "list", "--group", group["id"])
    assert [(r["Role"], r["Group"], r["Project"]) for r in direct] == [
        (admin.role_id("member"), group["id"], project["id"])
    ]
    raw = admin("GET", "/role_assignments", **{"effective": "", "user.id": user["id"]}).json()
    member_row = next(r for r in raw["role_assignments"] if "prior_role" not in r["links"])
    assert member_row["links"]["membership"].endswith(f"/groups/{group['id']}/users/{user['id']}")
    # The user reads its own groups; a member may not make groups.
    mine = Admin(cloud, token)("GET", f"/users/{user['id']}/groups").json()["groups"]
    assert [g["id"] for g in mine] == [group["id"]]
    refused = Admin(cloud, token)("POST", "/groups", {"group": {"name": unique("no")}})
    assert refused.status_code == 403
    # Leaving the group revokes the tokens it gave and the role with them.
    cloud.osc("group", "remove", "user", group["id"], user["id"])
    headers = {"X-Auth-Token": token}
    assert (
        httpx.get(f"{cloud.base_url}/networking/v2.0/networks", headers=headers).status_code == 401
    )
    body = {
        "auth": {
            "identity": {
                "methods": ["password"],
                "password": {"user": {"id": user["id"], "password": "group-secret"}},
            },
            "scope": {"project": {"id": project["id"]}},
        }
    }
    assert httpx.post(f"{cloud.base_url}/identity/v3/auth/tokens", json=body).status_code == 401
    assert admin("HEAD", f"/groups/{group['id']}/users/{user['id']}").status_code == 404
    cloud.osc("group", "delete", group["id"])
    assert admin("GET", f"/groups/{group['id']}").status_code == 404


def test_group_names_are_unique_per_domain_and_grants_idempotent(cloud: RunningCloud) -> None:
    admin = Admin(cloud)
    name = unique("dup")
    group = admin("POST", "/groups", {"group": {"name": name}}).json()["group"]
    assert admin("POST", "/groups", {"group": {"name": name}}).status_code == 409
    project = admin.project(unique("gp"))
    path = f"/projects/{project['id']}/groups/{group['id']}/roles/{admin.role_id('reader')}"
    assert admin("PUT", path).status_code == 204
    assert admin("PUT", path).status_code == 204
    assert admin("HEAD", path).status_code == 204
    roles = admin("GET", f"/projects/{project['id']}/groups/{group['id']}/roles").json()
    assert [r["name"] for r in roles["roles"]] == ["reader"]
    assert admin("DELETE", path).status_code == 204
    assert admin("HEAD", path).status_code == 404
    assert admin("DELETE", f"/groups/{group['id']}").status_code == 204


def test_a_group_keeps_attributes_keystone_does_not_know(cloud: RunningCloud) -> None:
    """Keystone's group schema allows additional properties (Tempest creates groups with a
    project_id): stored, shown and updated as they came."""
    admin = Admin(cloud)
    made = admin("POST", "/groups", {"group": {"name": unique("grp"), "project_id": "p1"}})
    assert made.status_code == 201, made.text
    group = made.json()["group"]
    assert group["project_id"] == "p1"
    changed = admin("PATCH", f"/groups/{group['id']}", {"group": {"project_id": "p2"}})
    assert changed.json()["group"]["project_id"] == "p2"
    assert admin("GET", f"/groups/{group['id']}").json()["group"]["project_id"] == "p2"
    assert admin("DELETE", f"/groups/{group['id']}").status_code == 204
