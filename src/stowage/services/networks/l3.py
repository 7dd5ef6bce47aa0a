"""Routers (interfaces, external gateway) and floating IPs: Neutron's router extension, on the
simulated network.

A router is a "router" document; what it is plugged into are ports it owns (device_id the
router's id): "network:router_interface" on an internal subnet (the subnet's gateway address),
"network:router_gateway" on an external network. A floating IP is a "floatingip" document and
the "network:floatingip" port that holds its address on the external network. A floating IP
can be associated with a port only when a router joins the port's subnet to the floating IP's
network, as in Neutron; it is then ACTIVE, and DOWN when it is not associated.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from stowage.services.caller import Caller
from stowage.services.networks.addresses import _drop_port
from stowage.services.networks.common import (
    AVAILABILITY_ZONE,
    NeutronBadRequest,
    NeutronConflict,
    NeutronNotFound,
    _As,
    _bodies,
    _bool,
    _check_keys,
    _common,
    _owned,
    _owner,
    _save,
    _standard,
    _text,
)
from stowage.services.networks.network import _network
from stowage.services.networks.port import create_port
from stowage.services.networks.quotas import create_counted

if TYPE_CHECKING:
    from stowage.services.cloud import Cloud

__all__ = [
    "add_router_interface",
    "create_floatingip",
    "create_router",
    "delete_floatingip",
    "delete_router",
    "get_floatingip",
    "get_router",
    "list_floatingips",
    "list_routers",
    "remove_router_interface",
    "update_floatingip",
    "update_router",
]

INTERFACE = "network:router_interface"
GATEWAY = "network:router_gateway"
FLOATING = "network:floatingip"

_ROUTER_CREATE = (
    "name",
    "description",
    "admin_state_up",
    "external_gateway_info",
    "project_id",
    "tenant_id",
    "availability_zone_hints",
)
_ROUTER_UPDATE = ("name", "description", "admin_state_up", "external_gateway_info")
_FIP_CREATE = (
    "floating_network_id",
    "floating_ip_address",
    "subnet_id",
    "port_id",
    "fixed_ip_address",
    "description",
    "project_id",
    "tenant_id",
)
_FIP_UPDATE = ("port_id", "fixed_ip_address", "description")


# A router's gateway port and a floating IP's port belong to no project, as in Neutron: no
# project's port quota counts them and no member lists them (the router and the floating IP
# show their addresses).
_NO_PROJECT: dict[str, Any] = {"project_id": "", "security_groups": []}


def _system(project_id: str) -> _As:
    return _As(project_id, True)


def _bad_router(message: str) -> NeutronBadRequest:
    return NeutronBadRequest(f"Bad router request: {message}.", "BadRequest")


def _external(cloud: Cloud, caller: Caller, network_id: Any) -> dict[str, Any]:
    net = _network(cloud, caller, _text("network_id", network_id))
    if not net.get("router:external"):
        raise NeutronBadRequest(
            f"Network {network_id} is not a valid external network.", "BadRequest"
        )
    return net


def _ports_of(cloud: Cloud, device_id: str, owner: str | None = None) -> list[dict[str, Any]]:
    return [
        p
        for p in _bodies(cloud, "port")
        if p.get("device_id") == device_id and (owner is None or p.get("device_owner") == owner)
    ]


# -- routers --------------------------------------------------------------------------------


def _router_visible(router: Mapping[str, Any], caller: Caller) -> bool:
    return caller.is_admin or router["project_id"] == caller.project_id


def _router(cloud: Cloud, caller: Caller, router_id: str) -> dict[str, Any]:
    doc = cloud.objects.find("router", router_id)
    if doc is None or not _router_visible(doc.body, caller):
        raise NeutronNotFound(f"Router {router_id} could not be found", "RouterNotFound")
    return doc.body


def _render_router(cloud: Cloud, router: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(router)
    gateway = _ports_of(cloud, router["id"], GATEWAY)
    info = router.get("external_gateway_info")
    if info is not None:
        out["external_gateway_info"] = {
            **info,
            "external_fixed_ips": [
                {"subnet_id": ip["subnet_id"], "ip_address": ip["ip_address"]}
                for p in gateway
                for ip in p["fixed_ips"]
            ],
        }
    return out


def list_routers(cloud: Cloud, caller: Caller) -> list[dict[str, Any]]:
    return [
        _render_router(cloud, r) for r in _bodies(cloud, "router") if _router_visible(r, caller)
    ]


def get_router(cloud: Cloud, caller: Caller, router_id: str) -> dict[str, Any]:
    return _render_router(cloud, _router(cloud, caller, router_id))


def _gateway_info(cloud: Cloud, caller: Caller, value: Any) -> dict[str, Any] | None:
    if value is None or value == {}:
        return None
    if not isinstance(value, dict):
        raise _bad_router("external_gateway_info must be an object")
    unknown = set(value) - {"network_id", "enable_snat", "external_fixed_ips"}
    if unknown:
        raise _bad_router(f"unknown external_gateway_info attribute(s) {sorted(unknown)}")
    if "network_id" not in value:
        raise _bad_router("external_gateway_info needs a network_id")
    net = _external(cloud, caller, value["network_id"])
    snat = True
    if "enable_snat" in value:
        if not caller.is_admin:
            raise NeutronBadRequest(
                "rule:create_router:external_gateway_info:enable_snat is disallowed by policy",
                "PolicyNotAuthorized",
                status=403,
            )
        snat = _bool("enable_snat", value["enable_snat"])
    fixed = value.get("external_fixed_ips")
    if fixed is not None and not caller.is_admin:
        raise NeutronBadRequest(
            "rule:create_router:external_gateway_info:external_fixed_ips is disallowed by policy",
            "PolicyNotAuthorized",
            status=403,
        )
    return {"network_id": net["id"], "enable_snat": snat, "_fixed_ips": fixed}


def _plug_gateway(cloud: Cloud, router: dict[str, Any], info: dict[str, Any] | None) -> None:
    """Replace the router's gateway port with one on `info`'s network (none when None)."""
    for port in _ports_of(cloud, router["id"], GATEWAY):
        _drop_port(cloud, port)
    if info is None:
        router["external_gateway_info"] = None
        return
    fixed = info.pop("_fixed_ips", None)
    attrs: dict[str, Any] = {
        "network_id": info["network_id"],
        "device_id": router["id"],
        "device_owner": GATEWAY,
        **_NO_PROJECT,
    }
    if fixed:
        attrs["fixed_ips"] = fixed
    create_port(cloud, _system(""), attrs)
    router["external_gateway_info"] = info


def create_router(cloud: Cloud, caller: Caller, attrs: Mapping[str, Any]) -> dict[str, Any]:
    _check_keys(attrs, _ROUTER_CREATE)
    project = _owner(attrs, caller)
    router_id = str(uuid.uuid4())
    body: dict[str, Any] = {
        "id": router_id,
        "name": "",
        **_standard(cloud, project),
        "status": "ACTIVE",
        "admin_state_up": True,
        "external_gateway_info": None,
        "routes": [],
        "availability_zone_hints": [],
        "availability_zones": [AVAILABILITY_ZONE],
        "flavor_id": None,
    }
    _common(attrs, body)
    if "admin_state_up" in attrs:
        body["admin_state_up"] = _bool("admin_state_up", attrs["admin_state_up"])
    hints = attrs.get("availability_zone_hints", [])
    if not isinstance(hints, list) or any(h != AVAILABILITY_ZONE for h in hints):
        raise NeutronNotFound(
            f"AvailabilityZone {hints} could not be found.", "AvailabilityZoneNotFound"
        )
    body["availability_zone_hints"] = hints
    info = _gateway_info(cloud, caller, attrs.get("external_gateway_info"))
    create_counted(cloud, "router", router_id, body, project_id=project, name=body["name"])
    if info is not None:
        try:
            _plug_gateway(cloud, body, info)
        except BaseException:
            cloud.objects.delete("router", router_id)
            raise
        _save(cloud, "router", body)
    return _render_router(cloud, body)


def _floating_ips_through(cloud: Cloud, router_id: str) -> list[dict[str, Any]]:
    return [f for f in _bodies(cloud, "floatingip") if f.get("router_id") == router_id]


def update_router(
    cloud: Cloud, caller: Caller, router_id: str, attrs: Mapping[str, Any]
) -> dict[str, Any]:
    router = _router(cloud, caller, router_id)
    _owned(router, caller, "update_router")
    _check_keys(attrs, _ROUTER_UPDATE, _ROUTER_CREATE)
    new = dict(router)
    _common(attrs, new)
    if "admin_state_up" in attrs:
        new["admin_state_up"] = _bool("admin_state_up", attrs["admin_state_up"])
    if "external_gateway_info" in attrs:
        info = _gateway_info(cloud, caller, attrs["external_gateway_info"])
        old = router.get("external_gateway_info") or {}
        if (info is None or info["network_id"] != old.get("network_id")) and (
            _floating_ips_through(cloud, router_id)
        ):
            raise NeutronConflict(
                f"Gateway cannot be updated for router {router_id}, since a gateway to external "
                f"network {old.get('network_id')} is required by one or more floating IPs.",
                "RouterExternalGatewayInUseByFloatingIp",
            )
        _plug_gateway(cloud, new, info)
    return _render_router(cloud, _save(cloud, "router", new))


def delete_router(cloud: Cloud, caller: Caller, router_id: str) -> None:
    router = _router(cloud, caller, router_id)
    _owned(router, caller, "delete_router")
    if _ports_of(cloud, router_id, INTERFACE):
        raise NeutronConflict(f"Router {router_id} still has ports", "RouterInUse")
    if _floating_ips_through(cloud, router_id):
        raise NeutronConflict(
            f"Router {router_id} still has floating IPs associated through it", "RouterInUse"
        )
    for port in _ports_of(cloud, router_id, GATEWAY):
        _drop_port(cloud, port)
    cloud.objects.delete("router", router_id)


def _interface_info(router: Mapping[str, Any], port: Mapping[str, Any]) -> dict[str, Any]:
    subnets = [ip["subnet_id"] for ip in port["fixed_ips"]]
    return {
        "id": router["id"],
        "tenant_id": router["project_id"],
        "project_id": router["project_id"],
        "port_id": port["id"],
        "network_id": port["network_id"],
        "subnet_id": subnets[0] if subnets else None,
        "subnet_ids": subnets,
        "tags": [],
    }


def _interface_ref(attrs: Any) -> tuple[str | None, str | None]:
    if not isinstance(attrs, dict):
        raise _bad_router("the body must be an object with a subnet_id or a port_id")
    subnet_id, port_id = attrs.get("subnet_id"), attrs.get("port_id")
    if bool(subnet_id) == bool(port_id):
        raise _bad_router("Either subnet_id or port_id must be specified, not both")
    unknown = set(attrs) - {"subnet_id", "port_id"}
    if unknown:
        raise _bad_router(f"unknown attribute(s) {sorted(unknown)}")
    return subnet_id, port_id


def _visible_subnet(cloud: Cloud, caller: Caller, subnet_id: str) -> dict[str, Any]:
    doc = cloud.objects.find("subnet", subnet_id)
    if doc is None:
        raise NeutronNotFound(f"Subnet {subnet_id} could not be found.", "SubnetNotFound")
    _network(cloud, caller, doc.body["network_id"])  # 404 unless the network is visible
    return doc.body


def add_router_interface(
    cloud: Cloud, caller: Caller, router_id: str, attrs: Any
) -> dict[str, Any]:
    router = _router(cloud, caller, router_id)
    _owned(router, caller, "add_router_interface")
    subnet_id, port_id = _interface_ref(attrs)
    plugged = {ip["subnet_id"] for p in _ports_of(cloud, router_id) for ip in p["fixed_ips"]}
    if subnet_id is not None:
        subnet = _visible_subnet(cloud, caller, subnet_id)
        if subnet_id in plugged:
            raise _bad_router(f"Router already has a port on subnet {subnet_id}")
        if not subnet.get("gateway_ip"):
            raise _bad_router(f"Subnet {subnet_id} does not have a gateway IP")
        port = create_port(
            cloud,
            _system(router["project_id"]),
            {
                "network_id": subnet["network_id"],
                "fixed_ips": [{"subnet_id": subnet_id, "ip_address": subnet["gateway_ip"]}],
                "device_id": router_id,
                "device_owner": INTERFACE,
                "project_id": router["project_id"],
            },
        )
        return _interface_info(router, port)
    doc = cloud.objects.find("port", str(port_id))
    if doc is None or not (caller.is_admin or doc.body["project_id"] == caller.project_id):
        raise NeutronNotFound(f"Port {port_id} could not be found.", "PortNotFound")
    port = dict(doc.body)
    if port.get("device_id"):
        raise NeutronConflict(
            f"Port {port_id} is still in use by device {port['device_id']}.", "PortInUse"
        )
    if not port["fixed_ips"]:
        raise _bad_router(f"Port {port_id} does not have any IP addresses")
    if {ip["subnet_id"] for ip in port["fixed_ips"]} & plugged:
        raise _bad_router(f"Router already has a port on a subnet of port {port_id}")
    port.update(device_id=router_id, device_owner=INTERFACE)
    return _interface_info(router, _save(cloud, "port", port))


def remove_router_interface(
    cloud: Cloud, caller: Caller, router_id: str, attrs: Any
) -> dict[str, Any]:
    router = _router(cloud, caller, router_id)
    _owned(router, caller, "remove_router_interface")
    subnet_id, port_id = _interface_ref(attrs)
    ports = _ports_of(cloud, router_id, INTERFACE)
    if subnet_id is not None:
        match = [p for p in ports if any(ip["subnet_id"] == subnet_id for ip in p["fixed_ips"])]
        if not match:
            raise NeutronNotFound(
                f"Router {router_id} has no interface on subnet {subnet_id}",
                "RouterInterfaceNotFoundForSubnet",
            )
    else:
        match = [p for p in ports if p["id"] == port_id]
        if not match:
            raise NeutronNotFound(
                f"Router {router_id} does not have an interface with id {port_id}",
                "RouterInterfaceNotFound",
            )
    port = match[0]
    subnets = {ip["subnet_id"] for ip in port["fixed_ips"]}
    for fip in _floating_ips_through(cloud, router_id):
        if fip.get("_subnet_id") in subnets:
            raise NeutronConflict(
                f"Router interface for subnet {sorted(subnets)[0]} on router {router_id} cannot "
                "be deleted, as it is required by one or more floating IPs.",
                "RouterInterfaceInUseByFloatingIP",
            )
    info = _interface_info(router, port)
    _drop_port(cloud, port)
    return info


# -- floating IPs ---------------------------------------------------------------------------


def _fip_visible(fip: Mapping[str, Any], caller: Caller) -> bool:
    return caller.is_admin or fip["project_id"] == caller.project_id


def _render_fip(fip: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in fip.items() if not k.startswith("_")}


def _fip(cloud: Cloud, caller: Caller, fip_id: str) -> dict[str, Any]:
    doc = cloud.objects.find("floatingip", fip_id)
    if doc is None or not _fip_visible(doc.body, caller):
        raise NeutronNotFound(f"Floating IP {fip_id} could not be found", "FloatingIPNotFound")
    return doc.body


def list_floatingips(cloud: Cloud, caller: Caller) -> list[dict[str, Any]]:
    return [_render_fip(f) for f in _bodies(cloud, "floatingip") if _fip_visible(f, caller)]


def get_floatingip(cloud: Cloud, caller: Caller, fip_id: str) -> dict[str, Any]:
    return _render_fip(_fip(cloud, caller, fip_id))


def _associate(
    cloud: Cloud, caller: Caller, fip: dict[str, Any], port_id: Any, fixed_ip: Any
) -> None:
    """Point `fip` at a port (None: at nothing), through a router that reaches it."""
    if port_id is None:
        fip.update(port_id=None, fixed_ip_address=None, router_id=None, status="DOWN")
        fip.pop("_subnet_id", None)
        return
    doc = cloud.objects.find("port", _text("port_id", port_id))
    if doc is None or not (caller.is_admin or doc.body["project_id"] == fip["project_id"]):
        raise NeutronNotFound(f"Port {port_id} could not be found.", "PortNotFound")
    port = doc.body
    ips = [ip for ip in port["fixed_ips"] if ip["ip_address"].count(".") == 3]
    if fixed_ip is not None:
        ips = [ip for ip in ips if ip["ip_address"] == fixed_ip]
        if not ips:
            raise NeutronBadRequest(
                f"Port {port_id} does not have fixed ip {fixed_ip}", "BadRequest"
            )
    if not ips:
        raise NeutronBadRequest(
            f"Bad floatingip request: Port {port_id} does not have any IPv4 address.",
            "BadRequest",
        )
    chosen = ips[0]
    for other in _bodies(cloud, "floatingip"):
        if (
            other["id"] != fip["id"]
            and other.get("port_id") == port["id"]
            and other.get("fixed_ip_address") == chosen["ip_address"]
        ):
            raise NeutronConflict(
                f"Cannot associate floating IP {fip['floating_ip_address']} ({fip['id']}) with "
                f"port {port['id']} using fixed IP {chosen['ip_address']}, as that fixed IP "
                f"already has a floating IP on external network {fip['floating_network_id']}.",
                "FloatingIPPortAlreadyAssociated",
            )
    router_id = _router_between(cloud, chosen["subnet_id"], fip["floating_network_id"])
    if router_id is None:
        raise NeutronNotFound(
            f"External network {fip['floating_network_id']} is not reachable from subnet "
            f"{chosen['subnet_id']}.  Therefore, cannot associate Port {port['id']} with a "
            "Floating IP.",
            "ExternalGatewayForFloatingIPNotFound",
        )
    fip.update(
        port_id=port["id"],
        fixed_ip_address=chosen["ip_address"],
        router_id=router_id,
        status="ACTIVE",
        _subnet_id=chosen["subnet_id"],
    )


def _router_between(cloud: Cloud, subnet_id: str, external_network_id: str) -> str | None:
    for router in _bodies(cloud, "router"):
        info = router.get("external_gateway_info") or {}
        if info.get("network_id") != external_network_id:
            continue
        for port in _ports_of(cloud, router["id"], INTERFACE):
            if any(ip["subnet_id"] == subnet_id for ip in port["fixed_ips"]):
                return str(router["id"])
    return None


def create_floatingip(cloud: Cloud, caller: Caller, attrs: Mapping[str, Any]) -> dict[str, Any]:
    _check_keys(attrs, _FIP_CREATE)
    project = _owner(attrs, caller)
    if "floating_network_id" not in attrs:
        raise NeutronBadRequest(
            "Failed to parse request. Required attribute 'floating_network_id' not specified",
            "HTTPBadRequest",
        )
    net = _external(cloud, caller, attrs["floating_network_id"])
    if "floating_ip_address" in attrs and not caller.is_admin:
        raise NeutronBadRequest(
            "rule:create_floatingip:floating_ip_address is disallowed by policy",
            "PolicyNotAuthorized",
            status=403,
        )
    fip_id = str(uuid.uuid4())
    body: dict[str, Any] = {
        "id": fip_id,
        **_standard(cloud, project),
        "floating_network_id": net["id"],
        "floating_ip_address": None,
        "router_id": None,
        "port_id": None,
        "fixed_ip_address": None,
        "status": "DOWN",
        "qos_policy_id": None,
        "port_forwardings": [],
    }
    _common(attrs, body)
    _associate(cloud, caller, body, attrs.get("port_id"), attrs.get("fixed_ip_address"))
    want: dict[str, Any] = {}
    if attrs.get("subnet_id"):
        want["subnet_id"] = attrs["subnet_id"]
    if attrs.get("floating_ip_address"):
        want["ip_address"] = attrs["floating_ip_address"]
    port_attrs: dict[str, Any] = {
        "network_id": net["id"],
        "device_id": fip_id,
        "device_owner": FLOATING,
        **_NO_PROJECT,
    }
    if want:
        port_attrs["fixed_ips"] = [want]
    create_counted(cloud, "floatingip", fip_id, body, project_id=project)
    try:
        port = create_port(cloud, _system(""), port_attrs)
    except BaseException:
        cloud.objects.delete("floatingip", fip_id)
        raise
    body["floating_ip_address"] = port["fixed_ips"][0]["ip_address"]
    saved = _render_fip(_save(cloud, "floatingip", body))
    if body.get("port_id"):
        _refresh_server_of(cloud, str(body["port_id"]))
    return saved


def update_floatingip(
    cloud: Cloud, caller: Caller, fip_id: str, attrs: Mapping[str, Any]
) -> dict[str, Any]:
    fip = _fip(cloud, caller, fip_id)
    _owned(fip, caller, "update_floatingip")
    _check_keys(attrs, _FIP_UPDATE, _FIP_CREATE)
    new = dict(fip)
    _common(attrs, new)
    if "port_id" in attrs:
        _associate(cloud, caller, new, attrs["port_id"], attrs.get("fixed_ip_address"))
    saved = _render_fip(_save(cloud, "floatingip", new))
    for port_id in {fip.get("port_id"), new.get("port_id")} - {None}:
        _refresh_server_of(cloud, str(port_id))
    return saved


def _refresh_server_of(cloud: Cloud, port_id: str) -> None:
    """The addresses of the server behind a port (see devices.refresh_server_addresses)."""
    from stowage.services.networks.devices import refresh_server_addresses

    port = cloud.objects.find("port", port_id)
    if port is None or not str(port.body.get("device_owner", "")).startswith("compute:"):
        return
    refresh_server_addresses(cloud, str(port.body["device_id"]))


def delete_floatingip(cloud: Cloud, caller: Caller, fip_id: str) -> None:
    fip = _fip(cloud, caller, fip_id)
    _owned(fip, caller, "delete_floatingip")
    for port in _ports_of(cloud, fip_id, FLOATING):
        _drop_port(cloud, port)
    cloud.objects.delete("floatingip", fip_id)
    if fip.get("port_id"):
        _refresh_server_of(cloud, str(fip["port_id"]))
