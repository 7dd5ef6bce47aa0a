"""Inherited role grants (OS-INHERIT): given with the real CLI's --inherited, held on the
projects below the target and not on the target, in tokens and effective role assignments."""

from __future__ import annotations

import httpx
from tests.api.cloudproc import RunningCloud
from tests.api.personas import personas
from tests.api.test_identity import Admin, login, unique


def _token_roles(cloud: RunningCloud, token: str) -> set[str]:
    body = httpx.get(
        f"{cloud.base_url}/identity/v3/auth/tokens",
        headers={"X-Auth-Token": token, "X-Subject-Token": token},
    )
    assert body.status_code == 200, body.text
    return {r["name"] for r in body.json()["token"]["roles"]}


def test_a_role_inherited_from_a_domain_reaches_its_projects(cloud: RunningCloud) -> None:
    admin = Admin(cloud)
    domain = cloud.osc_json("domain", "create", unique("dom"))
    project = admin.project(unique("proj"), domain_id=domain["id"])
    child = admin.project(unique("child"), domain_id=domain["id"], parent_id=project["id"])
    user = admin.user(unique("user"), "pw", domain_id=domain["id"])
    role = cloud.osc_json("role", "create", unique("operator"))
    cloud.osc(
        "role", "add", "--user", user["id"], "--domain", domain["id"], "--inherited", role["id"]
    )
    # Not held on the domain itself, held on each of its projects.
    listed = cloud.osc_json("role", "assignment", "list", "--user", user["id"], "--inherited")
    assert [(r["Role"], r["Domain"], r["Inherited"]) for r in listed] == [
        (role["id"], domain["id"], True)
    ]
    for target in (project, child):
        effective = cloud.osc_json(
            "role",
            "assignment",
            "list",
            "--effective",
            "--user",
            user["id"],
            "--project",
            target["id"],
        )
        assert {r["Role"] for r in effective} == {role["id"]}, effective
    base = f"/OS-INHERIT/domains/{domain['id']}/users/{user['id']}/roles"
    assert admin("HEAD", f"{base}/{role['id']}/inherited_to_projects").status_code == 204
    roles = admin("GET", f"{base}/inherited_to_projects").json()["roles"]
    assert [r["id"] for r in roles] == [role["id"]]
    body = {
        "auth": {
            "identity": {
                "methods": ["password"],
                "password": {"user": {"id": user["id"], "password": "pw"}},
            },
            "scope": {"project": {"id": child["id"]}},
        }
    }
    issued = httpx.post(f"{admin.base}/auth/tokens", json=body)
    assert issued.status_code == 201, issued.text
    token = issued.headers["x-subject-token"]
    assert _token_roles(cloud, token) == {role["name"]}
    # Revoked, it is gone from the projects and from the tokens that carried it.
    cloud.osc(
        "role", "remove", "--user", user["id"], "--domain", domain["id"], "--inherited", role["id"]
    )
    check = {"X-Auth-Token": cloud.token(), "X-Subject-Token": token}
    assert httpx.head(f"{admin.base}/auth/tokens", headers=check).status_code == 404
    assert httpx.post(f"{admin.base}/auth/tokens", json=body).status_code == 401
    query = {"user.id": user["id"], "scope.project.id": project["id"], "effective": ""}
    assert admin("GET", "/role_assignments", **query).json()["role_assignments"] == []


def test_a_groups_role_inherited_from_a_project_reaches_its_subtree_only(
    cloud: RunningCloud,
) -> None:
    admin = Admin(cloud)
    parent = admin.project(unique("parent"))
    child = admin.project(unique("child"), parent_id=parent["id"])
    user = admin.user(unique("user"), "pw")
    group = admin("POST", "/groups", {"group": {"name": unique("grp")}}).json()["group"]
    assert admin("PUT", f"/groups/{group['id']}/users/{user['id']}").status_code == 204
    reader = admin.role_id("reader")
    path = (
        f"/OS-INHERIT/projects/{parent['id']}/groups/{group['id']}/roles/{reader}"
        "/inherited_to_projects"
    )
    assert admin("PUT", path).status_code == 204
    assert admin("GET", path).status_code == 204
    assert _token_roles(cloud, login(cloud, user["name"], "pw", child["name"])) == {"reader"}
    # Not on the parent itself: no role there, no token.
    scoped = {
        "auth": {
            "identity": {
                "methods": ["password"],
                "password": {"user": {"id": user["id"], "password": "pw"}},
            },
            "scope": {"project": {"id": parent["id"]}},
        }
    }
    assert httpx.post(f"{admin.base}/auth/tokens", json=scoped).status_code == 401
    query = {"user.id": user["id"], "scope.project.id": child["id"], "effective": ""}
    rows = admin("GET", "/role_assignments", **query).json()["role_assignments"]
    assert [r["role"]["id"] for r in rows] == [reader]
    assert rows[0]["links"]["assignment"].endswith(path)
    assert rows[0]["links"]["membership"].endswith(f"/groups/{group['id']}/users/{user['id']}")
    assert admin("DELETE", path).status_code == 204
    assert admin("GET", path).status_code == 404


def test_only_an_admin_grants_inherited_roles(cloud: RunningCloud) -> None:
    team = personas(cloud, "inherit")
    admin = Admin(cloud)
    member_id = team.users["member"]["id"]
    path = (
        f"/OS-INHERIT/projects/{team.project['id']}/users/{member_id}/roles/"
        f"{admin.role_id('admin')}/inherited_to_projects"
    )
    for role in ("member", "reader"):
        refused = Admin(cloud, team.token(role))("PUT", path)
        assert refused.status_code == 403, refused.text
        assert "identity:create_grant" in refused.text
    assert admin("GET", path).status_code == 404
