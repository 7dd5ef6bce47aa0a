"""The ledger: hosts, groups and claims, each change one transaction the database guards."""

from __future__ import annotations

import json
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import Connection, Engine, delete, func, insert, select, update
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError

from stowage.domain.claims import Claim, ClaimOutcome, ConsumerKind, RefusalCode
from stowage.domain.errors import NotFound
from stowage.domain.groups import GroupPolicy, ServerGroup
from stowage.domain.numa import HostFree
from stowage.domain.topology import (
    DEFAULT_ALLOCATION_RATIOS,
    Cell,
    HostSpec,
    HostTopology,
    ResourceClass,
)
from stowage.ledger.bulk import BulkWriter
from stowage.ledger.db import READONLY, make_engine, migrate
from stowage.ledger.schema import (
    allocations,
    cells,
    changes,
    consumers,
    group_members,
    group_slots,
    hosts,
    inventories,
    numa_claims,
    pcpus,
    pins,
    server_groups,
)
from stowage.scheduling.view import HostGroups, HostState, View

__all__ = ["ClaimRefused", "CommitClaim", "Ledger", "topology_from_json", "topology_to_json"]

# How often a whole batch is retried after a deadlock or serialization failure.
_BATCH_RETRIES_MAX = 5


class _Refusal(Exception):
    """A claim the ledger refuses before the database has to."""

    def __init__(self, code: RefusalCode, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class ClaimRefused(_Refusal):
    """Raised by a claim's `also` callback: what the claim was for is gone or has moved on
    (a deleted instance, a migration someone else settled), so the claim must not commit."""

    def __init__(self, reason: str) -> None:
        super().__init__(RefusalCode.CONSUMER_GONE, reason)


CommitClaim = Callable[[Connection, Claim], None]
"""Runs inside the transaction (or savepoint) that commits one claim: the documents and the
next step of the use case the claim serves commit with it, or neither does."""


class Ledger:
    """Every claim, release and move is one transaction here; nothing else writes claims."""

    def __init__(self, engine: Engine, *, clock: Callable[[], float] = time.time) -> None:
        self.engine = engine
        self.clock = clock
        self._pg = engine.dialect.name == "postgresql"
        self._topologies: dict[str, HostTopology] = {}
        self._bulk = BulkWriter(engine.dialect.name)

    @classmethod
    def open(cls, url: str, *, upgrade: bool = True) -> Ledger:
        engine = make_engine(url)
        if upgrade:
            migrate(engine)
        return cls(engine)

    def close(self) -> None:
        self.engine.dispose()

    # -- hosts and groups -------------------------------------------------------------

    def register_host(self, spec: HostSpec) -> int:
        """Record a host with its topology and inventories; returns its id (idempotent)."""
        with self.engine.begin() as conn:
            found = conn.execute(select(hosts.c.id).where(hosts.c.name == spec.name)).scalar()
            if found is not None:
                return int(found)
            host_id = int(
                conn.execute(
                    insert(hosts).returning(hosts.c.id),
                    {
                        "uuid": str(uuid.uuid5(uuid.NAMESPACE_URL, f"stowage-host:{spec.name}")),
                        "name": spec.name,
                        "availability_zone": spec.availability_zone,
                        "labels": json.dumps(dict(spec.labels), sort_keys=True),
                        "hypervisor_type": spec.hypervisor_type,
                        "architecture": spec.architecture,
                        "topology": topology_to_json(spec.topology),
                        "disabled": False,
                        "forced_down": False,
                        "last_seen": self.clock(),
                        "generation": 0,
                    },
                ).scalar_one()
            )
            self._insert_host_rows(conn, host_id, spec)
            conn.execute(insert(changes), {"host_id": host_id, "at": self.clock()})
            return host_id

    def register_hosts(self, specs: Sequence[HostSpec]) -> list[int]:
        """Bulk registration for large simulated clouds (one transaction)."""
        ids: list[int] = []
        with self.engine.begin() as conn:
            for spec in specs:
                host_id = int(
                    conn.execute(
                        insert(hosts).returning(hosts.c.id),
                        {
                            "uuid": str(
                                uuid.uuid5(uuid.NAMESPACE_URL, f"stowage-host:{spec.name}")
                            ),
                            "name": spec.name,
                            "availability_zone": spec.availability_zone,
                            "labels": json.dumps(dict(spec.labels), sort_keys=True),
                            "hypervisor_type": spec.hypervisor_type,
                            "architecture": spec.architecture,
                            "topology": topology_to_json(spec.topology),
                            "disabled": False,
                            "forced_down": False,
                            "last_seen": self.clock(),
                            "generation": 0,
                        },
                    ).scalar_one()
                )
                self._insert_host_rows(conn, host_id, spec)
                ids.append(host_id)
            conn.execute(insert(changes), [{"host_id": h, "at": self.clock()} for h in ids])
        return ids

    def _insert_host_rows(self, conn: Connection, host_id: int, spec: HostSpec) -> None:
        topo = spec.topology
        conn.execute(
            insert(cells),
            [
                {"host_id": host_id, "cell_id": c.id, "memory_mb": c.memory_mb, "memory_mb_used": 0}
                for c in topo.cells
            ],
        )
        conn.execute(
            insert(pcpus),
            [
                {
                    "host_id": host_id,
                    "cpu_id": cpu,
                    "cell_id": c.id,
                    "dedicated": cpu in topo.cpu_dedicated_set,
                }
                for c in topo.cells
                for cpu in sorted(c.cpus)
            ],
        )
        rows = []
        for rc, total in spec.totals().items():
            if total <= 0:
                continue
            rows.append(
                {
                    "host_id": host_id,
                    "resource_class": rc.value,
                    "total": total,
                    "reserved": spec.reserved.get(rc, 0),
                    "allocation_ratio": spec.allocation_ratios.get(
                        rc, DEFAULT_ALLOCATION_RATIOS[rc]
                    ),
                    "min_unit": 1,
                    "max_unit": total,
                    "step_size": 1,
                    "used": 0,
                }
            )
        conn.execute(insert(inventories), rows)

    def set_host_state(
        self,
        name: str,
        *,
        disabled: bool | None = None,
        forced_down: bool | None = None,
        last_seen: float | None = None,
        availability_zone: str | None = None,
        aggregate_metadata: Mapping[str, Iterable[str]] | None = None,
    ) -> None:
        """Change what the scheduler reads about a host; every change is in the change log."""
        values: dict[str, Any] = {}
        if availability_zone is not None:
            values["availability_zone"] = availability_zone
        if aggregate_metadata is not None:
            values["aggregate_metadata"] = json.dumps(
                {k: sorted(set(v)) for k, v in aggregate_metadata.items()}, sort_keys=True
            )
        if disabled is not None:
            values["disabled"] = disabled
        if forced_down is not None:
            values["forced_down"] = forced_down
        if last_seen is not None:
            values["last_seen"] = last_seen
        if not values:
            self.host_id(name)  # nothing to change: still a NotFound for an unknown host
            return
        with self.engine.begin() as conn:
            host_id = conn.execute(
                update(hosts).where(hosts.c.name == name).values(**values).returning(hosts.c.id)
            ).scalar()
            if host_id is None:
                raise NotFound(f"host {name!r} not found")
            conn.execute(insert(changes), {"host_id": host_id, "at": self.clock()})

    def heartbeat(self, names: Sequence[str] | None = None) -> None:
        """Record that hosts' services are alive now (all hosts when `names` is None)."""
        query = update(hosts).values(last_seen=self.clock())
        if names is not None:
            query = query.where(hosts.c.name.in_(list(names)))
        with self.engine.begin() as conn:
            conn.execute(query)

    def host_id(self, name: str) -> int:
        with self.engine.connect().execution_options(**READONLY) as conn:
            found = conn.execute(select(hosts.c.id).where(hosts.c.name == name)).scalar()
        if found is None:
            raise NotFound(f"host {name!r} not found")
        return int(found)

    def create_group(
        self, group: ServerGroup, *, also: Callable[[Connection], None] | None = None
    ) -> None:
        """A new server group; `also` runs first in the same transaction (its quota)."""
        with self.engine.begin() as conn:
            if also is not None:
                also(conn)
            conn.execute(
                insert(server_groups),
                {
                    "id": group.id,
                    "name": group.name,
                    "policy": group.policy.value,
                    "max_per_domain": group.max_per_domain,
                    "failure_domain": group.failure_domain,
                    "rules": json.dumps(dict(group.rules), sort_keys=True),
                    "project_id": group.project_id,
                    "user_id": group.user_id,
                    "created_at": self.clock(),
                },
            )

    def get_group(self, group_id: str) -> ServerGroup:
        with self.engine.connect().execution_options(**READONLY) as conn:
            row = conn.execute(select(server_groups).where(server_groups.c.id == group_id)).first()
        if row is None:
            raise NotFound(f"server group {group_id} not found")
        return _group_from_row(row._mapping)

    # -- claims -----------------------------------------------------------------------

    def claim(
        self,
        batch: Sequence[Claim],
        *,
        writer: str | None = None,
        also: CommitClaim | None = None,
        atomic: bool = False,
    ) -> list[ClaimOutcome]:
        """Commit a batch of claims, sharing one commit; each claim stays all or nothing.

        The whole batch is tried at once. If the database refuses any part of it, the
        transaction is rolled back and the claims are replayed one savepoint each, so the
        good ones still commit together and each refused one says why. `also` runs for each
        claim in the same transaction (in its savepoint on replay): raising ClaimRefused
        there refuses that claim. With `atomic`, there is no replay: the batch commits whole
        or every claim is refused with the first refusal's reason.
        """
        if not batch:
            return []
        for attempt in range(_BATCH_RETRIES_MAX):
            try:
                with self.engine.begin() as conn:
                    self._lock_hosts(conn, {c.host_id for c in batch}, writer)
                    self._write_claims(conn, batch)
                    if also is not None:
                        for claim in batch:
                            also(conn, claim)
                return [ClaimOutcome(c.consumer_id, c.host_id, True) for c in batch]
            except _Refusal as refusal:
                if atomic:
                    return [_refused(c, refusal.code, refusal.reason) for c in batch]
                break
            except IntegrityError as exc:
                if atomic:
                    code, reason = _explain(exc, batch[0])
                    return [_refused(c, code, reason) for c in batch]
                break
            except OperationalError as exc:
                if not _retryable(exc) or attempt == _BATCH_RETRIES_MAX - 1:
                    raise
        for attempt in range(_BATCH_RETRIES_MAX):
            try:
                return self._claim_one_by_one(batch, writer, also)
            except OperationalError as exc:
                if not _retryable(exc) or attempt == _BATCH_RETRIES_MAX - 1:
                    raise
        raise AssertionError("unreachable")

    def _claim_one_by_one(
        self, batch: Sequence[Claim], writer: str | None, also: CommitClaim | None
    ) -> list[ClaimOutcome]:
        outcomes: list[ClaimOutcome] = []
        with self.engine.begin() as conn:
            wanted = {c.host_id for c in batch}
            known = set(conn.execute(select(hosts.c.id).where(hosts.c.id.in_(wanted))).scalars())
            # A refused claim leaves its host's view stale, so its change is not the writer's.
            self._lock_hosts(conn, known, None)
            for claim in batch:
                if claim.host_id not in known:
                    outcomes.append(
                        _refused(
                            claim,
                            RefusalCode.UNKNOWN_RESOURCE,
                            f"host {claim.host_id} is not in the ledger",
                        )
                    )
                    continue
                try:
                    with conn.begin_nested():
                        self._write_claims(conn, [claim])
                        if also is not None:
                            also(conn, claim)
                    outcomes.append(ClaimOutcome(claim.consumer_id, claim.host_id, True))
                except _Refusal as refusal:
                    outcomes.append(_refused(claim, refusal.code, refusal.reason))
                except IntegrityError as exc:
                    code, reason = _explain(exc, claim)
                    outcomes.append(_refused(claim, code, reason))
        return outcomes

    def _lock_hosts(
        self, conn: Connection, host_ids: Iterable[int], writer: str | None = None
    ) -> None:
        """Bump each host's generation in id order: the first lock every writer takes."""
        ordered = sorted(host_ids)
        if self._pg:
            bumped = conn.exec_driver_sql(_PG_LOCK_HOSTS, (ordered,)).rowcount
        else:
            bumped = self._bulk.add(conn, hosts, ["id"], "generation", [(h, 1) for h in ordered])
        if bumped != len(ordered):
            raise _Refusal(RefusalCode.UNKNOWN_RESOURCE, "claim names a host the ledger lacks")
        now = self.clock()
        self._bulk.insert(
            conn, changes, ("host_id", "at", "writer"), [(h, now, writer) for h in ordered]
        )

    def _write_claims(self, conn: Connection, batch: Sequence[Claim]) -> None:
        bulk = self._bulk
        now = self.clock()
        if len({c.consumer_id for c in batch}) != len(batch):
            raise _Refusal(RefusalCode.CONSUMER_PLACED, "the batch names one consumer twice")
        self._lock_groups(conn, {g for c in batch for g in c.affinity_groups})
        instances = [_consumer_row(c, now) for c in batch if c.kind is ConsumerKind.INSTANCE]
        migrations = [_consumer_row(c, now) for c in batch if c.kind is ConsumerKind.MIGRATION]
        placed = bulk.insert(
            conn, consumers, _CONSUMER_COLUMNS, instances, on_conflict=_REPLACE_IF_UNPLACED
        )
        if placed != len(instances):
            raise _Refusal(
                RefusalCode.CONSUMER_PLACED, "the instance already holds a claim on a host"
            )
        bulk.insert(conn, consumers, _CONSUMER_COLUMNS, migrations)
        members = {(g, c.instance_id) for c in batch for g in c.member_of}
        bulk.insert(
            conn,
            group_members,
            ("group_id", "instance_id"),
            sorted(members),
            on_conflict="ON CONFLICT DO NOTHING",
        )
        usage: dict[tuple[int, str], int] = {}
        for c in batch:
            for rc, amount in c.amounts.items():
                usage[(c.host_id, rc.value)] = usage.get((c.host_id, rc.value), 0) + amount
        changed = bulk.add(
            conn,
            inventories,
            ("host_id", "resource_class"),
            "used",
            [(h, rc, a) for (h, rc), a in sorted(usage.items())],
        )
        if changed != len(usage):
            raise _Refusal(
                RefusalCode.UNKNOWN_RESOURCE, "claim names a resource class the host lacks"
            )
        bulk.insert(
            conn,
            allocations,
            ("consumer_id", "host_id", "resource_class", "amount"),
            [(c.consumer_id, c.host_id, rc.value, a) for c in batch for rc, a in c.amounts.items()],
        )
        cell_memory: dict[tuple[int, int], int] = {}
        numa_rows = []
        for c in batch:
            for cell in c.fit.cells:
                key = (c.host_id, cell.host_cell)
                cell_memory[key] = cell_memory.get(key, 0) + cell.memory_mb
                numa_rows.append(
                    (c.consumer_id, c.host_id, cell.host_cell, cell.guest_cell, cell.memory_mb)
                )
        changed = bulk.add(
            conn,
            cells,
            ("host_id", "cell_id"),
            "memory_mb_used",
            [(h, cell, m) for (h, cell), m in sorted(cell_memory.items())],
        )
        if changed != len(cell_memory):
            raise _Refusal(RefusalCode.UNKNOWN_RESOURCE, "claim names a NUMA cell the host lacks")
        bulk.insert(
            conn,
            numa_claims,
            ("consumer_id", "host_id", "cell_id", "guest_cell", "memory_mb"),
            numa_rows,
        )
        bulk.insert(
            conn,
            pins,
            ("host_id", "cpu_id", "consumer_id", "guest_vcpu", "dedicated"),
            sorted(
                (c.host_id, cpu, c.consumer_id, vcpu, True)
                for c in batch
                for cell in c.fit.cells
                for cpu, vcpu in _pins_with_withheld(cell.pins, cell.withheld)
            ),
        )
        bulk.insert(
            conn,
            group_slots,
            ("group_id", "domain", "slot", "max_per_domain", "consumer_id", "host_id"),
            sorted(
                (s.group_id, s.domain, s.slot, s.max_per_domain, c.consumer_id, c.host_id)
                for c in batch
                for s in c.slots
            ),
        )
        for claim in batch:
            for group_id in claim.affinity_groups:
                self._check_affinity(conn, group_id, claim)

    def _lock_groups(self, conn: Connection, group_ids: set[str]) -> None:
        """Lock strict affinity groups' rows in id order, before any member row refers to them.

        Taken after the hosts and before the members' foreign keys share-lock the same rows,
        so two writers for one group queue instead of deadlocking.
        """
        if not group_ids:
            return
        query = (
            select(server_groups.c.id)
            .where(server_groups.c.id.in_(group_ids))
            .order_by(server_groups.c.id)
        )
        if self._pg:
            query = query.with_for_update()
        found = set(conn.execute(query).scalars())
        missing = sorted(group_ids - found)
        if missing:
            raise _Refusal(RefusalCode.AFFINITY, f"server group {missing[0]} not found")

    def _check_affinity(self, conn: Connection, group_id: str, claim: Claim) -> None:
        """Strict affinity under the group's row lock: no member may sit on another host."""
        elsewhere = conn.execute(
            select(hosts.c.name)
            .select_from(
                group_members.join(
                    consumers, consumers.c.instance_id == group_members.c.instance_id
                ).join(hosts, hosts.c.id == consumers.c.host_id)
            )
            .where(group_members.c.group_id == group_id, consumers.c.host_id != claim.host_id)
            .limit(1)
        ).scalar()
        if elsewhere is not None:
            raise _Refusal(
                RefusalCode.AFFINITY,
                f"affinity group {group_id} already has a member on {elsewhere}",
            )

    # -- release and move -------------------------------------------------------------

    def release(
        self,
        consumer_id: str,
        *,
        forget: bool = True,
        also: Callable[[Connection], None] | None = None,
    ) -> bool:
        """Drop every claim a consumer holds, in one transaction. Idempotent.

        `forget` also deletes the consumer (a deleted instance, a finished migration);
        otherwise an instance stays known with no host. `also` runs in the same
        transaction (a status change that must commit with the release, or not at all).
        """
        return self._retry(
            lambda conn: _then(self._release(conn, consumer_id, forget=forget), also, conn)
        )

    def complete_migration(
        self, migration_id: str, *, also: Callable[[Connection], None] | None = None
    ) -> bool:
        """The instance moves: its source claims go and the migration's become its own."""
        return self._retry(lambda conn: _then(self._complete(conn, migration_id), also, conn))

    def fail_migration(
        self, migration_id: str, *, also: Callable[[Connection], None] | None = None
    ) -> bool:
        """The instance stays: the destination's claims go with the migration."""
        return self.release(migration_id, forget=True, also=also)

    def _retry(self, work: Callable[[Connection], bool]) -> bool:
        for attempt in range(_BATCH_RETRIES_MAX):
            try:
                with self.engine.begin() as conn:
                    return work(conn)
            except OperationalError as exc:
                if not _retryable(exc) or attempt == _BATCH_RETRIES_MAX - 1:
                    raise
        raise AssertionError("unreachable")

    def _held_hosts(self, conn: Connection, consumer_ids: Sequence[str]) -> set[int]:
        found = conn.execute(
            select(allocations.c.host_id)
            .where(allocations.c.consumer_id.in_(consumer_ids))
            .union(
                select(pins.c.host_id).where(pins.c.consumer_id.in_(consumer_ids)),
                select(group_slots.c.host_id).where(group_slots.c.consumer_id.in_(consumer_ids)),
            )
        ).scalars()
        return {int(h) for h in found}

    def _release(self, conn: Connection, consumer_id: str, *, forget: bool) -> bool:
        held = self._held_hosts(conn, [consumer_id])
        if held:
            self._lock_hosts(conn, held)
        released = self._drop_claims(conn, consumer_id)
        if forget:
            gone = conn.execute(delete(consumers).where(consumers.c.id == consumer_id)).rowcount
        else:
            gone = conn.execute(
                update(consumers)
                .where(consumers.c.id == consumer_id, consumers.c.host_id.is_not(None))
                .values(host_id=None, generation=consumers.c.generation + 1)
            ).rowcount
        return released or gone > 0

    def _drop_claims(self, conn: Connection, consumer_id: str) -> bool:
        freed = conn.execute(
            delete(allocations)
            .where(allocations.c.consumer_id == consumer_id)
            .returning(allocations.c.host_id, allocations.c.resource_class, allocations.c.amount)
        ).all()
        self._bulk.add(
            conn,
            inventories,
            ("host_id", "resource_class"),
            "used",
            [(h, rc, -a) for h, rc, a in sorted(freed)],
        )
        cells_freed = conn.execute(
            delete(numa_claims)
            .where(numa_claims.c.consumer_id == consumer_id)
            .returning(numa_claims.c.host_id, numa_claims.c.cell_id, numa_claims.c.memory_mb)
        ).all()
        per_cell: dict[tuple[int, int], int] = {}
        for h, cell, m in cells_freed:
            per_cell[(h, cell)] = per_cell.get((h, cell), 0) - m
        self._bulk.add(
            conn,
            cells,
            ("host_id", "cell_id"),
            "memory_mb_used",
            [(h, cell, m) for (h, cell), m in sorted(per_cell.items())],
        )
        pins_freed = conn.execute(delete(pins).where(pins.c.consumer_id == consumer_id)).rowcount
        slots_freed = conn.execute(
            delete(group_slots).where(group_slots.c.consumer_id == consumer_id)
        ).rowcount
        return bool(freed or cells_freed or pins_freed or slots_freed)

    def _complete(self, conn: Connection, migration_id: str) -> bool:
        row = conn.execute(
            select(consumers.c.instance_id, consumers.c.host_id).where(
                consumers.c.id == migration_id, consumers.c.kind == ConsumerKind.MIGRATION.value
            )
        ).first()
        if row is None:
            return False
        instance_id, dest = row
        held = self._held_hosts(conn, [instance_id, migration_id])
        self._lock_hosts(conn, held | ({dest} if dest is not None else set()))
        self._drop_claims(conn, instance_id)
        for table in (allocations, numa_claims, pins, group_slots):
            conn.execute(
                update(table)
                .where(table.c.consumer_id == migration_id)
                .values(consumer_id=instance_id)
            )
        conn.execute(
            update(consumers)
            .where(consumers.c.id == instance_id)
            .values(host_id=dest, generation=consumers.c.generation + 1)
        )
        conn.execute(delete(consumers).where(consumers.c.id == migration_id))
        return True

    # -- reading ----------------------------------------------------------------------

    def consumer_host(self, consumer_id: str) -> int | None:
        with self.engine.connect().execution_options(**READONLY) as conn:
            return conn.execute(
                select(consumers.c.host_id).where(consumers.c.id == consumer_id)
            ).scalar()

    def load_view(self, writer: str = "") -> View:
        """A full view: used once at start; later refreshes read only what changed."""
        view = View(writer)
        with self.engine.connect().execution_options(**READONLY) as conn, conn.begin():
            view.seq = int(
                conn.execute(select(func.coalesce(func.max(changes.c.seq), 0))).scalar_one()
            )
            view.seen.update(
                conn.execute(
                    select(changes.c.seq).where(changes.c.seq > view.seq - _REREAD_WINDOW)
                ).scalars()
            )
            for row in conn.execute(select(server_groups)):
                view.add_group(_group_from_row(row._mapping))
            for state, contribution in self._read_hosts(conn, None):
                view.replace_host(state, contribution)
        return view

    def refresh(
        self,
        view: View,
        *,
        host_ids: Iterable[int] = (),
        defer: Callable[[int], bool] | None = None,
        deferred_max: int = 64,
    ) -> int:
        """Bring `view` up to date with committed changes; returns how many hosts were read.

        Sequence numbers can commit out of order on PostgreSQL, so each refresh looks a
        window behind the newest sequence it saw and skips the rows it has already seen,
        and the rows its own writer committed and applied. Changed hosts for which `defer`
        is true (another worker's shard) are only marked stale, and at most `deferred_max`
        of those are read per refresh, so a worker does not spend its time re-reading hosts
        it seldom uses; a stale host it does use costs at worst a refused claim and a retry.
        """
        wanted = set(host_ids)
        with self.engine.connect().execution_options(**READONLY) as conn, conn.begin():
            oldest = conn.execute(select(func.min(changes.c.seq))).scalar()
            # Rows this view never saw were pruned: it reads every host again.
            missed = oldest is not None and oldest > view.seq + 1
            rows = conn.execute(
                select(changes.c.seq, changes.c.host_id, changes.c.writer).where(
                    changes.c.seq > max(0, view.seq - _REREAD_WINDOW)
                )
            ).all()
            for seq, host_id, writer in rows:
                if seq in view.seen:
                    continue
                view.seen.add(seq)
                view.seq = max(view.seq, seq)
                if writer and writer == view.writer:
                    continue
                if defer is not None and defer(host_id):
                    view.stale.add(int(host_id))
                else:
                    wanted.add(int(host_id))
            floor = view.seq - _REREAD_WINDOW
            if len(view.seen) > 4 * _REREAD_WINDOW:
                view.seen = {s for s in view.seen if s > floor}
            while view.stale and deferred_max > 0:
                wanted.add(view.stale.pop())
                deferred_max -= 1
            view.stale -= wanted
            if missed:
                view.stale.clear()
                for row in conn.execute(select(server_groups)):
                    view.add_group(_group_from_row(row._mapping))
                for state, contribution in self._read_hosts(conn, None):
                    view.replace_host(state, contribution)
                return len(view.hosts)
            if not wanted:
                return 0
            self._ensure_groups(conn, view, wanted)
            for state, contribution in self._read_hosts(conn, sorted(wanted)):
                view.replace_host(state, contribution)
        return len(wanted)

    def prune_changes(self, *, older_than_s: float = 600.0) -> int:
        """Forget change rows older than any view still needs; returns how many went.

        A view that has not refreshed for longer than this reloads itself fully
        (see `refresh`), so nothing it needed is lost.
        """
        newest = select(func.max(changes.c.seq)).scalar_subquery()
        with self.engine.begin() as conn:
            # The newest row always stays, so a view can tell it missed pruned rows.
            return int(
                conn.execute(
                    delete(changes).where(
                        changes.c.at < self.clock() - older_than_s, changes.c.seq < newest
                    )
                ).rowcount
            )

    def refresh_liveness(self, view: View) -> None:
        """Heartbeat times and service flags of every host, in one narrow query.

        Heartbeats write no change rows (that would make every scheduler re-read every host
        at each beat); schedulers read liveness alone, often, instead.
        """
        with self.engine.connect().execution_options(**READONLY) as conn:
            rows = conn.execute(
                select(hosts.c.id, hosts.c.last_seen, hosts.c.forced_down, hosts.c.disabled)
            ).all()
        for host_id, last_seen, forced_down, disabled in rows:
            state = view.hosts.get(host_id)
            if state is not None:
                state.last_seen = last_seen
                state.forced_down = bool(forced_down)
                state.disabled = bool(disabled)

    def ensure_group(self, view: View, group_id: str) -> None:
        if group_id in view.groups:
            return
        view.add_group(self.get_group(group_id))
        with self.engine.connect().execution_options(**READONLY) as conn, conn.begin():
            member_hosts = set(
                conn.execute(
                    select(consumers.c.host_id)
                    .select_from(
                        group_members.join(
                            consumers, consumers.c.instance_id == group_members.c.instance_id
                        )
                    )
                    .where(group_members.c.group_id == group_id, consumers.c.host_id.is_not(None))
                ).scalars()
            )
            member_hosts.update(
                conn.execute(
                    select(group_slots.c.host_id).where(group_slots.c.group_id == group_id)
                ).scalars()
            )
            for state, contribution in self._read_hosts(conn, sorted(member_hosts)):
                view.replace_host(state, contribution)

    def _ensure_groups(self, conn: Connection, view: View, host_ids: set[int]) -> None:
        known = set(view.groups)
        query = select(server_groups).where(
            server_groups.c.id.in_(
                select(group_slots.c.group_id).where(group_slots.c.host_id.in_(host_ids))
            )
        )
        for row in conn.execute(query):
            if row.id not in known:
                view.add_group(_group_from_row(row._mapping))

    def _read_hosts(
        self, conn: Connection, host_ids: Sequence[int] | None
    ) -> Iterable[tuple[HostState, HostGroups]]:
        def where(col: Any) -> Any:
            return col.in_(host_ids) if host_ids is not None else True

        inv: dict[int, list[Any]] = defaultdict(list)
        for row in conn.execute(select(inventories).where(where(inventories.c.host_id))):
            inv[row.host_id].append(row)
        cell_used: dict[int, dict[int, int]] = defaultdict(dict)
        for row in conn.execute(select(cells).where(where(cells.c.host_id))):
            cell_used[row.host_id][row.cell_id] = row.memory_mb - row.memory_mb_used
        pinned: dict[int, set[int]] = defaultdict(set)
        for host_id, cpu in conn.execute(
            select(pins.c.host_id, pins.c.cpu_id).where(where(pins.c.host_id))
        ):
            pinned[host_id].add(cpu)
        contributions: dict[int, HostGroups] = defaultdict(HostGroups)
        member_query = (
            select(group_members.c.group_id, consumers.c.host_id, func.count())
            .select_from(
                group_members.join(
                    consumers, consumers.c.instance_id == group_members.c.instance_id
                )
            )
            .where(where(consumers.c.host_id), consumers.c.host_id.is_not(None))
            .group_by(group_members.c.group_id, consumers.c.host_id)
        )
        for group_id, host_id, count in conn.execute(member_query):
            contributions[host_id].members[group_id] += int(count)
        # Members are counted through consumers.instance_id, so a migration's destination
        # counts beside the instance's source.
        for row in conn.execute(
            select(
                group_slots.c.group_id,
                group_slots.c.domain,
                group_slots.c.slot,
                group_slots.c.host_id,
            ).where(where(group_slots.c.host_id))
        ):
            contributions[row.host_id].slots.append((row.group_id, row.domain, row.slot))
        for row in conn.execute(select(hosts).where(where(hosts.c.id))):
            topo = self._topology(row.topology)
            capacity: dict[ResourceClass, int] = {}
            used: dict[ResourceClass, int] = {}
            max_unit: dict[ResourceClass, int] = {}
            for item in inv.get(row.id, []):
                if item.resource_class not in _KNOWN_CLASSES:
                    continue  # a custom class no flavor asks for yet
                rc = ResourceClass(item.resource_class)
                capacity[rc] = int((item.total - item.reserved) * item.allocation_ratio)
                used[rc] = item.used
                max_unit[rc] = item.max_unit
            free = HostFree(
                frozenset(topo.cpu_dedicated_set - pinned.get(row.id, set())),
                cell_used.get(row.id, {}),
            )
            state = HostState(
                id=row.id,
                name=row.name,
                topology=topo,
                capacity=capacity,
                used=used,
                max_unit=max_unit,
                free=free,
                availability_zone=row.availability_zone,
                labels=json.loads(row.labels),
                aggregate_metadata={
                    k: frozenset(v) for k, v in json.loads(row.aggregate_metadata).items()
                },
                hypervisor_type=row.hypervisor_type,
                architecture=row.architecture,
                disabled=bool(row.disabled),
                forced_down=bool(row.forced_down),
                last_seen=row.last_seen,
                generation=row.generation,
            )
            yield state, contributions.get(row.id, HostGroups())

    def _topology(self, text: str) -> HostTopology:
        topo = self._topologies.get(text)
        if topo is None:
            topo = self._topologies[text] = topology_from_json(text)
        return topo


_KNOWN_CLASSES = frozenset(rc.value for rc in ResourceClass)

# Sequence numbers re-read behind the newest seen, to catch commits that landed out of order.
_REREAD_WINDOW = 256

# Locks the hosts in id order before bumping them, so concurrent writers never deadlock.
_PG_LOCK_HOSTS = (
    "UPDATE hosts SET generation = generation + 1 WHERE id IN "
    "(SELECT id FROM hosts WHERE id = ANY(%s::int8[]) ORDER BY id FOR UPDATE)"
)
_CONSUMER_COLUMNS = (
    "id",
    "kind",
    "instance_id",
    "project_id",
    "user_id",
    "host_id",
    "generation",
    "created_at",
)
# An instance consumer may be placed again only once it holds no host.
_REPLACE_IF_UNPLACED = (
    "ON CONFLICT (id) DO UPDATE SET host_id = excluded.host_id, "
    "generation = consumers.generation + 1 WHERE consumers.host_id IS NULL"
)


def _consumer_row(claim: Claim, now: float) -> tuple[Any, ...]:
    return (
        claim.consumer_id,
        claim.kind.value,
        claim.instance_id,
        claim.project_id,
        claim.user_id,
        claim.host_id,
        0,
        now,
    )


def _pins_with_withheld(pinned: Any, withheld: frozenset[int]) -> Iterable[tuple[int, int | None]]:
    for vcpu, cpu in pinned.items():
        yield cpu, vcpu
    for cpu in withheld:
        yield cpu, None


def _refused(claim: Claim, code: RefusalCode, reason: str) -> ClaimOutcome:
    return ClaimOutcome(claim.consumer_id, claim.host_id, False, code, reason)


def _then(result: bool, also: Callable[[Connection], None] | None, conn: Connection) -> bool:
    if also is not None:
        also(conn)
    return result


def _retryable(exc: DBAPIError) -> bool:
    """Deadlocks and serialization failures on PostgreSQL; a locked database on SQLite."""
    code = getattr(exc.orig, "sqlstate", None) or getattr(exc.orig, "pgcode", None)
    if code in ("40P01", "40001"):
        return True
    return "database is locked" in str(exc.orig)


def _explain(exc: IntegrityError, claim: Claim) -> tuple[RefusalCode, str]:
    text = str(exc.orig)
    host = claim.host_id
    if "group_slots" in text:
        domains = ", ".join(sorted({s.domain for s in claim.slots}))
        return (
            RefusalCode.ANTI_AFFINITY,
            f"anti-affinity: {domains} already holds as many members as the group allows",
        )
    if "ck_inventories_capacity" in text:
        return RefusalCode.CAPACITY, f"host {host} lacks capacity for the claimed amounts"
    if "ck_cells_memory" in text:
        return RefusalCode.NUMA_MEMORY, f"host {host} lacks memory on the chosen NUMA cell"
    if "pins" in text:
        cpus = sorted(claim.fit.cpus)
        return RefusalCode.PCPU_TAKEN, f"pCPUs {cpus} on host {host}: one is already pinned"
    if "consumers" in text:
        return RefusalCode.CONSUMER_PLACED, f"consumer {claim.consumer_id} already holds a claim"
    return RefusalCode.UNKNOWN_RESOURCE, f"the ledger refused the claim: {text.splitlines()[0]}"


def _group_from_row(row: Any) -> ServerGroup:
    return ServerGroup(
        id=row["id"],
        name=row["name"],
        policy=GroupPolicy(row["policy"]),
        max_per_domain=row["max_per_domain"],
        failure_domain=row["failure_domain"],
        project_id=row["project_id"],
        user_id=row["user_id"],
        rules=json.loads(row["rules"]),
    )


def topology_to_json(topo: HostTopology) -> str:
    return json.dumps(
        {
            "cells": [
                {"id": c.id, "cpus": sorted(c.cpus), "memory_mb": c.memory_mb} for c in topo.cells
            ],
            "siblings": {str(k): sorted(v) for k, v in sorted(topo.siblings.items())},
            "dedicated": sorted(topo.cpu_dedicated_set),
            "shared": sorted(topo.cpu_shared_set),
        },
        sort_keys=True,
    )


def topology_from_json(text: str) -> HostTopology:
    data = json.loads(text)
    return HostTopology(
        cells=tuple(Cell(c["id"], frozenset(c["cpus"]), c["memory_mb"]) for c in data["cells"]),
        siblings={int(k): frozenset(v) for k, v in data["siblings"].items()},
        cpu_dedicated_set=frozenset(data["dedicated"]),
        cpu_shared_set=frozenset(data["shared"]),
    )
