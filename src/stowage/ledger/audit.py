"""Invariant checks over a whole ledger, written independently of the keys that enforce them."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass

from sqlalchemy import Connection, func, select

from stowage.domain.groups import GroupPolicy
from stowage.ledger.db import READONLY
from stowage.ledger.ledger import Ledger
from stowage.ledger.schema import (
    allocations,
    cells,
    consumers,
    consumers_of_instance,
    group_members,
    group_slots,
    hosts,
    inventories,
    numa_claims,
    pcpus,
    pins,
    server_groups,
    storage_pools,
    volume_claims,
)

__all__ = ["Violation", "audit"]


@dataclass(frozen=True, slots=True)
class Violation:
    check: str
    detail: str

    def __str__(self) -> str:
        return f"[{self.check}] {self.detail}"


def audit(ledger: Ledger) -> list[Violation]:
    """Every broken invariant found, or an empty list when the ledger is consistent."""
    with ledger.engine.connect().execution_options(**READONLY) as conn, conn.begin():
        names = {row.id: row.name for row in conn.execute(select(hosts.c.id, hosts.c.name))}
        found: list[Violation] = []
        found += _pcpus(conn, names)
        found += _usage(conn, names)
        found += _cells(conn, names)
        found += _orphans(conn)
        found += _groups(conn, names)
        found += _storage(conn)
    return found


def _pcpus(conn: Connection, names: dict[int, str]) -> list[Violation]:
    out = []
    dup = conn.execute(
        select(pins.c.host_id, pins.c.cpu_id, func.count())
        .group_by(pins.c.host_id, pins.c.cpu_id)
        .having(func.count() > 1)
    )
    for host_id, cpu, count in dup:
        out.append(
            Violation("pcpu.double_pin", f"{names.get(host_id)} pCPU {cpu} held {count} times")
        )
    not_dedicated = conn.execute(
        select(pins.c.host_id, pins.c.cpu_id, consumers.c.id)
        .select_from(
            pins.outerjoin(
                pcpus, (pcpus.c.host_id == pins.c.host_id) & (pcpus.c.cpu_id == pins.c.cpu_id)
            ).join(consumers, consumers.c.seq == pins.c.consumer_seq)
        )
        .where((pcpus.c.cpu_id.is_(None)) | (pcpus.c.dedicated.is_(False)))
    )
    for host_id, cpu, consumer in not_dedicated:
        out.append(
            Violation(
                "pcpu.not_dedicated",
                f"{names.get(host_id)} pCPU {cpu} pinned by {consumer} is not in cpu_dedicated_set",
            )
        )
    pcpu_alloc = {
        (c, h): a
        for c, h, a in conn.execute(
            select(consumers.c.id, allocations.c.host_id, allocations.c.amount)
            .select_from(allocations.join(consumers, consumers.c.seq == allocations.c.consumer_seq))
            .where(allocations.c.resource_class == "PCPU")
        )
    }
    pin_counts = {
        (c, h): n
        for c, h, n in conn.execute(
            select(consumers.c.id, pins.c.host_id, func.count())
            .select_from(pins.join(consumers, consumers.c.seq == pins.c.consumer_seq))
            .group_by(consumers.c.id, pins.c.host_id)
        )
    }
    for key in sorted(set(pcpu_alloc) | set(pin_counts)):
        if pcpu_alloc.get(key, 0) != pin_counts.get(key, 0):
            consumer, host_id = key
            out.append(
                Violation(
                    "pcpu.claim_mismatch",
                    f"{consumer} on {names.get(host_id)}: PCPU allocation "
                    f"{pcpu_alloc.get(key, 0)} but {pin_counts.get(key, 0)} pinned pCPUs",
                )
            )
    return out


def _usage(conn: Connection, names: dict[int, str]) -> list[Violation]:
    out = []
    sums = {
        (h, rc): int(total)
        for h, rc, total in conn.execute(
            select(
                allocations.c.host_id, allocations.c.resource_class, func.sum(allocations.c.amount)
            ).group_by(allocations.c.host_id, allocations.c.resource_class)
        )
    }
    for row in conn.execute(select(inventories)):
        key = (row.host_id, row.resource_class)
        claimed = sums.pop(key, 0)
        host = names.get(row.host_id)
        if row.used != claimed:
            out.append(
                Violation(
                    "usage.mismatch",
                    f"{host} {row.resource_class}: usage {row.used}, claims add up to {claimed}",
                )
            )
        limit = (row.total - row.reserved) * row.allocation_ratio
        if claimed > limit:
            out.append(
                Violation(
                    "usage.over_capacity",
                    f"{host} {row.resource_class}: claims {claimed} exceed capacity {limit:g}",
                )
            )
    for (host_id, rc), claimed in sorted(sums.items()):
        out.append(
            Violation(
                "usage.no_inventory", f"{names.get(host_id)} {rc}: {claimed} claimed, no inventory"
            )
        )
    return out


def _cells(conn: Connection, names: dict[int, str]) -> list[Violation]:
    out = []
    sums = {
        (h, c): int(m)
        for h, c, m in conn.execute(
            select(
                numa_claims.c.host_id, numa_claims.c.cell_id, func.sum(numa_claims.c.memory_mb)
            ).group_by(numa_claims.c.host_id, numa_claims.c.cell_id)
        )
    }
    for row in conn.execute(select(cells)):
        claimed = sums.get((row.host_id, row.cell_id), 0)
        host = names.get(row.host_id)
        if row.memory_mb_used != claimed:
            out.append(
                Violation(
                    "numa.memory_mismatch",
                    f"{host} cell {row.cell_id}: usage {row.memory_mb_used} MB, "
                    f"claims add up to {claimed} MB",
                )
            )
        if claimed > row.memory_mb:
            out.append(
                Violation(
                    "numa.memory_over",
                    f"{host} cell {row.cell_id}: {claimed} MB claimed of {row.memory_mb} MB",
                )
            )
    return out


def _orphans(conn: Connection) -> list[Violation]:
    out = []
    live = select(consumers.c.seq)
    for table, what in (
        (allocations, "allocation"),
        (numa_claims, "NUMA claim"),
        (pins, "pin"),
        (group_slots, "group slot"),
    ):
        rows = conn.execute(
            select(table.c.consumer_seq).distinct().where(table.c.consumer_seq.not_in(live))
        ).scalars()
        out += [Violation("claim.orphan", f"{what} held by unknown consumer key {c}") for c in rows]
    misplaced = conn.execute(
        select(consumers.c.id, allocations.c.host_id, consumers.c.host_id)
        .select_from(allocations.join(consumers, consumers.c.seq == allocations.c.consumer_seq))
        .where((consumers.c.host_id.is_(None)) | (consumers.c.host_id != allocations.c.host_id))
        .distinct()
    )
    for consumer, held_on, placed_on in misplaced:
        out.append(
            Violation(
                "claim.host_mismatch",
                f"consumer {consumer} holds claims on host {held_on} but is placed on {placed_on}",
            )
        )
    return out


def _groups(conn: Connection, names: dict[int, str]) -> list[Violation]:
    """Recount every strict group from where its members' consumers actually are."""
    out = []
    groups = {row.id: row for row in conn.execute(select(server_groups))}
    placed: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for group_id, consumer_id, host_id in conn.execute(
        select(group_members.c.group_id, consumers.c.id, consumers.c.host_id)
        .select_from(
            group_members.join(consumers, consumers_of_instance(group_members.c.instance_id))
        )
        .where(consumers.c.host_id.is_not(None))
    ):
        placed[group_id].append((consumer_id, host_id))
    labels = {row.id: row.labels for row in conn.execute(select(hosts.c.id, hosts.c.labels))}
    for group_id, members in sorted(placed.items()):
        group = groups.get(group_id)
        if group is None:
            continue
        policy = GroupPolicy(group.policy)
        if policy is GroupPolicy.AFFINITY:
            on = sorted({names.get(h, str(h)) for _, h in members})
            if len(on) > 1:
                out.append(
                    Violation("group.affinity", f"group {group.name} ({group_id}) spans {on}")
                )
        elif policy is GroupPolicy.ANTI_AFFINITY:
            counts: dict[str, int] = defaultdict(int)
            for _, host_id in members:
                if group.failure_domain == "host":
                    counts[f"host={names.get(host_id)}"] += 1
                else:
                    value = json.loads(labels[host_id]).get(group.failure_domain)
                    counts[f"{group.failure_domain}={value}"] += 1
            for domain, n in sorted(counts.items()):
                if n > group.max_per_domain:
                    out.append(
                        Violation(
                            "group.anti_affinity",
                            f"group {group.name} ({group_id}): {n} members on {domain}, "
                            f"at most {group.max_per_domain} allowed",
                        )
                    )
    return out


def _storage(conn: Connection) -> list[Violation]:
    """Each storage pool's usage equals its volume and snapshot claims, within capacity."""
    out = []
    sums = {
        pool_id: int(total)
        for pool_id, total in conn.execute(
            select(volume_claims.c.pool_id, func.sum(volume_claims.c.gigabytes)).group_by(
                volume_claims.c.pool_id
            )
        )
    }
    for row in conn.execute(select(storage_pools)):
        claimed = sums.get(row.id, 0)
        if row.used_gb != claimed:
            out.append(
                Violation(
                    "storage.mismatch",
                    f"pool {row.name}: usage {row.used_gb} GB, claims add up to {claimed} GB",
                )
            )
        limit = (row.total_gb - row.reserved_gb) * row.allocation_ratio
        if claimed > limit:
            out.append(
                Violation(
                    "storage.over_capacity",
                    f"pool {row.name}: claims {claimed} GB exceed capacity {limit:g} GB",
                )
            )
    return out
