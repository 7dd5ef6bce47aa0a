"""Subnets: CIDRs, gateways and allocation pools, checked as neutron checks them."""

from __future__ import annotations

import ipaddress
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from stowage.services.caller import Caller
from stowage.services.networks import subnetpools
from stowage.services.networks.common import (
    IPAddress,
    IPNetwork,
    NeutronBadRequest,
    NeutronConflict,
    NeutronNotFound,
    _address,
    _bodies,
    _bool,
    _check_keys,
    _common,
    _denied,
    _editable,
    _invalid,
    _owned,
    _owner,
    _required,
    _save,
    _standard,
    _text,
)
from stowage.services.networks.network import _network, _network_visible
from stowage.services.networks.quotas import create_counted

if TYPE_CHECKING:
    from stowage.services.cloud import Cloud

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
    "use_default_subnetpool",
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
    pool = subnetpools.pool_for_subnet(cloud, caller, attrs, version)
    if pool is None and attrs.get("cidr") is None:
        raise NeutronBadRequest(
            "Bad subnets request: a subnetpool must be specified in the absence of a cidr.",
            "BadRequest",
        )
    if pool is None and attrs.get("prefixlen") is not None:
        raise NeutronBadRequest(
            "Bad subnets request: prefixlen is only valid with a subnetpool.", "BadRequest"
        )
    subnet_id = str(uuid.uuid4())
    if pool is not None:
        net = subnetpools.claim_prefix(cloud, pool, attrs, subnet_id, project)
    else:
        net = _cidr(attrs["cidr"], version)
    try:
        return _create_subnet(cloud, attrs, network_id, project, version, net, subnet_id, pool)
    except BaseException:
        if pool is not None:
            subnetpools.release_prefix(cloud, {"subnetpool_id": pool["id"], "cidr": str(net)})
        raise


def _create_subnet(
    cloud: Cloud,
    attrs: Mapping[str, Any],
    network_id: str,
    project: str,
    version: int,
    net: IPNetwork,
    subnet_id: str,
    pool: Mapping[str, Any] | None,
) -> dict[str, Any]:
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
        "subnetpool_id": None if pool is None else pool["id"],
        "segment_id": None,
        "service_types": [],
    }
    _subnet_attrs({k: v for k, v in attrs.items() if k != "allocation_pools"}, body, net)
    gateway = ipaddress.ip_address(body["gateway_ip"]) if body["gateway_ip"] else None
    body["allocation_pools"] = _default_pools(net, gateway)
    if "allocation_pools" in attrs:
        _subnet_attrs({"allocation_pools": attrs["allocation_pools"]}, body, net)
    create_counted(cloud, "subnet", subnet_id, body, project_id=project, name=body["name"])
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
    if cloud.objects.delete("subnet", subnet_id):
        subnetpools.release_prefix(cloud, subnet)
