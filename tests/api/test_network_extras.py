"""Neutron extensions beyond the core through the real CLI, per persona: network IP
availability (admin only) and an admin's MAC change of an unbound port."""

from __future__ import annotations

import json
from typing import Any

import pytest
from tests.api.cloudproc import RunningCloud
from tests.api.personas import Personas, personas
from tests.api.test_identity import unique
from tests.api.test_network import Neutron, error


@pytest.fixture(scope="module")
def team(cloud: RunningCloud) -> Personas:
    return personas(cloud, "netx")


def _ok(result: Any) -> Any:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout) if result.stdout.strip().startswith(("{", "[")) else None


def _network_with_ports(member: Neutron, cidr: str, ports: int) -> tuple[dict[str, Any], ...]:
    net = member.create("networks", "network", name=unique("avail"))
    subnet = member.create("subnets", "subnet", network_id=net["id"], ip_version=4, cidr=cidr)
    made = tuple(member.create("ports", "port", network_id=net["id"]) for _ in range(ports))
    return (net, subnet, *made)


def test_ip_availability_counts_pools_and_claims_for_an_admin_only(
    cloud: RunningCloud, team: Personas
) -> None:
    member = Neutron(cloud, team.token("member"))
    net, subnet, *_ports = _network_with_ports(member, "10.77.1.0/28", 3)
    shown = _ok(team.osc("admin", "ip", "availability", "show", net["id"], "-f", "json"))
    assert shown["network_id"] == net["id"]
    assert shown["network_name"] == net["name"]
    assert shown["project_id"] == team.project["id"]
    # 10.77.1.0/28: .2-.14 in the pool (13), the three ports hold three of them.
    assert (shown["total_ips"], shown["used_ips"]) == (13, 3)
    assert shown["subnet_ip_availability"] == [
        {
            "subnet_id": subnet["id"],
            "subnet_name": subnet["name"],
            "cidr": "10.77.1.0/28",
            "ip_version": 4,
            "total_ips": 13,
            "used_ips": 3,
        }
    ]
    listed = _ok(
        team.osc(
            "admin", "ip", "availability", "list", "--project",
            team.project["id"], "--ip-version", "4", "-f", "json",
        )
    )  # fmt: skip
    assert [(r["Network ID"], r["Total IPs"], r["Used IPs"]) for r in listed] == [
        (net["id"], 13, 3)
    ]
    admin = Neutron(cloud, team.token("admin"))
    by_name = admin.get("/network-ip-availabilities", params={"network_name": net["name"]})
    assert [r["network_id"] for r in by_name.json()["network_ip_availabilities"]] == [net["id"]]
    v6 = admin.get("/network-ip-availabilities", params={"network_id": net["id"], "ip_version": 6})
    assert v6.json()["network_ip_availabilities"] == []
    assert admin.get("/network-ip-availabilities", params={"bogus": "x"}).status_code == 400
    # A port freed is an address free again.
    assert member.delete(f"/ports/{_ports[0]['id']}").status_code == 204
    again = admin.get(f"/network-ip-availabilities/{net['id']}").json()["network_ip_availability"]
    assert again["used_ips"] == 2
    # A member and a reader see none: neutron's policy is admin only.
    for role in ("member", "reader"):
        caller = Neutron(cloud, team.token(role))
        rows = caller.get("/network-ip-availabilities").json()["network_ip_availabilities"]
        assert rows == []
        assert caller.get(f"/network-ip-availabilities/{net['id']}").status_code == 404
    refused = team.osc("member", "ip", "availability", "show", net["id"])
    assert refused.returncode != 0
    assert admin.get("/network-ip-availabilities/nope").status_code == 404
    aliases = {e["Alias"] for e in cloud.osc_json("extension", "list", "--network")}
    assert "network-ip-availability" in aliases


def test_an_admin_changes_an_unbound_ports_mac_and_a_member_may_not(
    cloud: RunningCloud, team: Personas
) -> None:
    member = Neutron(cloud, team.token("member"))
    admin = Neutron(cloud, team.token("admin"))
    net, _subnet, port, other = _network_with_ports(member, "10.77.2.0/24", 2)
    old = port["mac_address"]
    refused = member.put(f"/ports/{port['id']}", {"port": {"mac_address": "fa:16:3e:00:00:01"}})
    assert refused.status_code == 403, refused.text
    assert error(refused)["type"] == "PolicyNotAuthorized"
    reader = Neutron(cloud, team.token("reader"))
    assert (
        reader.put(f"/ports/{port['id']}", {"port": {"mac_address": "fa:16:3e:00:00:01"}})
    ).status_code == 403
    # The same MAC is no change, and a member may send it.
    same = member.put(f"/ports/{port['id']}", {"port": {"mac_address": old, "name": "same"}})
    assert same.status_code == 200, same.text
    # Taken on the network: 409 MacAddressInUse, and the port keeps its own.
    taken = admin.put(f"/ports/{port['id']}", {"port": {"mac_address": other["mac_address"]}})
    assert taken.status_code == 409
    assert error(taken)["type"] == "MacAddressInUse"
    assert (
        admin.put(
            f"/ports/{port['id']}", {"port": {"mac_address": "01:00:00:00:00:01"}}
        ).status_code
        == 400
    )
    new = "fa:16:3e:aa:bb:cc"
    changed = _ok(team.osc("admin", "port", "set", "--mac-address", new, port["id"]))
    assert changed is None
    assert member.get(f"/ports/{port['id']}").json()["port"]["mac_address"] == new
    # The old MAC is free again: another port may take it; the new one is not.
    reused = admin.post("/ports", {"port": {"network_id": net["id"], "mac_address": old}})
    assert reused.status_code == 201, reused.text
    dup = admin.post("/ports", {"port": {"network_id": net["id"], "mac_address": new}})
    assert dup.status_code == 409
    # A bound port's MAC stays: ML2's PortBound.
    bound = admin.put(f"/ports/{other['id']}", {"port": {"binding:host_id": "compute-1"}})
    assert bound.status_code == 200, bound.text
    busy = admin.put(f"/ports/{other['id']}", {"port": {"mac_address": "fa:16:3e:aa:bb:cd"}})
    assert busy.status_code == 409
    assert error(busy)["type"] == "PortBound"


def test_auto_allocated_topology_per_persona(cloud: RunningCloud, team: Personas) -> None:
    project = team.project["id"]
    checked = _ok(
        team.osc("member", "network", "auto", "allocated", "topology", "create",
                 "--check-resources", "-f", "json")
    )  # fmt: skip
    assert checked is not None
    reader = Neutron(cloud, team.token("reader"))
    dry = reader.get(f"/auto-allocated-topology/{project}", params={"fields": "dry-run"})
    assert dry.json()["auto_allocated_topology"]["id"] == "dry-run=pass"
    assert reader.get(f"/auto-allocated-topology/{project}").status_code == 403
    made = _ok(
        team.osc("member", "network", "auto", "allocated", "topology", "create", "-f", "json")
    )
    member = Neutron(cloud, team.token("member"))
    net = member.get(f"/networks/{made['id']}").json()["network"]
    assert (net["name"], net["project_id"]) == ("auto_allocated_network", project)
    subnet = member.get(f"/subnets/{net['subnets'][0]}").json()["subnet"]
    assert subnet["cidr"] == "10.128.0.0/24"
    routers = member.get("/routers", params={"name": "auto_allocated_router"}).json()["routers"]
    assert len(routers) == 1
    assert (
        routers[0]["external_gateway_info"]["network_id"]
        == cloud.osc_json("network", "show", "public")["id"]
    )
    # The same one again (a reader may now see it), another project's member may not ask.
    again = member.get(f"/auto-allocated-topology/{project}").json()["auto_allocated_topology"]
    assert again["id"] == made["id"]
    assert again["tenant_id"] == project
    shown = reader.get(f"/auto-allocated-topology/{project}")
    assert shown.json()["auto_allocated_topology"]["id"] == made["id"]
    other = Neutron(cloud, cloud.token("demo", "stowage-demo", "demo"))
    assert other.get(f"/auto-allocated-topology/{project}").status_code == 403
    assert other.delete(f"/auto-allocated-topology/{project}").status_code == 403
    assert reader.delete(f"/auto-allocated-topology/{project}").status_code == 403
    # A port in use keeps it; deleted, it is all gone, and a second delete is a 404.
    port = member.create("ports", "port", network_id=made["id"], device_owner="compute:nova")
    busy = member.delete(f"/auto-allocated-topology/{project}")
    assert busy.status_code == 409
    assert member.delete(f"/ports/{port['id']}").status_code == 204
    _ok(team.osc("member", "network", "auto", "allocated", "topology", "delete"))
    assert member.get(f"/networks/{made['id']}").status_code == 404
    assert member.get(f"/routers/{routers[0]['id']}").status_code == 404
    assert member.delete(f"/auto-allocated-topology/{project}").status_code == 404
    # An admin makes (and removes) one for a project.
    admin = Neutron(cloud, cloud.token())
    by_admin = admin.get(f"/auto-allocated-topology/{project}").json()["auto_allocated_topology"]
    assert member.get(f"/networks/{by_admin['id']}").status_code == 200
    assert admin.delete(f"/auto-allocated-topology/{project}").status_code == 204
    aliases = {e["Alias"] for e in cloud.osc_json("extension", "list", "--network")}
    assert "auto-allocated-topology" in aliases
