"""Implied roles (Keystone's role inference rules): data seeded with Keystone's defaults, changed
by an admin through the real CLI, followed by tokens and effective role assignments."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from tests.api.cloudproc import RunningCloud
from tests.api.personas import personas
from tests.api.test_identity import Admin, login, unique

from stowage.domain.errors import NotFound
from stowage.services.cloud import CloudConfig
from stowage.services.identity import INFERENCE, INFERENCES_STORED, IdentityDirectory
from stowage.services.runtime import open_cloud


def _role(admin: Admin, **fields: str) -> dict[str, str]:
    made = admin("POST", "/roles", {"role": {"name": unique("role"), **fields}})
    assert made.status_code == 201, made.text
    return dict(made.json()["role"])


def test_an_admin_makes_a_role_imply_another_and_tokens_follow(cloud: RunningCloud) -> None:
    admin = Admin(cloud)
    deployer, viewer = _role(admin), _role(admin)
    created = cloud.osc_json(
        "implied", "role", "create", deployer["name"], "--implied-role", viewer["name"]
    )
    assert (created["prior_role"], created["implies"]) == (deployer["id"], viewer["id"])
    listed = cloud.osc_json("implied", "role", "list")
    assert {"Prior Role ID": deployer["id"], "Implied Role ID": viewer["id"]}.items() <= next(
        row for row in listed if row["Prior Role ID"] == deployer["id"]
    ).items()
    # Keystone's defaults are rules like any other: admin > manager > member > reader.
    names = {(row["Prior Role Name"], row["Implied Role Name"]) for row in listed}
    assert {("admin", "manager"), ("manager", "member"), ("member", "reader")} <= names
    path = f"/roles/{deployer['id']}/implies/{viewer['id']}"
    shown = admin("GET", path).json()
    assert shown["role_inference"]["prior_role"]["id"] == deployer["id"]
    assert shown["role_inference"]["implies"]["id"] == viewer["id"]
    assert admin("HEAD", path).status_code == 204
    assert admin("PUT", path).status_code == 201  # idempotent
    implies = admin("GET", f"/roles/{deployer['id']}/implies").json()["role_inference"]
    assert [r["id"] for r in implies["implies"]] == [viewer["id"]]

    # A user granted the prior role holds the implied one too: in its token and in the
    # effective role assignments (with the prior role's link).
    project = admin.project(unique("proj"))
    user = admin.user(unique("user"), "pw")
    grant = f"/projects/{project['id']}/users/{user['id']}/roles/{deployer['id']}"
    assert admin("PUT", grant).status_code == 204
    token = login(cloud, user["name"], "pw", project["name"])
    body = httpx.get(
        f"{admin.base}/auth/tokens", headers={"X-Auth-Token": token, "X-Subject-Token": token}
    ).json()
    assert {r["id"] for r in body["token"]["roles"]} == {deployer["id"], viewer["id"]}
    query = {"user.id": user["id"], "scope.project.id": project["id"], "effective": ""}
    rows = admin("GET", "/role_assignments", **query).json()["role_assignments"]
    assert {r["role"]["id"] for r in rows} == {deployer["id"], viewer["id"]}
    implied_row = next(r for r in rows if r["role"]["id"] == viewer["id"])
    assert implied_row["links"]["prior_role"].endswith(f"/roles/{deployer['id']}")

    # Deleted, the rule no longer applies.
    cloud.osc("implied", "role", "delete", deployer["name"], "--implied-role", viewer["name"])
    assert admin("GET", path).status_code == 404
    rows = admin("GET", "/role_assignments", **query).json()["role_assignments"]
    assert [r["role"]["id"] for r in rows] == [deployer["id"]]
    token = login(cloud, user["name"], "pw", project["name"])
    body = httpx.get(
        f"{admin.base}/auth/tokens", headers={"X-Auth-Token": token, "X-Subject-Token": token}
    ).json()
    assert [r["id"] for r in body["token"]["roles"]] == [deployer["id"]]


def test_what_a_rule_may_not_be(cloud: RunningCloud) -> None:
    admin = Admin(cloud)
    domain = admin("POST", "/domains", {"domain": {"name": unique("dom")}}).json()["domain"]
    global_role = _role(admin)
    domain_role = _role(admin, domain_id=domain["id"])
    other = _role(admin, domain_id=domain["id"])
    # A domain role may imply a global one and another domain's; a global one no domain role.
    assert (
        admin("PUT", f"/roles/{domain_role['id']}/implies/{global_role['id']}").status_code == 201
    )
    assert admin("PUT", f"/roles/{domain_role['id']}/implies/{other['id']}").status_code == 201
    refused = admin("PUT", f"/roles/{global_role['id']}/implies/{domain_role['id']}")
    assert refused.status_code == 403, refused.text
    # admin may not be implied (Keystone's prohibited_implied_role); no cycles.
    assert (
        admin("PUT", f"/roles/{global_role['id']}/implies/{admin.role_id('admin')}").status_code
        == 403
    )
    assert admin("PUT", f"/roles/{other['id']}/implies/{domain_role['id']}").status_code == 403
    assert (
        admin("PUT", f"/roles/{global_role['id']}/implies/{global_role['id']}").status_code == 403
    )
    assert admin("PUT", f"/roles/{global_role['id']}/implies/nope").status_code == 404
    # Deleting a role takes its rules with it.
    assert admin("DELETE", f"/roles/{other['id']}").status_code == 204
    implies = admin("GET", f"/roles/{domain_role['id']}/implies").json()["role_inference"]
    assert [r["id"] for r in implies["implies"]] == [global_role["id"]]
    # A domain role granted on a project is not in the effective assignments, what it
    # implies is (Keystone's domain-specific roles).
    project = admin.project(unique("proj"), domain_id=domain["id"])
    user = admin.user(unique("user"), "pw", domain_id=domain["id"])
    grant = f"/projects/{project['id']}/users/{user['id']}/roles/{domain_role['id']}"
    assert admin("PUT", grant).status_code == 204
    query = {"user.id": user["id"], "scope.project.id": project["id"], "effective": ""}
    rows = admin("GET", "/role_assignments", **query).json()["role_assignments"]
    assert [r["role"]["id"] for r in rows] == [global_role["id"]]


def test_only_an_admin_changes_rules_and_only_readers_of_the_system_read_them(
    cloud: RunningCloud,
) -> None:
    team = personas(cloud, "implied")
    admin = Admin(cloud)
    first, second = _role(admin), _role(admin)
    path = f"/roles/{first['id']}/implies/{second['id']}"
    for role in ("member", "reader"):
        caller = Admin(cloud, team.token(role))
        assert caller("PUT", path).status_code == 403
        assert caller("GET", "/role_inferences").status_code == 403
        assert caller("GET", f"/roles/{first['id']}/implies").status_code == 403
    refused = team.osc(
        "member", "implied", "role", "create", first["id"], "--implied-role", second["id"]
    )
    assert refused.returncode != 0 and "identity:create_implied_role" in refused.stderr
    assert admin("GET", path).status_code == 404


def test_a_cloud_from_before_the_rules_were_data_keeps_the_defaults_until_changed(
    tmp_path: Path,
) -> None:
    cloud = open_cloud(CloudConfig(state_dir=tmp_path / "state", hosts=1))
    try:
        # As a cloud bootstrapped before: no rule documents, no marker.
        for doc in cloud.objects.list(INFERENCE):
            cloud.objects.delete(INFERENCE, doc.id)
        cloud.objects.delete(INFERENCES_STORED, "all")
        directory = IdentityDirectory(cloud)
        admin = next(p for p in directory.projects() if p.name == "admin")
        user = next(u for u in directory.users() if u.name == "admin")
        assert cloud.roles_of(user.id, admin.id) == ("admin", "manager", "member", "reader")
        member = directory.role_by_name("member")
        reader = directory.role_by_name("reader")
        assert member is not None and reader is not None
        directory.delete_implied_role(member.id, reader.id)
        # The first change stored the defaults, less the one deleted.
        assert len(cloud.objects.list(INFERENCE)) == 2
        assert cloud.roles_of(user.id, admin.id) == ("admin", "manager", "member")
        with pytest.raises(NotFound):
            directory.implied_rule(member.id, reader.id)
    finally:
        cloud.ledger.close()
