"""Trunks and subports (Neutron's trunk and trunk-details extensions) per persona, through the
real `openstack network trunk` CLI, openstacksdk and the raw API for Neutron's refusals."""

from __future__ import annotations

import json
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from tests.api.cloudproc import RunningCloud
from tests.api.personas import Personas, personas
from tests.api.sdk import SDK_WARNINGS
from tests.api.test_identity import unique
from tests.api.test_network import Neutron


@pytest.fixture(scope="module")
def team(cloud: RunningCloud) -> Personas:
    return personas(cloud, "trunk")


def _ok(result: Any) -> Any:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout) if result.stdout.strip().startswith(("{", "[")) else None


def _ports(member: Neutron, count: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    net = member.create("networks", "network", name=unique("tn"))
    member.create("subnets", "subnet", network_id=net["id"], ip_version=4, cidr="10.44.0.0/24")
    return net, [
        member.create("ports", "port", network_id=net["id"], name=unique("tp"))
        for _ in range(count)
    ]


def test_a_member_trunks_ports_through_the_cli_and_a_reader_only_looks(
    cloud: RunningCloud, team: Personas
) -> None:
    member = Neutron(cloud, team.token("member"))
    _net, (parent, sub1, sub2) = _ports(member, 3)
    name = unique("trunk")
    trunk = _ok(
        team.osc(
            "member", "network", "trunk", "create", "--parent-port", parent["id"],
            "--subport", f"port={sub1['id']},segmentation-type=vlan,segmentation-id=100",
            "--description", "t", name, "-f", "json",
        )
    )  # fmt: skip
    assert trunk["status"] == "DOWN"
    assert trunk["port_id"] == parent["id"]
    assert trunk["project_id"] == team.project["id"]
    assert [s["segmentation_id"] for s in trunk["sub_ports"]] == [100]
    _ok(
        team.osc(
            "member", "network", "trunk", "set", name,
            "--subport", f"port={sub2['id']},segmentation-type=vlan,segmentation-id=200",
        )
    )  # fmt: skip
    shown = _ok(team.osc("member", "network", "trunk", "show", name, "-f", "json"))
    assert sorted(s["segmentation_id"] for s in shown["sub_ports"]) == [100, 200]
    assert shown["revision_number"] > trunk["revision_number"]
    # trunk-details on the parent port, with the subports' MACs
    details = member.get(f"/ports/{parent['id']}").json()["port"]["trunk_details"]
    assert details["trunk_id"] == trunk["id"]
    assert {s["port_id"]: s["mac_address"] for s in details["sub_ports"]} == {
        sub1["id"]: sub1["mac_address"],
        sub2["id"]: sub2["mac_address"],
    }
    assert "trunk_details" not in member.get(f"/ports/{sub1['id']}").json()["port"]
    got = member.get(f"/trunks/{trunk['id']}/get_subports").json()["sub_ports"]
    assert len(got) == 2
    # a reader sees it, and may change nothing
    reader = Neutron(cloud, team.token("reader"))
    assert reader.get(f"/trunks/{trunk['id']}").status_code == 200
    assert _ok(team.osc("reader", "network", "trunk", "list", "-f", "json"))[0]["ID"] == trunk["id"]
    denied = team.osc("reader", "network", "trunk", "set", "--name", "x", name)
    assert denied.returncode != 0
    assert reader.put(f"/trunks/{trunk['id']}", {"trunk": {"name": "x"}}).status_code == 403
    assert reader.delete(f"/trunks/{trunk['id']}").status_code == 403
    assert (
        reader.put(f"/trunks/{trunk['id']}/remove_subports", {"sub_ports": []}).status_code == 403
    )
    # a port of the trunk cannot be deleted while it is
    refused = member.delete(f"/ports/{parent['id']}")
    assert refused.status_code == 409
    assert refused.json()["NeutronError"]["type"] == "PortInUseAsTrunkParent"
    refused = member.delete(f"/ports/{sub1['id']}")
    assert refused.status_code == 409
    assert refused.json()["NeutronError"]["type"] == "PortInUseAsSubPort"
    _ok(team.osc("member", "network", "trunk", "unset", name, "--subport", sub1["id"]))
    shown = _ok(team.osc("member", "network", "trunk", "show", name, "-f", "json"))
    assert [s["port_id"] for s in shown["sub_ports"]] == [sub2["id"]]
    assert member.delete(f"/ports/{sub1['id']}").status_code == 204
    _ok(team.osc("member", "network", "trunk", "delete", name))
    assert member.get(f"/trunks/{trunk['id']}").status_code == 404
    assert "trunk_details" not in member.get(f"/ports/{parent['id']}").json()["port"]
    assert member.delete(f"/ports/{parent['id']}").status_code == 204


def _error(response: Any, status: int, kind: str) -> None:
    assert response.status_code == status, response.text
    assert response.json()["NeutronError"]["type"] == kind, response.text


def test_neutrons_refusals_of_trunk_requests(cloud: RunningCloud, team: Personas) -> None:
    member = Neutron(cloud, team.token("member"))
    _net, (parent, sub, other, spare) = _ports(member, 4)
    trunk = member.create(
        "trunks",
        "trunk",
        port_id=parent["id"],
        sub_ports=[{"port_id": sub["id"], "segmentation_type": "vlan", "segmentation_id": 10}],
    )
    # a port already in a trunk, as its parent or a subport, is in use
    _error(member.post("/trunks", {"trunk": {"port_id": parent["id"]}}), 409, "TrunkPortInUse")
    _error(member.post("/trunks", {"trunk": {"port_id": sub["id"]}}), 409, "TrunkPortInUse")
    add = f"/trunks/{trunk['id']}/add_subports"

    def sub_port(port_id: str, seg: Any, kind: Any = "vlan") -> dict[str, Any]:
        return {
            "sub_ports": [{"port_id": port_id, "segmentation_type": kind, "segmentation_id": seg}]
        }

    _error(member.put(add, sub_port(other["id"], 10)), 409, "DuplicateSubPort")
    _error(member.put(add, sub_port(parent["id"], 11)), 409, "TrunkPortInUse")
    _error(member.put(add, sub_port(sub["id"], 12)), 409, "TrunkPortInUse")
    for seg in (0, 4095, "x"):
        _error(member.put(add, sub_port(other["id"], seg)), 400, "HTTPBadRequest")
    _error(member.put(add, sub_port(other["id"], 13, "inherit")), 400, "HTTPBadRequest")
    _error(member.put(add, {"sub_ports": [{"port_id": other["id"]}]}), 400, "HTTPBadRequest")
    _error(member.put(add, sub_port(str(uuid.uuid4()), 14)), 404, "PortNotFound")
    _error(member.post("/trunks", {"trunk": {"port_id": str(uuid.uuid4())}}), 404, "PortNotFound")
    _error(member.post("/trunks", {"trunk": {}}), 400, "HTTPBadRequest")
    remove = f"/trunks/{trunk['id']}/remove_subports"
    _error(member.put(remove, {"sub_ports": [{"port_id": other["id"]}]}), 404, "SubPortNotFound")
    _error(member.get(f"/trunks/{uuid.uuid4()}"), 404, "TrunkNotFound")
    _error(member.put(f"/trunks/{trunk['id']}", {"trunk": {"port_id": spare["id"]}}), 400,
           "HTTPBadRequest")  # fmt: skip
    # a disabled trunk takes no subport changes
    member.put(f"/trunks/{trunk['id']}", {"trunk": {"admin_state_up": False}})
    _error(member.put(add, sub_port(other["id"], 15)), 409, "TrunkDisabled")
    member.put(f"/trunks/{trunk['id']}", {"trunk": {"admin_state_up": True}})
    # another project sees none of it
    outsider = personas(cloud, "trunk-out")
    stranger = Neutron(cloud, outsider.token("member"))
    _error(stranger.get(f"/trunks/{trunk['id']}"), 404, "TrunkNotFound")
    assert stranger.get("/trunks").json()["trunks"] == []
    _error(stranger.post("/trunks", {"trunk": {"port_id": spare["id"]}}), 404, "PortNotFound")
    # bound to a server (as Nova binds it), the trunk is ACTIVE and cannot be deleted
    admin = Neutron(cloud, cloud.token())
    bound = admin.put(
        f"/ports/{parent['id']}",
        {"port": {"device_id": str(uuid.uuid4()), "device_owner": "compute:nova",
                  "binding:host_id": "stowage"}},
    )  # fmt: skip
    assert bound.status_code == 200, bound.text
    assert member.get(f"/trunks/{trunk['id']}").json()["trunk"]["status"] == "ACTIVE"
    _error(member.delete(f"/trunks/{trunk['id']}"), 409, "TrunkInUse")
    admin.put(f"/ports/{parent['id']}", {"port": {"device_id": "", "device_owner": ""}})
    assert member.get(f"/trunks/{trunk['id']}").json()["trunk"]["status"] == "ACTIVE"
    admin.put(f"/ports/{parent['id']}", {"port": {"binding:host_id": ""}})
    assert member.get(f"/trunks/{trunk['id']}").json()["trunk"]["status"] == "DOWN"
    assert member.delete(f"/trunks/{trunk['id']}").status_code == 204


@SDK_WARNINGS
def test_admin_and_openstacksdk_see_trunks_and_the_extensions(
    cloud: RunningCloud, team: Personas, sdk: Any
) -> None:
    member = Neutron(cloud, team.token("member"))
    _net, (parent, sub) = _ports(member, 2)
    made = sdk.network.create_trunk(
        port_id=parent["id"], name=unique("sdk"), project_id=team.project["id"]
    )
    assert made.status == "DOWN"
    sdk.network.add_trunk_subports(
        made, [{"port_id": sub["id"], "segmentation_type": "vlan", "segmentation_id": 42}]
    )
    assert sdk.network.get_trunk_subports(made)["sub_ports"][0]["segmentation_id"] == 42
    assert [t.id for t in sdk.network.trunks(port_id=parent["id"])] == [made.id]
    assert member.get("/trunks", params={"name": made.name}).json()["trunks"][0]["id"] == made.id
    sdk.network.delete_trunk_subports(made, [{"port_id": sub["id"]}])
    assert sdk.network.get_trunk(made.id).sub_ports == []
    sdk.network.delete_trunk(made.id)
    aliases = {e.alias for e in sdk.network.extensions()}
    assert {"trunk", "trunk-details"} <= aliases


def test_a_port_goes_to_one_trunk_however_close_the_requests(
    cloud: RunningCloud, team: Personas
) -> None:
    member = Neutron(cloud, team.token("member"))
    _net, (parent,) = _ports(member, 1)
    with ThreadPoolExecutor(6) as pool:
        answers = list(
            pool.map(
                lambda _i: member.post("/trunks", {"trunk": {"port_id": parent["id"]}}), range(6)
            )
        )
    codes = sorted(a.status_code for a in answers)
    assert codes == [201] + [409] * 5, [a.text for a in answers]
    made = next(a.json()["trunk"] for a in answers if a.status_code == 201)
    assert len(member.get("/trunks", params={"port_id": parent["id"]}).json()["trunks"]) == 1
    assert member.delete(f"/trunks/{made['id']}").status_code == 204
    # released with the trunk: the port may be a trunk's again
    again = member.create("trunks", "trunk", port_id=parent["id"])
    assert member.delete(f"/trunks/{again['id']}").status_code == 204


def test_subports_added_at_once_to_one_trunk_are_all_kept(
    cloud: RunningCloud, team: Personas
) -> None:
    """Each add_subports writes the trunk by compare-and-swap: 24 requests adding one
    subport each at the same moment leave 24 subports, none lost to another's write."""
    member = Neutron(cloud, team.token("member"))
    _net, (parent, *subs) = _ports(member, 25)
    trunk = member.create("trunks", "trunk", port_id=parent["id"])
    url = f"/trunks/{trunk['id']}/add_subports"

    def add(i: int) -> int:
        sub = {"port_id": subs[i]["id"], "segmentation_type": "vlan", "segmentation_id": 10 + i}
        return member.put(url, {"sub_ports": [sub]}).status_code

    with ThreadPoolExecutor(24) as pool:
        assert list(pool.map(add, range(24))) == [200] * 24
    kept = member.get(f"/trunks/{trunk['id']}/get_subports").json()["sub_ports"]
    assert sorted(s["segmentation_id"] for s in kept) == list(range(10, 34))
