"""Keystone's token method and the scopes a user may ask for: a rescoped token names how the
user first proved itself, an application credential's token is not rescoped, and
/v3/auth/domains counts the domains a group gives a role on."""

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


def test_a_rescoped_token_names_the_first_method_and_keeps_the_expiry(cloud: RunningCloud) -> None:
    admin = Admin(cloud)
    name, password = unique("resc"), "pw-resc"
    user = admin.user(name, password)
    first, second = admin.project(unique("p1")), admin.project(unique("p2"))
    for project in (first, second):
        admin.grant(project["id"], user["id"], "member")
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
    name, password = unique("acr"), "pw-acr"
    user = admin.user(name, password)
    project, other = admin.project(unique("p")), admin.project(unique("o"))
    for each in (project, other):
        admin.grant(each["id"], user["id"], "member")
    own = {"X-Auth-Token": login(cloud, name, password, project["name"])}
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
