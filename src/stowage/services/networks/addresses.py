"""Address claims: each IP and MAC is a document whose id the store refuses twice."""

from __future__ import annotations

import contextlib
import ipaddress
import random
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stowage.domain.errors import ConflictError
from stowage.services.networks.common import (
    MAC_PREFIX,
    NeutronBadRequest,
    NeutronConflict,
    _address,
    _invalid,
    _uuid5,
)
from stowage.services.networks.quotas import lock_quotas

if TYPE_CHECKING:
    from sqlalchemy import Connection

    from stowage.services.cloud import Cloud

# -- address claims ---------------------------------------------------------------------------


# One address decision at a time in this process; the claim documents guard across processes.
# Reentrant: `ports_in_one_commit` holds it around a transaction whose ports claim addresses.
_ipam_lock = threading.RLock()


@contextlib.contextmanager
def ports_in_one_commit(cloud: Cloud, project_id: str) -> Iterator[Connection]:
    """Every port of `project_id` made, bound or let go inside (its quota, MAC and address
    claims included), and what the caller writes on the connection it yields, commit in one
    transaction, or nothing does: no claim outlives a failure or a crash half-way.

    The locks are taken in one order: the address lock (never waited for inside a write
    transaction, which SQLite lets one thread hold at a time), then the project's quotas
    (before any claim: another process's transaction that holds a claim this one wants never
    waits for this one's quota lock), then the claims."""
    with _ipam_lock, cloud.objects.writing() as conn:
        lock_quotas(conn, project_id)
        yield conn


def _ip_claim_id(subnet_id: str, address: str) -> str:
    """`<subnet id>/<address>`: readable, so the used addresses of a subnet are its claims'
    ids (no document decoded per address: a boot read every address claim of its subnet)."""
    return f"{subnet_id}/{address}"


def _used_ips(cloud: Cloud, subnet_id: str) -> set[str]:
    return {i.rpartition("/")[2] for i in cloud.objects.ids("ip_allocation", name=subnet_id)}


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


def _next_free(cloud: Cloud, subnet: Mapping[str, Any], port_id: str) -> str | None:
    """Claim the lowest free address of the subnet's pools; None when it is full."""
    used = {int(ipaddress.ip_address(a)) for a in _used_ips(cloud, subnet["id"])}
    for pool in subnet["allocation_pools"]:
        start = ipaddress.ip_address(pool["start"])
        for number in range(int(start), int(ipaddress.ip_address(pool["end"])) + 1):
            if number in used:
                continue  # compared as integers: no address object per taken address
            text = str(type(start)(number))
            if _claim_ip(cloud, subnet["id"], text, port_id):
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


def _drop_port(cloud: Cloud, port: Mapping[str, Any]) -> None:
    # A floating IP whose port goes is no longer associated (Neutron's).
    for doc in cloud.objects.list("floatingip"):
        if doc.body.get("port_id") == port["id"]:
            fip = {k: v for k, v in doc.body.items() if k != "_subnet_id"}
            fip.update(port_id=None, fixed_ip_address=None, router_id=None, status="DOWN")
            cloud.objects.update("floatingip", doc.id, fip)
    if cloud.objects.delete("port", port["id"]):
        _release_ips(cloud, port.get("fixed_ips", []))
        cloud.objects.delete(
            "mac_allocation", _uuid5("mac", port["network_id"], port["mac_address"])
        )
