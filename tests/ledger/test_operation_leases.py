"""Leasing due operations (ledger/operations.py): one guarded UPDATE per poll, and still
every operation is held by one conductor at a time, on SQLite and PostgreSQL."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import event, select

from stowage.ledger import Ledger
from stowage.ledger.operations import OperationEnded, Operations
from stowage.ledger.schema import operations


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def ledger(db_url: str) -> Iterator[Ledger]:
    ledger = Ledger.open(db_url)
    yield ledger
    ledger.close()


def test_a_poll_takes_what_is_free_and_only_that(ledger: Ledger) -> None:
    clock = Clock()
    ops = Operations(ledger.engine, clock=clock)
    ids = []
    for n in range(5):
        ids.append(ops.enqueue("build", f"i{n}", "h", step="spawn").id)
        clock.now += 1  # oldest first
    first = ops.lease("a", lease_s=60, limit=3)
    assert [op.id for op in first] == ids[:3]  # up to the limit
    second = ops.lease("b", lease_s=60, limit=10)
    assert [op.id for op in second] == ids[3:]  # a's leases hold
    assert ops.lease("b", lease_s=60, limit=10, exclude=frozenset(ids[3:])) == []
    clock.now += 61  # a's leases run out: b may take them
    assert [op.id for op in ops.lease("b", lease_s=60, limit=10)] == ids


def test_racing_conductors_never_share_an_operation(ledger: Ledger) -> None:
    ops = Operations(ledger.engine)
    ids = {ops.enqueue("build", f"i{n}", "h", step="spawn").id for n in range(60)}
    won: dict[str, list[str]] = {}
    barrier = threading.Barrier(4)

    def conductor(owner: str) -> None:
        barrier.wait()
        taken: list[str] = []
        for _ in range(10):
            taken += [op.id for op in ops.lease(owner, lease_s=60, limit=4)]
        won[owner] = taken

    threads = [threading.Thread(target=conductor, args=(f"c{n}",)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    every = [op_id for taken in won.values() for op_id in taken]
    # A conductor may lease again what it holds (as before); no two conductors hold one.
    owners = {op_id: {o for o, taken in won.items() if op_id in taken} for op_id in every}
    assert all(len(held_by) == 1 for held_by in owners.values())
    assert set(every) <= ids


@pytest.mark.parametrize(
    "db_url", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
def test_conductors_polling_at_once_on_postgresql_take_different_operations(
    ledger: Ledger,
) -> None:
    """Two polls whose takes run at the same moment: each takes its own share of what is
    due (SKIP LOCKED), rather than both choosing the same oldest operations and one of them
    winning nothing (as a read of the due list before the take did)."""
    clock = Clock()
    ops = Operations(ledger.engine, clock=clock)
    ids = []
    for n in range(10):
        ids.append(ops.enqueue("build", f"i{n}", "h", step="spawn").id)
        clock.now += 1
    at_take = threading.Barrier(2, timeout=10)

    def meet(_conn: Any, _cursor: Any, statement: str, *_rest: Any) -> None:
        if statement.lstrip().startswith(("UPDATE operations", "WITH due")):
            at_take.wait()

    event.listen(ledger.engine, "before_cursor_execute", meet)
    won: dict[str, list[str]] = {}

    def conductor(owner: str) -> None:
        won[owner] = [op.id for op in ops.lease(owner, lease_s=60, limit=5)]

    threads = [threading.Thread(target=conductor, args=(f"c{n}",)) for n in range(2)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        event.remove(ledger.engine, "before_cursor_execute", meet)
    assert sorted(len(taken) for taken in won.values()) == [5, 5], won
    assert sorted(won["c0"] + won["c1"]) == sorted(ids)
    for taken in won.values():
        assert taken == sorted(taken, key=ids.index)  # oldest first, as before


def test_a_batch_of_operations_ends_in_one_statement(ledger: Ledger) -> None:
    """`end_each`: the listed operations done, leases dropped, in one UPDATE; the others
    untouched; with the guard, one that had already ended refuses the whole batch."""
    clock = Clock()
    ops = Operations(ledger.engine, clock=clock, guarded=True)
    ids = [ops.enqueue("build", f"i{n}", "h", step="schedule").id for n in range(4)]
    assert len(ops.lease("c", lease_s=60, limit=10)) == 4
    updates: list[str] = []

    @event.listens_for(ledger.engine, "before_cursor_execute")
    def _count(_c: Any, _cur: Any, sql: str, *_rest: Any) -> None:
        if sql.lstrip().upper().startswith("UPDATE"):
            updates.append(sql)

    clock.now += 5
    with ledger.engine.begin() as conn:
        ops.end_each(conn, ids[:3], state="done")
    assert len(updates) == 1
    assert [ops.find(op_id).state for op_id in ids] == ["done", "done", "done", "pending"]
    owners = dict(_owners(ledger))
    assert [owners[op_id] for op_id in ids] == [
        (None, None),
        (None, None),
        (None, None),
        ("c", 1060.0),
    ]
    with pytest.raises(OperationEnded), ledger.engine.begin() as conn:
        ops.end_each(conn, [ids[2], ids[3]], state="failed")  # ids[2] has ended
    assert [ops.find(op_id).state for op_id in ids[2:]] == ["done", "pending"]  # rolled back
    with pytest.raises(ValueError), ledger.engine.begin() as conn:
        ops.end_each(conn, [ids[3]], state="pending")


def _owners(ledger: Ledger) -> list[tuple[str, tuple[Any, Any]]]:
    with ledger.engine.connect() as conn:
        rows = conn.execute(select(operations.c.id, operations.c.owner, operations.c.lease_until))
        return [(row.id, (row.owner, row.lease_until)) for row in rows]
