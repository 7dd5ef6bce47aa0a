"""A server's interfaces attached and detached (os-interface), and the legacy addFixedIp and
removeFixedIp, through the network package's ports.

An attach is one durable operation committed with its instance action: the conductor makes
(or binds) the port, the host hot-plugs its NIC, and then the server's addresses show it; a
failed hot-plug lets the port go again (deleted when it was made for the attach, unbound
when it was given). A made port carries the operation's id, so a step repeated after a crash
finds the port it made instead of making another. A detach unplugs the NIC first, then
lets the port go. No claim moves.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stowage.domain.errors import ConflictError, InvalidSpec, NotFound
from stowage.ledger.operations import Operation
from stowage.services import networks
from stowage.services.caller import Caller, SystemCaller
from stowage.services.cloud import Cloud
from stowage.services.compute import record_action
from stowage.services.guest_actions import ready_on_its_host

__all__ = [
    "ATTACHABLE",
    "add_fixed_ip",
    "attach_interface",
    "attached_port",
    "detach_interface",
    "interface_port",
    "nic_of",
    "remove_fixed_ip",
]

# Nova's check_instance_state of attach_interface and detach_interface.
ATTACHABLE = frozenset({"ACTIVE", "PAUSED", "SHUTOFF"})


def _ready(cloud: Cloud, caller: Any, instance_id: str, action: str) -> dict[str, Any]:
    body = cloud.objects.get("instance", instance_id).body
    return ready_on_its_host(cloud, caller, instance_id, body, action, ATTACHABLE)


def _enqueue(
    cloud: Cloud,
    caller: Any,
    body: Mapping[str, Any],
    action: str,
    kind: str,
    step: str,
    payload: dict[str, Any],
    request_id: str,
) -> str:
    with cloud.ledger.engine.begin() as conn:
        record_action(
            cloud, body["id"], action, caller.user_id, caller.project_id, request_id, conn=conn
        )
        op_id = cloud.operations.enqueue(
            kind,
            body["id"],
            str(body["host"]),
            step=step,
            payload={**payload, "request_id": request_id},
            conn=conn,
        ).id
    cloud.kick()
    return op_id


def _only_network(cloud: Cloud, caller: Caller) -> str:
    """Nova's choice when neither a port nor a network is named: the one network the
    project may attach to (its own, or shared), else a refusal."""
    usable = [
        n
        for n in networks.list_networks(cloud, caller)
        if not n.get("router:external")
        and (n.get("shared") or n["project_id"] == caller.project_id)
    ]
    if not usable:
        raise InvalidSpec("No network is available to attach the interface to.")
    if len(usable) > 1:
        raise InvalidSpec("Multiple possible networks found, use a Network ID to be more specific.")
    return str(usable[0]["id"])


def attach_interface(
    cloud: Cloud,
    caller: Any,
    instance_id: str,
    *,
    port_id: str | None,
    net_id: str | None,
    fixed_ip: str | None,
    request_id: str,
) -> str:
    """POST os-interface: checks what it can before anything is committed (the port or the
    network is visible, a port is free), then commits the operation; returns its id."""
    body = _ready(cloud, caller, instance_id, "attach_interface")
    if port_id:
        port = networks.get_port(cloud, caller, port_id)  # 404 PortNotFound
        if port.get("device_id") and port["device_id"] != instance_id:
            raise ConflictError(f"Port {port_id} is still in use.")
        if port.get("device_id") == instance_id:
            raise ConflictError(f"Port {port_id} is attached to instance {instance_id} already.")
    elif net_id:
        networks.get_network(cloud, caller, net_id)  # 404 NetworkNotFound
    else:
        net_id = _only_network(cloud, caller)
    payload = {
        "port_id": port_id,
        "net_id": net_id,
        "fixed_ip": fixed_ip,
        "project_id": body["project_id"],
        "is_admin": bool(caller.is_admin),
    }
    return _enqueue(
        cloud,
        caller,
        body,
        "attach_interface",
        "interface-attach",
        "interface_port",
        payload,
        request_id,
    )


def interface_port(cloud: Cloud, op: Operation) -> dict[str, Any]:
    """The conductor's `port` step of an attach: the port given, bound to the server, or one
    made on the network (found again when this step already made it). NetworkError when
    Neutron refuses (a taken or foreign address, a full network, a port in use)."""
    payload = op.payload
    host = cloud.objects.get("instance", op.instance_id).body.get("host")
    if payload.get("port_id"):
        return networks.attach_port(
            cloud,
            str(payload["port_id"]),
            str(payload["project_id"]),
            op.instance_id,
            is_admin=bool(payload.get("is_admin")),
            host=host,
        )
    made = networks.made_by(cloud, op.instance_id, op.id)
    if made is not None:
        return made
    return networks.allocate_port(
        cloud,
        str(payload["net_id"]),
        str(payload["project_id"]),
        op.instance_id,
        is_admin=bool(payload.get("is_admin")),
        host=host,
        fixed_ip=payload.get("fixed_ip"),
        marker=op.id,
    )


def nic_of(port: Mapping[str, Any]) -> dict[str, Any]:
    """The guest NIC of a port, as the agent's attach_interface takes it."""
    return {
        "mac": port["mac_address"],
        "ips": [ip["ip_address"] for ip in port.get("fixed_ips") or []],
        "network_id": port.get("network_id") or "",
        "port_id": port["id"],
    }


def attached_port(cloud: Cloud, instance_id: str, port_id: str) -> dict[str, Any]:
    for port in networks.ports_of(cloud, instance_id):
        if port["id"] == port_id:
            return port
    raise NotFound(f"Port {port_id} is not attached to instance {instance_id}.")


def detach_interface(
    cloud: Cloud, caller: Any, instance_id: str, port_id: str, *, request_id: str
) -> str:
    """DELETE os-interface/{port_id}: the NIC unplugged, then the port let go."""
    body = _ready(cloud, caller, instance_id, "detach_interface")
    port = attached_port(cloud, instance_id, port_id)
    payload = {"port_id": port_id, "mac": port["mac_address"]}
    return _enqueue(
        cloud,
        caller,
        body,
        "detach_interface",
        "interface-detach",
        "detach_interface",
        payload,
        request_id,
    )


def _port_on(cloud: Cloud, instance_id: str, network_id: str) -> dict[str, Any]:
    for port in networks.ports_of(cloud, instance_id):
        if port["network_id"] == network_id:
            return port
    raise InvalidSpec(f"Instance {instance_id} has no interface on network {network_id}.")


def add_fixed_ip(cloud: Cloud, caller: Any, instance_id: str, network_id: str) -> None:
    """Legacy addFixedIp (before 2.44): one more address on the server's port on that network
    (Nova's neutron API), no new NIC; the server's addresses follow."""
    _ready(cloud, caller, instance_id, "addFixedIp")
    port = _port_on(cloud, instance_id, network_id)
    if not port["fixed_ips"]:
        raise InvalidSpec(f"Network {network_id} has no subnet for a fixed IP.")
    wanted = [*port["fixed_ips"], {"subnet_id": port["fixed_ips"][0]["subnet_id"]}]
    networks.update_port(cloud, SystemCaller(port["project_id"]), port["id"], {"fixed_ips": wanted})
    networks.refresh_server_addresses(cloud, instance_id)


def remove_fixed_ip(cloud: Cloud, caller: Any, instance_id: str, address: str) -> None:
    """Legacy removeFixedIp (before 2.44): the address off the port that has it; the port
    and its NIC stay (Nova's neutron API)."""
    _ready(cloud, caller, instance_id, "removeFixedIp")
    for port in networks.ports_of(cloud, instance_id):
        kept = [ip for ip in port["fixed_ips"] if ip["ip_address"] != address]
        if len(kept) != len(port["fixed_ips"]):
            networks.update_port(
                cloud, SystemCaller(port["project_id"]), port["id"], {"fixed_ips": kept}
            )
            networks.refresh_server_addresses(cloud, instance_id)
            return
    raise InvalidSpec(f"Instance {instance_id} has no fixed IP {address}.")
