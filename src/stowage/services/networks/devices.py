"""What compute calls: a server's ports, allocated, attached, listed and released."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stowage.services.networks.addresses import _drop_port
from stowage.services.networks.common import NeutronConflict, _As, _bodies, _owned, _save
from stowage.services.networks.port import (
    _port,
    _port_attrs,
    _render_port,
    create_port,
    update_port,
)

if TYPE_CHECKING:
    from stowage.services.cloud import Cloud

# -- what compute calls -----------------------------------------------------------------------


def allocate_port(
    cloud: Cloud,
    network_id: str,
    project_id: str,
    device_id: str,
    *,
    is_admin: bool = False,
    host: str | None = None,
    fixed_ip: str | None = None,
    device_owner: str = "compute:nova",
    marker: str | None = None,
) -> dict[str, Any]:
    """A port for a server on `network_id` with the next free address (or `fixed_ip`), made
    as `project_id` would make it (`is_admin` lifts the visibility rules); `marker` is kept
    with it (`made_by`), so a repeated step finds the port it made.

    Raises NetworkError, whose `status` says why: 404 (NetworkNotFound) when the network is
    not there or not visible, 403 when the project may not attach to it, 409 when its
    subnets are full (IpAddressGenerationFailure) or `fixed_ip` is taken, 400 when
    `fixed_ip` is not on the network. Returns the port as neutron shows it to an admin.
    """
    caller = _As(project_id, is_admin)
    attrs: dict[str, Any] = {
        "network_id": network_id,
        "device_id": device_id,
        "device_owner": device_owner,
    }
    if fixed_ip is not None:
        attrs["fixed_ips"] = [{"ip_address": fixed_ip}]
    port = create_port(cloud, caller, attrs, private={"_made_by": marker} if marker else None)
    if host:
        port = update_port(cloud, _As(project_id, True), port["id"], {"binding:host_id": host})
    return _render_port(cloud.objects.get("port", port["id"]).body, _As(project_id, True))


def attach_port(
    cloud: Cloud,
    port_id: str,
    project_id: str,
    device_id: str,
    *,
    is_admin: bool = False,
    host: str | None = None,
    device_owner: str = "compute:nova",
) -> dict[str, Any]:
    """Bind an existing port (`server create --nic port-id=`) to a server; release_ports
    detaches it again instead of deleting it. 409 (PortInUse) when another device has it."""
    caller = _As(project_id, is_admin)
    port = _port(cloud, caller, port_id)
    _owned(port, caller, "update_port")
    if port.get("device_id") and port["device_id"] != device_id:
        raise NeutronConflict(
            f"Port {port_id} is still in use by device {port['device_id']}.", "PortInUse"
        )
    new = dict(port)
    new.update(device_id=device_id, device_owner=device_owner, _preserve=True)
    _port_attrs(cloud, {"binding:host_id": host or ""}, _As(project_id, True), new)
    return _render_port(_save(cloud, "port", new), _As(project_id, True))


def ports_of(cloud: Cloud, device_id: str) -> list[dict[str, Any]]:
    """The ports a server holds (made for it, or attached to it), found by the index of
    ports by device (a scan of every port per boot made building slower with each server)."""
    if not device_id:
        return [p for p in _bodies(cloud, "port") if p.get("device_id") == device_id]
    return [doc.body for doc in cloud.objects.list("port", ref=device_id)]


def made_by(cloud: Cloud, device_id: str, marker: str) -> dict[str, Any] | None:
    """The port of `device_id` that `allocate_port(..., marker=marker)` made, if any."""
    found = [p for p in ports_of(cloud, device_id) if p.get("_made_by") == marker]
    return _render_port(found[0], _As(found[0]["project_id"], True)) if found else None


def release_port(cloud: Cloud, port: dict[str, Any]) -> None:
    """One of a server's ports let go: deleted when it was made for the server, detached
    (device and binding cleared) when it was given to it."""
    if port.get("_preserve"):
        new = dict(port)
        new.update(device_id="", device_owner="", _preserve=False)
        _port_attrs(cloud, {"binding:host_id": ""}, _As(port["project_id"], True), new)
        _save(cloud, "port", new)
    else:
        _drop_port(cloud, port)


def release_ports(cloud: Cloud, device_id: str) -> int:
    """A deleted server's ports: those made for it are deleted, attached ones detached.
    Returns how many ports it held."""
    ports = ports_of(cloud, device_id)
    for port in ports:
        release_port(cloud, port)
    return len(ports)


def refresh_server_addresses(cloud: Cloud, device_id: str) -> None:
    """Nova's network info cache of a server, rebuilt from its ports and floating IPs (what
    Neutron's network-changed and network-vif-deleted events make Nova do); nothing when
    `device_id` is no server."""
    # Late: the instance store imports the cloud, which imports this package.
    from stowage.services.instances import write_instance

    doc = cloud.objects.find("instance", device_id)
    if doc is None:
        return
    addresses = addresses_of(cloud, doc.id)
    if doc.body.get("addresses") != addresses:
        write_instance(cloud, doc.id, doc.body, {**doc.body, "addresses": addresses})


def addresses_of(cloud: Cloud, device_id: str) -> dict[str, list[dict[str, Any]]]:
    """A server's `addresses`, as nova shows them: network name to its fixed addresses and
    the floating ones associated with them."""
    ports = ports_of(cloud, device_id)
    if not ports:
        return {}
    network_ids = {p["network_id"] for p in ports}
    subnet_ids = {ip["subnet_id"] for p in ports for ip in p["fixed_ips"]}
    names = {
        d.id: d.body.get("name") or d.id for d in cloud.objects.list("network", ids=network_ids)
    }
    subnets = {d.id: d.body["ip_version"] for d in cloud.objects.list("subnet", ids=subnet_ids)}
    floating = _bodies(cloud, "floatingip")
    out: dict[str, list[dict[str, Any]]] = {}
    for port in ports:
        entries = out.setdefault(names.get(port["network_id"], port["network_id"]), [])
        for ip in port["fixed_ips"]:
            entries.append(
                {
                    "version": subnets.get(ip["subnet_id"], 4),
                    "addr": ip["ip_address"],
                    "OS-EXT-IPS:type": "fixed",
                    "OS-EXT-IPS-MAC:mac_addr": port["mac_address"],
                }
            )
        for fip in floating:
            if fip.get("port_id") == port["id"]:
                entries.append(
                    {
                        "version": 4,
                        "addr": fip["floating_ip_address"],
                        "OS-EXT-IPS:type": "floating",
                        "OS-EXT-IPS-MAC:mac_addr": port["mac_address"],
                    }
                )
    return out
