"""`ObjectStore.write_together` with group writes (`stowage up`'s SQLite ledger): the works that
ask at one moment commit in one transaction, and each caller gets its own answer once the
commit is made: its value, or its own exception with nothing of it written. The rows the works
ask to insert `later` are written together, in one statement a table, before the commit."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Connection, event

from stowage.domain.errors import ConflictError
from stowage.ledger import Ledger
from stowage.ledger.objects import NewDocument, ObjectStore, flush_inserts


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'ledger.db'}")
    try:
        yield ledger
    finally:
        ledger.close()


def _commits(ledger: Ledger) -> list[int]:
    made: list[int] = []

    @event.listens_for(ledger.engine, "commit")
    def _count(_conn: object) -> None:
        made.append(1)

    return made


def _held_writer(store: ObjectStore) -> tuple[threading.Event, threading.Thread]:
    """A first work that holds the writer thread until the returned event is set, so that
    what is asked meanwhile waits and goes in the next group."""
    release = threading.Event()
    holding = threading.Event()

    def hold(conn: Connection) -> None:
        store.create_in(conn, "thing", "first", {})
        holding.set()
        assert release.wait(30)

    first = threading.Thread(target=store.write_together, args=(hold,))
    first.start()
    assert holding.wait(30), "the writer did not start the first work"
    return release, first


def _asked(store: ObjectStore, works: list[Callable[[Connection], Any]]) -> list[Any]:
    """Each of `works` asked from a thread of its own while the writer is held, then the
    writer released; each one's answer, or the exception it got."""
    return _called(store, [functools.partial(store.write_together, work) for work in works])


def _called(store: ObjectStore, calls: list[Callable[[], Any]]) -> list[Any]:
    """Each of `calls` (each asking the writer for one work) made from a thread of its own
    while the writer is held, then the writer released; each one's answer or exception."""
    release, first = _held_writer(store)
    group = store._group
    assert group is not None
    with ThreadPoolExecutor(len(calls)) as pool:
        try:
            asked = [pool.submit(call) for call in calls]
            deadline = time.monotonic() + 30
            while group._waiting.qsize() < len(calls):
                assert time.monotonic() < deadline, "the works were not all asked"
                time.sleep(0.01)
        finally:
            release.set()
            first.join(30)
        answers: list[Any] = []
        for future in asked:
            try:
                answers.append(future.result(30))
            except Exception as exc:
                answers.append(exc)
    return answers


def test_the_works_of_one_moment_commit_in_one_transaction(ledger: Ledger) -> None:
    store = ObjectStore(ledger.engine, group_writes=True)
    commits = _commits(ledger)

    def make(n: int) -> Callable[[Connection], Any]:
        return lambda conn: store.create_in(conn, "thing", f"t{n}", {"n": n}).id

    answers = _asked(store, [make(n) for n in range(10)])
    assert answers == [f"t{n}" for n in range(10)]
    # The first work's commit, then one for the ten that waited for it.
    assert len(commits) == 2
    assert sorted(store.ids("thing")) == sorted(["first", *(f"t{n}" for n in range(10))])


def test_a_work_that_fails_undoes_only_itself(ledger: Ledger) -> None:
    store = ObjectStore(ledger.engine, group_writes=True)
    store.create("thing", "taken", {})

    def good(n: int) -> Callable[[Connection], Any]:
        return lambda conn: store.create_in(conn, "thing", f"ok{n}", {}).id

    def bad(conn: Connection) -> None:
        store.create_in(conn, "thing", "half", {})  # written: the group is undone, each alone
        raise ConflictError("this one fails")

    def duplicate(conn: Connection) -> None:
        store.create("thing", "taken", {})  # the database refuses it: a ConflictError too

    answers = _asked(store, [good(0), bad, good(1), duplicate, good(2)])
    assert answers[0] == "ok0" and answers[2] == "ok1" and answers[4] == "ok2"
    assert isinstance(answers[1], ConflictError) and "this one fails" in str(answers[1])
    assert isinstance(answers[3], ConflictError)
    assert store.find("thing", "half") is None
    assert sorted(store.ids("thing")) == ["first", "ok0", "ok1", "ok2", "taken"]


def test_a_failed_commit_runs_each_work_again_alone(ledger: Ledger) -> None:
    store = ObjectStore(ledger.engine, group_writes=True)
    refused: list[int] = []

    @event.listens_for(ledger.engine, "commit")
    def _refuse_a_group(conn: Connection) -> None:
        # The group's commit (the one with more than the first work's document) fails once.
        if not refused and conn.exec_driver_sql("SELECT count(*) FROM objects").scalar() > 1:
            refused.append(1)
            raise RuntimeError("the disk is full")

    def make(n: int) -> Callable[[Connection], Any]:
        return lambda conn: store.create_in(conn, "thing", f"t{n}", {"n": n}).id

    answers = _asked(store, [make(n) for n in range(4)])
    assert refused == [1]
    assert answers == ["t0", "t1", "t2", "t3"]
    assert sorted(store.ids("thing")) == ["first", "t0", "t1", "t2", "t3"]


def test_the_answer_comes_after_the_commit(ledger: Ledger) -> None:
    """What a caller gets back is committed: another connection reads it at once."""
    store = ObjectStore(ledger.engine, group_writes=True)
    other = ObjectStore(ledger.engine)
    for n in range(20):
        store.write_together(lambda conn, n=n: store.create_in(conn, "thing", f"t{n}", {}))
        assert other.find("thing", f"t{n}") is not None


def test_inside_an_open_write_it_joins_that_transaction(ledger: Ledger) -> None:
    store = ObjectStore(ledger.engine, group_writes=True)
    with pytest.raises(ConflictError), store.writing() as conn:
        store.create_in(conn, "thing", "outer", {})
        store.write_together(lambda inner: store.create_in(inner, "thing", "inner", {}))
        assert store.find("thing", "inner") is not None  # seen in the same transaction
        raise ConflictError("the outer write fails")
    assert store.find("thing", "outer") is None
    assert store.find("thing", "inner") is None
    assert store._group is not None and store._group._thread is None  # never needed


def test_without_group_writes_each_work_commits_on_its_own_thread(ledger: Ledger) -> None:
    store = ObjectStore(ledger.engine)
    commits = _commits(ledger)
    threads: list[str] = []

    def work(conn: Connection) -> None:
        threads.append(threading.current_thread().name)
        store.create_in(conn, "thing", f"t{len(threads)}", {})

    store.write_together(work)
    store.write_together(work)
    assert threads == [threading.current_thread().name] * 2
    assert len(commits) == 2


def test_creates_of_one_group_count_each_other_against_the_quota(tmp_path: Path) -> None:
    """Twelve creates of one project, one server each, asked while the writer is held so that
    they commit as one group, against a limit of 5 instances: each counts what the ones before
    it in the group made, so 5 are made and 7 refused, as one at a time would have it."""
    from tests.agent.test_use_cases import instance_count, open_cloud, request

    from stowage.domain.errors import QuotaExceeded
    from stowage.services.compute import build_servers

    cloud = open_cloud(f"sqlite:///{tmp_path / 'ledger.db'}", tmp_path / "state", group_writes=True)
    try:
        cloud.objects.create("quota", "p", {"instances": 5, "cores": -1, "ram": -1})
        answers = _called(
            cloud.objects,
            [functools.partial(build_servers, cloud, request(1), f"req-{n}") for n in range(12)],
        )
        made = [a for a in answers if isinstance(a, list)]
        refused = [a for a in answers if isinstance(a, QuotaExceeded)]
        assert (len(made), len(refused)) == (5, 7)
        assert instance_count(cloud) == 5
    finally:
        cloud.ledger.close()


def _statements(ledger: Ledger) -> list[str]:
    made: list[str] = []

    @event.listens_for(ledger.engine, "before_cursor_execute")
    def _count(_c: object, _cur: object, sql: str, *_rest: object) -> None:
        made.append(sql)

    return made


def _later(store: ObjectStore, n: int, *, fail: bool = False) -> Callable[[Connection], Any]:
    def work(conn: Connection) -> str:
        made = [NewDocument("thing", f"t{n}", {"n": n}), NewDocument("note", f"t{n}", {})]
        store.create_each_in(conn, made, later=True)
        if fail:
            raise ConflictError(f"work {n} fails")
        return f"t{n}"

    return work


def test_the_rows_a_group_inserts_later_are_one_statement(ledger: Ledger) -> None:
    """Ten works of two documents each: one INSERT of twenty rows before the commit, and no
    savepoint a work (each was two statements more, the write lock held)."""
    store = ObjectStore(ledger.engine, group_writes=True)
    release, first = _held_writer(store)
    group = store._group
    assert group is not None
    made = _statements(ledger)
    with ThreadPoolExecutor(10) as pool:
        try:
            asked = [pool.submit(store.write_together, _later(store, n)) for n in range(10)]
            while group._waiting.qsize() < 10:
                time.sleep(0.01)
            made.clear()  # what the first work's transaction made, if anything, after this
        finally:
            release.set()
            first.join(30)
        assert [future.result(30) for future in asked] == [f"t{n}" for n in range(10)]
    verbs = [sql.split(None, 1)[0].upper() for sql in made]
    assert verbs.count("INSERT") == 1, made
    assert "SAVEPOINT" not in verbs and "RELEASE" not in verbs, made
    assert sorted(store.ids("thing")) == sorted(["first", *(f"t{n}" for n in range(10))])
    assert len(store.ids("note")) == 10


def test_a_work_that_fails_drops_the_rows_it_asked_for(ledger: Ledger) -> None:
    store = ObjectStore(ledger.engine, group_writes=True)
    answers = _asked(store, [_later(store, 0), _later(store, 1, fail=True), _later(store, 2)])
    assert answers[0] == "t0" and answers[2] == "t2"
    assert isinstance(answers[1], ConflictError)
    assert sorted(store.ids("thing")) == ["first", "t0", "t2"]
    assert sorted(store.ids("note")) == ["t0", "t2"]


def test_a_work_that_fails_after_writing_its_held_rows_leaves_none(ledger: Ledger) -> None:
    """A work that flushes the group's held rows (its own among them) and then raises: the
    rows of the works before it stay, its own do not (the group runs again, each alone)."""
    store = ObjectStore(ledger.engine, group_writes=True)

    def flushed_then_fails(conn: Connection) -> None:
        _later(store, 1)(conn)
        flush_inserts(conn)
        raise ConflictError("fails after its rows were written")

    answers = _asked(store, [_later(store, 0), flushed_then_fails, _later(store, 2)])
    assert answers[0] == "t0" and answers[2] == "t2"
    assert isinstance(answers[1], ConflictError)
    assert sorted(store.ids("thing")) == ["first", "t0", "t2"]


def test_a_group_whose_later_rows_collide_runs_each_work_alone(ledger: Ledger) -> None:
    """Two works insert the same document later: the group's insert fails, nothing of it is
    kept, and each work runs again alone: the first makes it, the second is refused."""
    store = ObjectStore(ledger.engine, group_writes=True)
    answers = _asked(store, [_later(store, 0), _later(store, 1), _later(store, 0)])
    assert answers[:2] == ["t0", "t1"]
    assert isinstance(answers[2], Exception) and "UNIQUE" in str(answers[2])
    assert sorted(store.ids("thing")) == ["first", "t0", "t1"]


def test_flush_inserts_shows_the_group_its_rows(ledger: Ledger) -> None:
    """A work that reads what the works before it asked to insert flushes them first."""
    store = ObjectStore(ledger.engine, group_writes=True)

    def count(flush: bool) -> Callable[[Connection], Any]:
        def work(conn: Connection) -> int:
            if flush:
                flush_inserts(conn)
            sql = "SELECT count(*) FROM objects WHERE kind = 'thing'"
            return conn.exec_driver_sql(sql).scalar()

        return work

    answers = _asked(store, [_later(store, 0), _later(store, 1), count(False), count(True)])
    # "first" is committed before the group; t0 and t1 are held until the flush.
    assert answers == ["t0", "t1", 1, 3]
    assert sorted(store.ids("thing")) == ["first", "t0", "t1"]


def test_the_creates_of_a_group_read_the_quota_limits_once(tmp_path: Path) -> None:
    """Eight creates of one project in one group: the project's limits are read once for the
    group, not once a create (no create writes a limit), and each still counts the ones
    before it."""
    from tests.agent.test_use_cases import instance_count, open_cloud, request

    from stowage.domain.errors import QuotaExceeded
    from stowage.services import quotas
    from stowage.services.compute import build_servers

    cloud = open_cloud(f"sqlite:///{tmp_path / 'ledger.db'}", tmp_path / "state", group_writes=True)
    try:
        cloud.objects.create("quota", "p", {"instances": 6, "cores": -1, "ram": -1})
        made = _statements(cloud.ledger)
        answers = _called(
            cloud.objects,
            [functools.partial(build_servers, cloud, request(1), f"req-{n}") for n in range(8)],
        )
        assert [type(a) for a in answers].count(QuotaExceeded) == 2, answers
        assert instance_count(cloud) == 6
        limits = " ".join(str(quotas._LIMITS.compile(dialect=cloud.ledger.engine.dialect)).split())
        assert [" ".join(sql.split()) for sql in made].count(limits) == 1, made
    finally:
        cloud.ledger.close()


def _swap_later(store: ObjectStore, n: int, *, old: int = 0) -> Callable[[Connection], Any]:
    """A work that reads thing t{n} and swaps its `v` from `old` to n + 100, held to the end
    of the group; its answer is what `swap_in` said."""

    def work(conn: Connection) -> bool:
        found = store.find_in(conn, "thing", f"t{n}")
        assert found is not None
        return store.swap_in(conn, "thing", f"t{n}", {"v": old}, {"v": n + 100}, later=True)

    return work


def test_the_swaps_a_group_holds_are_one_statement(ledger: Ledger) -> None:
    """Ten works each swap a document of their own, held: one UPDATE for the ten before the
    commit, each swap made."""
    store = ObjectStore(ledger.engine, group_writes=True)
    for n in range(10):
        store.create("thing", f"t{n}", {"v": 0})
    made = _statements(ledger)
    answers = _asked(store, [_swap_later(store, n) for n in range(10)])
    assert answers == [True] * 10
    updates = [sql for sql in made if sql.split(None, 1)[0].upper() == "UPDATE"]
    assert len(updates) == 1, made
    assert [store.get("thing", f"t{n}").body for n in range(10)] == [
        {"v": n + 100} for n in range(10)
    ]


def test_a_held_swap_that_misses_runs_the_group_again_alone(ledger: Ledger) -> None:
    """Two works swap one document from the same old body: in one statement the document
    changes once, the group is undone, and alone the first swap wins and the second, at once,
    says False, as two swaps one after the other would."""
    store = ObjectStore(ledger.engine, group_writes=True)
    store.create("thing", "t1", {"v": 0})
    store.create("thing", "t2", {"v": 0})

    def second(conn: Connection) -> bool:  # t1 from v 0 as well, to another value
        return store.swap_in(conn, "thing", "t1", {"v": 0}, {"v": 7}, later=True)

    answers = _asked(store, [_swap_later(store, 1), second, _swap_later(store, 2)])
    assert answers == [True, False, True]
    assert store.get("thing", "t1").body == {"v": 101}
    assert store.get("thing", "t2").body == {"v": 102}


def test_a_read_in_the_group_sees_the_updates_held_before_it(ledger: Ledger) -> None:
    """A work reads by key a document an earlier work of its group swapped, held: the held
    updates are written first, so it reads the new body (and swaps from it)."""
    store = ObjectStore(ledger.engine, group_writes=True)
    store.create("thing", "t1", {"v": 0})
    made = _statements(ledger)

    def then(conn: Connection) -> Any:
        seen = store.find_in(conn, "thing", "t1")
        assert seen is not None
        store.update_in(conn, "thing", "t1", {"v": seen.body["v"] + 1}, later=True)
        return seen.body

    answers = _asked(store, [_swap_later(store, 1), then])
    assert answers == [True, {"v": 101}]
    assert store.get("thing", "t1").body == {"v": 102}
    assert [sql.split(None, 1)[0].upper() for sql in made].count("UPDATE") == 2, made


def _ending(ledger: Ledger) -> tuple[Any, Callable[[str], Callable[[Connection], Any]]]:
    """The conductor's guarded operations on `ledger`, and a work that ends one, held."""
    from stowage.ledger.operations import Operations

    ops = Operations(ledger.engine, guarded=True)

    def end(op_id: str) -> Callable[[Connection], Any]:
        def work(conn: Connection) -> str:
            ops.advance(conn, op_id, state="done", result={"op": op_id}, later=True)
            return op_id

        return work

    return ops, end


def test_operations_ended_later_are_one_statement(ledger: Ledger) -> None:
    """Five works each end an operation with its result, held: one UPDATE of the operations
    before the commit, each ended with its own result."""
    store = ObjectStore(ledger.engine, group_writes=True)
    ops, end = _ending(ledger)
    ids = [ops.enqueue("build", f"i{n}", "h", step="spawn").id for n in range(5)]
    made = _statements(ledger)
    assert _asked(store, [end(op_id) for op_id in ids]) == ids
    updates = [sql for sql in made if sql.split(None, 1)[0].upper() == "UPDATE"]
    assert len(updates) == 1, made
    for op_id in ids:
        op = ops.find(op_id)
        assert op is not None
        assert (op.state, op.result) == ("done", {"op": op_id})


def test_an_operation_ended_before_its_held_end_fails_alone(ledger: Ledger) -> None:
    """Of three held ends, one is of an operation that had already ended: the group is undone
    and, alone, that work fails with OperationEnded while the others end theirs."""
    from stowage.ledger.operations import OperationEnded

    store = ObjectStore(ledger.engine, group_writes=True)
    ops, end = _ending(ledger)
    ids = [ops.enqueue("build", f"j{n}", "h", step="spawn").id for n in range(3)]
    ops.update(ids[1], state="failed")
    answers = _asked(store, [end(op_id) for op_id in ids])
    assert answers[0] == ids[0] and answers[2] == ids[2]
    assert isinstance(answers[1], OperationEnded)
    assert [getattr(ops.find(op_id), "state", None) for op_id in ids] == ["done", "failed", "done"]


def test_the_spawns_of_a_group_commit_in_three_updates(tmp_path: Path) -> None:
    """Five spawns that end at one moment commit in one group: their instances and actions
    are read in one statement, and the instances' swaps, the actions' events and the
    operations' ends are one UPDATE each (before: a read and three writes a spawn, each a
    hand-over of the interpreter with the write lock held), and each instance is ACTIVE with
    its operation done and its action's event."""
    from tests.agent.test_conductor import FAST
    from tests.agent.test_use_cases import open_cloud, request

    from stowage.bus.inproc import InProcTransport
    from stowage.services.compute import build_servers, schedule_builds
    from stowage.services.conductor import Conductor

    cloud = open_cloud(f"sqlite:///{tmp_path / 'ledger.db'}", tmp_path / "state", group_writes=True)
    try:
        made = [build_servers(cloud, request(1), f"req-{n}")[0]["id"] for n in range(5)]
        schedule_builds(cloud, [op for op in cloud.operations.active() if op.step == "schedule"])
        spawns = [op for op in cloud.operations.active() if op.step == "spawn"]
        assert sorted(op.instance_id for op in spawns) == sorted(made)
        conductor = Conductor(cloud, InProcTransport(), FAST)
        statements = _statements(cloud.ledger)
        answers = _called(
            cloud.objects,
            [functools.partial(conductor._spawned, op, {"ok": True}) for op in spawns],
        )
        assert answers == [None] * 5
        # The held writer's own work inserts "first"; the group's statements are the rest:
        # one read of the five instances and their actions (before: one a spawn), and
        updates = [s for s in statements if s.split(None, 1)[0].upper() == "UPDATE"]
        reads = [s for s in statements if s.split(None, 1)[0].upper() == "SELECT"]
        assert len(updates) == 3, updates
        assert len(reads) == 1, reads
        for op in spawns:
            body = cloud.objects.get("instance", op.instance_id).body
            assert (body["status"], body["task_state"]) == ("ACTIVE", None)
            ended = cloud.operations.find(op.id)
            assert ended is not None and ended.state == "done"
            key = f"{op.payload['request_id']}:{op.instance_id}"
            action = cloud.objects.get("instance_action", key)
            assert action.body["events"][-1]["result"] == "Success"
    finally:
        cloud.ledger.close()


def test_a_missed_held_write_a_work_swallows_still_undoes_the_group(ledger: Ledger) -> None:
    """A work whose read makes the group write its held swaps, one of which misses, and
    which catches what that raises: the group still does not commit as it stands (the miss
    is raised again as it ends), and alone each work gets its own answer."""
    store = ObjectStore(ledger.engine, group_writes=True)
    store.create("thing", "t1", {"v": 0})

    def stale(conn: Connection) -> bool:  # from v 0 again: misses once t1 is 101
        return store.swap_in(conn, "thing", "t1", {"v": 0}, {"v": 5}, later=True)

    def swallows(conn: Connection) -> str:
        try:
            store.find_in(conn, "thing", "t1")
        except Exception as exc:
            return type(exc).__name__
        return "read"

    answers = _asked(store, [_swap_later(store, 1), stale, swallows])
    assert answers == [True, False, "read"]
    assert store.get("thing", "t1").body == {"v": 101}


def _reader(store: ObjectStore, n: int, *, write: str = "") -> Callable[[Connection], Any]:
    """A work that reads thing t{n} by key (and with `write`, then writes it at once: the
    store's method of that name)."""

    def work(conn: Connection) -> Any:
        found = store.find_in(conn, "thing", f"t{n}")
        assert found is not None
        if write == "update_in":
            store.update_in(conn, "thing", f"t{n}", {"v": "written"})
        elif write == "update":  # outside the caller's connection: the group's, all the same
            store.update("thing", f"t{n}", {"v": "written"})
        elif write == "delete":
            store.delete("thing", f"t{n}")
        return found.body

    return work


def test_what_the_works_of_a_group_read_is_read_once(ledger: Ledger) -> None:
    """Six works that say which documents they read (one a missing one): one SELECT for
    the group, and each work reads its own."""
    store = ObjectStore(ledger.engine, group_writes=True)
    for n in range(5):
        store.create("thing", f"t{n}", {"v": n})

    def missing(conn: Connection) -> Any:
        return store.find_each_in(conn, [("thing", "nothing")])

    made = _statements(ledger)
    calls = [
        *(
            functools.partial(store.write_together, _reader(store, n), reads=[("thing", f"t{n}")])
            for n in range(5)
        ),
        functools.partial(store.write_together, missing, reads=[("thing", "nothing")]),
    ]
    answers = _called(store, calls)
    assert answers == [*({"v": n} for n in range(5)), {}]
    reads = [sql for sql in made if sql.split(None, 1)[0].upper() == "SELECT"]
    assert len(reads) == 1, made


@pytest.mark.parametrize("write", ["update_in", "update", "delete"])
def test_a_document_the_group_wrote_is_read_again(ledger: Ledger, write: str) -> None:
    """A work writes a document another work of its group said it reads: that work reads
    it from the database and sees the write, not the group's read of before."""
    store = ObjectStore(ledger.engine, group_writes=True)
    store.create("thing", "t1", {"v": 1})
    key = [("thing", "t1")]

    def second(conn: Connection) -> Any:
        found = store.find_each_in(conn, key)
        return found[key[0]].body if found else None

    calls = [
        functools.partial(store.write_together, _reader(store, 1, write=write), reads=key),
        functools.partial(store.write_together, second, reads=key),
    ]
    after = None if write == "delete" else {"v": "written"}
    assert _called(store, calls) == [{"v": 1}, after]


def test_a_held_update_reads_its_rows_by_key(ledger: Ledger) -> None:
    """The held updates' statement finds each row by its key: SQLite's plan of it is no scan
    (its walk of its own VALUES rows is not one), while a scan of a table inside a subquery
    it materializes still is."""
    from stowage.ledger.db import sqlite_scans
    from stowage.ledger.objects import _multi_update

    held = _multi_update("objects", ("kind", "id", "body"), ("body", "updated_at", "ref"), "", 3)
    params = tuple(v for n in range(3) for v in ("thing", f"t{n}", "{}", "{}", 0.0, None))
    scanning = (
        "UPDATE objects SET body = v.b FROM (SELECT id AS i, body AS b FROM objects "
        "WHERE body LIKE '%x%' LIMIT 5) AS v WHERE objects.kind = 'thing' AND objects.id = v.i"
    )
    with ledger.engine.connect() as conn:
        assert sqlite_scans(conn, held, params) == []
        assert any(step.startswith("SCAN objects") for step in sqlite_scans(conn, scanning, ()))
