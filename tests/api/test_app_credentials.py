"""Application credentials: created by the CLI, used by openstacksdk alone (the way Terraform
and CI authenticate), held to their roles, expiry, restriction and access rules."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openstack.exceptions
import pytest
from tests.api.cloudproc import IMAGE, RunningCloud
from tests.api.personas import Personas, personas
from tests.api.sdk import SDK_WARNINGS, connect
from tests.api.test_identity import Admin, unique

pytestmark = SDK_WARNINGS


@pytest.fixture(scope="module")
def team(cloud: RunningCloud) -> Personas:
    return personas(cloud, "appcred")


def _create(cloud: RunningCloud, token: str, user_id: str, **fields: Any) -> httpx.Response:
    return httpx.post(
        f"{cloud.base_url}/identity/v3/users/{user_id}/application_credentials",
        headers={"X-Auth-Token": token},
        json={"application_credential": fields},
        timeout=30,
    )


def _auth(cloud: RunningCloud, cred_id: str, secret: str, **extra: Any) -> httpx.Response:
    identity = {
        "methods": ["application_credential"],
        "application_credential": {"id": cred_id, "secret": secret},
    }
    return httpx.post(
        f"{cloud.base_url}/identity/v3/auth/tokens", json={"auth": {"identity": identity, **extra}}
    )


def test_terraform_style_automation_through_openstacksdk_alone(
    cloud: RunningCloud, team: Personas
) -> None:
    made = team.osc(
        "member",
        "application",
        "credential",
        "create",
        "--role",
        "member",
        unique("tf"),
        "-f",
        "json",
    )
    assert made.returncode == 0, made.stderr
    cred = json.loads(made.stdout)
    conn = connect(
        cloud,
        auth_type="v3applicationcredential",
        application_credential_id=cred["ID"],
        application_credential_secret=cred["Secret"],
    )
    assert conn.current_project_id == team.project["id"]
    net = conn.network.create_network(name=unique("tf-net"))
    subnet = conn.network.create_subnet(network_id=net.id, ip_version=4, cidr="192.168.77.0/24")
    flavor = conn.compute.find_flavor("m1.tiny", ignore_missing=False)
    image = conn.image.find_image(IMAGE, ignore_missing=False)
    server = conn.compute.create_server(
        name=unique("tf-vm"), flavor_id=flavor.id, image_id=image.id, networks=[{"uuid": net.id}]
    )
    server = conn.compute.wait_for_server(server, wait=120)
    assert server.status == "ACTIVE"
    ports = list(conn.network.ports(device_id=server.id))
    assert [ip["subnet_id"] for p in ports for ip in p.fixed_ips] == [subnet.id]
    # A router from the subnet to the external network, and a floating IP through it.
    public = conn.network.find_network("public", ignore_missing=False)
    router = conn.network.create_router(
        name=unique("tf-router"), external_gateway_info={"network_id": public.id}
    )
    gateway = router.external_gateway_info["external_fixed_ips"]
    assert [ip["ip_address"].startswith("172.24.4.") for ip in gateway] == [True]
    conn.network.add_interface_to_router(router, subnet_id=subnet.id)
    fip = conn.network.create_ip(floating_network_id=public.id)
    assert fip.status == "DOWN"
    fip = conn.network.update_ip(fip, port_id=ports[0].id)
    assert (fip.status, fip.router_id, fip.fixed_ip_address) == (
        "ACTIVE",
        router.id,
        ports[0].fixed_ips[0]["ip_address"],
    )
    addresses = conn.compute.get_server(server.id).addresses[net.name]
    assert {(a["OS-EXT-IPS:type"], a["addr"]) for a in addresses} == {
        ("fixed", ports[0].fixed_ips[0]["ip_address"]),
        ("floating", fip.floating_ip_address),
    }
    # The router cannot lose what the floating IP needs; the server's end frees it.
    with pytest.raises(openstack.exceptions.ConflictException):
        conn.network.remove_interface_from_router(router, subnet_id=subnet.id)
    conn.compute.delete_server(server)
    conn.compute.wait_for_delete(server, wait=120)
    assert conn.network.get_ip(fip.id).status == "DOWN"
    conn.network.remove_interface_from_router(router, subnet_id=subnet.id)
    conn.network.delete_ip(fip)
    conn.network.delete_router(router)


def test_roles_restriction_expiry_and_revocation(cloud: RunningCloud, team: Personas) -> None:
    reader, reader_id = team.token("reader"), team.users["reader"]["id"]
    # A credential carries only roles its user holds; a reader's cannot carry member.
    refused = _create(cloud, reader, reader_id, name=unique("c"), roles=[{"name": "member"}])
    assert refused.status_code == 403
    past = _create(cloud, reader, reader_id, name=unique("c"), expires_at="2001-01-01T00:00:00Z")
    assert past.status_code == 400
    name = unique("ci")
    made = _create(cloud, reader, reader_id, name=name, expires_at="2099-01-01T00:00:00Z")
    assert made.status_code == 201, made.text
    cred = made.json()["application_credential"]
    assert [r["name"] for r in cred["roles"]] == ["reader"]
    assert cred["expires_at"].startswith("2099-01-01T00:00:00")
    assert _create(cloud, reader, reader_id, name=name).status_code == 409
    # Another's credentials: a member may not list them, an admin may.
    base = f"{cloud.base_url}/identity/v3/users/{reader_id}/application_credentials"
    member = {"X-Auth-Token": team.token("member")}
    assert httpx.get(base, headers=member).status_code == 403
    listed = httpx.get(base, headers={"X-Auth-Token": cloud.token()}).json()
    assert name in {c["name"] for c in listed["application_credentials"]}
    assert "secret" not in listed["application_credentials"][0]
    # Its token: the reader's project and roles, no scope of another, no more credentials.
    issued = _auth(cloud, cred["id"], cred["secret"])
    assert issued.status_code == 201, issued.text
    token = issued.json()["token"]
    assert token["application_credential"] == {"id": cred["id"], "name": name, "restricted": True}
    assert {r["name"] for r in token["roles"]} == {"reader"}
    scoped = _auth(cloud, cred["id"], cred["secret"], scope={"project": {"id": "x"}})
    assert scoped.status_code == 401
    assert _auth(cloud, cred["id"], "wrong").status_code == 401
    ac_token = issued.headers["x-subject-token"]
    again = _create(cloud, ac_token, reader_id, name=unique("c"))
    assert again.status_code == 403
    # Deleting the credential revokes its tokens.
    headers = {"X-Auth-Token": ac_token}
    networks = f"{cloud.base_url}/networking/v2.0/networks"
    assert httpx.get(networks, headers=headers).status_code == 200
    assert httpx.delete(f"{base}/{cred['id']}", headers={"X-Auth-Token": reader}).status_code == 204
    assert httpx.get(networks, headers=headers).status_code == 401
    assert _auth(cloud, cred["id"], cred["secret"]).status_code == 401


def test_access_rules_hold_a_token_to_the_requests_they_name(
    cloud: RunningCloud, team: Personas
) -> None:
    member, member_id = team.token("member"), team.users["member"]["id"]
    rules = [{"service": "network", "method": "GET", "path": "/v2.0/networks"}]
    made = _create(cloud, member, member_id, name=unique("ar"), access_rules=rules)
    assert made.status_code == 201, made.text
    cred = made.json()["application_credential"]
    token = _auth(cloud, cred["id"], cred["secret"]).headers["x-subject-token"]
    headers = {"X-Auth-Token": token}
    base = f"{cloud.base_url}/networking/v2.0"
    assert httpx.get(f"{base}/networks", headers=headers).status_code == 200
    assert httpx.get(f"{base}/ports", headers=headers).status_code == 401
    posted = httpx.post(f"{base}/networks", headers=headers, json={"network": {}})
    assert posted.status_code == 401
    servers = httpx.get(f"{cloud.base_url}/compute/v2.1/servers", headers=headers)
    assert servers.status_code == 401
    listed = httpx.get(
        f"{cloud.base_url}/identity/v3/users/{member_id}/access_rules",
        headers={"X-Auth-Token": member},
    ).json()["access_rules"]
    assert [(r["service"], r["method"], r["path"]) for r in listed] == [
        ("network", "GET", "/v2.0/networks")
    ]
    bad = _create(cloud, member, member_id, name=unique("ar"), access_rules=[{"path": "x"}])
    assert bad.status_code == 400


def test_a_role_granted_after_the_token_may_be_given_to_a_credential(
    cloud: RunningCloud, team: Personas
) -> None:
    """Keystone checks a credential's roles against the user's assignments, not the token's
    roles: a role granted since the token was issued counts (Tempest's
    test_create_application_credential_with_roles)."""
    member, member_id = team.token("member"), team.users["member"]["id"]
    admin = Admin(cloud)
    role = admin("POST", "/roles", {"role": {"name": unique("deployer")}}).json()["role"]
    refused = _create(cloud, member, member_id, name=unique("c"), roles=[{"id": role["id"]}])
    assert refused.status_code == 403, refused.text  # not held yet
    path = f"/projects/{team.project['id']}/users/{member_id}/roles/{role['id']}"
    assert admin("PUT", path).status_code == 204
    made = _create(cloud, member, member_id, name=unique("c"), roles=[{"id": role["id"]}])
    assert made.status_code == 201, made.text
    cred = made.json()["application_credential"]
    issued = _auth(cloud, cred["id"], cred["secret"])
    assert issued.status_code == 201, issued.text
    assert [r["id"] for r in issued.json()["token"]["roles"]] == [role["id"]]
