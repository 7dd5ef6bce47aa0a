"""Read models for the dashboard and `stowage status`: hosts down to each pCPU, servers with
their claims, groups, moves in flight, and a cheap marker of what changed. Reads only."""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import func, select

from stowage.ledger.db import READONLY
from stowage.ledger.objects import Document
from stowage.ledger.schema import (
    cells,
    changes,
    consumer_key,
    consumers,
    consumers_of_instance,
    group_slots,
    hosts,
    numa_claims,
    objects,
    operations,
    pins,
)
from stowage.services.cloud import Cloud
from stowage.services.compute_catalog import (
    HostView,
    group_members_of,
    list_groups,
    read_hosts,
)
from stowage.services.migrations import ENDED

__all__ = [
    "CellView",
    "CloudStatus",
    "CpuView",
    "GroupView",
    "HostCard",
    "ServerClaim",
    "change_marker",
    "cloud_status",
    "heartbeat_ages",
    "host_cards",
    "host_labels",
    "migrations_in_flight",
    "server_claim",
    "server_groups",
    "servers",
]

# An operation this many attempts in, or this long without a step, counts as stuck.
STUCK_ATTEMPTS_MIN = 5
STUCK_AGE_S = 300.0


@dataclass(frozen=True, slots=True)
class CpuView:
    """One pCPU: dedicated (pinnable) or shared, and which guest holds it."""

    id: int
    dedicated: bool
    instance_id: str | None = None  # the guest pinned here (a migration's: the migrating one)
    migration_id: str | None = None  # set when the pin is a move's destination claim
    withheld: bool = False  # a sibling kept idle by the isolate thread policy


@dataclass(frozen=True, slots=True)
class CellView:
    id: int
    memory_mb: int
    memory_mb_used: int
    cores: tuple[tuple[CpuView, ...], ...]  # each core's thread siblings, side by side


@dataclass(frozen=True, slots=True)
class HostCard:
    host: HostView
    state: str  # up, down, forced down
    heartbeat_age_s: float | None
    cells: tuple[CellView, ...]
    shared_cpus: tuple[int, ...]
    shared_vcpus_used: int
    shared_vcpus_total: int

    @property
    def pcpus_free(self) -> int:
        return sum(
            1
            for cell in self.cells
            for core in cell.cores
            for cpu in core
            if cpu.dedicated and cpu.instance_id is None
        )

    @property
    def pcpus_total(self) -> int:
        return sum(1 for cell in self.cells for core in cell.cores for cpu in core if cpu.dedicated)

    @property
    def shared_load(self) -> float:
        """Shared vCPUs placed per shared pCPU (above 1.0: overcommitted)."""
        return self.shared_vcpus_used / len(self.shared_cpus) if self.shared_cpus else 0.0


def change_marker(cloud: Cloud) -> str:
    """What a page polls: it changes when a claim or a release commits (the ledger's change
    log), when an operation in flight takes a step, when a migration records progress, and
    when a host's service goes up or down. Aggregates over indexed or small tables."""
    down_before = cloud.clock() - cloud.config.service_down_time_s
    with cloud.ledger.engine.connect().execution_options(**READONLY) as conn, conn.begin():
        seq = conn.execute(select(func.coalesce(func.max(changes.c.seq), 0))).scalar_one()
        active = conn.execute(
            select(func.count(), func.max(operations.c.updated_at)).where(
                operations.c.state.in_(("pending", "unknown"))
            )
        ).one()
        moved = conn.execute(
            select(func.count(), func.max(objects.c.updated_at)).where(
                objects.c.kind == "migration"
            )
        ).one()
        services = conn.execute(
            select(hosts.c.id, hosts.c.forced_down, hosts.c.disabled, hosts.c.last_seen)
        ).all()
    states = "".join(
        f"{'f' if forced else ''}{'d' if disabled else ''}"
        f"{'u' if seen is not None and seen >= down_before else 'x'}"
        for _, forced, disabled, seen in sorted(services)
    )
    digest = hashlib.sha256(states.encode()).hexdigest()[:12]
    return f"{seq}.{active[0]}.{active[1] or 0}.{moved[0]}.{moved[1] or 0}.{digest}"


def host_cards(cloud: Cloud) -> list[HostCard]:
    """Every host with its cells, cores and pCPUs, who holds each, and its service state."""
    views = read_hosts(cloud)
    now = cloud.clock()
    with cloud.ledger.engine.connect().execution_options(**READONLY) as conn, conn.begin():
        held: dict[tuple[int, int], tuple[str, str, str, bool]] = {}
        for host_id, cpu_id, consumer_id, kind, instance_id, vcpu in conn.execute(
            select(
                pins.c.host_id,
                pins.c.cpu_id,
                consumers.c.id,
                consumers.c.kind,
                consumers.c.instance_id,
                pins.c.guest_vcpu,
            ).select_from(pins.join(consumers, consumers.c.seq == pins.c.consumer_seq))
        ):
            held[(host_id, cpu_id)] = (consumer_id, kind, instance_id, vcpu is None)
        memory: dict[tuple[int, int], tuple[int, int]] = {
            (row.host_id, row.cell_id): (row.memory_mb, row.memory_mb_used)
            for row in conn.execute(select(cells))
        }
    return [_card(view, now, held, memory) for view in views]


def _card(
    view: HostView,
    now: float,
    held: Mapping[tuple[int, int], tuple[str, str, str, bool]],
    memory: Mapping[tuple[int, int], tuple[int, int]],
) -> HostCard:
    topo = view.topology
    siblings = {int(k): set(v) for k, v in topo.get("siblings", {}).items()}
    dedicated = set(topo.get("dedicated", []))
    out_cells = []
    for cell in topo.get("cells", []):
        seen: set[int] = set()
        cores = []
        for cpu in sorted(cell["cpus"]):
            if cpu in seen:
                continue
            core = sorted({cpu} | siblings.get(cpu, set()))
            seen.update(core)
            cores.append(tuple(_cpu(view.id, c, c in dedicated, held) for c in core))
        total, used = memory.get((view.id, cell["id"]), (int(cell.get("memory_mb", 0)), 0))
        out_cells.append(CellView(cell["id"], total, used, tuple(cores)))
    state = "forced down" if view.forced_down else "up" if view.up else "down"
    vcpu = view.inventories.get("VCPU")
    return HostCard(
        host=view,
        state=state,
        heartbeat_age_s=None if view.last_seen is None else max(0.0, now - view.last_seen),
        cells=tuple(out_cells),
        shared_cpus=tuple(sorted(topo.get("shared", []))),
        shared_vcpus_used=vcpu.used if vcpu else 0,
        shared_vcpus_total=int((vcpu.total - vcpu.reserved) * vcpu.allocation_ratio) if vcpu else 0,
    )


def _cpu(
    host_id: int,
    cpu: int,
    dedicated: bool,
    held: Mapping[tuple[int, int], tuple[str, str, str, bool]],
) -> CpuView:
    owner = held.get((host_id, cpu))
    if owner is None:
        return CpuView(cpu, dedicated)
    consumer_id, kind, instance_id, withheld = owner
    migration_id = consumer_id if kind == "migration" else None
    return CpuView(cpu, dedicated, instance_id, migration_id, withheld)


def heartbeat_ages(cloud: Cloud, names: Sequence[str] | None = None) -> dict[str, float | None]:
    """Seconds since each host's (or each named host's) last heartbeat; None for never."""
    now = cloud.clock()
    query = select(hosts.c.name, hosts.c.last_seen)
    if names is not None:
        query = query.where(hosts.c.name.in_(list(names)))
    with cloud.ledger.engine.connect().execution_options(**READONLY) as conn:
        rows = conn.execute(query).all()
    return {name: None if seen is None else max(0.0, now - seen) for name, seen in rows}


# -- servers -------------------------------------------------------------------------------


def servers(
    cloud: Cloud,
    project_id: str | None,
    *,
    name: str = "",
    status: str = "",
    host: str = "",
) -> list[Document]:
    """Instance documents of one project (None: every project), filtered as the server list
    filters: `name` as a substring, `status` and `host` exactly; newest first."""
    docs = cloud.objects.list("instance", project_id=project_id)
    out = []
    for doc in docs:
        body = doc.body
        if name and name.lower() not in str(body.get("name", "")).lower():
            continue
        if status and str(body.get("status", "")).upper() != status.upper():
            continue
        if host and body.get("host") != host:
            continue
        out.append(doc)
    return sorted(out, key=lambda d: (-d.created_at, d.id))


@dataclass(frozen=True, slots=True)
class ServerClaim:
    """What the ledger holds for one instance: host, NUMA cells, pins, group slot, and any
    move's destination claim beside it."""

    host: str | None
    cells: tuple[tuple[int, int, int], ...]  # (host cell, guest cell, memory MiB)
    pins: tuple[tuple[int, int], ...]  # (guest vCPU, pCPU)
    slots: tuple[tuple[str, str, int], ...]  # (group id, failure domain, slot)
    incoming: tuple[tuple[str, str, tuple[int, ...]], ...] = ()  # (migration, host, pCPUs)
    actions: tuple[Mapping[str, Any], ...] = ()
    migrations: tuple[Document, ...] = ()


def server_claim(cloud: Cloud, instance_id: str) -> ServerClaim:
    names = {h.id: h.name for h in read_hosts(cloud)}
    with cloud.ledger.engine.connect().execution_options(**READONLY) as conn, conn.begin():
        rows = conn.execute(
            select(consumers.c.id, consumers.c.seq, consumers.c.kind, consumers.c.host_id).where(
                consumers_of_instance(instance_id)
            )
        ).all()
        own = next((r for r in rows if r.kind == "instance"), None)
        cell_rows = conn.execute(
            select(numa_claims.c.cell_id, numa_claims.c.guest_cell, numa_claims.c.memory_mb)
            .where(numa_claims.c.consumer_seq == consumer_key(instance_id))
            .order_by(numa_claims.c.guest_cell)
        ).all()
        pin_rows = conn.execute(
            select(pins.c.guest_vcpu, pins.c.cpu_id)
            .where(pins.c.consumer_seq == consumer_key(instance_id), pins.c.guest_vcpu.is_not(None))
            .order_by(pins.c.guest_vcpu)
        ).all()
        slot_rows = conn.execute(
            select(group_slots.c.group_id, group_slots.c.domain, group_slots.c.slot).where(
                group_slots.c.consumer_seq == consumer_key(instance_id)
            )
        ).all()
        incoming = []
        for row in rows:
            if row.kind != "migration" or row.host_id is None:
                continue
            cpus = conn.execute(
                select(pins.c.cpu_id).where(pins.c.consumer_seq == row.seq).order_by(pins.c.cpu_id)
            ).scalars()
            incoming.append((row.id, names.get(row.host_id, "?"), tuple(cpus)))
    actions = sorted(
        (d.body for d in cloud.objects.list("instance_action", project_id=instance_id)),
        key=lambda b: float(b.get("start_time") or 0),
        reverse=True,
    )
    moves = sorted(
        (d for d in cloud.objects.list("migration") if d.body.get("instance_uuid") == instance_id),
        key=lambda d: -d.created_at,
    )
    host = names.get(own.host_id) if own is not None and own.host_id is not None else None
    return ServerClaim(
        host=host,
        cells=tuple((int(a), int(b), int(c)) for a, b, c in cell_rows),
        pins=tuple((int(v), int(c)) for v, c in pin_rows),
        slots=tuple((str(g), str(d), int(s)) for g, d, s in slot_rows),
        incoming=tuple(incoming),
        actions=tuple(actions),
        migrations=tuple(moves),
    )


# -- groups and moves ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GroupView:
    id: str
    name: str
    policy: str
    rules: Mapping[str, object]
    failure_domain: str
    max_per_domain: int
    members_by_domain: Mapping[str, tuple[str, ...]]  # domain ("host=h1") -> instance ids
    unplaced: tuple[str, ...]
    free: tuple[tuple[str, int], ...] = field(default=())  # domain -> members it can still take


def server_groups(cloud: Cloud, project_id: str | None) -> list[GroupView]:
    """Groups (of one project, or all) with their members per failure domain, and for
    anti-affinity the room left per domain."""
    groups = list_groups(cloud, project_id)
    members = group_members_of(cloud, [g.id for g in groups])
    labels = host_labels(cloud)
    where = _instance_hosts(cloud, [i for ids in members.values() for i in ids])
    out = []
    for group in groups:
        by_domain: dict[str, list[str]] = defaultdict(list)
        unplaced = []
        for instance_id in members.get(group.id, []):
            host = where.get(instance_id)
            if host is None:
                unplaced.append(instance_id)
                continue
            by_domain[_domain_of(group.failure_domain, host, labels.get(host, {}))].append(
                instance_id
            )
        free: list[tuple[str, int]] = []
        if group.policy.value == "anti-affinity":
            domains = sorted({_domain_of(group.failure_domain, h, labels[h]) for h in labels})
            free = [(d, max(0, group.max_per_domain - len(by_domain.get(d, [])))) for d in domains]
        out.append(
            GroupView(
                id=group.id,
                name=group.name,
                policy=group.policy.value,
                rules=dict(group.rules),
                failure_domain=group.failure_domain,
                max_per_domain=group.max_per_domain,
                members_by_domain={d: tuple(v) for d, v in sorted(by_domain.items())},
                unplaced=tuple(unplaced),
                free=tuple(free),
            )
        )
    return out


def host_labels(cloud: Cloud) -> dict[str, dict[str, str]]:
    """Each host's labels (rack, ...), by host name."""
    with cloud.ledger.engine.connect().execution_options(**READONLY) as conn:
        rows = conn.execute(select(hosts.c.name, hosts.c.labels)).all()
    return {name: dict(json.loads(text or "{}")) for name, text in rows}


def _domain_of(failure_domain: str, host: str, labels: Mapping[str, str]) -> str:
    if failure_domain == "host":
        return f"host={host}"
    return f"{failure_domain}={labels.get(failure_domain, '?')}"


def _instance_hosts(cloud: Cloud, instance_ids: Sequence[str]) -> dict[str, str]:
    if not instance_ids:
        return {}
    docs = cloud.objects.list("instance", ids=list(instance_ids))
    return {d.id: str(d.body["host"]) for d in docs if d.body.get("host")}


def migrations_in_flight(cloud: Cloud, project_id: str | None) -> list[Document]:
    """Moves not yet ended (of one project, or all), newest first, with their progress."""
    docs = [
        d
        for d in cloud.objects.list("migration")
        if d.body.get("status") not in ENDED
        and (project_id is None or d.body.get("project_id") == project_id)
    ]
    return sorted(docs, key=lambda d: -d.created_at)


def progress_percent(body: Mapping[str, Any]) -> int | None:
    """A live migration's memory copy, in percent, when the hypervisor reported it."""
    total = int(body.get("memory_total_bytes") or 0)
    if total <= 0:
        return None
    return min(100, int(100 * int(body.get("memory_processed_bytes") or 0) / total))


# -- the one-screen summary -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CloudStatus:
    hosts: tuple[HostCard, ...]
    ops_in_flight: Mapping[str, int]  # kind -> count
    stuck: tuple[Mapping[str, Any], ...]
    failed: tuple[Mapping[str, Any], ...]

    @property
    def hosts_up(self) -> int:
        return sum(1 for card in self.hosts if card.state == "up")

    @property
    def pcpus_free(self) -> int:
        return sum(card.pcpus_free for card in self.hosts)


def cloud_status(cloud: Cloud, *, failed_max: int = 10) -> CloudStatus:
    """Hosts up and down, free pCPUs, operations in flight, stuck ones and the latest failed."""
    now = cloud.clock()
    with cloud.ledger.engine.connect().execution_options(**READONLY) as conn, conn.begin():
        active = conn.execute(
            select(operations).where(operations.c.state.in_(("pending", "unknown")))
        ).all()
        failed = conn.execute(
            select(operations)
            .where(operations.c.state == "failed")
            .order_by(operations.c.updated_at.desc())
            .limit(failed_max)
        ).all()
    in_flight: dict[str, int] = defaultdict(int)
    stuck = []
    for row in active:
        in_flight[row.kind] += 1
        if row.attempts >= STUCK_ATTEMPTS_MIN or now - row.updated_at >= STUCK_AGE_S:
            stuck.append(_op_summary(row, now))
    return CloudStatus(
        hosts=tuple(host_cards(cloud)),
        ops_in_flight=dict(sorted(in_flight.items())),
        stuck=tuple(stuck),
        failed=tuple(_op_summary(row, now) for row in failed),
    )


def _op_summary(row: Any, now: float) -> dict[str, Any]:
    result = json.loads(row.result) if row.result else {}
    return {
        "id": row.id,
        "kind": row.kind,
        "instance_id": row.instance_id,
        "host": row.host,
        "state": row.state,
        "step": row.step,
        "attempts": row.attempts,
        "age_s": round(now - row.updated_at, 1),
        "error": str(result.get("error", "")) if isinstance(result, dict) else str(result),
    }
