"""The operations table: the conductor's durable, leased work queue."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, Update, and_, bindparam, insert, or_, select, update
from sqlalchemy.dialects import sqlite

from stowage.domain.ids import new_uuid
from stowage.ledger.db import READONLY, direct_rows
from stowage.ledger.objects import decode_body, insert_rows, update_later
from stowage.ledger.schema import operations

__all__ = ["ACTIVE_STATES", "TERMINAL_STATES", "Operation", "OperationEnded", "Operations"]

ACTIVE_STATES = ("pending", "unknown")
TERMINAL_STATES = ("done", "failed")
_INSERT = insert(operations)  # built once: building it per operation cost more than running it
# The statements of every step, built once too (a statement built per call cost about three
# times the CPU of running a prebuilt one: docs/performance.md, session 8).
_FIND = select(operations).where(operations.c.id == bindparam("k_id"))
_STATE = select(operations.c.state).where(operations.c.id == bindparam("k_id"))
_STATES = select(operations.c.id, operations.c.state).where(
    operations.c.id.in_(bindparam("k_ids", expanding=True))
)
_FREE = or_(
    operations.c.owner.is_(None),
    operations.c.owner == bindparam("k_owner"),
    operations.c.lease_until < bindparam("k_now"),
)
_DUE = (
    select(operations.c.id)
    .where(operations.c.state.in_(ACTIVE_STATES), operations.c.next_at <= bindparam("k_now"), _FREE)
    .order_by(operations.c.created_at, operations.c.id)
    .limit(bindparam("k_limit"))
)
_TAKE = (
    update(operations)
    .where(
        operations.c.id.in_(bindparam("k_ids", expanding=True)),
        operations.c.state.in_(ACTIVE_STATES),
        _FREE,
    )
    .values(owner=bindparam("k_owner"), lease_until=bindparam("v_until"))
)
_TAKEN = select(operations).where(
    operations.c.id.in_(bindparam("k_ids", expanding=True)),
    operations.c.state.in_(ACTIVE_STATES),
    operations.c.owner == bindparam("k_owner"),
)
# PostgreSQL: one statement takes up to `k_limit` due operations that no other transaction
# has locked (SKIP LOCKED), so conductors polling at once take different operations instead
# of all reading the same oldest ones and all but one winning nothing. The choice is a
# MATERIALIZED CTE so that it runs once (a subquery under IN could be run again by the plan,
# and its LIMIT with it).
_DUE_UNLOCKED = (
    select(operations.c.id)
    .where(
        operations.c.state.in_(ACTIVE_STATES),
        operations.c.next_at <= bindparam("k_now"),
        _FREE,
        operations.c.id.not_in(bindparam("k_exclude", expanding=True)),
    )
    .order_by(operations.c.created_at, operations.c.id)
    .limit(bindparam("k_limit"))
    .with_for_update(skip_locked=True)
    .cte("due")
    .prefix_with("MATERIALIZED")
)
_TAKE_SKIPPING = (
    update(operations)
    .where(operations.c.id.in_(select(_DUE_UNLOCKED.c.id)))
    .values(owner=bindparam("k_owner"), lease_until=bindparam("v_until"))
    .returning(*operations.c)
)
_LET_GO = (
    update(operations)
    .where(operations.c.id == bindparam("k_id"), operations.c.owner == bindparam("k_owner"))
    .values(owner=None, lease_until=None)
)
_CLEANUPS = (
    select(operations.c.created_at, operations.c.id, operations.c.host)
    .where(operations.c.state.in_(ACTIVE_STATES), operations.c.kind.in_(("cleanup", "delete")))
    .order_by(operations.c.created_at, operations.c.id)
)
_ADVANCES: dict[tuple[frozenset[str], bool], Update] = {}


_END_EACH = (
    update(operations)
    .where(operations.c.id.in_(bindparam("k_ids", expanding=True)))
    .values(
        state=bindparam("v_state"),
        updated_at=bindparam("v_at"),
        next_at=bindparam("v_at"),
        owner=None,
        lease_until=None,
    )
)
_GUARD = operations.c.state.in_(ACTIVE_STATES)
"""A guarded write's condition: the operation has not ended (`Operations.guarded`)."""
_END_EACH_GUARDED = _END_EACH.where(_GUARD)
_STILL_ACTIVE = str(
    _GUARD.compile(dialect=sqlite.dialect(), compile_kwargs={"literal_binds": True})
)
"""`_GUARD` as the SQL of a held `advance` (`update_later`'s `where`, SQLite only)."""


def _advance_statement(columns: frozenset[str], guarded: bool) -> Update:
    """The UPDATE of `advance` for this set of columns (a handful of sets occur), built once."""
    key = (columns, guarded)
    query = _ADVANCES.get(key)
    if query is None:
        query = update(operations).where(operations.c.id == bindparam("k_id"))
        if guarded:
            query = query.where(_GUARD)
        query = query.values({c: bindparam("v_" + c) for c in sorted(columns)})
        _ADVANCES[key] = query
    return query


@dataclass(frozen=True, slots=True)
class Operation:
    id: str
    kind: str
    instance_id: str
    host: str
    migration_id: str | None
    state: str
    step: str
    payload: dict[str, Any]
    result: dict[str, Any] | None
    attempts: int
    created_at: float
    next_at: float

    @property
    def call_id(self) -> str:
        """The op id of this step's agent call: a resumed step is recognised by the agent.

        A step tried again after the agent said it failed is a new call (`retry` counts
        them), so the agent runs it again instead of repeating its failure.
        """
        retry = int(self.payload.get("retry", 0))
        return f"{self.id}:{self.step}" + (f":{retry}" if retry else "")

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL_STATES


class OperationEnded(Exception):
    """A guarded write found its operation already ended (a delete overtook it): the
    transaction it was part of must not commit."""


def _row(row: Any) -> Operation:
    """An operation of a row of `operations`' columns in order, read by position: SQLAlchemy's
    row or the driver's tuple (`db.direct_rows`)."""
    return Operation(
        id=row[0],
        kind=row[1],
        instance_id=row[2],
        host=row[3],
        migration_id=row[4],
        state=row[5],
        step=row[6],
        payload=decode_body(row[7]),
        result=None if row[8] is None else decode_body(row[8]),
        attempts=row[9],
        created_at=row[10],
        next_at=row[12],
    )


class Operations:
    """Insert, lease, advance and wait for operations; every write may join a caller's commit."""

    def __init__(
        self, engine: Engine, *, clock: Callable[[], float] = time.time, guarded: bool = False
    ) -> None:
        self.engine = engine
        self.clock = clock
        # Guarded (the conductor's): `advance` moves only an operation that is still active
        # and raises `OperationEnded` otherwise, so what a step commits with it (documents,
        # claims) never lands after another writer ended the operation.
        self.guarded = guarded

    def enqueue(
        self,
        kind: str,
        instance_id: str,
        host: str,
        *,
        step: str,
        payload: Mapping[str, Any] | None = None,
        migration_id: str | None = None,
        conn: Connection | None = None,
        later: bool = False,
        owner: str | None = None,
        lease_s: float = 0.0,
    ) -> Operation:
        """A new pending operation, due now, as inserted; inside `conn`'s transaction when given
        (and with `later`, inside a group write, inserted with the group's other rows before it
        commits: `insert_rows`). With `owner`, leased to it for `lease_s` from the start: a
        conductor that drives it itself as soon as it commits, without leasing it again (if it
        does not, the lease runs out and any conductor takes it)."""
        op_id = "op-" + new_uuid().hex
        now = self.clock()
        body = dict(payload or {})
        values = {
            "id": op_id,
            "kind": kind,
            "instance_id": instance_id,
            "host": host,
            "migration_id": migration_id,
            "state": "pending",
            "step": step,
            "payload": json.dumps(body, sort_keys=True),
            "result": None,
            "attempts": 0,
            "created_at": now,
            "updated_at": now,
            "next_at": now,
            "owner": owner,
            "lease_until": None if owner is None else now + lease_s,
        }
        if conn is not None and later:
            insert_rows(conn, operations, [values])
        elif conn is not None:
            conn.execute(_INSERT, values)
        else:
            with self.engine.begin() as own:
                own.execute(_INSERT, values)
        return Operation(
            id=op_id,
            kind=kind,
            instance_id=instance_id,
            host=host,
            migration_id=migration_id,
            state="pending",
            step=step,
            payload=body,
            result=None,
            attempts=0,
            created_at=now,
            next_at=now,
        )

    def advance(
        self,
        conn: Connection,
        op_id: str,
        *,
        state: str | None = None,
        step: str | None = None,
        host: str | None = None,
        payload: Mapping[str, Any] | None = None,
        result: Mapping[str, Any] | None = None,
        retry_in_s: float | None = None,
        attempts: int | None = None,
        later: bool = False,
    ) -> None:
        """Move an operation on, inside the caller's transaction (with what it changes).

        `later`: held to the end of the group write on `conn` (`update_later`), with the other
        works' in one statement; an operation ended by then undoes the group, whose works
        run again alone, where this raises OperationEnded at once (guarded only)."""
        now = self.clock()
        values: dict[str, Any] = {"updated_at": now}
        if state is not None:
            values["state"] = state
            if state in TERMINAL_STATES:
                values.update(owner=None, lease_until=None)
        if step is not None:
            values["step"] = step
        if host is not None:
            values["host"] = host
        if payload is not None:
            values["payload"] = json.dumps(dict(payload), sort_keys=True)
        if result is not None:
            values["result"] = json.dumps(dict(result), sort_keys=True)
        if attempts is not None:
            values["attempts"] = attempts
        values["next_at"] = now + (retry_in_s or 0.0)
        # Held, one statement a shape: a set of columns is always set in one order.
        held = later and self.guarded
        if held and update_later(conn, operations, {"id": op_id}, values, where=_STILL_ACTIVE):
            return
        query = _advance_statement(frozenset(values), self.guarded)
        params = {"v_" + c: v for c, v in values.items()}
        params["k_id"] = op_id
        if not conn.execute(query, params).rowcount and self.guarded:
            raise OperationEnded(f"operation {op_id} has already ended")

    def end_each(self, conn: Connection, op_ids: Sequence[str], *, state: str) -> None:
        """`advance(conn, op_id, state=state)` of each of `op_ids` (a terminal state), in one
        statement (a schedule step's batch of creates ends together: one UPDATE, not one a
        create, with the write lock held)."""
        if state not in TERMINAL_STATES:
            raise ValueError(f"{state} is not a state an operation ends in")
        if not op_ids:
            return
        now = self.clock()
        query = _END_EACH_GUARDED if self.guarded else _END_EACH
        params = {"k_ids": list(op_ids), "v_state": state, "v_at": now}
        changed = conn.execute(query, params).rowcount
        if changed != len(set(op_ids)) and self.guarded:
            raise OperationEnded(f"of operations {', '.join(op_ids)}, one has already ended")

    def end_later(self, conn: Connection, op_id: str, *, state: str) -> bool:
        """Hold the end of `op_id` (in a terminal `state`) to the end of the group write or
        `held_inserts` block on `conn` (`update_later`: the ends held there are one
        statement), and only while it is still active: an operation ended by then undoes the
        block (`HeldWriteMissed`). False where nothing holds writes on `conn` (PostgreSQL,
        or outside such a block): nothing is written, the caller ends it itself."""
        if state not in TERMINAL_STATES:
            raise ValueError(f"{state} is not a state an operation ends in")
        now = self.clock()
        values = {
            "state": state,
            "updated_at": now,
            "next_at": now,
            "owner": None,
            "lease_until": None,
        }
        return update_later(conn, operations, {"id": op_id}, values, where=_STILL_ACTIVE)

    def update(self, op_id: str, **changes: Any) -> None:
        with self.engine.begin() as conn:
            self.advance(conn, op_id, **changes)

    def lease(
        self,
        owner: str,
        *,
        lease_s: float,
        limit: int,
        exclude: frozenset[str] = frozenset(),
    ) -> list[Operation]:
        """Take up to `limit` due operations nobody else holds (compare-and-swap per row);
        `exclude` names operations the caller is already driving."""
        now = self.clock()
        keys = {"k_owner": owner, "k_now": now}
        if self.engine.dialect.name == "postgresql":
            with self.engine.begin() as conn:
                params = {**keys, "k_limit": limit, "v_until": now + lease_s}
                rows = conn.execute(_TAKE_SKIPPING, {**params, "k_exclude": list(exclude)}).all()
            return sorted(map(_row, rows), key=lambda op: (op.created_at, op.id))
        # SQLite has one writer at a time: a poll that finds nothing due takes no write lock.
        with self.engine.connect().execution_options(**READONLY) as conn:
            due = direct_rows(conn, _DUE, {**keys, "k_limit": limit + len(exclude)})
            candidates = [op_id for (op_id,) in due if op_id not in exclude][:limit]
        if not candidates:
            return []
        # One guarded UPDATE takes every candidate still free (each row's condition is checked
        # as it is written, so two conductors never both win one), then the same transaction
        # reads what it won: one commit per poll, not one per operation and a read per win.
        with self.engine.begin() as conn:
            conn.execute(_TAKE, {**keys, "k_ids": candidates, "v_until": now + lease_s})
            rows = conn.execute(_TAKEN, {"k_ids": candidates, "k_owner": owner}).all()
        won = {row.id: _row(row) for row in rows}
        return [won[op_id] for op_id in candidates if op_id in won]

    def renew(self, owner: str, op_ids: Sequence[str], *, lease_s: float) -> None:
        if not op_ids:
            return
        with self.engine.begin() as conn:
            conn.execute(
                update(operations)
                .where(operations.c.owner == owner, operations.c.id.in_(list(op_ids)))
                .values(lease_until=self.clock() + lease_s)
            )

    def let_go(self, owner: str, op_id: str) -> None:
        """Give an operation back (its next try is due later) without finishing it."""
        with self.engine.begin() as conn:
            conn.execute(_LET_GO, {"k_id": op_id, "k_owner": owner})

    def take_over(self, owner: str) -> int:
        """At start-up: every active operation's lease is void (its conductor is gone)."""
        with self.engine.begin() as conn:
            return conn.execute(
                update(operations)
                .where(operations.c.state.in_(ACTIVE_STATES), operations.c.owner != owner)
                .values(owner=None, lease_until=None)
            ).rowcount

    def state_in(self, conn: Connection, op_id: str) -> str | None:
        """The operation's state, inside a transaction the caller holds; None if there is no
        such operation (a check that it is still active, without decoding the rest)."""
        rows = direct_rows(conn, _STATE, {"k_id": op_id})
        return str(rows[0][0]) if rows else None

    def states_in(self, conn: Connection, op_ids: list[str]) -> dict[str, str]:
        """`state_in` of each of `op_ids` in one statement; an id with no operation is left
        out."""
        if not op_ids:
            return {}
        return {row.id: row.state for row in conn.execute(_STATES, {"k_ids": op_ids})}

    def find_in(self, conn: Connection, op_id: str) -> Operation | None:
        """`find` inside a transaction the caller holds."""
        rows = direct_rows(conn, _FIND, {"k_id": op_id})
        return _row(rows[0]) if rows else None

    def find(self, op_id: str) -> Operation | None:
        with self.engine.connect().execution_options(**READONLY) as conn:
            return self.find_in(conn, op_id)

    def active(self, *, instance_id: str | None = None, host: str | None = None) -> list[Operation]:
        """Unfinished operations, oldest first, of an instance or of a host."""
        query = select(operations).where(operations.c.state.in_(ACTIVE_STATES))
        if instance_id is not None:
            query = query.where(operations.c.instance_id == instance_id)
        if host is not None:
            query = query.where(operations.c.host == host)
        with self.engine.connect().execution_options(**READONLY) as conn:
            rows = conn.execute(query.order_by(operations.c.created_at, operations.c.id)).all()
        return [_row(r) for r in rows]

    def active_cleanups(self) -> list[tuple[float, str, str]]:
        """(created_at, id, host) of the unfinished clean-ups and deletes, oldest first: what
        the conductor reads at every poll, without decoding every active operation."""
        with self.engine.connect().execution_options(**READONLY) as conn:
            return [(float(c), str(i), str(h)) for c, i, h in direct_rows(conn, _CLEANUPS, {})]

    def of_migration(self, migration_id: str) -> list[Operation]:
        with self.engine.connect().execution_options(**READONLY) as conn:
            rows = conn.execute(
                select(operations)
                .where(operations.c.migration_id == migration_id)
                .order_by(operations.c.created_at)
            ).all()
        return [_row(r) for r in rows]

    def wait_instances(self, instance_ids: Sequence[str], timeout_s: float) -> bool:
        """Block until the instances have no unfinished operation (or `timeout_s`), including
        those their operations start on the way (a build's schedule, then its spawn)."""
        deadline = time.monotonic() + timeout_s
        while True:
            op_ids = [op.id for i in instance_ids for op in self.active(instance_id=i)]
            if not op_ids:
                return True
            if not self.wait(op_ids, max(0.0, deadline - time.monotonic())):
                return False

    def wait(self, op_ids: Sequence[str], timeout_s: float, *, poll_s: float = 0.02) -> bool:
        """Block until every operation is finished or `timeout_s` passed; True when finished."""
        if not op_ids:
            return True
        deadline = time.monotonic() + timeout_s
        wanted = list(op_ids)
        while True:
            with self.engine.connect().execution_options(**READONLY) as conn:
                open_n = conn.execute(
                    select(operations.c.id).where(
                        and_(
                            operations.c.id.in_(wanted),
                            operations.c.state.in_(ACTIVE_STATES),
                        )
                    )
                ).all()
            if not open_n:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)
