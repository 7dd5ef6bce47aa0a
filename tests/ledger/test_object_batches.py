"""Several documents read or created in one statement (a create's flavor and image; its servers
and their action records) behave as one at a time would: only what exists is found, and a
batch with one id that exists already creates none of its documents."""

from __future__ import annotations

import pytest
from sqlalchemy import event
from sqlalchemy.exc import IntegrityError

from stowage.ledger import Ledger
from stowage.ledger.objects import NewDocument, ObjectStore


def _statements(ledger: Ledger) -> list[str]:
    seen: list[str] = []

    @event.listens_for(ledger.engine, "before_cursor_execute")
    def _count(_conn: object, _cursor: object, statement: str, *_args: object) -> None:
        if statement.split(maxsplit=1)[0].upper() in ("SELECT", "INSERT"):
            seen.append(statement)

    return seen


def _instances_and_a_flavor(ledger: Ledger, count: int) -> ObjectStore:
    """A store of `count` instances (vm-0, vm-1, ...: body {"n": i}) and flavor 1."""
    store = ObjectStore(ledger.engine)
    with ledger.engine.begin() as conn:
        store.create_each_in(
            conn, [NewDocument("instance", f"vm-{i}", {"n": i}) for i in range(count)]
        )
    store.create("flavor", "1", {"name": "m1.tiny"})
    return store


def test_find_each_reads_the_pairs_that_exist_in_one_statement(db_url: str) -> None:
    ledger = Ledger.open(db_url)
    try:
        store = ObjectStore(ledger.engine)
        store.create("flavor", "1", {"name": "m1.tiny"})
        store.create("image", "1", {"name": "cirros"})  # the same id, another kind
        store.create("image", "2", {"name": "other"})
        seen = _statements(ledger)
        found = store.find_each([("flavor", "1"), ("image", "1"), ("flavor", "missing")])
        assert len(seen) == 1
        assert sorted(found) == [("flavor", "1"), ("image", "1")]
        assert found[("image", "1")].body == {"name": "cirros"}
        assert found[("flavor", "1")] == store.find("flavor", "1")
    finally:
        ledger.close()


def test_find_each_searches_the_key_rather_than_scan_every_document(db_url: str) -> None:
    """A create reads its flavor and image with `find_each`: the plan searches the primary
    key, of each kind, whatever else the table holds (it scanned the table on SQLite)."""
    ledger = Ledger.open(db_url)
    try:
        store = _instances_and_a_flavor(ledger, 300)
        seen = _statements(ledger)
        params: list[object] = []

        @event.listens_for(ledger.engine, "before_cursor_execute")
        def _keep(_c: object, _cur: object, _s: str, parameters: object, *_a: object) -> None:
            params.append(parameters)

        found = store.find_each([("flavor", "1"), ("instance", "vm-7"), ("instance", "vm-9")])
        assert sorted(found) == [("flavor", "1"), ("instance", "vm-7"), ("instance", "vm-9")]
        assert found[("instance", "vm-9")].body == {"n": 9}
        [statement] = seen
        with ledger.engine.connect() as conn:
            if ledger.engine.dialect.name == "sqlite":
                plan = conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", params[0])
                details = [str(row[-1]) for row in plan]
                assert not any(d.startswith("SCAN objects") for d in details), details
                assert any("USING INDEX sqlite_autoindex_objects_1" in d for d in details)
            else:
                conn.exec_driver_sql("SET enable_seqscan = off")
                plan = conn.exec_driver_sql(f"EXPLAIN {statement}", params[0])
                details = [str(row[0]) for row in plan]
                assert not any("Seq Scan" in d for d in details), details
    finally:
        ledger.close()


def test_find_each_of_few_ids_renders_nothing_per_call_and_of_many_still_reads_all(
    db_url: str,
) -> None:
    """A create's flavor and image (a few ids of each kind) are bound one by one in a
    statement compiled once for that shape; an expanding list was rendered into the
    statement on every call (post-compile), a fifth of the read. Past 16 ids of a kind the
    list expands again, and every id is still read."""
    ledger = Ledger.open(db_url)
    try:
        store = _instances_and_a_flavor(ledger, 40)
        rendered: list[bool] = []

        @event.listens_for(ledger.engine, "before_cursor_execute")
        def _seen(_c: object, _cur: object, _s: str, _p: object, context: object, _m: bool) -> None:
            compiled = getattr(context, "compiled", None)
            rendered.append(bool(compiled is not None and compiled.post_compile_params))

        for _ in range(2):
            found = store.find_each([("flavor", "1"), ("instance", "vm-3"), ("instance", "x")])
            assert sorted(found) == [("flavor", "1"), ("instance", "vm-3")]
        assert rendered == [False, False]
        for count in (16, 17, 40):
            keys = [("instance", f"vm-{i}") for i in range(count)] + [("flavor", "1")]
            found = store.find_each(keys)
            assert sorted(found) == sorted(keys)
            assert found[("instance", f"vm-{count - 1}")].body == {"n": count - 1}
        assert rendered[2:] == [False, True, True]
    finally:
        ledger.close()


def test_create_each_in_writes_all_in_one_statement_or_none(db_url: str) -> None:
    ledger = Ledger.open(db_url)
    try:
        store = ObjectStore(ledger.engine)
        new = [
            NewDocument("instance", "vm-1", {"name": "a"}, "p", "a"),
            NewDocument("instance_action", "req:vm-1", {"action": "create"}, "vm-1", "create"),
        ]
        seen = _statements(ledger)
        with ledger.engine.begin() as conn:
            made = store.create_each_in(conn, new)
        assert len(seen) == 1
        assert [(d.kind, d.id, d.project_id, d.name) for d in made] == [
            ("instance", "vm-1", "p", "a"),
            ("instance_action", "req:vm-1", "vm-1", "create"),
        ]
        assert store.find("instance", "vm-1") == made[0]
        again = [NewDocument("instance", "vm-2", {}), NewDocument("instance", "vm-1", {})]
        with pytest.raises(IntegrityError), ledger.engine.begin() as conn:
            store.create_each_in(conn, again)
        assert store.find("instance", "vm-2") is None
    finally:
        ledger.close()
