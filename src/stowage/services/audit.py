"""The whole cloud's audit: the ledger's invariants, and what the layer above it can drift in.

Beyond `ledger.audit` (pCPUs, usage, cells, orphans, groups), it checks the documents against
the claims (each instance's host and flavor against its consumer), moves against their
owners (a migration that is not over has an operation driving it), operations against their
conductors (none left undriven past `stale_after_s`), and quotas against what is counted.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from sqlalchemy import Connection, select

from stowage.domain.topology import ResourceClass
from stowage.ledger.audit import Violation, audit
from stowage.ledger.db import READONLY
from stowage.ledger.ledger import Ledger
from stowage.ledger.operations import ACTIVE_STATES
from stowage.ledger.schema import allocations, consumers, hosts, objects, operations
from stowage.services.compute_catalog import DEFAULT_QUOTAS

__all__ = ["audit_cloud"]

# Migration statuses that hold nothing, and `finished`, which waits for its owner's confirm.
_RESTING = frozenset({"completed", "confirmed", "reverted", "failed", "cancelled", "done"})
_WAITING_FOR_USER = frozenset({"finished"})
_COUNTED = ("instances", "cores", "ram")


def audit_cloud(
    ledger: Ledger,
    *,
    stale_after_s: float = 300.0,
    clock: Callable[[], float] = time.time,
) -> list[Violation]:
    """Every broken invariant of the ledger and of the documents over it."""
    found = audit(ledger)
    with ledger.engine.connect().execution_options(**READONLY) as conn, conn.begin():
        docs = _documents(conn)
        if not docs["domain"]:
            # A bare ledger (claims with no cloud over them: the placement benchmark, a
            # scheduler of one's own) has no documents to hold them against.
            return found
        found += _instances_against_claims(conn, docs)
        found += _consumers_against_documents(conn, docs)
        found += _migrations_against_operations(conn, docs)
        found += _operations_against_conductors(conn, clock(), stale_after_s)
        found += _quotas(docs)
    return found


def _documents(conn: Connection) -> dict[str, dict[str, dict[str, Any]]]:
    out: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    rows = conn.execute(
        select(objects.c.kind, objects.c.id, objects.c.body).where(
            objects.c.kind.in_(("domain", "instance", "migration", "quota", "quota_class"))
        )
    )
    for kind, doc_id, body in rows:
        out[kind][doc_id] = json.loads(body)
    return out


def _instances_against_claims(
    conn: Connection, docs: dict[str, dict[str, dict[str, Any]]]
) -> list[Violation]:
    names = {row.id: row.name for row in conn.execute(select(hosts.c.id, hosts.c.name))}
    placed = {
        row.id: row.host_id
        for row in conn.execute(
            select(consumers.c.id, consumers.c.host_id).where(consumers.c.kind == "instance")
        )
    }
    amounts: dict[str, dict[str, int]] = defaultdict(dict)
    for consumer_id, resource, amount in conn.execute(
        select(consumers.c.id, allocations.c.resource_class, allocations.c.amount).select_from(
            allocations.join(consumers, consumers.c.seq == allocations.c.consumer_seq)
        )
    ):
        amounts[consumer_id][resource] = amounts[consumer_id].get(resource, 0) + int(amount)
    found = []
    for instance_id, body in docs["instance"].items():
        host = body.get("host")
        held = names.get(placed[instance_id]) if placed.get(instance_id) is not None else None
        if host and held != host and body.get("task_state") != "scheduling":
            found.append(
                Violation(
                    "instance_claim",
                    f"instance {instance_id} shows host {host} but the ledger places it on "
                    f"{held or 'no host'}",
                )
            )
            continue
        if not host and held is not None:
            found.append(
                Violation(
                    "instance_claim",
                    f"instance {instance_id} shows no host but holds claims on {held}",
                )
            )
            continue
        if held is None:
            continue
        flavor = body.get("flavor") or {}
        have = amounts.get(instance_id, {})
        cpus = have.get(ResourceClass.VCPU.value, 0) + have.get(ResourceClass.PCPU.value, 0)
        memory = have.get(ResourceClass.MEMORY_MB.value, 0)
        if cpus != int(flavor.get("vcpus", 0)) or memory != int(flavor.get("ram", 0)):
            found.append(
                Violation(
                    "instance_claim",
                    f"instance {instance_id} of flavor {flavor.get('name')} "
                    f"({flavor.get('vcpus')} vCPU, {flavor.get('ram')} MB) holds {cpus} CPU "
                    f"and {memory} MB",
                )
            )
    return found


def _consumers_against_documents(
    conn: Connection, docs: dict[str, dict[str, dict[str, Any]]]
) -> list[Violation]:
    found = []
    rows = conn.execute(
        select(consumers.c.id, consumers.c.kind, consumers.c.host_id).where(
            consumers.c.host_id.is_not(None)
        )
    )
    for consumer_id, kind, _host in rows:
        if kind == "instance" and consumer_id not in docs["instance"]:
            found.append(
                Violation("orphan_claim", f"instance {consumer_id} is deleted but holds claims")
            )
        elif kind == "migration":
            record = docs["migration"].get(consumer_id)
            if record is None or record.get("status") in _RESTING:
                status = "gone" if record is None else record.get("status")
                found.append(
                    Violation(
                        "orphan_claim",
                        f"migration {consumer_id} ({status}) still holds its destination",
                    )
                )
    return found


def _migrations_against_operations(
    conn: Connection, docs: dict[str, dict[str, dict[str, Any]]]
) -> list[Violation]:
    driven = set(
        conn.execute(
            select(operations.c.migration_id).where(
                operations.c.state.in_(ACTIVE_STATES), operations.c.migration_id.is_not(None)
            )
        ).scalars()
    )
    return [
        Violation(
            "unowned_migration",
            f"migration {migration_id} of instance {record.get('instance_uuid')} rests in "
            f"{record.get('status')} with no operation to end it",
        )
        for migration_id, record in docs["migration"].items()
        if record.get("status") not in _RESTING | _WAITING_FOR_USER and migration_id not in driven
    ]


def _operations_against_conductors(
    conn: Connection, now: float, stale_after_s: float
) -> list[Violation]:
    found = []
    rows = conn.execute(
        select(
            operations.c.id,
            operations.c.kind,
            operations.c.step,
            operations.c.owner,
            operations.c.lease_until,
            operations.c.next_at,
        ).where(operations.c.state.in_(ACTIVE_STATES))
    )
    for op_id, kind, step, owner, lease_until, next_at in rows:
        held = owner is not None and lease_until is not None and lease_until >= now
        if not held and now - float(next_at) > stale_after_s:
            found.append(
                Violation(
                    "undriven_operation",
                    f"operation {op_id} ({kind}/{step}) has waited {now - float(next_at):.0f} s "
                    f"with no conductor holding it"
                    + (f" (its lease of {owner} ran out)" if owner else ""),
                )
            )
    return found


def _quotas(docs: dict[str, dict[str, dict[str, Any]]]) -> list[Violation]:
    defaults = dict(DEFAULT_QUOTAS)
    defaults.update(
        {k: int(v) for k, v in docs["quota_class"].get("default", {}).items() if k in defaults}
    )
    used: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(_COUNTED, 0))
    for body in docs["instance"].values():
        flavor = body.get("flavor") or {}
        counts = used[str(body.get("project_id"))]
        counts["instances"] += 1
        counts["cores"] += int(flavor.get("vcpus", 0) or 0)
        counts["ram"] += int(flavor.get("ram", 0) or 0)
    found = []
    for project, counts in sorted(used.items()):
        limits = dict(defaults)
        override = docs["quota"].get(project, {})
        limits.update({k: int(v) for k, v in override.items() if k in limits})
        for resource in _COUNTED:
            if 0 <= limits[resource] < counts[resource]:
                found.append(
                    Violation(
                        "quota",
                        f"project {project} uses {counts[resource]} {resource}, its quota is "
                        f"{limits[resource]}",
                    )
                )
    return found
