"""Keystone's token method and the scopes a user may ask for: a rescoped token names how the
user first proved itself, an application credential's token is not rescoped,
/v3/auth/domains counts the domains a group gives a role on, and a role on a domain gives a
domain-scoped token."""

from __future__ import annotations

from typing import Any

import httpx
from tests.api.cloudproc import RunningCloud
from tests.api.test_identity import Admin, login, unique


def _tokens(cloud: RunningCloud, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{cloud.base_url}/identity/v3/auth/tokens", json={"auth": body})


def _by_token(cloud: RunningCloud, token: str, project_id: str) -> httpx.Response:
    return _tokens(
        cloud,
        {
            "identity": {"methods": ["token"], "token": {"id": token}},
            "scope": {"project": {"id": project_id}},
        },
    )


def _member_of_two(admin: Admin, prefix: str) -> tuple[dict[str, Any], str, list[dict[str, Any]]]:
    """A new user, its password, and two projects it is a member of."""
    password = f"pw-{prefix}"
    user = admin.user(unique(prefix), password)
    projects = [admin.project(unique("p")) for _ in range(2)]
    for project in projects:
        admin.grant(project["id"], user["id"], "member")
    return user, password, projects


def test_a_rescoped_token_names_the_first_method_and_keeps_the_expiry(cloud: RunningCloud) -> None:
    admin = Admin(cloud)
    user, password, (first, second) = _member_of_two(admin, "resc")
    unscoped = _tokens(
        cloud,
        {
            "identity": {
                "methods": ["password"],
                "password": {"user": {"id": user["id"], "password": password}},
            }
        },
    )
    assert unscoped.status_code == 201, unscoped.text
    assert "project" not in unscoped.json()["token"]
    token = unscoped.headers["x-subject-token"]

    scoped = _by_token(cloud, token, first["id"])
    assert scoped.status_code == 201, scoped.text
    body = scoped.json()["token"]
    assert sorted(body["methods"]) == ["password", "token"]
    assert body["expires_at"] == unscoped.json()["token"]["expires_at"]
    assert body["project"]["id"] == first["id"]
    # Rescoped once more, from the scoped one: still the two methods, once each.
    again = _by_token(cloud, scoped.headers["x-subject-token"], second["id"])
    assert again.status_code == 201, again.text
    assert sorted(again.json()["token"]["methods"]) == ["password", "token"]
    admin("DELETE", f"/users/{user['id']}")


def test_an_application_credential_token_is_not_rescoped(cloud: RunningCloud) -> None:
    admin = Admin(cloud)
    user, password, (project, other) = _member_of_two(admin, "acr")
    own = {"X-Auth-Token": login(cloud, user["name"], password, project["name"])}
    made = httpx.post(
        f"{cloud.base_url}/identity/v3/users/{user['id']}/application_credentials",
        json={"application_credential": {"name": unique("c")}},
        headers=own,
    )
    assert made.status_code == 201, made.text
    cred = made.json()["application_credential"]
    issued = _tokens(
        cloud,
        {
            "identity": {
                "methods": ["application_credential"],
                "application_credential": {"id": cred["id"], "secret": cred["secret"]},
            }
        },
    )
    assert issued.status_code == 201, issued.text
    refused = _by_token(cloud, issued.headers["x-subject-token"], other["id"])
    assert refused.status_code == 403, refused.text
    admin("DELETE", f"/users/{user['id']}")


def test_auth_domains_lists_the_domains_of_the_users_and_its_groups_grants(
    cloud: RunningCloud,
) -> None:
    admin = Admin(cloud)
    name, password = unique("dom"), "pw-dom"
    user = admin.user(name, password)
    project = admin.project(unique("p"))
    admin.grant(project["id"], user["id"], "member")
    domains = [
        admin("POST", "/domains", {"domain": {"name": unique("d")}}).json()["domain"]["id"]
        for _ in range(3)
    ]
    reader = admin.role_id("reader")
    assert (
        admin("PUT", f"/domains/{domains[0]}/users/{user['id']}/roles/{reader}").status_code == 204
    )
    group = admin("POST", "/groups", {"group": {"name": unique("g")}}).json()["group"]["id"]
    assert admin("PUT", f"/groups/{group}/users/{user['id']}").status_code == 204
    assert admin("PUT", f"/domains/{domains[1]}/groups/{group}/roles/{reader}").status_code == 204

    token = login(cloud, name, password, project["name"])
    listed = httpx.get(
        f"{cloud.base_url}/identity/v3/auth/domains", headers={"X-Auth-Token": token}
    )
    assert listed.status_code == 200, listed.text
    assert {d["id"] for d in listed.json()["domains"]} == set(domains[:2])
    # Leaving the group takes its domain out of the list.
    assert admin("DELETE", f"/groups/{group}/users/{user['id']}").status_code == 204
    token = login(cloud, name, password, project["name"])
    listed = httpx.get(
        f"{cloud.base_url}/identity/v3/auth/domains", headers={"X-Auth-Token": token}
    )
    assert {d["id"] for d in listed.json()["domains"]} == {domains[0]}
    admin("DELETE", f"/users/{user['id']}")


def _domain_token(
    cloud: RunningCloud, user_id: str, password: str, domain: dict[str, str]
) -> httpx.Response:
    return _tokens(
        cloud,
        {
            "identity": {
                "methods": ["password"],
                "password": {"user": {"id": user_id, "password": password}},
            },
            "scope": {"domain": domain},
        },
    )


def test_a_role_on_a_domain_gives_a_token_scoped_to_it(cloud: RunningCloud) -> None:
    admin = Admin(cloud)
    name, password = unique("dsc"), "pw-dsc"
    user = admin.user(name, password)
    project = admin.project(unique("p"))
    admin.grant(project["id"], user["id"], "member")
    own, via_group, none = (
        admin("POST", "/domains", {"domain": {"name": unique("d")}}).json()["domain"]
        for _ in range(3)
    )
    reader, member = admin.role_id("reader"), admin.role_id("member")
    assert (
        admin("PUT", f"/domains/{own['id']}/users/{user['id']}/roles/{member}").status_code == 204
    )
    group = admin("POST", "/groups", {"group": {"name": unique("g")}}).json()["group"]["id"]
    admin("PUT", f"/groups/{group}/users/{user['id']}")
    admin("PUT", f"/domains/{via_group['id']}/groups/{group}/roles/{reader}")

    issued = _domain_token(cloud, user["id"], password, {"name": own["name"]})
    assert issued.status_code == 201, issued.text
    body = issued.json()["token"]
    assert body["domain"] == {"id": own["id"], "name": own["name"]}
    assert "project" not in body and "system" not in body
    # The member role implies reader (Keystone's default inference rules).
    assert {r["name"] for r in body["roles"]} == {"member", "reader"}
    token = issued.headers["x-subject-token"]
    shown = httpx.get(
        f"{cloud.base_url}/identity/v3/auth/tokens",
        headers={"X-Auth-Token": token, "X-Subject-Token": token},
    )
    assert shown.status_code == 200 and shown.json()["token"]["domain"]["id"] == own["id"]

    grouped = _domain_token(cloud, user["id"], password, {"id": via_group["id"]})
    assert grouped.status_code == 201, grouped.text
    assert [r["name"] for r in grouped.json()["token"]["roles"]] == ["reader"]
    assert _domain_token(cloud, user["id"], password, {"id": none["id"]}).status_code == 401
    assert _domain_token(cloud, user["id"], password, {"id": "nope"}).status_code == 401
    assert _domain_token(cloud, user["id"], password, {}).status_code == 400

    # It is rescoped to a project like any other token.
    rescoped = _by_token(cloud, token, project["id"])
    assert (
        rescoped.status_code == 201 and rescoped.json()["token"]["project"]["id"] == project["id"]
    )
    # Losing the role on the domain revokes the token, as for a project.
    admin("DELETE", f"/domains/{own['id']}/users/{user['id']}/roles/{member}")
    assert (
        httpx.get(
            f"{cloud.base_url}/identity/v3/auth/tokens",
            headers={"X-Auth-Token": token, "X-Subject-Token": token},
        ).status_code
        == 401
    )
    admin("DELETE", f"/users/{user['id']}")


def test_a_domain_admin_token_is_not_a_cloud_admin(cloud: RunningCloud) -> None:
    """The token shows the admin role on the domain; it manages nothing with it (Keystone's
    domain management policies are not offered), and other services refuse it."""
    admin = Admin(cloud)
    name, password = unique("dad"), "pw-dad"
    user = admin.user(name, password)
    domain = admin("POST", "/domains", {"domain": {"name": unique("d")}}).json()["domain"]
    role = admin.role_id("admin")
    admin("PUT", f"/domains/{domain['id']}/users/{user['id']}/roles/{role}")
    issued = _domain_token(cloud, user["id"], password, {"id": domain["id"]})
    assert issued.status_code == 201, issued.text
    assert "admin" in {r["name"] for r in issued.json()["token"]["roles"]}
    as_domain = Admin(cloud, issued.headers["x-subject-token"])
    made = as_domain("POST", "/projects", {"project": {"name": unique("x")}})
    assert made.status_code == 403, made.text
    assert as_domain("GET", f"/users/{user['id']}").status_code == 200  # its own user
    listed = as_domain("GET", "/users")
    assert listed.status_code == 200, listed.text
    assert [u["id"] for u in listed.json()["users"]] == [user["id"]]  # only its own user
    servers = httpx.get(
        f"{cloud.base_url}/compute/v2.1/servers",
        headers={"X-Auth-Token": issued.headers["x-subject-token"]},
    )
    assert servers.status_code == 401
    admin("DELETE", f"/users/{user['id']}")
