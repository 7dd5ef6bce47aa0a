"""Routers and floating IPs per persona through the real CLI, and Nova's floating IP proxy
(os-floating-ips up to 2.35) and addFloatingIp/removeFloatingIp (up to 2.43)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from tests.api.cloudproc import IMAGE, RunningCloud
from tests.api.personas import Personas, personas
from tests.api.test_identity import unique
from tests.api.test_network import Neutron


@pytest.fixture(scope="module")
def team(cloud: RunningCloud) -> Personas:
    return personas(cloud, "l3")


def _ok(result: Any) -> Any:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout) if result.stdout.strip().startswith(("{", "[")) else None


def _neutron(cloud: RunningCloud, token: str) -> Neutron:
    return Neutron(cloud, token)


def _wait_active(cloud: RunningCloud, server_id: str, token: str) -> dict[str, Any]:
    for _ in range(120):
        server: dict[str, Any] = cloud.compute("GET", f"/servers/{server_id}", token=token).json()[
            "server"
        ]
        if server["status"] in ("ACTIVE", "ERROR"):
            return server
        time.sleep(0.5)
    raise AssertionError(f"server {server_id} did not settle")


def test_a_member_routes_a_subnet_out_and_a_reader_only_looks(
    cloud: RunningCloud, team: Personas
) -> None:
    member = _neutron(cloud, team.token("member"))
    net = member.post("/networks", {"network": {"name": unique("l3")}}).json()["network"]
    subnet = member.post(
        "/subnets",
        {"subnet": {"network_id": net["id"], "ip_version": 4, "cidr": "10.9.8.0/24"}},
    ).json()["subnet"]
    name = unique("r")
    router = _ok(
        team.osc("member", "router", "create", "--external-gateway", "public", name, "-f", "json")
    )
    assert router["status"] == "ACTIVE"
    assert router["external_gateway_info"]["external_fixed_ips"][0]["ip_address"].startswith(
        "172.24.4."
    )
    _ok(team.osc("member", "router", "add", "subnet", name, subnet["id"]))
    ports = member.get("/ports", params={"device_id": router["id"]}).json()["ports"]
    interface = next(p for p in ports if p["device_owner"] == "network:router_interface")
    assert interface["fixed_ips"] == [{"subnet_id": subnet["id"], "ip_address": "10.9.8.1"}]
    # The reader sees the router and may not change anything.
    shown = _ok(team.osc("reader", "router", "show", name, "-f", "json"))
    assert shown["id"] == router["id"]
    refused = team.osc("reader", "router", "create", unique("no"))
    assert refused.returncode != 0
    reader = _neutron(cloud, team.token("reader"))
    assert reader.post("/floatingips", {"floatingip": {}}).status_code == 403
    # Another project's member does not see it; the same subnet twice is refused.
    other = _neutron(cloud, cloud.token("demo", "stowage-demo", "demo"))
    assert other.get(f"/routers/{router['id']}").status_code == 404
    again = member.put(f"/routers/{router['id']}/add_router_interface", {"subnet_id": subnet["id"]})
    assert again.status_code == 400
    # A router with interfaces cannot be deleted; without them it can.
    assert member.delete(f"/routers/{router['id']}").status_code == 409
    _ok(team.osc("member", "router", "remove", "subnet", name, subnet["id"]))
    assert member.delete(f"/routers/{router['id']}").status_code == 204
    names = {e["Alias"]: e["Name"] for e in cloud.osc_json("extension", "list", "--network")}
    assert names["router"] == "Neutron L3 Router"


def test_novas_floating_ip_proxy_and_actions(cloud: RunningCloud, team: Personas) -> None:
    token = team.token("member")
    member = _neutron(cloud, token)
    net = member.post("/networks", {"network": {"name": unique("fipnet")}}).json()["network"]
    subnet = member.post(
        "/subnets",
        {"subnet": {"network_id": net["id"], "ip_version": 4, "cidr": "10.7.6.0/24"}},
    ).json()["subnet"]
    public = member.get("/networks", params={"name": "public"}).json()["networks"][0]
    router = member.post(
        "/routers",
        {"router": {"name": unique("r"), "external_gateway_info": {"network_id": public["id"]}}},
    ).json()["router"]
    member.put(f"/routers/{router['id']}/add_router_interface", {"subnet_id": subnet["id"]})
    flavor = cloud.osc_json("flavor", "show", "m1.tiny")["id"]
    image = cloud.osc_json("image", "show", IMAGE)["id"]
    server = {"name": unique("fipvm"), "flavorRef": flavor, "imageRef": image}
    server["networks"] = [{"uuid": net["id"]}]  # type: ignore[assignment]
    made = cloud.compute("POST", "/servers", token=token, json={"server": server})
    assert made.status_code == 202, made.text
    server_id = made.json()["server"]["id"]
    assert _wait_active(cloud, server_id, token)["status"] == "ACTIVE"
    # os-floating-ips at 2.35: a reader may list, not allocate; at 2.36 it is gone.
    reader = team.token("reader")
    assert cloud.compute("GET", "/os-floating-ips", version="2.35", token=reader).status_code == 200
    denied = cloud.compute("POST", "/os-floating-ips", version="2.35", token=reader, json={})
    assert denied.status_code == 403
    assert cloud.compute("GET", "/os-floating-ips", version="2.36", token=token).status_code == 404
    allocated = cloud.compute(
        "POST", "/os-floating-ips", version="2.35", token=token, json={"pool": "public"}
    )
    assert allocated.status_code == 200, allocated.text
    fip = allocated.json()["floating_ip"]
    assert (fip["pool"], fip["instance_id"], fip["fixed_ip"]) == ("public", None, None)
    # addFloatingIp up to 2.43: the server's addresses carry it; removeFloatingIp undoes it.
    action = f"/servers/{server_id}/action"
    add = {"addFloatingIp": {"address": fip["ip"]}}
    assert cloud.compute("POST", action, version="2.44", token=token, json=add).status_code == 404
    assert cloud.compute("POST", action, version="2.43", token=reader, json=add).status_code == 403
    assert cloud.compute("POST", action, version="2.43", token=token, json=add).status_code == 202
    shown = cloud.compute("GET", f"/os-floating-ips/{fip['id']}", version="2.35", token=token)
    assert shown.json()["floating_ip"]["instance_id"] == server_id
    addresses = cloud.compute("GET", f"/servers/{server_id}", token=token).json()["server"][
        "addresses"
    ][net["name"]]
    assert {a["OS-EXT-IPS:type"] for a in addresses} == {"fixed", "floating"}
    remove = {"removeFloatingIp": {"address": fip["ip"]}}
    assert (
        cloud.compute("POST", action, version="2.43", token=token, json=remove).status_code == 202
    )
    again = cloud.compute("POST", action, version="2.43", token=token, json=remove)
    assert again.status_code == 400
    assert member.get(f"/floatingips/{fip['id']}").json()["floatingip"]["status"] == "DOWN"
    released = cloud.compute("DELETE", f"/os-floating-ips/{fip['id']}", version="2.35", token=token)
    assert released.status_code == 202
    assert member.get(f"/floatingips/{fip['id']}").status_code == 404
    cloud.compute("DELETE", f"/servers/{server_id}", token=token)


def test_gateway_and_floating_ip_ports_belong_to_no_project(cloud: RunningCloud) -> None:
    """As in Neutron: a router's gateway port and a floating IP's port count against no
    project's port quota and are not in a member's port list. Before the fix a project at its
    port quota could make neither a gateway nor a floating IP."""
    team = personas(cloud, "noport")
    project = team.project["id"]
    member = _neutron(cloud, team.token("member"))
    admin = _neutron(cloud, cloud.token())
    net = member.post("/networks", {"network": {"name": unique("q")}}).json()["network"]
    member.post(
        "/subnets", {"subnet": {"network_id": net["id"], "ip_version": 4, "cidr": "10.5.4.0/24"}}
    )
    first = member.post("/ports", {"port": {"network_id": net["id"]}})
    assert first.status_code == 201, first.text
    cloud.osc("quota", "set", "--ports", "1", project)  # used up by the port above
    assert member.post("/ports", {"port": {"network_id": net["id"]}}).status_code == 409
    public = member.get("/networks", params={"name": "public"}).json()["networks"][0]
    router = member.post(
        "/routers",
        {"router": {"name": unique("r"), "external_gateway_info": {"network_id": public["id"]}}},
    )
    assert router.status_code == 201, router.text
    fip = member.post("/floatingips", {"floatingip": {"floating_network_id": public["id"]}})
    assert fip.status_code == 201, fip.text
    router_id, fip_id = router.json()["router"]["id"], fip.json()["floatingip"]["id"]
    mine = member.get("/ports").json()["ports"]
    assert [p["id"] for p in mine] == [first.json()["port"]["id"]]
    every = admin.get("/ports").json()["ports"]
    owners = {p["device_id"]: p["project_id"] for p in every}
    assert owners[router_id] == "" and owners[fip_id] == ""
    used = cloud.osc_json("quota", "show", "--usage", project)
    ports = next(r for r in used if r["Resource"] == "ports")
    assert ports["In Use"] == 1, used
    assert member.delete(f"/floatingips/{fip_id}").status_code == 204
    cleared = member.put(f"/routers/{router_id}", {"router": {"external_gateway_info": {}}})
    assert cleared.status_code == 200, cleared.text
    assert member.delete(f"/routers/{router_id}").status_code == 204
    left = admin.get("/ports").json()["ports"]
    assert not [p for p in left if p["device_id"] in (router_id, fip_id)]
