"""Networks, subnets, ports and security groups as documents, with IP and MAC claims.

Each resource is a document of its own kind ("network", "subnet", "port", "security_group",
"security_group_rule") whose body is what neutron returns, less the fields computed when it
is read (a network's `subnets`, a group's `security_group_rules`) and less the admin-only
fields a member does not see. The document's project_id column is the owning project.

Addresses are claimed with documents whose id is derived from what they claim, so the store's
primary key refuses a second claim on the same address:
  "ip_allocation"  id uuid5(subnet id, address), name = the subnet id
  "mac_allocation" id uuid5(network id, MAC),    name = the network id
A port is written after its claims and its claims are released after it is deleted.
"""

from __future__ import annotations

import contextlib
import ipaddress
import random
import threading
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from stowage.domain.errors import ConflictError, InvalidSpec, NotFound, StowageError
from stowage.services.caller import Caller

if TYPE_CHECKING:
    from stowage.services.cloud import Cloud

__all__ = [
    "Caller",
    "NetworkError",
    "addresses_of",
    "allocate_port",
    "attach_port",
    "bootstrap_networks",
    "create_network",
    "create_port",
    "create_security_group",
    "create_security_group_rule",
    "create_subnet",
    "delete_network",
    "delete_port",
    "delete_security_group",
    "delete_security_group_rule",
    "delete_subnet",
    "ensure_default_security_group",
    "get_network",
    "get_port",
    "get_security_group",
    "get_security_group_rule",
    "get_subnet",
    "list_networks",
    "list_ports",
    "list_security_group_rules",
    "list_security_groups",
    "list_subnets",
    "ports_of",
    "release_ports",
    "set_tags",
    "tags_of",
    "update_network",
    "update_port",
    "update_security_group",
    "update_subnet",
]

MTU = 1450
AVAILABILITY_ZONE = "nova"
MAC_PREFIX = "fa:16:3e"
_NAMESPACE = uuid.UUID("6a1d5c0e-9d1b-4a55-8f1e-2a63c1f0b7aa")
# One address decision at a time in this process; the claim documents guard across processes.
_ipam_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class _As:
    project_id: str
    is_admin: bool = False


class NetworkError(StowageError):
    """A refused network request: `status` is neutron's HTTP status, `code` its error type."""

    status = 400

    def __init__(self, message: str, kind: str, *, status: int | None = None) -> None:
        super().__init__(message, code=kind)
        if status is not None:
            self.status = status


class NeutronNotFound(NetworkError, NotFound):
    status = 404


class NeutronConflict(NetworkError, ConflictError):
    status = 409


class NeutronBadRequest(NetworkError, InvalidSpec):
    status = 400


class NeutronForbidden(NetworkError):
    status = 403


def _invalid(attr: str, reason: str) -> NeutronBadRequest:
    return NeutronBadRequest(f"Invalid input for {attr}. Reason: {reason}.", "HTTPBadRequest")


def _denied(action: str) -> NeutronForbidden:
    return NeutronForbidden(f"rule:{action} is disallowed by policy", "PolicyNotAuthorized")


def _now(cloud: Cloud) -> str:
    return datetime.fromtimestamp(cloud.clock(), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _uuid5(*parts: str) -> str:
    return str(uuid.uuid5(_NAMESPACE, "/".join(parts)))


def _standard(cloud: Cloud, project_id: str) -> dict[str, Any]:
    """The standard attributes every neutron resource carries."""
    now = _now(cloud)
    return {
        "project_id": project_id,
        "tenant_id": project_id,
        "description": "",
        "tags": [],
        "created_at": now,
        "updated_at": now,
        "revision_number": 1,
    }


def _save(cloud: Cloud, kind: str, body: dict[str, Any]) -> dict[str, Any]:
    body["updated_at"] = _now(cloud)
    body["revision_number"] = int(body.get("revision_number", 0)) + 1
    cloud.objects.update(kind, body["id"], body, name=body.get("name") or "")
    return body


def _bodies(cloud: Cloud, kind: str) -> list[dict[str, Any]]:
    return [doc.body for doc in cloud.objects.list(kind)]


# -- request checking -------------------------------------------------------------------------


_READ_ONLY = ("id", "status", "created_at", "updated_at", "revision_number", "tags")


def _check_keys(
    attrs: Mapping[str, Any], allowed: Iterable[str], known: Iterable[str] = ()
) -> None:
    """Neutron's refusals: a known attribute that may not be written here is read-only."""
    unknown = sorted(set(attrs) - set(allowed))
    if not unknown:
        return
    read_only = [key for key in unknown if key in set(known) | set(_READ_ONLY)]
    if read_only:
        raise NeutronBadRequest(
            f"Cannot update read-only attribute {read_only[0]}", "HTTPBadRequest"
        )
    raise NeutronBadRequest(f"Unrecognized attribute(s) '{', '.join(unknown)}'", "HTTPBadRequest")


def _required(attrs: Mapping[str, Any], key: str) -> Any:
    if key not in attrs:
        raise NeutronBadRequest(
            f"Failed to parse request. Required attribute '{key}' not specified",
            "HTTPBadRequest",
        )
    return attrs[key]


def _bool(attr: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    raise _invalid(attr, f"'{value}' cannot be converted to boolean")


def _text(attr: str, value: Any, max_len: int = 255) -> str:
    if not isinstance(value, str):
        raise _invalid(attr, f"'{value}' is not a valid string")
    if len(value) > max_len:
        raise _invalid(attr, f"'{value}' exceeds maximum length of {max_len}")
    return value


def _owner(attrs: Mapping[str, Any], caller: Caller) -> str:
    project = attrs.get("project_id") or attrs.get("tenant_id") or caller.project_id
    if "project_id" in attrs and "tenant_id" in attrs and attrs["project_id"] != attrs["tenant_id"]:
        raise _invalid("project_id", "project_id and tenant_id do not match")
    project = _text("project_id", project)
    if project != caller.project_id and not caller.is_admin:
        raise NeutronBadRequest(
            "Specifying 'project_id' or 'tenant_id' other than the authenticated project in "
            "request requires admin privileges",
            "HTTPBadRequest",
        )
    return project


def _common(attrs: Mapping[str, Any], body: dict[str, Any]) -> None:
    """name and description, present on every resource here."""
    if "name" in attrs:
        body["name"] = _text("name", attrs["name"] if attrs["name"] is not None else "")
    if "description" in attrs:
        body["description"] = _text("description", attrs["description"] or "", 255)


# -- networks ---------------------------------------------------------------------------------

_NETWORK_CREATE = (
    "name",
    "description",
    "admin_state_up",
    "shared",
    "router:external",
    "mtu",
    "port_security_enabled",
    "availability_zone_hints",
    "project_id",
    "tenant_id",
    "provider:network_type",
    "provider:physical_network",
    "provider:segmentation_id",
    "dns_domain",
    "qos_policy_id",
    "is_default",
)
_NETWORK_UPDATE = (
    "name",
    "description",
    "admin_state_up",
    "shared",
    "router:external",
    "mtu",
    "port_security_enabled",
    "dns_domain",
    "qos_policy_id",
    "is_default",
)
_NETWORK_ADMIN_FIELDS = (
    "provider:network_type",
    "provider:physical_network",
    "provider:segmentation_id",
)


def _network_visible(net: Mapping[str, Any], caller: Caller) -> bool:
    return (
        caller.is_admin
        or net["project_id"] == caller.project_id
        or bool(net.get("shared"))
        or bool(net.get("router:external"))
    )


def _render_network(
    net: Mapping[str, Any], caller: Caller, subnets: Mapping[str, list[str]]
) -> dict[str, Any]:
    out = dict(net)
    out["subnets"] = list(subnets.get(net["id"], []))
    if not caller.is_admin:
        for key in _NETWORK_ADMIN_FIELDS:
            out.pop(key, None)
    return out


def _subnets_by_network(cloud: Cloud) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for subnet in _bodies(cloud, "subnet"):
        out.setdefault(subnet["network_id"], []).append(subnet["id"])
    return out


def _network(cloud: Cloud, caller: Caller, network_id: str) -> dict[str, Any]:
    doc = cloud.objects.find("network", network_id)
    if doc is None or not _network_visible(doc.body, caller):
        raise NeutronNotFound(f"Network {network_id} could not be found.", "NetworkNotFound")
    return doc.body


def list_networks(cloud: Cloud, caller: Caller) -> list[dict[str, Any]]:
    subnets = _subnets_by_network(cloud)
    return [
        _render_network(net, caller, subnets)
        for net in _bodies(cloud, "network")
        if _network_visible(net, caller)
    ]


def get_network(cloud: Cloud, caller: Caller, network_id: str) -> dict[str, Any]:
    net = _network(cloud, caller, network_id)
    return _render_network(net, caller, _subnets_by_network(cloud))


def _network_attrs(
    attrs: Mapping[str, Any], caller: Caller, body: dict[str, Any], verb: str
) -> None:
    _common(attrs, body)
    for key in ("admin_state_up", "port_security_enabled", "is_default"):
        if key in attrs:
            body[key] = _bool(key, attrs[key])
    for key, action in (("shared", "shared"), ("router:external", "router:external")):
        if key in attrs:
            value = _bool(key, attrs[key])
            if value != body.get(key, False) and not caller.is_admin:
                raise _denied(f"{verb}_network:{action}")
            body[key] = value
    if "mtu" in attrs:
        mtu = attrs["mtu"]
        if isinstance(mtu, bool) or not isinstance(mtu, int) or not 68 <= mtu <= 9000:
            raise _invalid("mtu", f"'{mtu}' is not in range 68 through 9000")
        body["mtu"] = mtu
    if "dns_domain" in attrs:
        body["dns_domain"] = _text("dns_domain", attrs["dns_domain"] or "")
    if "qos_policy_id" in attrs and attrs["qos_policy_id"] is not None:
        raise NeutronNotFound(
            f"QoS policy {attrs['qos_policy_id']} could not be found.", "QosPolicyNotFound"
        )
    if "availability_zone_hints" in attrs:
        hints = attrs["availability_zone_hints"]
        if not isinstance(hints, list) or any(h != AVAILABILITY_ZONE for h in hints):
            raise NeutronNotFound(
                f"AvailabilityZone {hints} could not be found.", "AvailabilityZoneNotFound"
            )
        body["availability_zone_hints"] = hints
    provider = {k: attrs[k] for k in _NETWORK_ADMIN_FIELDS if k in attrs}
    if provider:
        if not caller.is_admin:
            raise _denied(f"{verb}_network:provider:network_type")
        kind = provider.get("provider:network_type", "vxlan")
        if kind not in ("flat", "vlan", "vxlan", "geneve", "gre", "local"):
            raise _invalid("provider:network_type", f"network type {kind} is not supported")
        body.update(provider)


def create_network(cloud: Cloud, caller: Caller, attrs: Mapping[str, Any]) -> dict[str, Any]:
    _check_keys(attrs, _NETWORK_CREATE)
    project = _owner(attrs, caller)
    network_id = str(uuid.uuid4())
    body: dict[str, Any] = {
        "id": network_id,
        "name": "",
        **_standard(cloud, project),
        "status": "ACTIVE",
        "admin_state_up": True,
        "shared": False,
        "router:external": False,
        "mtu": MTU,
        "port_security_enabled": True,
        "availability_zone_hints": [],
        "availability_zones": [AVAILABILITY_ZONE],
        "ipv4_address_scope": None,
        "ipv6_address_scope": None,
        "l2_adjacency": True,
        "is_default": False,
        "qos_policy_id": None,
        "dns_domain": "",
        "provider:network_type": "geneve",
        "provider:physical_network": None,
        "provider:segmentation_id": _segment_id(network_id),
    }
    _network_attrs(attrs, caller, body, "create")
    if body["provider:network_type"] in ("flat", "local"):
        body["provider:segmentation_id"] = None
    cloud.objects.create("network", network_id, body, project_id=project, name=body["name"])
    return _render_network(body, caller, {})


def _segment_id(network_id: str) -> int:
    return 1 + int(uuid.UUID(network_id)) % 65000


def _owned(body: Mapping[str, Any], caller: Caller, action: str) -> None:
    if not caller.is_admin and body["project_id"] != caller.project_id:
        raise _denied(action)


def _editable(
    body: Mapping[str, Any],
    caller: Caller,
    action: str,
    attrs: Mapping[str, Any],
    allowed: Iterable[str],
    known: Iterable[str],
) -> dict[str, Any]:
    """A copy of `body` to change: refused unless the caller owns it and may write `attrs`."""
    _owned(body, caller, action)
    _check_keys(attrs, allowed, known)
    return dict(body)


def update_network(
    cloud: Cloud, caller: Caller, network_id: str, attrs: Mapping[str, Any]
) -> dict[str, Any]:
    net = _network(cloud, caller, network_id)
    new = _editable(net, caller, "update_network", attrs, _NETWORK_UPDATE, _NETWORK_CREATE)
    _network_attrs(attrs, caller, new, "update")
    return _render_network(_save(cloud, "network", new), caller, _subnets_by_network(cloud))


def delete_network(cloud: Cloud, caller: Caller, network_id: str) -> None:
    """Refused while ports other than DHCP ones use it; its subnets go with it."""
    net = _network(cloud, caller, network_id)
    _owned(net, caller, "delete_network")
    ports = [p for p in _bodies(cloud, "port") if p["network_id"] == network_id]
    if any(not p.get("device_owner", "").startswith("network:dhcp") for p in ports):
        raise NeutronConflict(
            f"Unable to complete operation on network {network_id}. There are one or more "
            "ports still in use on the network.",
            "NetworkInUse",
        )
    for port in ports:
        _drop_port(cloud, port)
    for subnet in _bodies(cloud, "subnet"):
        if subnet["network_id"] == network_id:
            cloud.objects.delete("subnet", subnet["id"])
    cloud.objects.delete("network", network_id)


# -- subnets ----------------------------------------------------------------------------------

_SUBNET_CREATE = (
    "name",
    "description",
    "network_id",
    "ip_version",
    "cidr",
    "gateway_ip",
    "allocation_pools",
    "enable_dhcp",
    "dns_nameservers",
    "host_routes",
    "ipv6_ra_mode",
    "ipv6_address_mode",
    "project_id",
    "tenant_id",
    "subnetpool_id",
    "use_default_subnet_pool",
    "prefixlen",
    "segment_id",
    "service_types",
)
_SUBNET_UPDATE = (
    "name",
    "description",
    "gateway_ip",
    "allocation_pools",
    "enable_dhcp",
    "dns_nameservers",
    "host_routes",
    "segment_id",
    "service_types",
)
_IPV6_MODES = ("slaac", "dhcpv6-stateful", "dhcpv6-stateless")
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def _subnet_visible(cloud: Cloud, subnet: Mapping[str, Any], caller: Caller) -> bool:
    if caller.is_admin or subnet["project_id"] == caller.project_id:
        return True
    net = cloud.objects.find("network", subnet["network_id"])
    return net is not None and _network_visible(net.body, caller)


def _subnet(cloud: Cloud, caller: Caller, subnet_id: str) -> dict[str, Any]:
    doc = cloud.objects.find("subnet", subnet_id)
    if doc is None or not _subnet_visible(cloud, doc.body, caller):
        raise NeutronNotFound(f"Subnet {subnet_id} could not be found.", "SubnetNotFound")
    return doc.body


def list_subnets(cloud: Cloud, caller: Caller) -> list[dict[str, Any]]:
    visible_nets = {n["id"] for n in _bodies(cloud, "network") if _network_visible(n, caller)}
    return [
        dict(s)
        for s in _bodies(cloud, "subnet")
        if caller.is_admin
        or s["project_id"] == caller.project_id
        or s["network_id"] in visible_nets
    ]


def get_subnet(cloud: Cloud, caller: Caller, subnet_id: str) -> dict[str, Any]:
    return dict(_subnet(cloud, caller, subnet_id))


def _address(attr: str, value: Any, version: int | None = None) -> IPAddress:
    try:
        address = ipaddress.ip_address(str(value))
    except ValueError:
        raise _invalid(attr, f"'{value}' is not a valid IP address") from None
    if version is not None and address.version != version:
        raise _invalid(attr, f"'{value}' is not an IPv{version} address")
    return address


def _cidr(value: Any, version: int) -> IPNetwork:
    try:
        net = ipaddress.ip_network(str(value), strict=False)
    except ValueError:
        raise _invalid("cidr", f"'{value}' is not a valid IP subnet") from None
    if "/" not in str(value):
        # neutron-lib's validate_subnet: an address without a prefix is not a CIDR. Host bits
        # set (10.0.0.5/24) are accepted, and the subnet is the network (10.0.0.0/24).
        raise _invalid(
            "cidr", f"'{value}' isn't a recognized IP subnet cidr, '{net}' is recommended"
        )
    if net.version != version:
        raise NeutronBadRequest(
            f"Invalid input for operation: cidr {value} is not an IPv{version} subnet.",
            "InvalidInput",
        )
    if net.num_addresses < (4 if version == 4 else 2):
        raise _invalid("cidr", f"'{value}' is too small: prefix length {net.prefixlen}")
    return net


def _usable(net: IPNetwork) -> tuple[IPAddress, IPAddress]:
    """First and last assignable address: IPv4 loses the network and broadcast addresses."""
    first = net.network_address + 1
    last = net.broadcast_address - 1 if net.version == 4 else net.broadcast_address
    return first, last


def _default_pools(net: IPNetwork, gateway: IPAddress | None) -> list[dict[str, str]]:
    first, last = _usable(net)
    if gateway is None or not int(first) <= int(gateway) <= int(last):
        return [{"start": str(first), "end": str(last)}]
    pools = []
    if int(gateway) > int(first):
        pools.append({"start": str(first), "end": str(gateway - 1)})
    if int(gateway) < int(last):
        pools.append({"start": str(gateway + 1), "end": str(last)})
    return pools


def _pools(value: Any, net: IPNetwork) -> list[dict[str, str]]:
    if not isinstance(value, list):
        raise _invalid("allocation_pools", f"'{value}' is not a list")
    ranges: list[tuple[IPAddress, IPAddress]] = []
    first, last = _usable(net)
    for pool in value:
        if not isinstance(pool, dict) or set(pool) != {"start", "end"}:
            raise _invalid("allocation_pools", f"'{pool}' needs exactly 'start' and 'end'")
        start = _address("allocation_pools", pool["start"], net.version)
        end = _address("allocation_pools", pool["end"], net.version)
        if not (int(first) <= int(start) <= int(end) <= int(last)):
            raise NeutronBadRequest(
                f"The allocation pool {start}-{end} spans beyond the subnet cidr {net}.",
                "OutOfBoundsAllocationPool",
            )
        for other_start, other_end in ranges:
            if int(start) <= int(other_end) and int(other_start) <= int(end):
                raise NeutronBadRequest(
                    f"Found overlapping allocation pools: {start}-{end} and "
                    f"{other_start}-{other_end}",
                    "OverlappingAllocationPools",
                )
        ranges.append((start, end))
    return [{"start": str(s), "end": str(e)} for s, e in ranges]


def _subnet_attrs(attrs: Mapping[str, Any], body: dict[str, Any], net: IPNetwork) -> None:
    """Every attribute but the network, version and cidr: checked, then set on `body`."""
    _common(attrs, body)
    if "enable_dhcp" in attrs:
        body["enable_dhcp"] = _bool("enable_dhcp", attrs["enable_dhcp"])
    if "gateway_ip" in attrs:
        gateway = attrs["gateway_ip"]
        if gateway is None:
            body["gateway_ip"] = None
        else:
            address = _address("gateway_ip", gateway, net.version)
            if address in (net.network_address, net.broadcast_address) and net.version == 4:
                raise NeutronBadRequest(
                    f"Gateway is not valid on subnet: {address} is the network or "
                    "broadcast address.",
                    "InvalidInput",
                )
            body["gateway_ip"] = str(address)
    if "allocation_pools" in attrs:
        body["allocation_pools"] = _pools(attrs["allocation_pools"], net)
    if "dns_nameservers" in attrs:
        servers = attrs["dns_nameservers"] or []
        if not isinstance(servers, list):
            raise _invalid("dns_nameservers", f"'{servers}' is not a list")
        body["dns_nameservers"] = [str(_address("dns_nameservers", s)) for s in servers]
    if "host_routes" in attrs:
        routes = attrs["host_routes"] or []
        if not isinstance(routes, list):
            raise _invalid("host_routes", f"'{routes}' is not a list")
        checked = []
        for route in routes:
            if not isinstance(route, dict) or set(route) != {"destination", "nexthop"}:
                raise _invalid("host_routes", f"'{route}' needs 'destination' and 'nexthop'")
            try:
                destination = ipaddress.ip_network(str(route["destination"]))
            except ValueError:
                raise _invalid(
                    "host_routes", f"'{route['destination']}' is not a valid CIDR"
                ) from None
            nexthop = _address("host_routes", route["nexthop"])
            checked.append({"destination": str(destination), "nexthop": str(nexthop)})
        body["host_routes"] = checked
    if attrs.get("segment_id") is not None:
        raise NeutronNotFound(
            f"Segment {attrs['segment_id']} could not be found.", "SegmentNotFound"
        )
    if "service_types" in attrs:
        kinds = attrs["service_types"] or []
        if not isinstance(kinds, list) or not all(isinstance(k, str) for k in kinds):
            raise _invalid("service_types", f"'{kinds}' is not a list of strings")
        body["service_types"] = kinds
    gateway = body.get("gateway_ip")
    if gateway is not None:
        address = ipaddress.ip_address(gateway)
        for pool in body["allocation_pools"]:
            start, end = ipaddress.ip_address(pool["start"]), ipaddress.ip_address(pool["end"])
            if int(start) <= int(address) <= int(end):
                raise NeutronConflict(
                    f"Gateway ip {gateway} conflicts with allocation pool "
                    f"{pool['start']}-{pool['end']}",
                    "GatewayConflictWithAllocationPools",
                )


def create_subnet(cloud: Cloud, caller: Caller, attrs: Mapping[str, Any]) -> dict[str, Any]:
    _check_keys(attrs, _SUBNET_CREATE)
    network_id = _text("network_id", _required(attrs, "network_id"))
    net_body = _network(cloud, caller, network_id)
    if not caller.is_admin and net_body["project_id"] != caller.project_id:
        raise _denied("create_subnet")
    project = _owner(attrs, caller)
    version = _required(attrs, "ip_version")
    if version not in (4, 6, "4", "6"):
        raise _invalid("ip_version", f"{version} is not in [4, 6]")
    version = int(version)
    if attrs.get("subnetpool_id") is not None or attrs.get("use_default_subnet_pool"):
        raise NeutronBadRequest(
            "Bad subnets request: subnet pools are not supported here; give a cidr.",
            "BadRequest",
        )
    if attrs.get("cidr") is None:
        raise NeutronBadRequest(
            "Bad subnets request: a subnetpool must be specified in the absence of a cidr.",
            "BadRequest",
        )
    net = _cidr(attrs["cidr"], version)
    for mode in ("ipv6_ra_mode", "ipv6_address_mode"):
        if attrs.get(mode) is not None and (version != 6 or attrs[mode] not in _IPV6_MODES):
            raise _invalid(mode, f"'{attrs[mode]}' is not valid for an IPv{version} subnet")
    for other in _bodies(cloud, "subnet"):
        if other["network_id"] == network_id and net.overlaps(ipaddress.ip_network(other["cidr"])):
            raise NeutronBadRequest(
                f"Invalid input for operation: Requested subnet with cidr: {net} for network: "
                f"{network_id} overlaps with another subnet.",
                "InvalidInput",
            )
    subnet_id = str(uuid.uuid4())
    body: dict[str, Any] = {
        "id": subnet_id,
        "name": "",
        **_standard(cloud, project),
        "network_id": network_id,
        "ip_version": version,
        "cidr": str(net),
        "gateway_ip": str(net.network_address + 1),
        "allocation_pools": [],
        "enable_dhcp": True,
        "dns_nameservers": [],
        "host_routes": [],
        "ipv6_ra_mode": attrs.get("ipv6_ra_mode"),
        "ipv6_address_mode": attrs.get("ipv6_address_mode"),
        "subnetpool_id": None,
        "segment_id": None,
        "service_types": [],
    }
    _subnet_attrs({k: v for k, v in attrs.items() if k != "allocation_pools"}, body, net)
    gateway = ipaddress.ip_address(body["gateway_ip"]) if body["gateway_ip"] else None
    body["allocation_pools"] = _default_pools(net, gateway)
    if "allocation_pools" in attrs:
        _subnet_attrs({"allocation_pools": attrs["allocation_pools"]}, body, net)
    cloud.objects.create("subnet", subnet_id, body, project_id=project, name=body["name"])
    return dict(body)


def update_subnet(
    cloud: Cloud, caller: Caller, subnet_id: str, attrs: Mapping[str, Any]
) -> dict[str, Any]:
    subnet = _subnet(cloud, caller, subnet_id)
    new = _editable(subnet, caller, "update_subnet", attrs, _SUBNET_UPDATE, _SUBNET_CREATE)
    _subnet_attrs(attrs, new, ipaddress.ip_network(subnet["cidr"]))
    return dict(_save(cloud, "subnet", new))


def delete_subnet(cloud: Cloud, caller: Caller, subnet_id: str) -> None:
    subnet = _subnet(cloud, caller, subnet_id)
    _owned(subnet, caller, "delete_subnet")
    for port in _bodies(cloud, "port"):
        if any(ip["subnet_id"] == subnet_id for ip in port.get("fixed_ips", [])):
            raise NeutronConflict(
                f"Unable to complete operation on subnet {subnet_id}: One or more ports have "
                "an IP allocation from this subnet.",
                "SubnetInUse",
            )
    cloud.objects.delete("subnet", subnet_id)


# -- address claims ---------------------------------------------------------------------------


def _ip_claim_id(subnet_id: str, address: str) -> str:
    return _uuid5("ip", subnet_id, address)


def _used_ips(cloud: Cloud, subnet_id: str) -> set[str]:
    return {doc.body["ip_address"] for doc in cloud.objects.list("ip_allocation", name=subnet_id)}


def _claim_ip(cloud: Cloud, subnet_id: str, address: str, port_id: str) -> bool:
    try:
        cloud.objects.create(
            "ip_allocation",
            _ip_claim_id(subnet_id, address),
            {"subnet_id": subnet_id, "ip_address": address, "port_id": port_id},
            name=subnet_id,
        )
    except ConflictError:
        return False
    return True


def _release_ips(cloud: Cloud, fixed_ips: Iterable[Mapping[str, str]]) -> None:
    for ip in fixed_ips:
        cloud.objects.delete("ip_allocation", _ip_claim_id(ip["subnet_id"], ip["ip_address"]))


def _pool_addresses(subnet: Mapping[str, Any]) -> Iterator[IPAddress]:
    for pool in subnet["allocation_pools"]:
        address = ipaddress.ip_address(pool["start"])
        end = ipaddress.ip_address(pool["end"])
        while int(address) <= int(end):
            yield address
            address += 1


def _next_free(cloud: Cloud, subnet: Mapping[str, Any], port_id: str) -> str | None:
    """Claim the lowest free address of the subnet's pools; None when it is full."""
    used = _used_ips(cloud, subnet["id"])
    for address in _pool_addresses(subnet):
        text = str(address)
        if text not in used and _claim_ip(cloud, subnet["id"], text, port_id):
            return text
    return None


@dataclass(frozen=True, slots=True)
class _IpRequest:
    subnet_id: str | None
    ip_address: str | None


def _ip_requests(
    value: Any, network_id: str, subnets: Mapping[str, Mapping[str, Any]]
) -> list[_IpRequest]:
    if not isinstance(value, list):
        raise _invalid("fixed_ips", f"'{value}' is not a list")
    requests = []
    for item in value:
        if not isinstance(item, dict) or not item or set(item) - {"subnet_id", "ip_address"}:
            raise _invalid("fixed_ips", f"'{item}' needs subnet_id and/or ip_address only")
        subnet_id = item.get("subnet_id")
        address = item.get("ip_address")
        if subnet_id is not None and not isinstance(subnet_id, str):
            raise _invalid("fixed_ips", f"'{subnet_id}' is not a valid subnet id")
        if subnet_id is not None and subnet_id not in subnets:
            raise NeutronBadRequest(
                f"Invalid input for operation: Failed to create port on network {network_id}, "
                f"because fixed_ips included invalid subnet {subnet_id}.",
                "InvalidInput",
            )
        if address is not None:
            parsed = _address("fixed_ips", address)
            matching = [
                s["id"]
                for s in subnets.values()
                if parsed in ipaddress.ip_network(s["cidr"])
                and (subnet_id is None or s["id"] == subnet_id)
            ]
            if not matching:
                raise NeutronBadRequest(
                    f"IP address {address} is not a valid IP for the specified subnet.",
                    "InvalidIpForSubnet",
                )
            subnet_id, address = matching[0], str(parsed)
        requests.append(_IpRequest(subnet_id, address))
    return requests


def _allocate_ips(
    cloud: Cloud,
    network_id: str,
    port_id: str,
    requests: list[_IpRequest] | None,
    subnets: Mapping[str, Mapping[str, Any]],
    keep: Iterable[Mapping[str, str]] = (),
) -> list[dict[str, str]]:
    """Claim addresses for a port: as requested, or one from the first IPv4 subnet with room.

    `keep` are addresses the port holds already (an update): they are reused, not claimed.
    On any failure every claim made here is released.
    """
    held = {(ip["subnet_id"], ip["ip_address"]) for ip in keep}
    claimed: list[dict[str, str]] = []
    result: list[dict[str, str]] = []
    try:
        with _ipam_lock:
            if requests is None:
                ordered = sorted(subnets.values(), key=lambda s: s["ip_version"])
                if not ordered:
                    return []
                for subnet in ordered:
                    address = _next_free(cloud, subnet, port_id)
                    if address is not None:
                        claimed.append({"subnet_id": subnet["id"], "ip_address": address})
                        return list(claimed)
                raise _exhausted(network_id)
            for request in requests:
                assert request.subnet_id is not None or request.ip_address is not None
                subnet_id = request.subnet_id or ""
                if request.ip_address is None:
                    address = _next_free(cloud, subnets[subnet_id], port_id)
                    if address is None:
                        raise _exhausted(network_id)
                    claimed.append({"subnet_id": subnet_id, "ip_address": address})
                    result.append(claimed[-1])
                    continue
                pair = {"subnet_id": subnet_id, "ip_address": request.ip_address}
                if (subnet_id, request.ip_address) in held:
                    result.append(pair)
                    continue
                if not _claim_ip(cloud, subnet_id, request.ip_address, port_id):
                    raise NeutronConflict(
                        f"IP address {request.ip_address} already allocated in subnet {subnet_id}",
                        "IpAddressAlreadyAllocated",
                    )
                claimed.append(pair)
                result.append(pair)
            return result
    except BaseException:
        _release_ips(cloud, claimed)
        raise


def _exhausted(network_id: str) -> NeutronConflict:
    return NeutronConflict(
        f"No more IP addresses available on network {network_id}.",
        "IpAddressGenerationFailure",
    )


def _claim_mac(cloud: Cloud, network_id: str, mac: str | None, port_id: str) -> str:
    if mac is not None:
        if not _claim_mac_once(cloud, network_id, mac, port_id):
            raise NeutronConflict(
                f"Unable to complete operation for network {network_id}. The mac address "
                f"{mac} is in use.",
                "MacAddressInUse",
            )
        return mac
    rng = random.SystemRandom()
    for _attempt in range(16):
        candidate = f"{MAC_PREFIX}:" + ":".join(f"{rng.randrange(256):02x}" for _ in range(3))
        if _claim_mac_once(cloud, network_id, candidate, port_id):
            return candidate
    raise NeutronConflict(
        f"Unable to generate a unique MAC address on network {network_id}.",
        "MacAddressGenerationFailure",
    )


def _claim_mac_once(cloud: Cloud, network_id: str, mac: str, port_id: str) -> bool:
    try:
        cloud.objects.create(
            "mac_allocation",
            _uuid5("mac", network_id, mac),
            {"network_id": network_id, "mac_address": mac, "port_id": port_id},
            name=network_id,
        )
    except ConflictError:
        return False
    return True


def _valid_mac(value: Any) -> str:
    text = str(value).lower()
    parts = text.split(":")
    if len(parts) != 6 or not all(
        len(p) == 2 and all(c in "0123456789abcdef" for c in p) for p in parts
    ):
        raise _invalid("mac_address", f"'{value}' is not a valid MAC address")
    if int(parts[0], 16) & 1 or text == "00:00:00:00:00:00":
        raise _invalid("mac_address", f"'{value}' is not a valid unicast MAC address")
    return text


# -- ports ------------------------------------------------------------------------------------

_PORT_CREATE = (
    "name",
    "description",
    "network_id",
    "admin_state_up",
    "mac_address",
    "fixed_ips",
    "device_id",
    "device_owner",
    "security_groups",
    "port_security_enabled",
    "allowed_address_pairs",
    "extra_dhcp_opts",
    "binding:host_id",
    "binding:profile",
    "binding:vnic_type",
    "project_id",
    "tenant_id",
    "qos_policy_id",
)
_PORT_UPDATE = (
    "name",
    "description",
    "admin_state_up",
    "fixed_ips",
    "device_id",
    "device_owner",
    "security_groups",
    "port_security_enabled",
    "allowed_address_pairs",
    "extra_dhcp_opts",
    "binding:host_id",
    "binding:profile",
    "binding:vnic_type",
    "qos_policy_id",
)
_PORT_ADMIN_FIELDS = (
    "binding:host_id",
    "binding:profile",
    "binding:vif_type",
    "binding:vif_details",
)
_VNIC_TYPES = (
    "normal",
    "direct",
    "macvtap",
    "baremetal",
    "direct-physical",
    "virtio-forwarder",
    "smart-nic",
    "vdpa",
    "remote-managed",
)


def _port_visible(cloud: Cloud, port: Mapping[str, Any], caller: Caller) -> bool:
    if caller.is_admin or port["project_id"] == caller.project_id:
        return True
    net = cloud.objects.find("network", port["network_id"])
    return net is not None and net.body["project_id"] == caller.project_id


def _render_port(port: Mapping[str, Any], caller: Caller) -> dict[str, Any]:
    out = {key: value for key, value in port.items() if not key.startswith("_")}
    if not caller.is_admin:
        for key in _PORT_ADMIN_FIELDS:
            out.pop(key, None)
    return out


def _port(cloud: Cloud, caller: Caller, port_id: str) -> dict[str, Any]:
    doc = cloud.objects.find("port", port_id)
    if doc is None or not _port_visible(cloud, doc.body, caller):
        raise NeutronNotFound(f"Port {port_id} could not be found.", "PortNotFound")
    return doc.body


def list_ports(cloud: Cloud, caller: Caller) -> list[dict[str, Any]]:
    owned_nets = {
        n["id"] for n in _bodies(cloud, "network") if n["project_id"] == caller.project_id
    }
    return [
        _render_port(p, caller)
        for p in _bodies(cloud, "port")
        if caller.is_admin or p["project_id"] == caller.project_id or p["network_id"] in owned_nets
    ]


def get_port(cloud: Cloud, caller: Caller, port_id: str) -> dict[str, Any]:
    return _render_port(_port(cloud, caller, port_id), caller)


def _network_subnets(cloud: Cloud, network_id: str) -> dict[str, dict[str, Any]]:
    return {s["id"]: s for s in _bodies(cloud, "subnet") if s["network_id"] == network_id}


def _security_groups(cloud: Cloud, value: Any, project_id: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _invalid("security_groups", f"'{value}' is not a list of ids")
    for group_id in value:
        doc = cloud.objects.find("security_group", group_id)
        if doc is None or doc.body["project_id"] != project_id:
            raise NeutronNotFound(
                f"Security group {group_id} does not exist", "SecurityGroupNotFound"
            )
    return list(dict.fromkeys(value))


def _port_attrs(
    cloud: Cloud, attrs: Mapping[str, Any], caller: Caller, body: dict[str, Any]
) -> None:
    """Every port attribute but network, MAC and addresses, checked and set on `body`."""
    _common(attrs, body)
    if "admin_state_up" in attrs:
        body["admin_state_up"] = _bool("admin_state_up", attrs["admin_state_up"])
    for key in ("device_id", "device_owner"):
        if key in attrs:
            body[key] = _text(key, attrs[key] or "")
    if "port_security_enabled" in attrs:
        body["port_security_enabled"] = _bool(
            "port_security_enabled", attrs["port_security_enabled"]
        )
    if "security_groups" in attrs:
        body["security_groups"] = _security_groups(
            cloud, attrs["security_groups"] or [], body["project_id"]
        )
    if not body["port_security_enabled"] and body["security_groups"]:
        if "security_groups" in attrs:
            raise NeutronConflict(
                f"Port {body['id']} has security group associated. Cannot disable port "
                "security or IP address until security group is removed",
                "PortSecurityAndIPRequiredForSecurityGroups",
            )
        body["security_groups"] = []
    for key in ("allowed_address_pairs", "extra_dhcp_opts"):
        if key in attrs:
            if not isinstance(attrs[key], list):
                raise _invalid(key, f"'{attrs[key]}' is not a list")
            body[key] = attrs[key]
    if "qos_policy_id" in attrs and attrs["qos_policy_id"] is not None:
        raise NeutronNotFound(
            f"QoS policy {attrs['qos_policy_id']} could not be found.", "QosPolicyNotFound"
        )
    if "binding:vnic_type" in attrs:
        if attrs["binding:vnic_type"] not in _VNIC_TYPES:
            raise _invalid("binding:vnic_type", f"'{attrs['binding:vnic_type']}' is not valid")
        body["binding:vnic_type"] = attrs["binding:vnic_type"]
    for key in ("binding:host_id", "binding:profile"):
        if key in attrs:
            if not caller.is_admin:
                raise _denied(f"create_port:{key}")
            body[key] = attrs[key] if key == "binding:profile" else _text(key, attrs[key] or "")
    bound = bool(body.get("binding:host_id"))
    body["binding:vif_type"] = "ovs" if bound else "unbound"
    body["binding:vif_details"] = {"port_filter": True, "connectivity": "l2"} if bound else {}
    body["status"] = "ACTIVE" if body["device_id"] and body["admin_state_up"] else "DOWN"


def create_port(cloud: Cloud, caller: Caller, attrs: Mapping[str, Any]) -> dict[str, Any]:
    _check_keys(attrs, _PORT_CREATE)
    network_id = _text("network_id", _required(attrs, "network_id"))
    net = _network(cloud, caller, network_id)
    net_owner = caller.is_admin or net["project_id"] == caller.project_id
    if not net_owner and not net.get("shared"):
        raise _denied("create_port")
    project = _owner(attrs, caller)
    subnets = _network_subnets(cloud, network_id)
    requests = None
    if "fixed_ips" in attrs:
        requests = _ip_requests(attrs["fixed_ips"], network_id, subnets)
        if not net_owner and any(r.ip_address is not None for r in requests):
            raise _denied("create_port:fixed_ips:ip_address")
    mac = None
    if attrs.get("mac_address") is not None:
        if not net_owner:
            raise _denied("create_port:mac_address")
        mac = _valid_mac(attrs["mac_address"])
    port_id = str(uuid.uuid4())
    body: dict[str, Any] = {
        "id": port_id,
        "name": "",
        **_standard(cloud, project),
        "network_id": network_id,
        "admin_state_up": True,
        "status": "DOWN",
        "mac_address": "",
        "fixed_ips": [],
        "device_id": "",
        "device_owner": "",
        "security_groups": [],
        "port_security_enabled": bool(net.get("port_security_enabled", True)),
        "allowed_address_pairs": [],
        "extra_dhcp_opts": [],
        "binding:host_id": "",
        "binding:profile": {},
        "binding:vif_type": "unbound",
        "binding:vif_details": {},
        "binding:vnic_type": "normal",
        "ip_allocation": "immediate",
        "dns_name": "",
        "qos_policy_id": None,
        "qos_network_policy_id": None,
        "resource_request": None,
        "propagate_uplink_status": False,
    }
    wants_groups = "security_groups" in attrs
    if body["port_security_enabled"] and not wants_groups:
        body["security_groups"] = [ensure_default_security_group(cloud, project)]
    _port_attrs(cloud, attrs, caller, body)
    if body["device_owner"].startswith("network:") and not wants_groups:
        body["security_groups"] = []
    body["mac_address"] = _claim_mac(cloud, network_id, mac, port_id)
    try:
        body["fixed_ips"] = _allocate_ips(cloud, network_id, port_id, requests, subnets)
        try:
            cloud.objects.create("port", port_id, body, project_id=project, name=body["name"])
        except BaseException:
            _release_ips(cloud, body["fixed_ips"])
            raise
    except BaseException:
        cloud.objects.delete("mac_allocation", _uuid5("mac", network_id, body["mac_address"]))
        raise
    return _render_port(body, caller)


def update_port(
    cloud: Cloud, caller: Caller, port_id: str, attrs: Mapping[str, Any]
) -> dict[str, Any]:
    port = _port(cloud, caller, port_id)
    new = _editable(
        port, caller, "update_port", attrs, _PORT_UPDATE, (*_PORT_CREATE, "mac_address")
    )
    _port_attrs(cloud, attrs, caller, new)
    if "fixed_ips" in attrs:
        subnets = _network_subnets(cloud, port["network_id"])
        requests = _ip_requests(attrs["fixed_ips"], port["network_id"], subnets)
        new["fixed_ips"] = _allocate_ips(
            cloud, port["network_id"], port_id, requests, subnets, keep=port["fixed_ips"]
        )
        kept = {(ip["subnet_id"], ip["ip_address"]) for ip in new["fixed_ips"]}
        try:
            saved = _save(cloud, "port", new)
        except BaseException:
            _release_ips(
                cloud,
                [ip for ip in new["fixed_ips"] if ip not in port["fixed_ips"]],
            )
            raise
        _release_ips(
            cloud,
            [ip for ip in port["fixed_ips"] if (ip["subnet_id"], ip["ip_address"]) not in kept],
        )
        return _render_port(saved, caller)
    return _render_port(_save(cloud, "port", new), caller)


def _drop_port(cloud: Cloud, port: Mapping[str, Any]) -> None:
    if cloud.objects.delete("port", port["id"]):
        _release_ips(cloud, port.get("fixed_ips", []))
        cloud.objects.delete(
            "mac_allocation", _uuid5("mac", port["network_id"], port["mac_address"])
        )


def delete_port(cloud: Cloud, caller: Caller, port_id: str) -> None:
    port = _port(cloud, caller, port_id)
    if not caller.is_admin and port["project_id"] != caller.project_id:
        net = cloud.objects.find("network", port["network_id"])
        if net is None or net.body["project_id"] != caller.project_id:
            raise _denied("delete_port")
    _drop_port(cloud, port)


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
) -> dict[str, Any]:
    """A port for a server on `network_id` with the next free address (or `fixed_ip`), made
    as `project_id` would make it (`is_admin` lifts the visibility rules).

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
    port = create_port(cloud, caller, attrs)
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
    """The ports a server holds (made for it, or attached to it)."""
    return [p for p in _bodies(cloud, "port") if p.get("device_id") == device_id]


def release_ports(cloud: Cloud, device_id: str) -> int:
    """A deleted server's ports: those made for it are deleted, attached ones detached.
    Returns how many ports it held."""
    ports = ports_of(cloud, device_id)
    for port in ports:
        if port.get("_preserve"):
            new = dict(port)
            new.update(device_id="", device_owner="", _preserve=False)
            _port_attrs(cloud, {"binding:host_id": ""}, _As(port["project_id"], True), new)
            _save(cloud, "port", new)
        else:
            _drop_port(cloud, port)
    return len(ports)


def addresses_of(cloud: Cloud, device_id: str) -> dict[str, list[dict[str, Any]]]:
    """A server's `addresses`, as nova shows them: network name to its fixed addresses."""
    names = {n["id"]: n.get("name") or n["id"] for n in _bodies(cloud, "network")}
    subnets = {s["id"]: s["ip_version"] for s in _bodies(cloud, "subnet")}
    out: dict[str, list[dict[str, Any]]] = {}
    for port in _bodies(cloud, "port"):
        if port.get("device_id") != device_id:
            continue
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
    return out


# -- security groups --------------------------------------------------------------------------

_GROUP_CREATE = ("name", "description", "project_id", "tenant_id", "stateful")
_GROUP_UPDATE = ("name", "description", "stateful")
_RULE_CREATE = (
    "security_group_id",
    "direction",
    "ethertype",
    "protocol",
    "port_range_min",
    "port_range_max",
    "remote_ip_prefix",
    "remote_group_id",
    "remote_address_group_id",
    "description",
    "project_id",
    "tenant_id",
)
_PROTOCOLS = {
    "ah": 51,
    "dccp": 33,
    "egp": 8,
    "esp": 50,
    "gre": 47,
    "icmp": 1,
    "icmpv6": 58,
    "igmp": 2,
    "ipip": 4,
    "ipv6-encap": 41,
    "ipv6-frag": 44,
    "ipv6-icmp": 58,
    "ipv6-nonxt": 59,
    "ipv6-opts": 60,
    "ipv6-route": 43,
    "ospf": 89,
    "pgm": 113,
    "rsvp": 46,
    "sctp": 132,
    "tcp": 6,
    "udp": 17,
    "udplite": 136,
    "vrrp": 112,
}
_PORTED = ("tcp", "udp", "sctp", "dccp", "udplite", "6", "17", "132", "33", "136")


def _group_visible(group: Mapping[str, Any], caller: Caller) -> bool:
    return caller.is_admin or group["project_id"] == caller.project_id


def _render_group(group: Mapping[str, Any], rules: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    out = dict(group)
    out["security_group_rules"] = [dict(r) for r in rules if r["security_group_id"] == group["id"]]
    return out


def _new_rule(
    cloud: Cloud,
    group_id: str,
    project_id: str,
    direction: str,
    ethertype: str,
    rule_id: str | None = None,
    **values: Any,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": rule_id or str(uuid.uuid4()),
        **_standard(cloud, project_id),
        "security_group_id": group_id,
        "direction": direction,
        "ethertype": ethertype,
        "protocol": None,
        "port_range_min": None,
        "port_range_max": None,
        "remote_ip_prefix": None,
        "normalized_cidr": None,
        "remote_group_id": None,
        "remote_address_group_id": None,
        "belongs_to_default_sg": False,
    }
    body.pop("tags")
    body.update(values)
    return body


def ensure_default_security_group(cloud: Cloud, project_id: str) -> str:
    """The project's "default" group, created with neutron's default rules on first use."""
    group_id = _uuid5("default-security-group", project_id)
    if cloud.objects.find("security_group", group_id) is not None:
        return group_id
    body = {
        "id": group_id,
        "name": "default",
        **_standard(cloud, project_id),
        "description": "Default security group",
        "stateful": True,
        "shared": False,
    }
    try:
        cloud.objects.create(
            "security_group", group_id, body, project_id=project_id, name="default"
        )
    except ConflictError:
        return group_id
    for direction in ("egress", "ingress"):
        for ethertype in ("IPv4", "IPv6"):
            remote = group_id if direction == "ingress" else None
            rule = _new_rule(
                cloud,
                group_id,
                project_id,
                direction,
                ethertype,
                rule_id=_uuid5("default-rule", group_id, direction, ethertype),
                remote_group_id=remote,
                belongs_to_default_sg=True,
            )
            with contextlib.suppress(ConflictError):
                cloud.objects.create("security_group_rule", rule["id"], rule, project_id=project_id)
    return group_id


def list_security_groups(cloud: Cloud, caller: Caller) -> list[dict[str, Any]]:
    ensure_default_security_group(cloud, caller.project_id)
    rules = _bodies(cloud, "security_group_rule")
    return [
        _render_group(g, rules)
        for g in _bodies(cloud, "security_group")
        if _group_visible(g, caller)
    ]


def _group(cloud: Cloud, caller: Caller, group_id: str) -> dict[str, Any]:
    doc = cloud.objects.find("security_group", group_id)
    if doc is None or not _group_visible(doc.body, caller):
        raise NeutronNotFound(f"Security group {group_id} does not exist", "SecurityGroupNotFound")
    return doc.body


def get_security_group(cloud: Cloud, caller: Caller, group_id: str) -> dict[str, Any]:
    ensure_default_security_group(cloud, caller.project_id)
    return _render_group(_group(cloud, caller, group_id), _bodies(cloud, "security_group_rule"))


def create_security_group(cloud: Cloud, caller: Caller, attrs: Mapping[str, Any]) -> dict[str, Any]:
    _check_keys(attrs, _GROUP_CREATE)
    project = _owner(attrs, caller)
    ensure_default_security_group(cloud, project)
    group_id = str(uuid.uuid4())
    body: dict[str, Any] = {
        "id": group_id,
        "name": "",
        **_standard(cloud, project),
        "stateful": True,
        "shared": False,
    }
    _common(attrs, body)
    if body["name"] == "default":
        raise NeutronConflict(
            "Default security group already exists.", "SecurityGroupDefaultAlreadyExists"
        )
    if "stateful" in attrs:
        body["stateful"] = _bool("stateful", attrs["stateful"])
    rules = [
        _new_rule(cloud, group_id, project, "egress", ethertype) for ethertype in ("IPv4", "IPv6")
    ]
    cloud.objects.create("security_group", group_id, body, project_id=project, name=body["name"])
    for rule in rules:
        cloud.objects.create("security_group_rule", rule["id"], rule, project_id=project)
    return _render_group(body, rules)


def update_security_group(
    cloud: Cloud, caller: Caller, group_id: str, attrs: Mapping[str, Any]
) -> dict[str, Any]:
    group = _group(cloud, caller, group_id)
    new = _editable(group, caller, "update_security_group", attrs, _GROUP_UPDATE, _GROUP_CREATE)
    _common(attrs, new)
    if group["name"] == "default" and new["name"] != "default":
        raise NeutronConflict(
            "Updating default security group not allowed.", "SecurityGroupCannotUpdateDefault"
        )
    if "stateful" in attrs:
        new["stateful"] = _bool("stateful", attrs["stateful"])
    return _render_group(_save(cloud, "security_group", new), _bodies(cloud, "security_group_rule"))


def delete_security_group(cloud: Cloud, caller: Caller, group_id: str) -> None:
    group = _group(cloud, caller, group_id)
    _owned(group, caller, "delete_security_group")
    if group_id == _uuid5("default-security-group", group["project_id"]) and not caller.is_admin:
        raise NeutronConflict(
            "Insufficient rights for removing default security group.",
            "SecurityGroupCannotRemoveDefault",
        )
    if any(group_id in p.get("security_groups", []) for p in _bodies(cloud, "port")):
        raise NeutronConflict(f"Security Group {group_id} in use.", "SecurityGroupInUse")
    # Its own rules go, and so do other groups' rules that name it as their remote group.
    for rule in _bodies(cloud, "security_group_rule"):
        if group_id in (rule["security_group_id"], rule.get("remote_group_id")):
            cloud.objects.delete("security_group_rule", rule["id"])
    cloud.objects.delete("security_group", group_id)


def list_security_group_rules(cloud: Cloud, caller: Caller) -> list[dict[str, Any]]:
    ensure_default_security_group(cloud, caller.project_id)
    return [dict(r) for r in _bodies(cloud, "security_group_rule") if _group_visible(r, caller)]


def _rule(cloud: Cloud, caller: Caller, rule_id: str) -> dict[str, Any]:
    doc = cloud.objects.find("security_group_rule", rule_id)
    if doc is None or not _group_visible(doc.body, caller):
        raise NeutronNotFound(
            f"Security group rule {rule_id} does not exist", "SecurityGroupRuleNotFound"
        )
    return doc.body


def get_security_group_rule(cloud: Cloud, caller: Caller, rule_id: str) -> dict[str, Any]:
    return dict(_rule(cloud, caller, rule_id))


def _rule_protocol(attrs: Mapping[str, Any]) -> str | None:
    protocol = attrs.get("protocol")
    if protocol is None or protocol in ("any", "0"):
        return None
    text = str(protocol).lower()
    if text in _PROTOCOLS or (text.isdigit() and 0 <= int(text) <= 255):
        return text
    raise NeutronBadRequest(
        f"Security group rule protocol {protocol} not supported. Only protocol values "
        f"{sorted(_PROTOCOLS)} and integer representations [0 to 255] are supported.",
        "SecurityGroupRuleInvalidProtocol",
    )


def _rule_ports(attrs: Mapping[str, Any], protocol: str | None) -> tuple[int | None, int | None]:
    low, high = attrs.get("port_range_min"), attrs.get("port_range_max")
    for key, value in (("port_range_min", low), ("port_range_max", high)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise _invalid(key, f"'{value}' is not an integer")
    if low is None and high is None:
        return None, None
    if protocol is None:
        raise NeutronBadRequest(
            "Must also specify protocol if port range is given.",
            "SecurityGroupProtocolRequiredWithPorts",
        )
    if protocol in _PORTED:
        if low is None or high is None or not 1 <= low <= high <= 65535:
            raise NeutronBadRequest(
                "For TCP/UDP protocols, port_range_min must be <= port_range_max",
                "SecurityGroupInvalidPortRange",
            )
        return low, high
    for key, value in (("port_range_min", low), ("port_range_max", high)):
        if value is not None and not 0 <= value <= 255:
            raise NeutronBadRequest(
                f"Invalid value for ICMP {key}: {value}. It must be 0 to 255.",
                "SecurityGroupInvalidIcmpValue",
            )
    return low, high


def create_security_group_rule(
    cloud: Cloud, caller: Caller, attrs: Mapping[str, Any]
) -> dict[str, Any]:
    _check_keys(attrs, _RULE_CREATE)
    group = _group(cloud, caller, _text("security_group_id", _required(attrs, "security_group_id")))
    _owned(group, caller, "create_security_group_rule")
    direction = _required(attrs, "direction")
    if direction not in ("ingress", "egress"):
        raise _invalid("direction", f"{direction} is not in ['ingress', 'egress']")
    ethertype = attrs.get("ethertype") or "IPv4"
    if ethertype not in ("IPv4", "IPv6"):
        raise _invalid("ethertype", f"{ethertype} is not in ['IPv4', 'IPv6']")
    protocol = _rule_protocol(attrs)
    low, high = _rule_ports(attrs, protocol)
    prefix, remote_group = attrs.get("remote_ip_prefix"), attrs.get("remote_group_id")
    if prefix is not None and remote_group is not None:
        raise NeutronBadRequest(
            "Only remote_ip_prefix or remote_group_id may be provided.",
            "SecurityGroupRemoteGroupAndRemoteIpPrefix",
        )
    if attrs.get("remote_address_group_id") is not None:
        raise NeutronNotFound(
            f"Address group {attrs['remote_address_group_id']} could not be found.",
            "AddressGroupNotFound",
        )
    normalized = None
    if prefix is not None:
        try:
            normalized = str(ipaddress.ip_network(str(prefix), strict=False))
        except ValueError:
            raise _invalid("remote_ip_prefix", f"'{prefix}' is not a valid CIDR") from None
        if ipaddress.ip_network(normalized).version != int(ethertype[-1]):
            raise NeutronBadRequest(
                f"Conflicting value ethertype {ethertype} for CIDR {prefix}",
                "SecurityGroupRuleParameterConflict",
            )
    if remote_group is not None:
        _group(cloud, caller, str(remote_group))
    rule = _new_rule(
        cloud,
        group["id"],
        group["project_id"],
        direction,
        ethertype,
        protocol=protocol,
        port_range_min=low,
        port_range_max=high,
        remote_ip_prefix=prefix,
        normalized_cidr=normalized,
        remote_group_id=remote_group,
        description=_text("description", attrs.get("description") or ""),
        belongs_to_default_sg=group["name"] == "default",
    )
    signature = (
        "direction",
        "ethertype",
        "protocol",
        "port_range_min",
        "port_range_max",
        "normalized_cidr",
        "remote_group_id",
    )
    for other in _bodies(cloud, "security_group_rule"):
        if other["security_group_id"] == group["id"] and all(
            other.get(k) == rule.get(k) for k in signature
        ):
            raise NeutronConflict(
                f"Security group rule already exists. Rule id is {other['id']}.",
                "SecurityGroupRuleExists",
            )
    cloud.objects.create("security_group_rule", rule["id"], rule, project_id=group["project_id"])
    return rule


def delete_security_group_rule(cloud: Cloud, caller: Caller, rule_id: str) -> None:
    rule = _rule(cloud, caller, rule_id)
    _owned(rule, caller, "delete_security_group_rule")
    cloud.objects.delete("security_group_rule", rule_id)


# -- tags -------------------------------------------------------------------------------------

_TAGGABLE = {
    "network": _network,
    "subnet": _subnet,
    "port": _port,
    "security_group": _group,
}


def set_tags(cloud: Cloud, caller: Caller, kind: str, resource_id: str, tags: Any) -> list[str]:
    """Replace a resource's tags (neutron's standard-attr-tag)."""
    body = _TAGGABLE[kind](cloud, caller, resource_id)
    _owned(body, caller, f"update_{kind}:tags")
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise _invalid("tags", f"'{tags}' is not a list of strings")
    for tag in tags:
        if not tag or len(tag) > 255 or "," in tag:
            raise _invalid("tags", f"'{tag}' is not a valid tag")
    new = dict(body)
    new["tags"] = sorted(set(tags))
    _save(cloud, kind, new)
    return list(new["tags"])


def tags_of(cloud: Cloud, caller: Caller, kind: str, resource_id: str) -> list[str]:
    return list(_TAGGABLE[kind](cloud, caller, resource_id).get("tags", []))


# -- bootstrap --------------------------------------------------------------------------------


def bootstrap_networks(cloud: Cloud, projects: Mapping[str, str]) -> None:
    """devstack's networks: a shared "private" 10.0.0.0/24 of project demo and an external
    "public" 172.24.4.0/24 of admin; nothing is created twice."""
    existing = {n.get("name") for n in _bodies(cloud, "network")}
    if "private" not in existing:
        demo = _As(projects["demo"], True)
        net = create_network(cloud, demo, {"name": "private", "shared": True})
        create_subnet(
            cloud,
            demo,
            {
                "name": "private-subnet",
                "network_id": net["id"],
                "ip_version": 4,
                "cidr": "10.0.0.0/24",
                "dns_nameservers": [],
            },
        )
    if "public" not in existing:
        admin = _As(projects["admin"], True)
        net = create_network(
            cloud,
            admin,
            {
                "name": "public",
                "router:external": True,
                "provider:network_type": "flat",
                "provider:physical_network": "public",
            },
        )
        create_subnet(
            cloud,
            admin,
            {
                "name": "public-subnet",
                "network_id": net["id"],
                "ip_version": 4,
                "cidr": "172.24.4.0/24",
                "enable_dhcp": False,
            },
        )
