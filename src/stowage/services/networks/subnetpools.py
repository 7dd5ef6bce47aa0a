"""Subnet pools (Neutron's subnet_allocation and default-subnetpools): prefixes a subnet's
CIDR is carved from.

A pool is a document of kind "subnetpool". Each prefix given to a subnet is a claim document
of kind "subnetpool_allocation", id "<pool id>/<cidr>", name = the pool id, written in a
transaction that holds the pool's lock and checks, after writing, that no other claim of the
pool overlaps it: the store's primary key refuses a second claim of the same prefix, and the
check (under the lock, or SQLite's write serialization) refuses an overlapping one.
"""

from __future__ import annotations

import ipaddress
import json
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, select
from sqlalchemy.exc import IntegrityError

from stowage.ledger.schema import objects
from stowage.services.caller import Caller
from stowage.services.networks.common import (
    IPNetwork,
    NeutronBadRequest,
    NeutronConflict,
    NeutronNotFound,
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
)

if TYPE_CHECKING:
    from stowage.services.cloud import Cloud

KIND = "subnetpool"
CLAIM = "subnetpool_allocation"

_CREATE = (
    "name",
    "description",
    "prefixes",
    "default_prefixlen",
    "min_prefixlen",
    "max_prefixlen",
    "shared",
    "is_default",
    "default_quota",
    "address_scope_id",
    "project_id",
    "tenant_id",
)
_UPDATE = (
    "name",
    "description",
    "prefixes",
    "default_prefixlen",
    "min_prefixlen",
    "max_prefixlen",
    "is_default",
    "default_quota",
    "address_scope_id",
)
_DEFAULT_MIN = {4: 8, 6: 64}


def _not_found(pool_id: str) -> NeutronNotFound:
    return NeutronNotFound(f"Subnet pool {pool_id} could not be found.", "SubnetPoolNotFound")


def _visible(pool: Mapping[str, Any], caller: Caller) -> bool:
    return caller.is_admin or pool["project_id"] == caller.project_id or bool(pool["shared"])


def _pool(cloud: Cloud, caller: Caller, pool_id: str) -> dict[str, Any]:
    doc = cloud.objects.find(KIND, pool_id)
    if doc is None or not _visible(doc.body, caller):
        raise _not_found(pool_id)
    return doc.body


def list_subnetpools(cloud: Cloud, caller: Caller) -> list[dict[str, Any]]:
    return [dict(p) for p in _bodies(cloud, KIND) if _visible(p, caller)]


def get_subnetpool(cloud: Cloud, caller: Caller, pool_id: str) -> dict[str, Any]:
    return dict(_pool(cloud, caller, pool_id))


def _prefixes(value: Any) -> list[IPNetwork]:
    if not isinstance(value, list) or not value:
        raise _invalid("prefixes", f"'{value}' is not a non-empty list of CIDRs")
    nets = []
    for item in value:
        try:
            nets.append(ipaddress.ip_network(str(item), strict=False))
        except ValueError:
            raise _invalid("prefixes", f"'{item}' is not a valid IP subnet") from None
    if len({n.version for n in nets}) != 1:
        raise NeutronBadRequest(
            "Invalid input for operation: Cannot mix IPv4 and IPv6 prefixes in a subnet pool.",
            "InvalidInput",
        )
    return list(ipaddress.collapse_addresses(nets))  # type: ignore[type-var]


def _prefixlen(attr: str, value: Any, version: int) -> int:
    bits = 32 if version == 4 else 128
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise _invalid(attr, f"'{value}' is not an integer") from None
    if isinstance(value, bool) or not 0 <= number <= bits:
        raise _invalid(attr, f"'{value}' is not in range 0 through {bits}")
    return number


def _bounds(body: dict[str, Any]) -> None:
    """min <= default <= max."""
    low, default, high = body["min_prefixlen"], body["default_prefixlen"], body["max_prefixlen"]
    for name, value, base_name, base in (
        ("default_prefixlen", default, "min_prefixlen", low),
        ("max_prefixlen", high, "default_prefixlen", default),
    ):
        if value < base:
            raise NeutronBadRequest(
                f"Illegal prefix bounds: {name}={value}, {base_name}={base}.",
                "IllegalSubnetPoolPrefixBounds",
            )


def _quota(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise _invalid("default_quota", f"'{value}' is not an integer")
    try:
        number = int(value)
    except ValueError:
        raise _invalid("default_quota", f"'{value}' is not an integer") from None
    if number < 0:
        raise _invalid("default_quota", f"'{value}' should be non-negative")
    return number


def _no_scope(attrs: Mapping[str, Any]) -> None:
    scope = attrs.get("address_scope_id")
    if scope is not None:
        raise NeutronNotFound(f"Address scope {scope} could not be found.", "AddressScopeNotFound")


def _one_default(cloud: Cloud, body: Mapping[str, Any]) -> None:
    if not body["is_default"]:
        return
    for other in _bodies(cloud, KIND):
        if (
            other["id"] != body["id"]
            and other["is_default"]
            and (other["ip_version"] == body["ip_version"])
        ):
            raise NeutronBadRequest(
                "Invalid input for operation: A default subnetpool for this IP family has "
                "already been set. Only one default may exist per IP family.",
                "InvalidInput",
            )


def _pool_attrs(cloud: Cloud, attrs: Mapping[str, Any], body: dict[str, Any]) -> None:
    _common(attrs, body)
    _no_scope(attrs)
    version = body["ip_version"]
    for key in ("min_prefixlen", "default_prefixlen", "max_prefixlen"):
        if key in attrs and attrs[key] is not None:
            body[key] = _prefixlen(key, attrs[key], version)
    if "default_quota" in attrs:
        body["default_quota"] = _quota(attrs["default_quota"])
    if "is_default" in attrs:
        body["is_default"] = _bool("is_default", attrs["is_default"])
    _bounds(body)
    _one_default(cloud, body)


def create_subnetpool(cloud: Cloud, caller: Caller, attrs: Mapping[str, Any]) -> dict[str, Any]:
    _check_keys(attrs, _CREATE, ("ip_version",))
    _required(attrs, "name")
    prefixes = _prefixes(_required(attrs, "prefixes"))
    project = _owner(attrs, caller)
    shared = _bool("shared", attrs.get("shared", False))
    if shared and not caller.is_admin:
        raise _denied("create_subnetpool:shared")
    if _bool("is_default", attrs.get("is_default", False)) and not caller.is_admin:
        raise _denied("create_subnetpool:is_default")
    version = prefixes[0].version
    low = _prefixlen("min_prefixlen", attrs.get("min_prefixlen", _DEFAULT_MIN[version]), version)
    pool_id = str(uuid.uuid4())
    body: dict[str, Any] = {
        "id": pool_id,
        "name": "",
        **_standard(cloud, project),
        "prefixes": [str(p) for p in prefixes],
        "ip_version": version,
        "min_prefixlen": low,
        "default_prefixlen": low,
        "max_prefixlen": 32 if version == 4 else 128,
        "shared": shared,
        "is_default": False,
        "default_quota": None,
        "address_scope_id": None,
    }
    _pool_attrs(cloud, attrs, body)
    cloud.objects.create(KIND, pool_id, body, project_id=project, name=body["name"])
    return dict(body)


def update_subnetpool(
    cloud: Cloud, caller: Caller, pool_id: str, attrs: Mapping[str, Any]
) -> dict[str, Any]:
    pool = _pool(cloud, caller, pool_id)
    new = _editable(pool, caller, "update_subnetpool", attrs, _UPDATE, (*_CREATE, "ip_version"))
    if "is_default" in attrs and not caller.is_admin:
        raise _denied("update_subnetpool:is_default")
    if "prefixes" in attrs:
        prefixes = _prefixes(attrs["prefixes"])
        if prefixes[0].version != pool["ip_version"]:
            raise NeutronBadRequest(
                "Invalid input for operation: Cannot mix IPv4 and IPv6 prefixes in a subnet pool.",
                "InvalidInput",
            )
        for old in pool["prefixes"]:
            net = ipaddress.ip_network(old)
            if not any(net.subnet_of(p) for p in prefixes):  # type: ignore[arg-type]
                raise NeutronBadRequest(
                    f"Illegal update to prefixes: Existing prefix {old} is not in the new "
                    "prefixes; existing prefixes must be a subset of the new prefixes.",
                    "IllegalSubnetPoolPrefixUpdate",
                )
        new["prefixes"] = [str(p) for p in prefixes]
    _pool_attrs(cloud, attrs, new)
    return dict(_save(cloud, KIND, new))


def delete_subnetpool(cloud: Cloud, caller: Caller, pool_id: str) -> None:
    pool = _pool(cloud, caller, pool_id)
    _owned(pool, caller, "delete_subnetpool")
    if cloud.objects.ids(CLAIM, name=pool_id):
        raise NeutronConflict(
            f"Unable to complete operation on subnet pool {pool_id}. Subnet pool has existing "
            "allocations.",
            "SubnetPoolInUse",
        )
    cloud.objects.delete(KIND, pool_id)


# -- allocation -------------------------------------------------------------------------------


def pool_for_subnet(
    cloud: Cloud, caller: Caller, attrs: Mapping[str, Any], version: int
) -> dict[str, Any] | None:
    """The pool a subnet request names (or the default of its IP version), else None."""
    pool_id = attrs.get("subnetpool_id")
    if pool_id is None and _bool(
        "use_default_subnetpool", attrs.get("use_default_subnetpool", False)
    ):
        default = default_pool(cloud, version)
        if default is None:
            raise NeutronBadRequest(
                f"Bad subnets request: No default subnetpool found for IPv{version}.",
                "BadRequest",
            )
        return default
    if pool_id is None:
        return None
    pool = _pool(cloud, caller, str(pool_id))
    if pool["ip_version"] != version:
        raise NeutronBadRequest(
            f"Bad subnets request: Cannot allocate IPv{version} subnet from "
            f"IPv{pool['ip_version']} subnet pool.",
            "BadRequest",
        )
    return pool


def default_pool(cloud: Cloud, version: int) -> dict[str, Any] | None:
    for pool in _bodies(cloud, KIND):
        if pool["is_default"] and pool["ip_version"] == version:
            return pool
    return None


def _allocation_error(reason: str) -> NeutronConflict:
    return NeutronConflict(f"Failed to allocate subnet: {reason}", "SubnetAllocationError")


def _requested(pool: Mapping[str, Any], attrs: Mapping[str, Any]) -> tuple[IPNetwork | None, int]:
    """The specific CIDR asked for (None: any), and the prefix length, checked on the pool."""
    cidr = attrs.get("cidr")
    wanted: IPNetwork | None = None
    if cidr is not None:
        try:
            wanted = ipaddress.ip_network(str(cidr), strict=False)
        except ValueError:
            raise _invalid("cidr", f"'{cidr}' is not a valid IP subnet") from None
        length = wanted.prefixlen
    elif attrs.get("prefixlen") is not None:
        length = _prefixlen("prefixlen", attrs["prefixlen"], pool["ip_version"])
    else:
        length = pool["default_prefixlen"]
    if length > pool["max_prefixlen"]:
        raise NeutronBadRequest(
            f"Unable to allocate subnet with prefix length {length}, maximum allowed prefix "
            f"is {pool['max_prefixlen']}.",
            "MaxPrefixSubnetAllocationError",
        )
    if length < pool["min_prefixlen"]:
        raise NeutronBadRequest(
            f"Unable to allocate subnet with prefix length {length}, minimum allowed prefix "
            f"is {pool['min_prefixlen']}.",
            "MinPrefixSubnetAllocationError",
        )
    if wanted is not None and not any(
        wanted.subnet_of(ipaddress.ip_network(p))  # type: ignore[arg-type]
        for p in pool["prefixes"]
    ):
        raise NeutronBadRequest(
            f"Failed to allocate subnet: Cidr {wanted} is not within the subnet pool's prefixes.",
            "SubnetAllocationError",
        )
    return wanted, length


def _first_free(pool: Mapping[str, Any], length: int, used: list[IPNetwork]) -> IPNetwork | None:
    """The lowest prefix of `length` in the pool that overlaps none of `used`."""
    taken = sorted((int(u.network_address), int(u.broadcast_address)) for u in used)
    for text in pool["prefixes"]:
        base = ipaddress.ip_network(text)
        if base.prefixlen > length:
            continue
        size = 1 << (base.max_prefixlen - length)
        start, end = int(base.network_address), int(base.broadcast_address)
        candidate = start
        while candidate + size - 1 <= end:
            last = candidate + size - 1
            clash = next((t for t in taken if t[0] <= last and candidate <= t[1]), None)
            if clash is None:
                return ipaddress.ip_network((candidate, length))
            candidate = ((clash[1] - start) // size + 1) * size + start
    return None


def _claims_in(conn: Connection, pool_id: str) -> list[dict[str, Any]]:
    rows = conn.execute(
        select(objects.c.body).where(objects.c.kind == CLAIM, objects.c.name == pool_id)
    ).scalars()
    return [json.loads(r) if isinstance(r, str) else dict(r) for r in rows]


def _size(net: IPNetwork) -> int:
    """What the pool's default_quota counts: addresses (IPv4) or /64s (IPv6), as Neutron."""
    return net.num_addresses if net.version == 4 else max(1, net.num_addresses >> 64)


def claim_prefix(
    cloud: Cloud, pool: Mapping[str, Any], attrs: Mapping[str, Any], subnet_id: str, project: str
) -> IPNetwork:
    """Claim a prefix of the pool for a subnet: the CIDR asked for, else the first free one."""
    wanted, length = _requested(pool, attrs)
    tried: set[str] = set()
    while True:
        used = [ipaddress.ip_network(c) for c in _used(cloud, pool["id"])]
        if wanted is not None:
            chosen: IPNetwork | None = wanted
            if any(wanted.overlaps(u) for u in used):
                raise _allocation_error(
                    f"Cannot allocate requested subnet {wanted} from the available set of prefixes."
                )
        else:
            chosen = _first_free(pool, length, used)
        if chosen is None or str(chosen) in tried:
            raise _allocation_error(f"Insufficient prefix space to allocate subnet size /{length}.")
        tried.add(str(chosen))
        if _try_claim(cloud, pool, chosen, subnet_id, project):
            return chosen


def _used(cloud: Cloud, pool_id: str) -> list[str]:
    return [i.partition("/")[2] for i in cloud.objects.ids(CLAIM, name=pool_id)]


class _Overlap(Exception):
    pass


def _try_claim(
    cloud: Cloud, pool: Mapping[str, Any], net: IPNetwork, subnet_id: str, project: str
) -> bool:
    body = {
        "subnetpool_id": pool["id"],
        "cidr": str(net),
        "subnet_id": subnet_id,
        "project_id": project,
    }
    # Late: services.documents imports the cloud, which imports this package.
    from stowage.services.documents import lock_key

    try:
        with cloud.ledger.engine.begin() as conn:
            lock_key(conn, f"stowage-subnetpool:{pool['id']}")
            cloud.objects.create_in(
                conn, CLAIM, f"{pool['id']}/{net}", body, project_id=project, name=pool["id"]
            )
            claims = _claims_in(conn, pool["id"])
            others = [c for c in claims if c["subnet_id"] != subnet_id]
            if any(net.overlaps(ipaddress.ip_network(c["cidr"])) for c in others):
                raise _Overlap
            quota = pool.get("default_quota")
            if quota is not None:
                mine = sum(
                    _size(ipaddress.ip_network(c["cidr"]))
                    for c in claims
                    if c["project_id"] == project
                )
                if mine > quota:
                    raise NeutronConflict(
                        "Per-tenant subnet pool prefix quota exceeded.",
                        "SubnetPoolQuotaExceeded",
                    )
    except (IntegrityError, _Overlap):
        return False
    return True


def release_prefix(cloud: Cloud, subnet: Mapping[str, Any]) -> None:
    if subnet.get("subnetpool_id"):
        cloud.objects.delete(CLAIM, f"{subnet['subnetpool_id']}/{subnet['cidr']}")
