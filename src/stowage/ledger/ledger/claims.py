"""Claims, releases and moves: each one transaction, the database's constraints the last word."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from sqlalchemy import Connection, delete, select, update
from sqlalchemy.exc import IntegrityError, OperationalError

from stowage.domain.claims import Claim, ClaimOutcome, ConsumerKind, RefusalCode
from stowage.ledger.db import READONLY
from stowage.ledger.ledger.core import (
    _BATCH_RETRIES_MAX,
    ClaimRefused,
    CommitClaim,
    _Refusal,
    _refused,
    _retryable,
    _then,
)
from stowage.ledger.ledger.groups import Groups
from stowage.ledger.objects import HeldWriteMissed, held_inserts
from stowage.ledger.schema import (
    allocations,
    cells,
    changes,
    consumers,
    group_members,
    group_slots,
    host_generations,
    hosts,
    inventories,
    numa_claims,
    pins,
)


class Claims(Groups):
    """Commits, releases and moves claims; nothing else writes them."""

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
        for c in batch:
            if c.kind is ConsumerKind.INSTANCE and c.consumer_id != c.instance_id:
                # The schema's partial index of moves relies on it (`consumers_of_instance`).
                raise ValueError(
                    f"an instance's claim is keyed by its instance id: consumer "
                    f"{c.consumer_id} claims for instance {c.instance_id}"
                )
        for attempt in range(_BATCH_RETRIES_MAX):
            try:
                with self.engine.begin() as conn:
                    self._lock_hosts(conn, {c.host_id for c in batch}, writer)
                    self._write_claims(conn, batch)
                    if also is not None:
                        # What `also` inserts or swaps later (a build's next operation, its
                        # instance's host) goes in one statement for the batch; replayed one
                        # by one, each at once (where a swap that misses refuses its claim).
                        try:
                            with held_inserts(conn):
                                for claim in batch:
                                    also(conn, claim)
                        except HeldWriteMissed as exc:
                            raise ClaimRefused(str(exc)) from exc
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
            bumped = self._bulk.add(
                conn, host_generations, ["host_id"], "generation", [(h, 1) for h in ordered]
            )
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
        seq = self._place_consumers(conn, batch, now)
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
            ("consumer_seq", "host_id", "resource_class", "amount"),
            [
                (seq[c.consumer_id], c.host_id, rc.value, a)
                for c in batch
                for rc, a in c.amounts.items()
            ],
        )
        cell_memory: dict[tuple[int, int], int] = {}
        numa_rows = []
        for c in batch:
            for cell in c.fit.cells:
                key = (c.host_id, cell.host_cell)
                cell_memory[key] = cell_memory.get(key, 0) + cell.memory_mb
                numa_rows.append(
                    (seq[c.consumer_id], c.host_id, cell.host_cell, cell.guest_cell, cell.memory_mb)
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
            ("consumer_seq", "host_id", "cell_id", "guest_cell", "memory_mb"),
            numa_rows,
        )
        bulk.insert(
            conn,
            pins,
            ("host_id", "cpu_id", "consumer_seq", "guest_vcpu", "dedicated"),
            sorted(
                (c.host_id, cpu, seq[c.consumer_id], vcpu, True)
                for c in batch
                for cell in c.fit.cells
                for cpu, vcpu in _pins_with_withheld(cell.pins, cell.withheld)
            ),
        )
        bulk.insert(
            conn,
            group_slots,
            ("group_id", "domain", "slot", "max_per_domain", "consumer_seq", "host_id"),
            sorted(
                (s.group_id, s.domain, s.slot, s.max_per_domain, seq[c.consumer_id], c.host_id)
                for c in batch
                for s in c.slots
            ),
        )
        for claim in batch:
            for group_id in claim.affinity_groups:
                self._check_affinity(conn, group_id, claim)

    def _place_consumers(
        self, conn: Connection, batch: Sequence[Claim], now: float
    ) -> dict[str, int]:
        """Insert the batch's consumers, or place known instances that hold no host.

        Returns each consumer's key by its id. An instance already placed is neither
        inserted nor placed again, and refuses the batch.
        """
        instances = [_consumer_row(c, now) for c in batch if c.kind is ConsumerKind.INSTANCE]
        migrations = [_consumer_row(c, now) for c in batch if c.kind is ConsumerKind.MIGRATION]
        if self._pg:
            returned = self._bulk.insert_returning(
                conn, consumers, _CONSUMER_COLUMNS, instances, "id, seq", _REPLACE_IF_UNPLACED
            )
            placed = len(returned)
            returned += self._bulk.insert_returning(
                conn, consumers, _CONSUMER_COLUMNS, migrations, "id, seq"
            )
            seq = dict(returned)
        else:
            placed, seq = self._sqlite_place_consumers(conn, instances, migrations)
        if placed != len(instances):
            raise _Refusal(
                RefusalCode.CONSUMER_PLACED, "the instance already holds a claim on a host"
            )
        return seq

    def _sqlite_place_consumers(
        self, conn: Connection, instances: list[tuple[Any, ...]], migrations: list[tuple[Any, ...]]
    ) -> tuple[int, dict[str, int]]:
        """SQLite's half of `_place_consumers`: how many instances were placed, and the keys.

        The transaction holds the writer lock from its BEGIN, so the keys after the largest
        are the batch's to give: its new consumers get them in order, and only a known
        consumer's key has to be read back.
        """
        last = conn.exec_driver_sql("SELECT coalesce(max(seq), 0) FROM consumers").scalar_one()
        keyed = [(last + i, *row) for i, row in enumerate((*instances, *migrations), start=1)]
        seq = {row[1]: row[0] for row in keyed}
        columns = ("seq", *_CONSUMER_COLUMNS)
        # SQLite runs an upsert's DO UPDATE with foreign-key scans of every table that
        # references consumers, for every row (about 15 us a row at 10,000 hosts): the same
        # claim as an insert of the new ones, then an update of the known unplaced ones, costs
        # a third, and the update runs only when a consumer was known (a new consumer is
        # inserted placed, so the update cannot touch it). Both run under the writer lock, so
        # nothing comes between them.
        placed = self._bulk.insert(
            conn, consumers, columns, keyed[: len(instances)], on_conflict="ON CONFLICT DO NOTHING"
        )
        self._bulk.insert(conn, consumers, columns, keyed[len(instances) :])
        if placed == len(instances):
            return placed, seq
        placed += int(
            conn.exec_driver_sql(
                _SQLITE_PLACE_UNPLACED, [(row[5], row[0]) for row in instances]
            ).rowcount
        )
        known = select(consumers.c.id, consumers.c.seq).where(
            consumers.c.id.in_([row[0] for row in instances])
        )
        seq.update({r.id: r.seq for r in conn.execute(known)})
        return placed, seq

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

    def _held_hosts(self, conn: Connection, seqs: Sequence[int]) -> set[int]:
        found = conn.execute(
            select(allocations.c.host_id)
            .where(allocations.c.consumer_seq.in_(seqs))
            .union(
                select(pins.c.host_id).where(pins.c.consumer_seq.in_(seqs)),
                select(group_slots.c.host_id).where(group_slots.c.consumer_seq.in_(seqs)),
            )
        ).scalars()
        return {int(h) for h in found}

    def _release(self, conn: Connection, consumer_id: str, *, forget: bool) -> bool:
        seq = _seq_of(conn, consumer_id)
        if seq is None:
            return False
        held = self._held_hosts(conn, [seq])
        if held:
            self._lock_hosts(conn, held)
        released = self._drop_claims(conn, seq)
        if forget:
            gone = conn.execute(delete(consumers).where(consumers.c.seq == seq)).rowcount
        else:
            gone = conn.execute(
                update(consumers)
                .where(consumers.c.seq == seq, consumers.c.host_id.is_not(None))
                .values(host_id=None, generation=consumers.c.generation + 1)
            ).rowcount
        return released or gone > 0

    def _drop_claims(self, conn: Connection, seq: int) -> bool:
        freed = conn.execute(
            delete(allocations)
            .where(allocations.c.consumer_seq == seq)
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
            .where(numa_claims.c.consumer_seq == seq)
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
        pins_freed = conn.execute(delete(pins).where(pins.c.consumer_seq == seq)).rowcount
        slots_freed = conn.execute(
            delete(group_slots).where(group_slots.c.consumer_seq == seq)
        ).rowcount
        return bool(freed or cells_freed or pins_freed or slots_freed)

    def _complete(self, conn: Connection, migration_id: str) -> bool:
        row = conn.execute(
            select(consumers.c.seq, consumers.c.instance_id, consumers.c.host_id).where(
                consumers.c.id == migration_id, consumers.c.kind == ConsumerKind.MIGRATION.value
            )
        ).first()
        if row is None:
            return False
        migration, instance_id, dest = row
        instance = _seq_of(conn, instance_id)
        held = self._held_hosts(conn, [migration] if instance is None else [instance, migration])
        self._lock_hosts(conn, held | ({dest} if dest is not None else set()))
        if instance is not None:
            self._drop_claims(conn, instance)
        for table in (allocations, numa_claims, pins, group_slots):
            conn.execute(
                update(table).where(table.c.consumer_seq == migration).values(consumer_seq=instance)
            )
        conn.execute(
            update(consumers)
            .where(consumers.c.seq == instance)
            .values(host_id=dest, generation=consumers.c.generation + 1)
        )
        conn.execute(delete(consumers).where(consumers.c.seq == migration))
        return True

    def consumer_host(self, consumer_id: str) -> int | None:
        with self.engine.connect().execution_options(**READONLY) as conn:
            return conn.execute(
                select(consumers.c.host_id).where(consumers.c.id == consumer_id)
            ).scalar()


# Locks the hosts in id order before bumping them, so concurrent writers never deadlock.
_PG_LOCK_HOSTS = (
    "UPDATE host_generations SET generation = generation + 1 WHERE host_id IN "
    "(SELECT host_id FROM host_generations WHERE host_id = ANY(%s::int8[]) "
    "ORDER BY host_id FOR UPDATE)"
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


# SQLite's half of _REPLACE_IF_UNPLACED, after the insert that skipped every known consumer.
_SQLITE_PLACE_UNPLACED = (
    "UPDATE consumers SET host_id = ?, generation = generation + 1 WHERE id = ? AND host_id IS NULL"
)


def _seq_of(conn: Connection, consumer_id: str) -> int | None:
    """The key of the consumer with this id, if the ledger knows it."""
    found = conn.execute(select(consumers.c.seq).where(consumers.c.id == consumer_id)).scalar()
    return None if found is None else int(found)


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
