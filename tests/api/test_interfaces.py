"""Interface attach and detach (`os-interface`) and the legacy fixed-IP actions on the
simulated hypervisor, as `openstack server add|remove port|network|fixed ip` send them:
the port is made or bound in the network service, the server's addresses follow, and the
simulated guest has the NIC plugged (or unplugged)."""

from __future__ import annotations

import ipaddress
import time
import uuid
from pathlib import Path
from typing import Any

from tests.api.cloudproc import RunningCloud, start_cloud, stop_cloud
from tests.api.test_guest_actions import guest


def _server(cloud: RunningCloud, name: str) -> dict[str, Any]:
    shown: dict[str, Any] = cloud.osc_json("server", "show", name)
    return shown


def _ports(cloud: RunningCloud, server_id: str) -> list[dict[str, Any]]:
    ports: list[dict[str, Any]] = cloud.osc_json("port", "list", "--device-id", server_id)
    return ports


def _private_ips(cloud: RunningCloud, name: str) -> list[str]:
    addresses = _server(cloud, name)["addresses"]
    return sorted(str(a) for a in addresses.get("private", []))


def test_ports_networks_and_fixed_ips_added_and_removed(cloud: RunningCloud) -> None:
    name = f"nic-{uuid.uuid4().hex[:6]}"
    server_id = cloud.boot(name)["id"]
    assert _private_ips(cloud, name) == [] and guest(cloud, server_id)["nics"] == []

    # add network: a port made on it, bound to the server's host, plugged into the guest.
    cloud.osc("server", "add", "network", name, "private")
    (made,) = _ports(cloud, server_id)
    port = cloud.osc_json("port", "show", made["ID"])
    assert port["device_owner"] == "compute:nova" and port["status"] == "ACTIVE"
    assert port["binding_host_id"] == _server(cloud, name)["OS-EXT-SRV-ATTR:host"]
    assert guest(cloud, server_id)["nics"] == [port["mac_address"]]
    assert _private_ips(cloud, name) == [port["fixed_ips"][0]["ip_address"]]

    # add port: a port of the user's, bound; add fixed ip: one more interface at that IP.
    own = cloud.osc_json("port", "create", "--network", "private", f"p-{name}")
    cloud.osc("server", "add", "port", name, own["id"])
    subnet = cloud.osc_json("subnet", "show", own["fixed_ips"][0]["subnet_id"])
    net = ipaddress.ip_network(subnet["cidr"])
    used = {p["fixed_ips"][0]["ip_address"] for p in (port, own)}
    wanted = next(str(ip) for ip in list(net.hosts())[-20:] if str(ip) not in used)
    cloud.osc("server", "add", "fixed", "ip", "--fixed-ip-address", wanted, name, "private")
    interfaces = cloud.compute("GET", f"/servers/{server_id}/os-interface").json()
    attached = {i["port_id"]: i for i in interfaces["interfaceAttachments"]}
    assert own["id"] in attached and made["ID"] in attached and len(attached) == 3
    macs = sorted(i["mac_addr"] for i in attached.values())
    assert guest(cloud, server_id)["nics"] == macs
    assert wanted in _private_ips(cloud, name)
    shown = cloud.compute("GET", f"/servers/{server_id}/os-interface/{own['id']}").json()
    assert shown["interfaceAttachment"]["mac_addr"] == own["mac_address"]

    # remove port: the user's port stays, unbound; the guest lost its NIC.
    cloud.osc("server", "remove", "port", name, own["id"])
    kept = cloud.osc_json("port", "show", own["id"])
    assert (kept["device_id"], kept["status"]) == ("", "DOWN")
    assert own["mac_address"] not in guest(cloud, server_id)["nics"]
    # remove network: every interface on it goes, the ports made for them deleted.
    cloud.osc("server", "remove", "network", name, "private")
    assert _ports(cloud, server_id) == []
    assert guest(cloud, server_id)["nics"] == [] and _private_ips(cloud, name) == []
    assert cloud.osc("port", "show", made["ID"], check=False).returncode != 0
    events = {e["Action"] for e in cloud.osc_json("server", "event", "list", name)}
    assert {"attach_interface", "detach_interface"} <= events
    cloud.osc("port", "delete", own["id"])
    cloud.osc("server", "delete", "--wait", name)


def test_attach_refusals_and_a_failed_hot_plug(cloud: RunningCloud) -> None:
    name = f"nicf-{uuid.uuid4().hex[:6]}"
    server = cloud.boot(name)
    server_id = server["id"]
    path = f"/servers/{server_id}/os-interface"
    network = cloud.osc_json("network", "show", "private")["id"]
    for body, status in (
        ({"interfaceAttachment": {"port_id": "a", "net_id": network}}, 400),
        ({"interfaceAttachment": {"fixed_ips": [{"ip_address": "10.0.0.9"}]}}, 400),
        ({"interfaceAttachment": {"net_id": str(uuid.uuid4())}}, 404),
        ({"interfaceAttachment": {"port_id": str(uuid.uuid4())}}, 404),
        ({"interfaceAttachment": {"colour": "red"}}, 400),
    ):
        answer = cloud.compute("POST", path, json=body)
        assert answer.status_code == status, (body, answer.text)
    assert cloud.compute("DELETE", f"{path}/{uuid.uuid4()}").status_code == 404

    # The host fails the hot-plug: 500, and the port made for it is gone again.
    host = _server(cloud, name)["OS-EXT-SRV-ATTR:host"]
    fault = {"fault": {"operation": "attach_interface", "step": "plug"}}
    assert cloud.compute("POST", f"/os-stowage-sim/{host}/action", json=fault).status_code == 200
    failed = cloud.compute("POST", path, json={"interfaceAttachment": {"net_id": network}})
    assert failed.status_code == 500, failed.text
    assert _ports(cloud, server_id) == [] and guest(cloud, server_id)["nics"] == []
    # Without a net_id Nova picks the one network the project may use: `private` here.
    attached = cloud.compute("POST", path, json=None)
    assert attached.status_code == 200, attached.text
    port_id = attached.json()["interfaceAttachment"]["port_id"]
    assert attached.json()["interfaceAttachment"]["net_id"] == network

    # Legacy fixed-IP actions, before 2.44 only.
    action = f"/servers/{server_id}/action"
    add = {"addFixedIp": {"networkId": network}}
    assert cloud.compute("POST", action, json=add).status_code == 404  # 2.96
    assert cloud.compute("POST", action, json=add, version="2.43").status_code == 202
    ips = [ip["ip_address"] for ip in cloud.osc_json("port", "show", port_id)["fixed_ips"]]
    assert len(ips) == 2 and _private_ips(cloud, name) == sorted(ips)
    remove = {"removeFixedIp": {"address": ips[1]}}
    assert cloud.compute("POST", action, json=remove, version="2.43").status_code == 202
    assert _private_ips(cloud, name) == [ips[0]]
    gone = {"removeFixedIp": {"address": ips[1]}}
    assert cloud.compute("POST", action, json=gone, version="2.43").status_code == 400
    cloud.osc("server", "delete", "--wait", name)
    assert cloud.osc("port", "show", port_id, check=False).returncode != 0


def test_an_attach_slower_than_the_api_wait_is_answered_as_in_progress(tmp_path: Path) -> None:
    """Nova answers 200 once the NIC is plugged. A plug slower than the API's wait (here
    2 x 2 s + 5 s) is answered 202 with the port and port_state BUILD, shown so by the list,
    until the host has plugged it (before: 200 with the port ACTIVE, the plug still going)."""
    cloud = start_cloud(tmp_path / "state", "--op-timeout", "2")
    try:
        name = f"nics-{uuid.uuid4().hex[:6]}"
        server = cloud.boot(name)
        server_id, host = server["id"], server["OS-EXT-SRV-ATTR:host"]
        slow = {"latency": {"operation": "attach_interface", "step": "plug", "seconds": 15}}
        assert cloud.compute("POST", f"/os-stowage-sim/{host}/action", json=slow).status_code == 200
        network = cloud.osc_json("network", "show", "private")["id"]
        path = f"/servers/{server_id}/os-interface"
        started = time.monotonic()
        answer = cloud.compute("POST", path, json={"interfaceAttachment": {"net_id": network}})
        assert answer.status_code == 202, answer.text
        pending = answer.json()["interfaceAttachment"]
        assert (pending["net_id"], pending["port_state"]) == (network, "BUILD")
        assert guest(cloud, server_id)["nics"] == []  # the plug is still going
        listed = cloud.compute("GET", path).json()["interfaceAttachments"]
        assert [(i["port_id"], i["port_state"]) for i in listed] == [(pending["port_id"], "BUILD")]
        shown = cloud.compute("GET", f"{path}/{pending['port_id']}").json()["interfaceAttachment"]
        assert shown["port_state"] == "BUILD"

        deadline = started + 60
        while guest(cloud, server_id)["nics"] != [pending["mac_addr"]]:
            assert time.monotonic() < deadline, guest(cloud, server_id)
            time.sleep(0.5)
        while (done := cloud.compute("GET", path).json()["interfaceAttachments"])[0][
            "port_state"
        ] != "ACTIVE":
            assert time.monotonic() < deadline, done
            time.sleep(0.5)
        assert [i["port_id"] for i in done] == [pending["port_id"]]
        events = cloud.osc_json("server", "event", "list", "--long", name)
        assert "attach_interface" in {e["Action"] for e in events}

        # Without the slowness the answer is Nova's: 200 once plugged.
        clear = {"clear": {}}
        assert (
            cloud.compute("POST", f"/os-stowage-sim/{host}/action", json=clear).status_code == 200
        )
        again = cloud.compute("POST", path, json={"interfaceAttachment": {"net_id": network}})
        assert again.status_code == 200, again.text
        assert again.json()["interfaceAttachment"]["port_state"] == "ACTIVE"
        assert again.json()["interfaceAttachment"]["mac_addr"] in guest(cloud, server_id)["nics"]
    finally:
        stop_cloud(cloud)
