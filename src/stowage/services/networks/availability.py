"""IP availability (neutron's network-ip-availability): totals of the subnets' allocation pools
and the addresses claimed on them, per subnet and per network; an admin's view only."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from stowage.services.caller import Caller
from stowage.services.networks.common import NeutronNotFound, _bodies

if TYPE_CHECKING:
    from stowage.services.cloud import Cloud

FILTERS = ("network_id", "network_name", "project_id", "tenant_id", "ip_version")


def _pool_size(subnet: Mapping[str, Any]) -> int:
    return sum(
        int(ipaddress.ip_address(p["end"])) - int(ipaddress.ip_address(p["start"])) + 1
        for p in subnet.get("allocation_pools", [])
    )


def _availability(
    cloud: Cloud, net: Mapping[str, Any], subnets: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    rows = []
    for subnet in subnets:
        used = len(cloud.objects.ids("ip_allocation", name=subnet["id"]))
        rows.append(
            {
                "subnet_id": subnet["id"],
                "subnet_name": subnet.get("name", ""),
                "cidr": subnet["cidr"],
                "ip_version": subnet["ip_version"],
                "total_ips": _pool_size(subnet),
                "used_ips": used,
            }
        )
    return {
        "network_id": net["id"],
        "network_name": net.get("name", ""),
        "project_id": net["project_id"],
        "tenant_id": net["project_id"],
        "total_ips": sum(r["total_ips"] for r in rows),
        "used_ips": sum(r["used_ips"] for r in rows),
        "subnet_ip_availability": rows,
    }


def _subnets_of(cloud: Cloud) -> dict[str, list[dict[str, Any]]]:
    by_network: dict[str, list[dict[str, Any]]] = {}
    for subnet in _bodies(cloud, "subnet"):
        by_network.setdefault(subnet["network_id"], []).append(subnet)
    return by_network


def list_ip_availabilities(
    cloud: Cloud, caller: Caller, filters: Mapping[str, Sequence[str]]
) -> list[dict[str, Any]]:
    """Every network's availability, filtered as neutron filters it; none for a non-admin
    (neutron drops from a list what its policy refuses to show)."""
    if not caller.is_admin:
        return []
    versions = {str(v) for v in filters.get("ip_version", [])}
    by_network = _subnets_of(cloud)
    out = []
    for net in _bodies(cloud, "network"):
        subnets = by_network.get(net["id"], [])
        if versions:
            subnets = [s for s in subnets if str(s["ip_version"]) in versions]
            if not subnets:
                continue
        row = _availability(cloud, net, subnets)
        if all(
            str(row[key]) in values
            for key, values in filters.items()
            if key != "ip_version" and values
        ):
            out.append(row)
    return out


def get_ip_availability(cloud: Cloud, caller: Caller, network_id: str) -> dict[str, Any]:
    doc = cloud.objects.find("network", network_id)
    if doc is None or not caller.is_admin:
        raise NeutronNotFound(f"Network {network_id} could not be found.", "NetworkNotFound")
    return _availability(cloud, doc.body, _subnets_of(cloud).get(network_id, []))


__all__ = ["FILTERS", "get_ip_availability", "list_ip_availabilities"]
