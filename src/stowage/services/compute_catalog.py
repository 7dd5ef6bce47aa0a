"""The compute API's catalog: flavors, hosts as services and hypervisors, zones, groups, quotas.

Host views are read from the ledger (`hosts`, `inventories`, `consumers`); flavors, aggregates,
keypairs, quota overrides and the services' disabled reasons are documents in `cloud.objects`.
Validation errors raise `InvalidSpec` (400), `NotFound` (404) or `ConflictError` (409).
"""

from __future__ import annotations

import json
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import delete, func, insert, select

from stowage.domain.errors import InvalidSpec, NotFound
from stowage.domain.flavor import Flavor, shape_of
from stowage.domain.groups import GroupPolicy, ServerGroup
from stowage.ledger.db import READONLY
from stowage.ledger.objects import Document
from stowage.ledger.schema import (
    changes,
    consumers,
    group_members,
    group_slots,
    hosts,
    inventories,
    objects,
    server_groups,
)
from stowage.services import identity_limits
from stowage.services.cloud import Cloud

__all__ = [
    "DEFAULT_QUOTAS",
    "DEFAULT_ZONE",
    "INTERNAL_ZONE",
    "ControlService",
    "HostView",
    "Inventory",
    "check_flavor_specs",
    "control_services",
    "count_groups",
    "default_quotas",
    "delete_group",
    "flavor_visible",
    "group_members_of",
    "host_metadata_from_aggregates",
    "host_zones_from_aggregates",
    "iso",
    "list_groups",
    "member",
    "only_keys",
    "parse_bool",
    "parse_int",
    "parse_name",
    "quota_key",
    "quota_limits",
    "quota_usage",
    "read_hosts",
    "set_disabled_reason",
    "sync_host_zones",
    "uptime_text",
    "visible_flavor",
    "visible_flavor_of",
]

DEFAULT_ZONE = "nova"
INTERNAL_ZONE = "internal"
STARTED_AT = time.time()

# Nova's default quotas (nova.conf [quota]); -1 is unlimited.
DEFAULT_QUOTAS: Mapping[str, int] = {
    "instances": 10,
    "cores": 20,
    "ram": 51200,
    "metadata_items": 128,
    "injected_files": 5,
    "injected_file_content_bytes": 10240,
    "injected_file_path_bytes": 255,
    "key_pairs": 100,
    "server_groups": 10,
    "server_group_members": 10,
    "fixed_ips": -1,
    "floating_ips": 10,
    "security_groups": 10,
    "security_group_rules": 20,
}

# Service ids below 2.53 are integers: the conductor and scheduler come first, as in devstack.
_CONDUCTOR_ID = 1
_SCHEDULER_ID = 2
_COMPUTE_ID_OFFSET = 2


def iso(ts: float | None) -> str | None:
    """Nova's timestamp format: 2012-10-29T13:42:02.000000 (UTC, no zone suffix)."""
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")


# -- input parsing --------------------------------------------------------------------------


def parse_int(
    value: Any, what: str, *, minimum: int | None = None, maximum: int = 2**31 - 1
) -> int:
    """An integer, or a string of digits as Nova's schemas allow; a 400 naming `what` otherwise."""
    if isinstance(value, bool):
        raise InvalidSpec(f"Invalid input for field/attribute {what}: {value!r} is not an integer")
    if isinstance(value, str):
        text = value.strip()
        negative = text.startswith("-")
        digits = text[1:] if negative else text
        if not digits.isascii() or not digits.isdigit():
            raise InvalidSpec(
                f"Invalid input for field/attribute {what}: {value!r} is not an integer"
            )
        value = -int(digits) if negative else int(digits)
    if not isinstance(value, int):
        raise InvalidSpec(f"Invalid input for field/attribute {what}: {value!r} is not an integer")
    if minimum is not None and value < minimum:
        raise InvalidSpec(
            f"Invalid input for field/attribute {what}: {value} is less than the minimum of "
            f"{minimum}"
        )
    if value > maximum:
        raise InvalidSpec(
            f"Invalid input for field/attribute {what}: {value} is greater than the maximum of "
            f"{maximum}"
        )
    return value


_TRUE = {"1", "t", "true", "on", "y", "yes"}
_FALSE = {"0", "f", "false", "off", "n", "no"}


def parse_bool(value: Any, what: str) -> bool:
    """Nova's boolean parameter type: JSON booleans or the usual strings."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
    raise InvalidSpec(f"Invalid input for field/attribute {what}: {value!r} is not a boolean")


def member(body: Any, key: str) -> dict[str, Any]:
    """`body[key]` as an object, as every compute request wraps its payload."""
    if not isinstance(body, dict) or key not in body:
        raise InvalidSpec(
            f"Invalid input for field/attribute {key}: '{key}' is a required property"
        )
    value = body[key]
    if not isinstance(value, dict):
        raise InvalidSpec(f"Invalid input for field/attribute {key}: {value!r} is not an object")
    return value


def only_keys(obj: Mapping[str, Any], allowed: Iterable[str], where: str) -> None:
    """Nova's schemas forbid additional properties; name the first one that is not allowed."""
    extra = sorted(set(obj) - set(allowed))
    if extra:
        raise InvalidSpec(
            f"Invalid input for field/attribute {where}: additional properties are not allowed "
            f"({extra[0]!r} was unexpected)"
        )


def parse_name(value: Any, what: str, *, maximum: int = 255) -> str:
    """A name as Nova's schemas take it: 1-255 printable characters, no edge whitespace."""
    if not isinstance(value, str):
        raise InvalidSpec(f"Invalid input for field/attribute {what}: {value!r} is not a string")
    if not 1 <= len(value) <= maximum:
        raise InvalidSpec(
            f"Invalid input for field/attribute {what}: length must be 1 to {maximum} characters"
        )
    if value != value.strip() or not value.isprintable():
        raise InvalidSpec(
            f"Invalid input for field/attribute {what}: {value!r} has leading or trailing "
            "whitespace or unprintable characters"
        )
    return value


# -- flavors --------------------------------------------------------------------------------


def flavor_visible(body: Mapping[str, Any], project_id: str, is_admin: bool) -> bool:
    """Admins see every flavor; others public ones and the private ones shared with them."""
    if is_admin or body.get("is_public", True):
        return True
    return project_id in body.get("projects", [])


def visible_flavor(cloud: Cloud, flavor_id: str, project_id: str, is_admin: bool) -> Document:
    """The flavor `flavor_id` as the caller may see it; NotFound for others' private flavors."""
    return visible_flavor_of(
        cloud.objects.find("flavor", flavor_id), flavor_id, project_id, is_admin
    )


def visible_flavor_of(
    doc: Document | None, flavor_id: str, project_id: str, is_admin: bool
) -> Document:
    """`visible_flavor` of the flavor document `doc` already read (None: there is none)."""
    if doc is None or not flavor_visible(doc.body, project_id, is_admin):
        raise NotFound(f"Flavor {flavor_id} could not be found.")
    return doc


def check_flavor_specs(body: Mapping[str, Any], specs: Mapping[str, str]) -> None:
    """Validate extra specs against the flavor they would belong to; InvalidSpec names the key."""
    shape_of(
        Flavor(
            name=str(body.get("name", "")),
            vcpus=int(body.get("vcpus", 1)),
            memory_mb=int(body.get("ram", 1)),
            disk_gb=int(body.get("disk", 0)),
            extra_specs=dict(specs),
            id=str(body.get("id", "")),
            ephemeral_gb=int(body.get("ephemeral", 0)),
            swap_mb=int(body.get("swap", 0)),
        )
    )


# -- hosts ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Inventory:
    total: int
    reserved: int
    allocation_ratio: float
    used: int


@dataclass(frozen=True, slots=True)
class HostView:
    """One compute host as the services, hypervisors and zones APIs show it."""

    id: int
    uuid: str
    name: str
    availability_zone: str
    hypervisor_type: str
    architecture: str
    topology: Mapping[str, Any]
    disabled: bool
    forced_down: bool
    last_seen: float | None
    up: bool
    disabled_reason: str | None
    inventories: Mapping[str, Inventory] = field(default_factory=dict)
    instance_ids: tuple[str, ...] = ()
    host_ip: str | None = None  # what the host's agent reported (Nova's my_ip)

    @property
    def service_id(self) -> int:
        return self.id + _COMPUTE_ID_OFFSET

    @property
    def service_uuid(self) -> str:
        return str(uuid.uuid5(uuid.NAMESPACE_URL, f"stowage-service:nova-compute:{self.name}"))

    def total(self, *classes: str) -> int:
        return sum(self.inventories[rc].total for rc in classes if rc in self.inventories)

    def used(self, *classes: str) -> int:
        """What claims use, plus what the host reserves for itself (as Nova counts it)."""
        return sum(
            self.inventories[rc].used + self.inventories[rc].reserved
            for rc in classes
            if rc in self.inventories
        )

    def cpu_info(self) -> dict[str, Any]:
        cells = self.topology.get("cells", [])
        cpus = sum(len(c.get("cpus", [])) for c in cells)
        # A CPU's siblings are listed without the CPU itself.
        threads = max((len(v) + 1 for v in self.topology.get("siblings", {}).values()), default=1)
        sockets = max(len(cells), 1)
        return {
            "arch": self.architecture,
            "model": "stowage-sim",
            "vendor": "Stowage",
            "topology": {
                "cells": len(cells),
                "sockets": sockets,
                "cores": max(cpus // (sockets * threads), 1),
                "threads": threads,
            },
            "features": [],
        }


def _service_doc_id(host_uuid: str) -> str:
    return host_uuid


def read_hosts(cloud: Cloud, names: Iterable[str] | None = None) -> list[HostView]:
    """Every compute host (or those named), in id order, with usage and liveness."""
    wanted = None if names is None else list(names)
    now = cloud.clock()
    down_after = cloud.config.service_down_time_s
    with cloud.ledger.engine.connect().execution_options(**READONLY) as conn, conn.begin():
        query = select(hosts).order_by(hosts.c.id)
        if wanted is not None:
            query = query.where(hosts.c.name.in_(wanted))
        rows = list(conn.execute(query))
        ids = [r.id for r in rows]
        inv: dict[int, dict[str, Inventory]] = defaultdict(dict)
        for item in conn.execute(select(inventories).where(inventories.c.host_id.in_(ids))):
            inv[item.host_id][item.resource_class] = Inventory(
                item.total, item.reserved, item.allocation_ratio, item.used
            )
        placed: dict[int, list[str]] = defaultdict(list)
        for host_id, instance_id in conn.execute(
            select(consumers.c.host_id, consumers.c.instance_id)
            .where(consumers.c.host_id.in_(ids), consumers.c.kind == "instance")
            .order_by(consumers.c.created_at)
        ):
            placed[host_id].append(instance_id)
    reasons = {
        doc.id: doc.body.get("disabled_reason")
        for doc in cloud.objects.list("service_state", ids=[r.uuid for r in rows])
    }
    addresses = {
        doc.id: doc.body.get("host_ip")
        for doc in cloud.objects.list("compute_node", ids=[r.name for r in rows])
    }
    out = []
    for row in rows:
        alive = row.last_seen is not None and now - row.last_seen <= down_after
        out.append(
            HostView(
                id=row.id,
                uuid=row.uuid,
                name=row.name,
                availability_zone=row.availability_zone,
                hypervisor_type=row.hypervisor_type,
                architecture=row.architecture,
                topology=json.loads(row.topology),
                disabled=bool(row.disabled),
                forced_down=bool(row.forced_down),
                last_seen=row.last_seen,
                up=alive and not row.forced_down,
                disabled_reason=reasons.get(_service_doc_id(row.uuid)),
                inventories=inv.get(row.id, {}),
                instance_ids=tuple(placed.get(row.id, ())),
                host_ip=addresses.get(row.name),
            )
        )
    return out


def record_host_ip(cloud: Cloud, host: str, host_ip: str) -> None:
    """The address a host's agent runs at (the ledger's hosts have no column for it, so it
    lives in a document beside the host, as Nova's compute node keeps `host_ip`)."""
    cloud.objects.put("compute_node", host, {"host_ip": host_ip})


def set_disabled_reason(cloud: Cloud, host: HostView, reason: str | None) -> None:
    """The ledger has no column for it, so the reason lives in a document beside the host."""
    cloud.objects.put("service_state", _service_doc_id(host.uuid), {"disabled_reason": reason})


def uptime_text(now: float) -> str:
    """`uptime`'s line, which the CLI parses into host time, uptime, users and load."""
    seconds = max(int(now - STARTED_AT), 0)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes = rest // 60
    clock = datetime.fromtimestamp(now, UTC).strftime("%H:%M:%S")
    day_word = "day" if days == 1 else "days"
    return (
        f" {clock} up {days} {day_word}, {hours:2d}:{minutes:02d},  1 user,  "
        "load average: 0.00, 0.00, 0.00"
    )


@dataclass(frozen=True, slots=True)
class ControlService:
    """The in-process scheduler and conductor, shown as Nova shows its control services."""

    id: int
    uuid: str
    binary: str
    host: str


def control_services() -> list[ControlService]:
    def make(service_id: int, binary: str) -> ControlService:
        ident = str(uuid.uuid5(uuid.NAMESPACE_URL, f"stowage-service:{binary}:controller"))
        return ControlService(service_id, ident, binary, "controller")

    return [make(_CONDUCTOR_ID, "nova-conductor"), make(_SCHEDULER_ID, "nova-scheduler")]


# -- aggregates and zones -------------------------------------------------------------------


def host_zones_from_aggregates(aggregates: Iterable[Mapping[str, Any]]) -> dict[str, set[str]]:
    """host -> the zones its aggregates give it (more than one is a conflict)."""
    zones: dict[str, set[str]] = defaultdict(set)
    for agg in aggregates:
        zone = agg.get("metadata", {}).get("availability_zone")
        if zone:
            for host in agg.get("hosts", []):
                zones[host].add(zone)
    return zones


def host_metadata_from_aggregates(
    aggregates: Iterable[Mapping[str, Any]],
) -> dict[str, dict[str, set[str]]]:
    """host -> key -> the values its aggregates' metadata give it (Nova's aggregate_values)."""
    out: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for agg in aggregates:
        for host in agg.get("hosts", []):
            for key, value in agg.get("metadata", {}).items():
                out[host][key].add(str(value))
    return out


def sync_host_zones(cloud: Cloud, names: Iterable[str]) -> None:
    """Set each named host's zone ("nova" when none) and aggregate metadata in the ledger from
    its aggregates, so the scheduler reads both with the host (a change row for each)."""
    wanted = sorted(set(names))
    if not wanted:
        return
    docs = [d.body for d in cloud.objects.list("aggregate")]
    zones = host_zones_from_aggregates(docs)
    metadata = host_metadata_from_aggregates(docs)
    for view in read_hosts(cloud, wanted):
        zone = min(zones.get(view.name, set()), default=DEFAULT_ZONE)
        cloud.ledger.set_host_state(
            view.name,
            availability_zone=zone if zone != view.availability_zone else None,
            aggregate_metadata=metadata.get(view.name, {}),
        )


# -- server groups --------------------------------------------------------------------------


def list_groups(cloud: Cloud, project_id: str | None) -> list[ServerGroup]:
    """Groups in creation order, of one project or (None) of all."""
    query = select(server_groups).order_by(server_groups.c.created_at, server_groups.c.id)
    if project_id is not None:
        query = query.where(server_groups.c.project_id == project_id)
    with cloud.ledger.engine.connect().execution_options(**READONLY) as conn:
        rows = list(conn.execute(query))
    return [
        ServerGroup(
            id=row.id,
            name=row.name,
            policy=GroupPolicy(row.policy),
            max_per_domain=row.max_per_domain,
            failure_domain=row.failure_domain,
            project_id=row.project_id,
            user_id=row.user_id,
            rules=json.loads(row.rules),
        )
        for row in rows
    ]


def group_members_of(cloud: Cloud, group_ids: Iterable[str]) -> dict[str, list[str]]:
    ids = list(group_ids)
    out: dict[str, list[str]] = {g: [] for g in ids}
    if not ids:
        return out
    with cloud.ledger.engine.connect().execution_options(**READONLY) as conn:
        # A deleted server's membership row outlives it in the ledger; Nova's list does not.
        alive = (
            select(objects.c.id)
            .where(objects.c.kind == "instance", objects.c.id == group_members.c.instance_id)
            .exists()
        )
        for group_id, instance_id in conn.execute(
            select(group_members.c.group_id, group_members.c.instance_id)
            .where(group_members.c.group_id.in_(ids), alive)
            .order_by(group_members.c.instance_id)
        ):
            out[group_id].append(instance_id)
    return out


def delete_group(cloud: Cloud, group_id: str) -> None:
    """Forget a group, its members and its anti-affinity slots in one transaction.

    The Ledger has no method for this yet; the hosts whose slots go are logged as changed
    so schedulers re-read them.
    """
    with cloud.ledger.engine.begin() as conn:
        slot_hosts = sorted(
            set(
                conn.execute(
                    select(group_slots.c.host_id).where(group_slots.c.group_id == group_id)
                ).scalars()
            )
        )
        conn.execute(delete(group_slots).where(group_slots.c.group_id == group_id))
        conn.execute(delete(group_members).where(group_members.c.group_id == group_id))
        gone = conn.execute(delete(server_groups).where(server_groups.c.id == group_id)).rowcount
        if not gone:
            raise NotFound(f"Instance group {group_id} could not be found.")
        now = cloud.clock()
        for host_id in slot_hosts:
            conn.execute(insert(changes), {"host_id": host_id, "at": now})


def count_groups(cloud: Cloud, project_id: str) -> int:
    with cloud.ledger.engine.connect().execution_options(**READONLY) as conn:
        return int(
            conn.execute(
                select(func.count())
                .select_from(server_groups)
                .where(server_groups.c.project_id == project_id)
            ).scalar_one()
        )


# -- quotas ---------------------------------------------------------------------------------


def default_quotas(cloud: Cloud) -> dict[str, int]:
    """Nova's defaults with the "default" quota class's overrides (os-quota-class-sets); with
    the unified limits driver, the registered limits (services/identity_limits.py)."""
    if identity_limits.uses_unified_limits(cloud):
        with cloud.ledger.engine.connect().execution_options(**READONLY) as conn:
            return identity_limits.compute_limits_in(
                conn, cloud.config.region, None, DEFAULT_QUOTAS
            )
    limits = dict(DEFAULT_QUOTAS)
    doc = cloud.objects.find("quota_class", "default")
    if doc is not None:
        limits.update({k: int(v) for k, v in doc.body.items() if k in DEFAULT_QUOTAS})
    return limits


def quota_key(project_id: str, user_id: str | None = None) -> str:
    """The id of a quota override document: the project's, or one user's in it."""
    return f"{project_id}/{user_id}" if user_id else project_id


def quota_limits(cloud: Cloud, project_id: str, user_id: str | None = None) -> dict[str, int]:
    """The project's limits: the defaults with its overrides (documents of kind "quota"), then
    a user's own overrides when `user_id` is given. With the unified limits driver: the
    project's unified limits, else the registered defaults (per-user limits do not exist)."""
    if identity_limits.uses_unified_limits(cloud):
        with cloud.ledger.engine.connect().execution_options(**READONLY) as conn:
            return identity_limits.compute_limits_in(
                conn, cloud.config.region, project_id, DEFAULT_QUOTAS
            )
    limits = default_quotas(cloud)
    keys = [quota_key(project_id)] + ([quota_key(project_id, user_id)] if user_id else [])
    for key in keys:
        doc = cloud.objects.find("quota", key)
        if doc is not None:
            limits.update({k: int(v) for k, v in doc.body.items() if k in DEFAULT_QUOTAS})
    return limits


def _live_instances(cloud: Cloud, project_id: str) -> list[Document]:
    return [
        doc
        for doc in cloud.objects.list("instance", project_id=project_id)
        if not doc.body.get("deleted") and str(doc.body.get("status", "")).upper() != "DELETED"
    ]


def quota_usage(cloud: Cloud, project_id: str, user_id: str | None = None) -> dict[str, int]:
    """What the project uses now; key pairs are counted for `user_id` (Nova counts per user)."""
    used = dict.fromkeys(DEFAULT_QUOTAS, 0)
    for doc in _live_instances(cloud, project_id):
        flavor = doc.body.get("flavor") or {}
        used["instances"] += 1
        used["cores"] += int(flavor.get("vcpus", 0) or 0)
        used["ram"] += int(flavor.get("ram", 0) or 0)
    used["server_groups"] = count_groups(cloud, project_id)
    if user_id is not None:
        used["key_pairs"] = sum(
            1 for d in cloud.objects.list("keypair") if d.body.get("user_id") == user_id
        )
    return used
