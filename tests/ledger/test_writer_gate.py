"""SQLite writers of one process take turns at a lock of their own (ledger/db.py): every
write commits, none is lost, and a transaction's end (commit, rollback, an error) frees it."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from sqlalchemy import Engine, text

from stowage.ledger.db import READONLY, _WriterGate, make_engine, sqlite_url


@pytest.fixture
def engine(tmp_path: Path) -> Engine:
    engine = make_engine(sqlite_url(tmp_path / "gate.db"))
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE n (writer INTEGER, i INTEGER)"))
    yield engine
    engine.dispose()


def _gate_is_free(engine: Engine) -> bool:
    """Whether another thread could take the gate now."""
    gate = _WriterGate.of(engine)
    got: list[bool] = []

    def probe() -> None:
        got.append(gate._lock.acquire(blocking=False))
        if got[0]:
            gate._lock.release()

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    return got[0]


def test_concurrent_writers_all_commit(engine: Engine) -> None:
    def write(writer: int) -> None:
        for i in range(25):
            with engine.begin() as conn:
                conn.execute(text("INSERT INTO n VALUES (:w, :i)"), {"w": writer, "i": i})

    threads = [threading.Thread(target=write, args=(w,)) for w in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    with engine.connect().execution_options(**READONLY) as conn:
        assert conn.execute(text("SELECT count(*) FROM n")).scalar_one() == 16 * 25
    assert _gate_is_free(engine)


def test_an_error_and_a_rollback_free_the_gate(engine: Engine) -> None:
    with pytest.raises(RuntimeError), engine.begin() as conn:
        conn.execute(text("INSERT INTO n VALUES (1, 1)"))
        raise RuntimeError("the use case fails")
    assert _gate_is_free(engine)
    conn = engine.connect()
    conn.begin()
    conn.execute(text("INSERT INTO n VALUES (2, 2)"))
    assert not _gate_is_free(engine)  # held while the transaction is open
    conn.rollback()
    assert _gate_is_free(engine)
    conn.close()
    with engine.connect().execution_options(**READONLY) as read:
        assert read.execute(text("SELECT count(*) FROM n")).scalar_one() == 0


def test_reads_do_not_take_the_gate(engine: Engine) -> None:
    with engine.connect().execution_options(**READONLY) as conn:
        conn.execute(text("SELECT count(*) FROM n")).scalar_one()
        assert _gate_is_free(engine)


def test_engines_on_one_file_share_the_gate(engine: Engine, tmp_path: Path) -> None:
    other = make_engine(sqlite_url(tmp_path / "gate.db"))
    try:
        assert _WriterGate.of(other) is _WriterGate.of(engine)
        with other.begin() as conn:
            conn.execute(text("INSERT INTO n VALUES (3, 3)"))
            assert not _gate_is_free(engine)
        assert _gate_is_free(engine)
    finally:
        other.dispose()


def test_a_begin_that_meets_another_processs_lock_fails_as_sqlalchemys_error(
    engine: Engine, tmp_path: Path
) -> None:
    """BEGIN goes to the driver directly (not through SQLAlchemy's execution): the driver's
    'database is locked' still comes out as SQLAlchemy's OperationalError (what the claim
    path's retries catch), and the gate is free after it."""
    import sqlite3

    from sqlalchemy.exc import OperationalError

    with engine.connect() as conn:  # the pool's one connection: waits 50 ms, not 60 s
        conn.exec_driver_sql("PRAGMA busy_timeout=50")
    other = sqlite3.connect(tmp_path / "gate.db", isolation_level=None)  # as another process
    other.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(OperationalError, match="database is locked"), engine.begin() as conn:
            conn.execute(text("INSERT INTO n VALUES (1, 1)"))
        assert _gate_is_free(engine)
    finally:
        other.execute("ROLLBACK")
        other.close()
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO n VALUES (1, 2)"))
    with engine.connect() as conn:
        assert conn.execute(text("SELECT i FROM n")).scalars().all() == [2]


def _file_lock_is_free(path: Path) -> bool:
    """Whether another process could take the gate's file lock now (a flock of an open file
    description of our own conflicts as another process's would)."""
    import fcntl
    import os

    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # closing drops the probe's own lock
    return True


def test_a_writer_holds_the_gate_against_other_processes_too(
    engine: Engine, tmp_path: Path
) -> None:
    """`stowage up --compute-process` writes one file from two processes: the writer holds
    a flock of `<file>-writer` from BEGIN to its end, which the kernel hands to a waiting
    process at once (SQLite's busy handler would have it sleep and look again)."""
    lock = tmp_path / "gate.db-writer"
    assert _file_lock_is_free(lock)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO n VALUES (4, 4)"))
        assert not _file_lock_is_free(lock)
    assert _file_lock_is_free(lock)
    with pytest.raises(RuntimeError), engine.begin() as conn:
        conn.execute(text("INSERT INTO n VALUES (5, 5)"))
        raise RuntimeError("the use case fails")
    assert _file_lock_is_free(lock)


def test_writers_of_two_processes_all_commit(engine: Engine, tmp_path: Path) -> None:
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from sqlalchemy import text\n"
        "from stowage.ledger.db import make_engine, sqlite_url\n"
        "e = make_engine(sqlite_url(sys.argv[1]))\n"
        "for i in range(200):\n"
        "    with e.begin() as c:\n"
        "        c.execute(text('INSERT INTO n VALUES (7, :i)'), {'i': i})\n"
    )
    other = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "gate.db")])
    for i in range(200):
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO n VALUES (6, :i)"), {"i": i})
    assert other.wait(timeout=120) == 0
    with engine.connect().execution_options(**READONLY) as conn:
        counted = dict(conn.execute(text("SELECT writer, count(*) FROM n GROUP BY writer")).all())
    assert counted == {6: 200, 7: 200}


def test_the_tally_names_where_each_write_began_and_how_long_it_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With STOWAGE_WRITER_TALLY set, the gate writes, per process, each place's holds of the
    write lock: their count, the seconds held (at least the sleep inside), the holder's CPU
    in them (not the sleep) and the seconds waited; reads are not counted."""
    import json
    import time

    from stowage.ledger.db import TALLY_ENV

    folder = tmp_path / "holds"
    monkeypatch.setenv(TALLY_ENV, str(folder))
    engine = make_engine(sqlite_url(tmp_path / "tallied.db"))
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE n (i INTEGER)"))

    def slow_writer() -> None:
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO n VALUES (1)"))
            time.sleep(0.3)  # held, not on a core

    slow_writer()
    with engine.connect().execution_options(**READONLY) as conn:
        conn.execute(text("SELECT count(*) FROM n")).scalar()
    slow_writer()
    engine.dispose()
    time.sleep(3 * 0.2)  # the tally's thread writes what changed every 0.2 s
    files = list(folder.glob("writer-holds-*.json"))
    assert [f.name for f in files] == [f"writer-holds-{__import__('os').getpid()}.json"]
    sites = json.loads(files[0].read_text())
    (site,) = [s for s in sites if "slow_writer" in s]
    assert "test_writer_gate.py" in site
    tally = sites[site]
    assert tally["holds"] == 2
    assert tally["held_s"] >= 0.6
    assert 0 <= tally["cpu_s"] < 0.3
    assert tally["waited_s"] >= 0
    assert sum(t["holds"] for t in sites.values()) == 3  # the CREATE TABLE's, and no read


def test_the_tally_tells_a_holders_wait_for_a_core_from_its_other_waits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A holder that shares its core with a busy process is ready to run but waits for the
    core part of its hold: the tally counts that time apart (the kernel's run delay), and
    a sleep inside the hold is not counted in it."""
    import json
    import os
    import subprocess
    import sys
    import time

    from stowage.ledger.db import TALLY_ENV

    folder = tmp_path / "holds"
    monkeypatch.setenv(TALLY_ENV, str(folder))
    engine = make_engine(sqlite_url(tmp_path / "tallied.db"))
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE n (i INTEGER)"))
    core = min(os.sched_getaffinity(0))
    mine = os.sched_getaffinity(0)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(busy.pid, {core})
        os.sched_setaffinity(0, {core})  # this thread only (Linux)

        def crowded_writer() -> None:
            with engine.begin() as conn:
                conn.execute(text("INSERT INTO n VALUES (1)"))
                end = time.perf_counter() + 0.6
                while time.perf_counter() < end:  # ready to run all along, on a shared core
                    pass

        def sleeping_writer() -> None:
            with engine.begin() as conn:
                conn.execute(text("INSERT INTO n VALUES (2)"))
                time.sleep(0.3)  # held, not ready to run

        crowded_writer()
        os.sched_setaffinity(0, mine)
        busy.kill()
        busy.wait()
        sleeping_writer()
    finally:
        os.sched_setaffinity(0, mine)
        if busy.poll() is None:
            busy.kill()
            busy.wait()
    engine.dispose()
    time.sleep(3 * 0.2)
    (path,) = folder.glob("writer-holds-*.json")
    sites = json.loads(path.read_text())
    crowded = next(t for s, t in sites.items() if "crowded_writer" in s)
    sleeping = next(t for s, t in sites.items() if "sleeping_writer" in s)
    # Sharing one core with a process that never sleeps, the holder got about half of it.
    assert crowded["run_delay_s"] >= 0.15, crowded
    assert crowded["cpu_s"] + crowded["run_delay_s"] <= crowded["held_s"] + 0.05, crowded
    assert sleeping["held_s"] >= 0.3 and sleeping["run_delay_s"] < 0.1, sleeping
