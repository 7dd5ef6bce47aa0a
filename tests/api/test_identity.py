"""Identity v3: domains, projects, users, roles and role assignments, through the real CLI."""

from __future__ import annotations

import json
import subprocess
import threading
import uuid
from pathlib import Path
from typing import Any

import httpx
from tests.api.cloudproc import BIN, RunningCloud, password_auth

from stowage.domain.errors import ConflictError
from stowage.services.cloud import CloudConfig
from stowage.services.identity import IdentityDirectory
from stowage.services.runtime import open_cloud


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


class Admin:
    """Raw HTTP as the admin, for exact statuses and for fast set-up."""

    def __init__(self, cloud: RunningCloud, token: str | None = None) -> None:
        self.base = f"{cloud.base_url}/identity/v3"
        self.headers = {"X-Auth-Token": token or cloud.token()}

    def __call__(self, method: str, path: str, body: Any = None, **params: str) -> httpx.Response:
        return httpx.request(
            method, f"{self.base}{path}", json=body, params=params, headers=self.headers, timeout=30
        )

    def role_id(self, name: str) -> str:
        roles = self("GET", "/roles", name=name).json()["roles"]
        assert len(roles) == 1, roles
        return str(roles[0]["id"])

    def project(self, name: str, **fields: Any) -> dict[str, Any]:
        response = self("POST", "/projects", {"project": {"name": name, **fields}})
        assert response.status_code == 201, response.text
        return dict(response.json()["project"])

    def user(self, name: str, password: str, **fields: Any) -> dict[str, Any]:
        response = self("POST", "/users", {"user": {"name": name, "password": password, **fields}})
        assert response.status_code == 201, response.text
        return dict(response.json()["user"])

    def grant(self, project_id: str, user_id: str, role: str) -> None:
        path = f"/projects/{project_id}/users/{user_id}/roles/{self.role_id(role)}"
        assert self("PUT", path).status_code == 204


def login(cloud: RunningCloud, user: str, password: str, project: str) -> str:
    body = password_auth(user, password, project)
    response = httpx.post(f"{cloud.base_url}/identity/v3/auth/tokens", json=body)
    assert response.status_code == 201, response.text
    return response.headers["x-subject-token"]


def osc_as(
    cloud: RunningCloud, user: str, password: str, project: str, *args: str
) -> subprocess.CompletedProcess[str]:
    """The real CLI logged in as `user` through OS_* variables, as a person would."""
    env = {k: v for k, v in cloud.env().items() if k not in {"OS_CLOUD", "OS_CLIENT_CONFIG_FILE"}}
    env.update(
        OS_AUTH_URL=f"{cloud.base_url}/identity/v3",
        OS_AUTH_TYPE="password",
        OS_USERNAME=user,
        OS_PASSWORD=password,
        OS_PROJECT_NAME=project,
        OS_USER_DOMAIN_NAME="Default",
        OS_PROJECT_DOMAIN_NAME="Default",
        OS_REGION_NAME="RegionOne",
        OS_IDENTITY_API_VERSION="3",
    )
    return subprocess.run(
        [str(BIN / "openstack"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


# -- the CLI --------------------------------------------------------------------------------


def test_domain_list_and_show(cloud: RunningCloud) -> None:
    rows = cloud.osc_json("domain", "list")
    assert {"ID": "default", "Name": "Default", "Enabled": True, "Description": ""} in rows
    shown = cloud.osc_json("domain", "show", "Default")
    assert shown["id"] == "default"
    assert shown["enabled"] is True


def test_project_create_show_set_list_delete(cloud: RunningCloud) -> None:
    name, renamed = unique("proj"), unique("proj")
    created = cloud.osc_json(
        "project", "create", name, "--description", "first", "--property", "color=blue"
    )
    assert created["name"] == name
    assert created["domain_id"] == "default"
    assert created["parent_id"] == "default"
    assert created["color"] == "blue"
    again = cloud.osc("project", "create", name, check=False)
    assert again.returncode != 0
    assert "409" in again.stderr and "Duplicate entry" in again.stderr
    cloud.osc("project", "set", name, "--name", renamed, "--description", "second", "--disable")
    shown = cloud.osc_json("project", "show", renamed)
    assert (shown["id"], shown["description"], shown["enabled"]) == (created["id"], "second", False)
    listed = cloud.osc_json("project", "list", "--long")
    assert {
        "ID": created["id"],
        "Name": renamed,
        "Domain ID": "default",
        "Description": "second",
        "Enabled": False,
    } in listed
    cloud.osc("project", "delete", renamed)
    gone = cloud.osc("project", "show", created["id"], check=False)
    assert gone.returncode != 0
    # The old name is free again once the project is renamed and deleted.
    assert cloud.osc_json("project", "create", name)["name"] == name
    cloud.osc("project", "delete", name)


def test_user_role_grant_login_and_delete(cloud: RunningCloud) -> None:
    project, user, password = unique("proj"), unique("user"), "pa55-" + uuid.uuid4().hex
    project_id = cloud.osc_json("project", "create", project)["id"]
    created = cloud.osc_json(
        "user",
        "create",
        user,
        "--password",
        password,
        "--project",
        project,
        "--email",
        "u@example.org",
    )
    assert created["default_project_id"] == project_id
    assert created["email"] == "u@example.org"
    assert not any("password" in key and key != "password_expires_at" for key in created)
    assert cloud.osc_json("user", "show", user)["id"] == created["id"]
    assert {"ID": created["id"], "Name": user} in cloud.osc_json("user", "list")
    roles = {row["Name"] for row in cloud.osc_json("role", "list")}
    assert {"admin", "member", "reader", "manager"} <= roles

    # No role yet: the user cannot scope a token to the project.
    refused = osc_as(cloud, user, password, project, "token", "issue")
    assert refused.returncode != 0

    cloud.osc("role", "add", "--project", project, "--user", user, "member")
    cloud.osc("role", "add", "--project", project, "--user", user, "member")  # idempotent
    rows = cloud.osc_json("role", "assignment", "list", "--project", project, "--names")
    assert rows == [
        {
            "Role": "member",
            "User": f"{user}@Default",
            "Group": "",
            "Project": f"{project}@Default",
            "Domain": "",
            "System": "",
            "Inherited": False,
        }
    ]

    issued = osc_as(cloud, user, password, project, "token", "issue", "-f", "json")
    assert issued.returncode == 0, issued.stderr
    token = json.loads(issued.stdout)
    assert (token["user_id"], token["project_id"]) == (created["id"], project_id)
    mine = osc_as(cloud, user, password, project, "project", "list", "--my-projects", "-f", "json")
    assert mine.returncode == 0, mine.stderr
    assert json.loads(mine.stdout) == [{"ID": project_id, "Name": project}]
    # Every project of the cloud is a system reader's list (Keystone's identity:list_projects):
    # the CLI, refused, falls back to the user's own, as it does against Keystone.
    every = osc_as(cloud, user, password, project, "project", "list", "-f", "json")
    assert json.loads(every.stdout) == [{"ID": project_id, "Name": project}], every.stderr
    refused = httpx.get(
        f"{cloud.base_url}/identity/v3/projects",
        headers={"X-Auth-Token": login(cloud, user, password, project)},
    )
    assert refused.status_code == 403, refused.text

    admin_token = login(cloud, "admin", "stowage-admin", "admin")
    admin = Admin(cloud, admin_token)
    member_token = login(cloud, user, password, project)
    check = {"X-Auth-Token": admin_token, "X-Subject-Token": member_token}
    assert httpx.head(f"{admin.base}/auth/tokens", headers=check).status_code == 200
    cloud.osc("role", "remove", "--project", project, "--user", user, "member")
    assert cloud.osc_json("role", "assignment", "list", "--project", project) == []
    # A token carries its roles: removing the grant revokes the tokens it was in (validating
    # a revoked token is Keystone's 404, TokenNotFound).
    assert httpx.head(f"{admin.base}/auth/tokens", headers=check).status_code == 404

    admin.grant(project_id, created["id"], "reader")
    user_token = login(cloud, user, password, project)
    check = {"X-Auth-Token": admin_token, "X-Subject-Token": user_token}
    assert httpx.head(f"{admin.base}/auth/tokens", headers=check).status_code == 200
    cloud.osc("user", "delete", user)
    # Deleting the user ends its tokens and takes its grants with it.
    assert httpx.head(f"{admin.base}/auth/tokens", headers=check).status_code == 404
    own = httpx.get(f"{admin.base}/auth/projects", headers={"X-Auth-Token": user_token})
    assert own.status_code == 401
    grants = admin("GET", "/role_assignments", **{"scope.project.id": project_id}).json()
    assert grants["role_assignments"] == []
    cloud.osc("project", "delete", project)


def test_a_member_cannot_create_a_user(cloud: RunningCloud) -> None:
    result = cloud.osc(
        "user", "create", "--password", "x", unique("user"), cloud="stowage", check=False
    )
    assert result.returncode != 0
    assert "403" in result.stderr
    assert "identity:create_user" in result.stderr


def test_a_reader_reads_its_own_things_and_cannot_write(cloud: RunningCloud) -> None:
    admin = Admin(cloud)
    project = admin.project(unique("proj"))
    user = admin.user(unique("reader"), "read-only")
    admin.grant(project["id"], user["id"], "reader")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return osc_as(cloud, user["name"], "read-only", project["name"], *args)

    shown = run("user", "show", user["name"], "-f", "json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["id"] == user["id"]
    listed = run("project", "list", "--my-projects", "-f", "json")
    assert json.loads(listed.stdout) == [{"ID": project["id"], "Name": project["name"]}]
    assert "reader" in {r["Name"] for r in json.loads(run("role", "list", "-f", "json").stdout)}
    created = run("project", "create", unique("proj"))
    assert created.returncode != 0
    assert "403" in created.stderr

    # Through HTTP: others' users are a 403, lists hold only what is the reader's own.
    reader = Admin(cloud, login(cloud, user["name"], "read-only", project["name"]))
    admin_id = admin("GET", "/users", name="admin").json()["users"][0]["id"]
    assert reader("GET", f"/users/{admin_id}").status_code == 403
    assert [u["id"] for u in reader("GET", "/users").json()["users"]] == [user["id"]]
    assert reader("GET", "/domains/default").status_code == 200
    assert reader("POST", "/users", {"user": {"name": unique("x")}}).status_code == 403
    assert reader("PATCH", f"/users/{user['id']}", {"user": {"enabled": False}}).status_code == 403
    path = f"/projects/{project['id']}/users/{user['id']}/roles/{admin.role_id('admin')}"
    assert reader("PUT", path).status_code == 403
    rows = reader("GET", "/role_assignments").json()["role_assignments"]
    assert {(r["user"]["id"], r["scope"]["project"]["id"]) for r in rows} == {
        (user["id"], project["id"])
    }


def test_domain_create_disable_and_cascading_delete(cloud: RunningCloud) -> None:
    domain, project, user = unique("dom"), unique("proj"), unique("user")
    domain_id = cloud.osc_json("domain", "create", domain, "--description", "d")["id"]
    admin = Admin(cloud)
    project_id = admin.project(project, domain_id=domain_id)["id"]
    user_id = admin.user(user, "pw", domain_id=domain_id)["id"]
    admin.grant(project_id, user_id, "member")
    group = cloud.osc_json("group", "create", "--domain", domain_id, unique("grp"))
    cloud.osc("group", "add", "user", group["id"], user_id)
    # The same names are free in another domain.
    twin = admin.project(project)
    refused = cloud.osc("domain", "delete", domain, check=False)
    assert refused.returncode != 0 and "disable it first" in refused.stderr
    cloud.osc("domain", "set", "--disable", domain)
    cloud.osc("domain", "delete", domain)
    assert admin("GET", f"/domains/{domain_id}").status_code == 404
    assert admin("GET", f"/projects/{project_id}").status_code == 404
    assert admin("GET", f"/users/{user_id}").status_code == 404
    assert admin("GET", f"/groups/{group['id']}").status_code == 404  # groups go too
    assert (
        admin("GET", "/role_assignments", **{"user.id": user_id}).json()["role_assignments"] == []
    )
    assert admin("DELETE", f"/projects/{twin['id']}").status_code == 204
    assert admin("DELETE", "/domains/default").status_code == 403


# -- the HTTP contract ----------------------------------------------------------------------


def test_grants_are_idempotent_checked_with_head_and_revoked_with_delete(
    cloud: RunningCloud,
) -> None:
    admin = Admin(cloud)
    project = admin.project(unique("proj"))
    user = admin.user(unique("user"), "pw")
    path = f"/projects/{project['id']}/users/{user['id']}/roles/{admin.role_id('member')}"
    assert admin("HEAD", path).status_code == 404
    assert admin("PUT", path).status_code == 204
    assert admin("PUT", path).status_code == 204
    assert admin("HEAD", path).status_code == 204
    listed = admin("GET", "/role_assignments", **{"user.id": user["id"]}).json()
    assert len(listed["role_assignments"]) == 1
    assert listed["role_assignments"][0]["links"]["assignment"].endswith(path)
    assert admin("DELETE", path).status_code == 204
    again = admin("DELETE", path)
    assert again.status_code == 404
    assert again.json()["error"]["code"] == 404
    missing = f"/projects/{project['id']}/users/{uuid.uuid4().hex}/roles/{admin.role_id('member')}"
    assert admin("PUT", missing).status_code == 404


def test_role_assignment_filters_names_and_effective_roles(cloud: RunningCloud) -> None:
    admin = Admin(cloud)
    project = admin.project(unique("proj"))
    other = admin.project(unique("proj"))
    user = admin.user(unique("user"), "pw")
    admin.grant(project["id"], user["id"], "manager")
    admin.grant(other["id"], user["id"], "reader")

    def rows(**params: str) -> list[dict[str, Any]]:
        response = admin("GET", "/role_assignments", **{"user.id": user["id"], **params})
        assert response.status_code == 200, response.text
        return list(response.json()["role_assignments"])

    assert len(rows()) == 2
    scoped = rows(**{"scope.project.id": project["id"], "include_names": "True"})
    assert [(r["role"]["name"], r["scope"]["project"]["name"]) for r in scoped] == [
        ("manager", project["name"])
    ]
    assert scoped[0]["user"] == {
        "id": user["id"],
        "name": user["name"],
        "domain": {"id": "default", "name": "Default"},
    }
    effective = rows(**{"scope.project.id": project["id"], "effective": "True"})
    implied = {r["role"]["id"] for r in effective}
    assert implied == {admin.role_id(n) for n in ("manager", "member", "reader")}
    assert all(
        "prior_role" in r["links"] for r in effective if r["role"]["id"] != admin.role_id("manager")
    )
    readers = rows(**{"role.id": admin.role_id("reader")})
    assert [r["scope"]["project"]["id"] for r in readers] == [other["id"]]
    both = admin("GET", "/role_assignments", **{"scope.project.id": "a", "scope.domain.id": "b"})
    assert both.status_code == 400

    projects = admin("GET", f"/users/{user['id']}/projects").json()["projects"]
    assert {p["id"] for p in projects} == {project["id"], other["id"]}
    on_other = login(cloud, user["name"], "pw", other["name"])
    admin("PATCH", f"/projects/{other['id']}", {"project": {"enabled": False}})
    revoked = httpx.get(f"{admin.base}/auth/projects", headers={"X-Auth-Token": on_other})
    assert revoked.status_code == 401  # disabling a project ends the tokens scoped to it
    token = login(cloud, user["name"], "pw", project["name"])
    mine = httpx.get(f"{admin.base}/auth/projects", headers={"X-Auth-Token": token}).json()
    assert [p["id"] for p in mine["projects"]] == [project["id"]]  # a disabled project is left out
    # A disabled project refuses new tokens.
    body = {
        "auth": {
            "identity": {
                "methods": ["password"],
                "password": {"user": {"id": user["id"], "password": "pw"}},
            },
            "scope": {"project": {"id": other["id"]}},
        }
    }
    assert httpx.post(f"{admin.base}/auth/tokens", json=body).status_code == 401


def test_bad_input_is_a_400_naming_the_field_and_leaves_nothing(cloud: RunningCloud) -> None:
    admin = Admin(cloud)
    name = unique("user")
    cases = [
        ("/users", {"user": {"name": ""}}, "'name'"),
        ("/users", {"user": {"name": name, "enabled": "yes"}}, "'enabled'"),
        ("/users", {"user": {"name": name, "default_project_id": "nope"}}, "'default_project_id'"),
        ("/users", {"user": {"name": name, "password": 5}}, "'password'"),
        ("/users", {"name": name}, "'user'"),
        ("/projects", {"project": {"name": name, "tags": ["a/b"]}}, "'tags'"),
        ("/projects", {"project": {"name": name, "parent_id": "nope"}}, "'parent_id'"),
        ("/domains", {"domain": {"name": name, "options": {"bogus": True}}}, "'options'"),
        ("/roles", {"role": {}}, "'name'"),
    ]
    for path, body, field in cases:
        response = admin("POST", path, body)
        assert response.status_code == 400, (path, body, response.text)
        assert field in response.json()["error"]["message"], response.text
    # A user in a domain that does not exist: Keystone's DomainNotFound, a 404.
    missing = admin("POST", "/users", {"user": {"name": name, "domain_id": "nope"}})
    assert missing.status_code == 404, missing.text
    assert "Could not find domain: nope" in missing.json()["error"]["message"]
    for kind in ("users", "projects", "domains", "roles"):
        assert admin("GET", f"/{kind}", name=name).json()[kind] == []


def test_names_are_unique_per_domain_and_renames_respect_it(cloud: RunningCloud) -> None:
    admin = Admin(cloud)
    first, second = unique("user"), unique("user")
    admin.user(first, "pw")
    user = admin.user(second, "pw")
    duplicate = admin("POST", "/users", {"user": {"name": first}})
    assert duplicate.status_code == 409
    rename = admin("PATCH", f"/users/{user['id']}", {"user": {"name": first}})
    assert rename.status_code == 409
    role = admin("POST", "/roles", {"role": {"name": "member"}})
    assert role.status_code == 409
    assert admin("POST", "/domains", {"domain": {"name": "Default"}}).status_code == 409


def test_passwords_are_never_returned_and_can_be_changed(cloud: RunningCloud) -> None:
    admin = Admin(cloud)
    project = admin.project(unique("proj"))
    user = admin.user(unique("user"), "old-pw", default_project_id=project["id"])
    admin.grant(project["id"], user["id"], "member")
    for response in (
        admin("GET", f"/users/{user['id']}"),
        admin("GET", "/users"),
        admin("PATCH", f"/users/{user['id']}", {"user": {"description": "d"}}),
    ):
        assert 'password"' not in response.text.replace('password_expires_at"', "")
        assert "scrypt" not in response.text
    own_token = login(cloud, user["name"], "old-pw", project["name"])
    own = Admin(cloud, own_token)
    wrong = own(
        "POST",
        f"/users/{user['id']}/password",
        {"user": {"original_password": "nope", "password": "new-pw"}},
    )
    assert wrong.status_code == 401
    changed = own(
        "POST",
        f"/users/{user['id']}/password",
        {"user": {"original_password": "old-pw", "password": "new-pw"}},
    )
    assert changed.status_code == 204
    assert own("GET", f"/users/{user['id']}").status_code == 401  # a new password ends old tokens
    assert login(cloud, user["name"], "new-pw", project["name"])
    # The original password is the credential: no token is needed (Keystone's change_password
    # is unenforced, so that an expired password can be changed), a wrong one is a 401.
    url = f"{admin.base}/users/{user['id']}/password"
    tokenless = httpx.post(url, json={"user": {"original_password": "nope", "password": "x"}})
    assert tokenless.status_code == 401, tokenless.text
    tokenless = httpx.post(url, json={"user": {"original_password": "new-pw", "password": "nw"}})
    assert tokenless.status_code == 204, tokenless.text
    assert login(cloud, user["name"], "nw", project["name"])
    # An admin reset works too, and a disabled user cannot log in.
    admin("PATCH", f"/users/{user['id']}", {"user": {"password": "reset", "enabled": False}})
    body = {
        "auth": {
            "identity": {
                "methods": ["password"],
                "password": {"user": {"id": user["id"], "password": "reset"}},
            }
        }
    }
    assert httpx.post(f"{admin.base}/auth/tokens", json=body).status_code == 401
    admin("PATCH", f"/users/{user['id']}", {"user": {"enabled": True}})
    unscoped = httpx.post(f"{admin.base}/auth/tokens", json=body)
    assert unscoped.status_code == 201  # scoped to the default project
    assert unscoped.json()["token"]["project"]["id"] == project["id"]


def test_lists_page_with_limit_and_marker(cloud: RunningCloud) -> None:
    admin = Admin(cloud)
    prefix = unique("page")
    ids = [admin.project(f"{prefix}-{i}")["id"] for i in range(3)]
    first = admin("GET", "/projects", name__startswith=prefix, limit="2").json()
    assert [p["id"] for p in first["projects"]] == ids[:2]
    assert first["links"]["next"].endswith(f"marker={ids[1]}")
    rest = admin("GET", "/projects", name__startswith=prefix, limit="2", marker=ids[1]).json()
    assert [p["id"] for p in rest["projects"]] == ids[2:]
    assert rest["links"]["next"] is None
    assert admin("GET", "/projects", limit="x").status_code == 400


def test_bootstrap_roles_are_immutable(cloud: RunningCloud) -> None:
    admin = Admin(cloud)
    member = admin.role_id("member")
    refused = admin("DELETE", f"/roles/{member}")
    assert refused.status_code == 403
    assert "immutable" in refused.json()["error"]["message"]
    assert admin("GET", f"/roles/{member}").json()["role"]["options"] == {"immutable": True}
    role = admin("POST", "/roles", {"role": {"name": unique("role")}}).json()["role"]
    assert admin("DELETE", f"/roles/{role['id']}").status_code == 204


def test_project_hierarchy_refuses_deleting_a_parent(cloud: RunningCloud) -> None:
    admin = Admin(cloud)
    parent = admin.project(unique("proj"))
    child = admin.project(unique("proj"), parent_id=parent["id"])
    assert child["parent_id"] == parent["id"]
    assert admin("DELETE", f"/projects/{parent['id']}").status_code == 403
    shown = admin("GET", f"/projects/{child['id']}", parents_as_ids="").json()["project"]
    assert shown["parents"] == {parent["id"]: {"default": None}}
    assert admin("DELETE", f"/projects/{child['id']}").status_code == 204
    assert admin("DELETE", f"/projects/{parent['id']}").status_code == 204


def test_concurrent_creates_of_one_name_leave_one_user(tmp_path: Path) -> None:
    """Below the API: eight threads race to create the same user name; exactly one wins."""
    cloud = open_cloud(CloudConfig(state_dir=tmp_path / "state", hosts=1))
    outcomes: list[str] = []
    barrier = threading.Barrier(8)

    def create() -> None:
        directory = IdentityDirectory(cloud)
        barrier.wait()
        try:
            directory.create_user({"name": "racer", "password": None})
            outcomes.append("created")
        except ConflictError:
            outcomes.append("conflict")

    threads = [threading.Thread(target=create) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert sorted(outcomes) == ["conflict"] * 7 + ["created"]
        assert len(cloud.objects.list("user", name="racer")) == 1
    finally:
        cloud.ledger.close()
