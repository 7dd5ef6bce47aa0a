"""The store's and the operations' statements are built once per shape and reused with other
values: each call must still see only its own filters and values (a statement cached for one
set of filters is never served to another)."""

from __future__ import annotations

import pytest

from stowage.domain.errors import NotFound
from stowage.ledger import Ledger
from stowage.ledger.objects import ObjectStore
from stowage.ledger.operations import OperationEnded, Operations


def test_list_filters_each_apply_whatever_was_asked_before(db_url: str) -> None:
    ledger = Ledger.open(db_url)
    try:
        store = ObjectStore(ledger.engine)
        store.create("port", "p1", {"device_id": "vm-a"}, project_id="x", name="one")
        store.create("port", "p2", {"device_id": "vm-b"}, project_id="x", name="two")
        store.create("port", "p3", {"device_id": "vm-a"}, project_id="y", name="one")
        store.create("image", "p1", {"name": "same id, other kind"}, project_id="x")

        def ids(**filters: object) -> list[str]:
            return [d.id for d in store.list(**filters)]  # type: ignore[arg-type]

        # Each shape twice, with other values, in an order that reuses the cached statements.
        assert ids(kind="port") == ["p1", "p2", "p3"]
        assert ids(kind="image") == ["p1"]
        assert ids(kind="port", ref="vm-a") == ["p1", "p3"]
        assert ids(kind="port", ref="vm-b") == ["p2"]
        assert ids(kind="port", project_id="y") == ["p3"]
        assert ids(kind="port", project_id="x", name="one") == ["p1"]
        assert ids(kind="port", project_id="y", name="two") == []
        assert ids(kind="port", ids=["p3", "p1", "nope"]) == ["p1", "p3"]
        assert ids(kind="port", ids=[]) == []
        assert ids(kind="port", limit=2) == ["p1", "p2"]
        assert ids(kind="port", limit=1, project_id="y") == ["p3"]
        assert ids(kind="port", marker="p1", limit=1) == ["p2"]
        assert ids(kind="port", ref="vm-a") == ["p1", "p3"]
        with pytest.raises(ValueError):
            store.list("image", ref="vm-a")
    finally:
        ledger.close()


def test_writes_by_key_touch_only_their_document(db_url: str) -> None:
    ledger = Ledger.open(db_url)
    try:
        store = ObjectStore(ledger.engine)
        store.create("flavor", "1", {"v": 1})
        store.create("image", "1", {"v": 1})
        assert store.swap("flavor", "1", {"v": 1}, {"v": 2})
        assert not store.swap("flavor", "1", {"v": 1}, {"v": 3})  # it moved: no swap
        with ledger.engine.begin() as conn:
            store.update_in(conn, "image", "1", {"v": 5, "kept": 0})
        with ledger.engine.begin() as conn:
            store.update_in(conn, "image", "1", {"v": 6, "kept": 1}, keep=("kept",))
            store.rename_in(conn, "image", "1", "cirros")
        assert store.get("flavor", "1").body == {"v": 2}
        image = store.get("image", "1")
        assert (image.body, image.name) == ({"v": 6, "kept": 0}, "cirros")
        with ledger.engine.begin() as conn, pytest.raises(NotFound):
            store.update_in(conn, "image", "missing", {"v": 1})
        assert store.delete("flavor", "1")
        assert not store.delete("flavor", "1")
        assert store.find("image", "1") is not None
    finally:
        ledger.close()


def test_advance_with_each_set_of_columns_and_its_guard(db_url: str) -> None:
    ledger = Ledger.open(db_url)
    try:
        ops = Operations(ledger.engine, guarded=True)
        first = ops.enqueue("build", "vm-1", "h1", step="schedule").id
        second = ops.enqueue("build", "vm-2", "h2", step="schedule").id
        with ledger.engine.begin() as conn:
            ops.advance(conn, first, step="spawn", host="h3")
            ops.advance(conn, second, payload={"a": 1})
        one, two = ops.find(first), ops.find(second)
        assert one is not None and (one.step, one.host, one.payload) == ("spawn", "h3", {})
        assert two is not None and (two.step, two.host, two.payload) == ("schedule", "h2", {"a": 1})
        with ledger.engine.begin() as conn:
            ops.advance(conn, first, state="done", result={"ok": True})
        with ledger.engine.begin() as conn, pytest.raises(OperationEnded):
            ops.advance(conn, first, step="spawn")  # ended: the guard refuses it
        leased = ops.lease("c1", lease_s=30, limit=5)
        assert [op.id for op in leased] == [second]
        assert ops.lease("c2", lease_s=30, limit=5) == []  # c1 holds it
        ops.let_go("c2", second)  # not c2's to give back
        assert ops.lease("c2", lease_s=30, limit=5) == []
        ops.let_go("c1", second)
        assert [op.id for op in ops.lease("c2", lease_s=30, limit=1)] == [second]
    finally:
        ledger.close()
