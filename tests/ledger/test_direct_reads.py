"""Documents read by key on SQLite's own connection (`db.direct_rows`) are the documents
SQLAlchemy's execution read, inside the same transaction: a read transaction reads as of one
moment, a write transaction sees its own writes, and the driver's errors are SQLAlchemy's."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import bindparam, event, select
from sqlalchemy.exc import OperationalError

from stowage.ledger import Ledger
from stowage.ledger.db import direct_rows, make_engine, sqlite_url
from stowage.ledger.objects import ObjectStore
from stowage.ledger.schema import objects


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    opened = Ledger.open(sqlite_url(tmp_path / "ledger.db"))
    try:
        yield opened
    finally:
        opened.close()


def _through_sqlalchemy(ledger: Ledger) -> list[str]:
    """The statements that go through SQLAlchemy's execution from now on (a statement-level
    event: the direct path leaves it out, and listening to it does not turn that path off)."""
    seen: list[str] = []

    @event.listens_for(ledger.engine, "before_execute")
    def _note(_conn: object, statement: Any, *_args: object) -> None:
        seen.append(str(statement))

    return seen


def test_reads_by_key_go_straight_to_sqlite_and_find_the_same_documents(ledger: Ledger) -> None:
    store = ObjectStore(ledger.engine)
    store.create("flavor", "1", {"name": "m1.tiny", "big": 2**70, "ram": 512})
    store.create("image", "1", {"name": "cirros"}, project_id="p1", name="cirros")
    for i in range(20):
        store.create("instance", f"vm-{i}", {"n": i})
    with ledger.engine.connect() as conn:
        rows = conn.execute(select(objects).order_by(objects.c.kind, objects.c.id)).all()
    wanted = {(r.kind, r.id): (r.project_id, r.name, r.created_at, r.updated_at) for r in rows}

    driver: list[str] = []
    seen = _through_sqlalchemy(ledger)
    with store.reading() as conn:
        conn.connection.dbapi_connection.set_trace_callback(driver.append)  # type: ignore[union-attr]
        try:
            flavor = store.find("flavor", "1")
            missing = store.find("flavor", "2")
            pair = store.find_each([("flavor", "1"), ("image", "1"), ("image", "2")])
            sixteen = store.find_each(("instance", f"vm-{i}") for i in range(16))
            seventeen = store.find_each(("instance", f"vm-{i}") for i in range(17))
        finally:
            conn.connection.dbapi_connection.set_trace_callback(None)  # type: ignore[union-attr]

    assert flavor is not None and missing is None
    assert flavor.body == {"name": "m1.tiny", "big": 2**70, "ram": 512}
    assert pair[("flavor", "1")] == flavor and sorted(pair) == [("flavor", "1"), ("image", "1")]
    image = pair[("image", "1")]
    assert (image.project_id, image.name, image.body) == ("p1", "cirros", {"name": "cirros"})
    assert sorted(d.body["n"] for d in sixteen.values()) == list(range(16))
    assert sorted(d.body["n"] for d in seventeen.values()) == list(range(17))
    for doc in (flavor, image, *sixteen.values()):
        assert (doc.project_id, doc.name, doc.created_at, doc.updated_at) == wanted[
            (doc.kind, doc.id)
        ]
    # Only the read of 17 ids (one expanding parameter, SQL made per call) went through
    # SQLAlchemy; the driver ran all five reads, after the one BEGIN.
    assert len(seen) == 1 and "IN (__[POSTCOMPILE_ids0])" in seen[0]
    assert driver[0] == "BEGIN" and sum(s.startswith("SELECT") for s in driver) == 5


def test_a_statements_own_values_and_a_float_parameter_bind_as_sqlalchemy_binds_them(
    ledger: Ledger,
) -> None:
    """A fixed IN list and a literal are the statement's (rendered one parameter per value);
    a float column's parameter is converted by its type (an integer given binds as a float)."""
    store = ObjectStore(ledger.engine, clock=iter(range(1, 100)).__next__)
    for kind, id in [("flavor", "a"), ("image", "b"), ("port", "c"), ("flavor", "d")]:
        store.create(kind, id, {}, name="n" if id != "d" else "other")
    statement = (
        select(objects.c.kind, objects.c.id)
        .where(
            objects.c.kind.in_(["flavor", "image"]),
            objects.c.name == "n",
            objects.c.created_at <= bindparam("until"),
        )
        .order_by(objects.c.id)
    )
    with ledger.engine.connect() as conn:
        wanted = [tuple(r) for r in conn.execute(statement, {"until": 2})]
    seen = _through_sqlalchemy(ledger)
    with ledger.engine.connect() as conn:
        got = [tuple(r) for r in direct_rows(conn, statement, {"until": 2})]
    assert got == wanted == [("flavor", "a"), ("image", "b")]
    assert seen == []


def test_with_a_cursor_listener_every_read_goes_through_sqlalchemy(ledger: Ledger) -> None:
    store = ObjectStore(ledger.engine)
    store.create("flavor", "1", {"name": "m1.tiny"})
    counted: list[str] = []

    def count(_conn: object, _cursor: object, statement: str, *_args: object) -> None:
        counted.append(statement)

    event.listen(ledger.engine, "before_cursor_execute", count)
    try:
        assert store.find("flavor", "1") is not None
        assert store.find_each([("flavor", "1"), ("image", "1")]).keys() == {("flavor", "1")}
    finally:
        event.remove(ledger.engine, "before_cursor_execute", count)
    assert len(counted) == 2 and all(s.startswith("SELECT") for s in counted)


def test_a_read_transaction_reads_as_of_its_first_read(ledger: Ledger) -> None:
    """The direct read begins the connection's transaction as SQLAlchemy's first statement
    would: a write committed between two reads of one `reading()` is not seen by the second
    (SQLite's connection alone runs each statement in a transaction of its own)."""
    store = ObjectStore(ledger.engine)
    store.create("flavor", "1", {"v": 1})
    with store.reading():
        first = store.find("flavor", "1")
        # Another thread: this one holds a read transaction, and the suite's guard refuses a
        # second connection opened by the same thread inside it.
        writer = threading.Thread(target=store.update, args=("flavor", "1", {"v": 2}))
        writer.start()
        writer.join()
        again = store.find("flavor", "1")
        both = store.find_each([("flavor", "1")])
    assert first is not None and again is not None
    assert first.body == again.body == both[("flavor", "1")].body == {"v": 1}
    latest = store.find("flavor", "1")
    assert latest is not None and latest.body == {"v": 2}


def test_a_read_inside_a_write_sees_its_own_writes(ledger: Ledger) -> None:
    store = ObjectStore(ledger.engine)
    with store.writing() as conn:
        store.create_in(conn, "flavor", "1", {"v": 1})
        found = store.find_in(conn, "flavor", "1")
        both = store.find_each_in(conn, [("flavor", "1"), ("flavor", "2")])
    assert found is not None and found.body == {"v": 1}
    assert both.keys() == {("flavor", "1")}


def test_the_drivers_error_is_sqlalchemys(tmp_path: Path) -> None:
    """A ledger with no schema: the read fails as it did through SQLAlchemy."""
    engine = make_engine(sqlite_url(tmp_path / "empty.db"))
    try:
        store = ObjectStore(engine)
        with pytest.raises(OperationalError, match="no such table: objects"):
            store.find("flavor", "1")
        with pytest.raises(OperationalError, match="no such table: objects"):
            store.find_each([("flavor", "1"), ("image", "1")])
    finally:
        engine.dispose()
