"""Engines for the ledger: SQLite (WAL, immediate write transactions) or PostgreSQL by URL."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import sqlite3
import sys
import sysconfig
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import IO, Any, ClassVar

import greenlet
from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.engine.characteristics import ConnectionCharacteristic
from sqlalchemy.exc import DBAPIError

__all__ = [
    "GUARD_ENV",
    "READONLY",
    "TALLY_ENV",
    "NamedLock",
    "NestedTransaction",
    "default_url",
    "direct_rows",
    "make_engine",
    "migrate",
    "sqlite_scans",
    "sqlite_url",
]

# Execution option for read transactions: on SQLite they begin DEFERRED and do not wait
# for the writer lock; on PostgreSQL they send no BEGIN and no ROLLBACK (`_ReadStatements`).
READONLY = {"stowage_readonly": True}

# A folder: each process's writer gate tallies its holds of a SQLite ledger's write lock
# there, by where the transaction began (`_HoldTally`; bench/api.py --holds reads it).
TALLY_ENV = "STOWAGE_WRITER_TALLY"

# Set (to anything but "" or "0") by the test suite: engines made meanwhile raise
# NestedTransaction where a thread opens a second connection inside an open transaction.
GUARD_ENV = "STOWAGE_GUARD_NESTED_TRANSACTIONS"

_HERE = Path(__file__).resolve().parent

log = logging.getLogger(__name__)


def sqlite_url(path: Path | str) -> str:
    return f"sqlite:///{Path(path).resolve()}"


def sqlite_scans(conn: Connection, statement: str, params: Any) -> list[str]:
    """SQLite's plan of `statement` with `params`: its steps if one reads a whole table or
    index (`SCAN t`, a walk of a covering index included), else none. A scan costs nothing
    in a small ledger and grows with it, and the rows a statement returns do not show it
    (bench/statements.py --plans, tests/api/test_boot_plans.py). A walk of the statement's
    own list of values (`VALUES` rows, or a subquery of them it materialized, as a held
    update's `FROM (VALUES ...) AS v`) is not a scan: a scan inside what it materialized is."""
    plan = conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", params).all()
    steps = [str(row[-1]) for row in plan]
    made = {s.split()[1] for s in steps if s.startswith("MATERIALIZE ") and len(s.split()) > 1}
    for step in steps:
        words = step.split()
        scanned = words[1] if len(words) > 1 else ""
        if words[0] == "SCAN" and "CONSTANT ROW" not in step and scanned not in made:
            return steps
    return []


def default_url(state_dir: Path | str) -> str:
    """The ledger `stowage up` keeps in its state directory, unless STOWAGE_DB_URL says so."""
    env = os.environ.get("STOWAGE_DB_URL")
    return env or sqlite_url(Path(state_dir) / "ledger.db")


def make_engine(url: str, *, pool_size: int = 5) -> Engine:
    """An engine tuned for the claim path. `postgresql://` URLs use psycopg 3."""
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://") :]
    sqlite = url.startswith("sqlite")
    if sqlite:
        # A connection for every thread that may wait for the writer lock at once (the API's
        # thread pool and the conductor's): a thread holding the lock never waits for one.
        engine = create_engine(url, connect_args={"timeout": 60.0}, pool_size=16, max_overflow=112)
    else:
        # Every connection the pool opens stays open (at most 2 x `pool_size`, as before): an
        # overflow connection closed at its return, and opened again at the next burst, cost
        # PostgreSQL a backend's start each time (a fork and its catalog caches, several ms of
        # CPU): under 16 clients the API opened a session per 5 trivial GETs, and PostgreSQL
        # spent more CPU on them than on the statements (docs/performance.md, session 13).
        engine = create_engine(url, pool_size=2 * pool_size, max_overflow=0, pool_pre_ping=True)
        dialect: Any = engine.dialect
        dialect.connection_characteristics = dialect.connection_characteristics.union(
            {"stowage_readonly": _ReadStatements()}
        )
    if os.environ.get(GUARD_ENV, "") not in ("", "0"):
        # Before SQLite's own begin: a nested write would wait there for the busy timeout.
        _guard_nesting(engine)
    if sqlite:
        _tune_sqlite(engine)
    return engine


class NestedTransaction(RuntimeError):
    """A thread checked out a second connection (or began a second transaction) while a
    transaction of its own was open: the second one can wait forever for what the first
    holds (SQLite's writer lock, a PostgreSQL row lock, the pool's last connection)."""


def _owner() -> object:
    """Who holds a connection: the running greenlet (the simulation runs requests as
    greenlets of one thread, each its own holder), which is a thread's own otherwise."""
    return greenlet.getcurrent()


def _guard_nesting(engine: Engine) -> None:
    """Test mode (GUARD_ENV): refuse a connection, or a transaction, that a holder of an
    open transaction asks for. Transactions on AUTOCOMMIT connections (a NamedLock's) hold
    nothing and do not count."""
    opened: weakref.WeakKeyDictionary[object, weakref.WeakSet[Connection]] = (
        weakref.WeakKeyDictionary()
    )
    lock = threading.Lock()

    def open_ones(owner: object, besides: Connection | None = None) -> list[Connection]:
        with lock:
            held = list(opened.get(owner, ()))
        return [
            conn
            for conn in held
            if conn is not besides
            and not conn.closed
            and conn.in_transaction()
            and conn.get_execution_options().get("isolation_level") != "AUTOCOMMIT"
        ]

    def refuse(what: str, held: list[Connection]) -> None:
        raise NestedTransaction(
            f"{what} while this thread holds {len(held)} open transaction(s) on the same ledger"
        )

    @event.listens_for(engine, "checkout")
    def _on_checkout(_dbapi: Any, _record: Any, _proxy: Any) -> None:
        held = open_ones(_owner())
        if held:
            refuse("a second connection checked out", held)

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        if conn.get_execution_options().get("isolation_level") == "AUTOCOMMIT":
            return
        owner = _owner()
        held = open_ones(owner, besides=conn)
        if held:
            refuse("a second transaction begun", held)
        with lock:
            opened.setdefault(owner, weakref.WeakSet()).add(conn)

    # Test mode, said where it is on (a process started by the tests shows it in its log).
    log.warning(
        "%s is set: this ledger engine raises NestedTransaction on a second connection or "
        "transaction inside an open one (a test-mode guard)",
        GUARD_ENV,
    )


class _ReadStatements(ConnectionCharacteristic):
    """PostgreSQL: a READONLY connection runs its statements in autocommit mode.

    At READ COMMITTED (PostgreSQL's default, and the ledger's) each statement of a
    transaction reads as of its own start, so a transaction that only reads gives its
    statements nothing that running each alone does not; it costs a BEGIN and a ROLLBACK,
    two round trips, and psycopg forgets the statements it prepared at every ROLLBACK
    (DEALLOCATE ALL, a third), so the ledger's statements were planned again at each use.
    The driver's autocommit flag is set at checkout, before any statement, and reset when
    the connection goes back to the pool. A server whose default isolation is stricter
    (`default_transaction_isolation`), where a read transaction does read as of one moment,
    keeps its read transactions."""

    __slots__ = ()
    transactional = True

    def set_characteristic(self, dialect: Any, dbapi_conn: Any, value: Any) -> None:
        if value and dialect.default_isolation_level == "READ COMMITTED":
            dialect.set_isolation_level(dbapi_conn, "AUTOCOMMIT")

    def reset_characteristic(self, dialect: Any, dbapi_conn: Any) -> None:
        dialect.reset_isolation_level(dbapi_conn)

    def get_characteristic(self, dialect: Any, dbapi_conn: Any) -> Any:
        return dialect.get_isolation_level(dbapi_conn) == "AUTOCOMMIT"


def _tune_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Let SQLAlchemy, not the driver, decide where transactions begin.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        # 16 KiB pages for a new ledger (no effect on an existing one): claims insert at
        # random keys, and shallower trees touch fewer pages per commit (bench/placement.py
        # measured about 5% more placements/s than with 4 KiB pages at 10,000 hosts).
        cursor.execute("PRAGMA page_size=16384")
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA busy_timeout=60000")
        # A large page cache: a 10,000-host ledger's pCPU index alone is tens of MB.
        cursor.execute("PRAGMA cache_size=-131072")
        cursor.execute("PRAGMA temp_store=MEMORY")
        cursor.close()

    writers = _WriterGate.of(engine)

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        # A write transaction takes the lock at BEGIN, so it never fails on lock upgrade.
        raw = conn.connection.dbapi_connection
        if conn.get_execution_options().get("stowage_readonly", False):
            _begin(raw, "BEGIN")
            return
        writers.enter(raw)
        try:
            _begin(raw, "BEGIN IMMEDIATE")
        except BaseException:
            writers.leave(raw)
            raise


def _begin(raw: Any, statement: str) -> None:
    """`statement` on the driver's connection itself: through SQLAlchemy's execution (its
    events, its cursor wrapping) a BEGIN cost about 35 function calls, on every transaction.
    The driver's error comes out as SQLAlchemy's, as it would have."""
    try:
        raw.execute(statement)
    except sqlite3.Error as exc:
        raise DBAPIError.instance(statement, (), exc, sqlite3.Error) from exc


def direct_rows(conn: Connection, statement: Any, params: dict[str, Any]) -> list[Any]:
    """The rows of a SELECT `statement` on `conn`, as `conn.execute(statement, params).all()`
    gives them (by position; same values), run on SQLite's own connection where it can be.

    SQLAlchemy's execution of a prebuilt read by key cost about 50 us of CPU against 14 us on
    the same sqlite3 connection (its context, its events, its result and row objects), and a
    boot makes 10-16 such reads, many with the write lock held (docs/performance.md, session
    25). Here the statement is compiled once for SQLite and run on the driver's connection,
    inside the connection's transaction: one is begun first where none is open, as
    SQLAlchemy's first statement would (so two reads of one `reading()` read as of one
    moment, as before). The values the statement holds (a literal, a fixed IN list) are bound
    as compiled, the caller's by name from `params` (which gives a value only to parameters
    built without one), each converted as its type converts it.

    It goes through SQLAlchemy as before on another database, for a statement with an
    expanding parameter the caller gives (its SQL depends on the values) or one computed at
    execution, for one whose columns convert what they read (none of the ledger's do), and
    where anyone listens to the engine's cursor events: the tests and benches that count or
    interrupt statements there see every one. The driver's error comes out as SQLAlchemy's."""
    if conn.dialect.name != "sqlite" or _listened(conn):
        return list(conn.execute(statement, params).all())
    plan = _DIRECT.get(statement)
    if plan is None:
        plan = _DIRECT[statement] = _direct_plan(conn, statement)
    if plan is _NOT_DIRECT:
        return list(conn.execute(statement, params).all())
    sql, slots = plan
    if not conn.in_transaction():
        conn.begin()
    raw = conn.connection.dbapi_connection
    values = tuple(
        [
            fixed if name is None else params[name] if convert is None else convert(params[name])
            for name, fixed, convert in slots
        ]
    )
    try:
        return raw.execute(sql, values).fetchall()  # type: ignore[union-attr, no-any-return]
    except sqlite3.Error as exc:
        raise DBAPIError.instance(sql, values, exc, sqlite3.Error) from exc


def _listened(conn: Connection) -> bool:
    dispatch: Any = conn.dispatch
    return bool(dispatch.before_cursor_execute) or bool(dispatch.after_cursor_execute)


_Slots = tuple[tuple[str | None, Any, Callable[[Any], Any] | None], ...]
"""Each positional parameter of a direct statement: the name of the caller's value and how
its type converts it (SQLAlchemy's bind processor: a float's `float()`), or None and the value
the statement holds, converted."""

_NOT_DIRECT: tuple[str, _Slots] = ("", ())
# Statement -> (SQL, its parameters), or _NOT_DIRECT. The ledger's direct statements are
# module constants or cached by shape: a few hundred at most.
_DIRECT: weakref.WeakKeyDictionary[Any, tuple[str, _Slots]] = weakref.WeakKeyDictionary()


def _direct_plan(conn: Connection, statement: Any) -> tuple[str, _Slots]:
    dialect = conn.dialect
    compiled: Any = statement.compile(dialect=dialect)
    binds = list(compiled.binds.values())
    asked = {b.key for b in binds if b.required}
    if compiled.positiontup is None or any(b.callable is not None for b in binds):
        return _NOT_DIRECT
    if any(b.expanding and b.key in asked for b in binds):
        return _NOT_DIRECT
    processors = compiled._bind_processors
    if any(b.expanding and b.key in processors for b in binds):
        return _NOT_DIRECT  # (its values are bound one by one: left to SQLAlchemy)
    columns = statement.selected_columns
    if any(c.type._cached_result_processor(dialect, None) is not None for c in columns):
        return _NOT_DIRECT
    # The statement's own IN lists rendered as one parameter per value, as SQLAlchemy renders
    # them at each execution.
    expanded = compiled.construct_expanded_state(dict.fromkeys(asked))
    slots: list[tuple[str | None, Any, Callable[[Any], Any] | None]] = []
    for name in expanded.positiontup:
        convert = processors.get(name)
        if name in asked:
            slots.append((name, None, convert))
        else:
            value = expanded.parameters[name]
            slots.append((None, value if convert is None else convert(value), None))
    return expanded.statement, tuple(slots)


class _WriterGate:
    """The writers of one SQLite file in this process take turns at a lock of their own.

    SQLite's busy handler makes a writer that finds the file locked sleep (1, 2, 5 ... 100
    ms) and look again: under load the lock sits free while its waiters sleep, and the
    latency of a write grows with the number of threads that want one. Waiting here instead
    hands the lock over at once. Reentrant, so a thread (or the simulation's greenlets, on one
    thread) that opens a second write transaction meets SQLite's own lock as before; bounded,
    so a holder that never ends its transaction only brings SQLite's wait back.

    Across processes (`stowage up --compute-process`: the APIs in one, the conductor and the
    agents in another) the gate's holder also holds an exclusive `flock` of a file beside
    the ledger's (`<file>-writer`), which the kernel hands to a waiting process as it is
    released. Measured without it (2,000 boots, 2026-12-06): the two processes' writers met
    SQLite's sleeps and the split gained 12% where with it it gains 30-39%.
    """

    _gates: ClassVar[dict[str, _WriterGate]] = {}
    _gates_lock: ClassVar[threading.Lock] = threading.Lock()
    wait_s: ClassVar[float] = 60.0

    def __init__(self, path: Path | None = None) -> None:
        self._lock = threading.RLock()
        self._holders: set[int] = set()
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600) if path is not None else None
        folder = os.environ.get(TALLY_ENV)
        self._tally = _HoldTally(Path(folder)) if folder else None

    @classmethod
    def of(cls, engine: Engine) -> _WriterGate:
        database = engine.url.database or ""
        memory = database in ("", ":memory:") or database.startswith("file::memory:")
        key = f"memory:{id(engine)}" if memory else str(Path(database).resolve())
        with cls._gates_lock:
            gate = cls._gates.get(key)
            if gate is None:
                gate = cls._gates[key] = cls(None if memory else Path(key + "-writer"))
        gate._wrap(engine.dialect)
        return gate

    def enter(self, raw: Any) -> None:
        asked = time.perf_counter() if self._tally is not None else 0.0
        if self._lock.acquire(timeout=self.wait_s):
            self._holders.add(id(raw))
            if self._fd is not None and len(self._holders) == 1:
                fcntl.flock(self._fd, fcntl.LOCK_EX)  # waits with the GIL released
            if self._tally is not None and len(self._holders) == 1:
                self._tally.taken(raw, asked)

    def leave(self, raw: Any) -> None:
        if id(raw) in self._holders:
            self._holders.discard(id(raw))
            if self._fd is not None and not self._holders:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            if self._tally is not None:
                self._tally.let_go(raw)
            self._lock.release()

    def _wrap(self, dialect: Any) -> None:
        """Leave the gate once the DBAPI connection's transaction has ended (its commit or
        rollback, the pool's reset included) or the connection is closed."""
        if getattr(dialect, "_stowage_gate", None) is self:
            return
        dialect._stowage_gate = self
        for name in ("do_commit", "do_rollback", "do_close", "do_terminate"):
            original = getattr(dialect, name)

            def ended(fairy: Any, _original: Any = original, _name: str = name) -> None:
                raw = getattr(fairy, "dbapi_connection", fairy)
                try:
                    _original(fairy)
                finally:
                    if raw is not None and (_name in ("do_close", "do_terminate") or _ended(raw)):
                        self.leave(raw)

            setattr(dialect, name, ended)


class _HoldTally:
    """A profile of the write lock (`TALLY_ENV`): for each place a write transaction began
    (the first two frames above the ledger's plumbing, or the thread's name), how many holds,
    the seconds held, the holding thread's CPU seconds within them, the seconds of them it
    was ready to run but waited for a core (the kernel's run delay, where it keeps one), the
    rest it slept (for the GIL, a lock, I/O), and the seconds waited for the lock. A thread
    of its own writes it to `<folder>/writer-holds-<pid>.json` every 0.2 s while it
    changes."""

    every_s = 0.2

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self._path = folder / f"writer-holds-{os.getpid()}.json"
        self._held: dict[int, tuple[float, float, float, float, str]] = {}
        self._sites: dict[str, list[float]] = {}
        self._changed = threading.Event()
        self._lock = threading.Lock()
        threading.Thread(target=self._write, name="stowage-writer-tally", daemon=True).start()

    def taken(self, raw: Any, asked: float) -> None:
        now = time.perf_counter()
        self._held[id(raw)] = (asked, now, time.thread_time(), _run_delay_s(), _site())

    def let_go(self, raw: Any) -> None:
        held = self._held.pop(id(raw), None)
        if held is None:
            return
        asked, taken, cpu, delay, site = held
        with self._lock:
            tally = self._sites.setdefault(site, [0, 0.0, 0.0, 0.0, 0.0])
            tally[0] += 1
            tally[1] += time.perf_counter() - taken
            tally[2] += time.thread_time() - cpu
            tally[3] += taken - asked
            tally[4] += _run_delay_s() - delay
        self._changed.set()

    def _write(self) -> None:
        keys = ("holds", "held_s", "cpu_s", "waited_s", "run_delay_s")
        while True:
            self._changed.wait()
            self._changed.clear()
            with self._lock:
                sites = {k: dict(zip(keys, v, strict=True)) for k, v in self._sites.items()}
            part = self._path.with_suffix(".part")
            part.write_text(json.dumps(sites))
            part.replace(self._path)
            time.sleep(self.every_s)


def _run_delay_s() -> float:
    """The calling thread's time ready to run but waiting for a core, from Linux's
    `/proc/thread-self/schedstat` (its second field, in ns); 0 where there is none."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


_PLUMBING = ("/stowage/ledger/db.py", "/stowage/ledger/objects.py")
_LIBRARIES = tuple(
    {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
)


def _site() -> str:
    """Where the write transaction being begun was asked for (see `_HoldTally`): the first
    two frames that are neither the ledger's plumbing nor a library's."""
    frame: FrameType | None = sys._getframe(3)
    names: list[str] = []
    while frame is not None and len(names) < 2:
        path = frame.f_code.co_filename
        if not path.startswith(("<", *_LIBRARIES)) and not path.endswith(_PLUMBING):
            where = path.rsplit("/stowage/", 1)[1] if "/stowage/" in path else Path(path).name
            names.append(f"{frame.f_code.co_qualname} ({where})")
        frame = frame.f_back
    return " < ".join(names) or threading.current_thread().name


def _ended(raw: Any) -> bool:
    try:
        return not raw.in_transaction
    except Exception:  # a closed connection holds no transaction
        return True


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(_HERE / "migrations"))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def migrate(engine: Engine, revision: str = "head") -> None:
    """Bring the schema to `revision` (idempotent)."""
    cfg = alembic_config(engine.url.render_as_string(hide_password=False))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


class NamedLock:
    """A lock that processes sharing one ledger take by name, held until released or until
    the holder's process ends (a `kill -9` included): a PostgreSQL session advisory lock
    (keyed by the schema and the name) on a connection of its own, or, on SQLite, `flock` on
    a file next to the database. An in-memory SQLite ledger has one process: always free.
    """

    def __init__(self, engine: Engine, name: str) -> None:
        self.engine = engine
        self.name = name
        self._conn: Connection | None = None
        self._file: IO[str] | None = None

    @property
    def held(self) -> bool:
        return self._conn is not None or self._file is not None

    def acquire(self, *, wait: bool = True) -> bool:
        """Take the lock (waiting for it, or not); True when this process holds it."""
        if self.held:
            return True
        if self.engine.dialect.name == "postgresql":
            return self._acquire_pg(wait)
        database = self.engine.url.database
        if not database or database == ":memory:":
            self._file = open(os.devnull)  # noqa: SIM115 - held until release()
            return True
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", self.name)
        handle = open(f"{database}.{safe}.lock", "a")  # noqa: SIM115 - held until release()
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            handle.close()
            return False
        self._file = handle
        return True

    def _acquire_pg(self, wait: bool) -> bool:
        conn = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        key = "hashtextextended('stowage:' || current_schema() || ':' || :name, 0)"
        try:
            if wait:
                conn.execute(text(f"SELECT pg_advisory_lock({key})"), {"name": self.name})
                got = True
            else:
                got = bool(
                    conn.execute(
                        text(f"SELECT pg_try_advisory_lock({key})"), {"name": self.name}
                    ).scalar()
                )
        except BaseException:
            conn.close()
            raise
        if not got:
            conn.close()
            return False
        self._conn = conn
        return True

    def release(self) -> None:
        conn, handle = self._conn, self._file
        self._conn = self._file = None
        if conn is not None:
            try:
                key = "hashtextextended('stowage:' || current_schema() || ':' || :name, 0)"
                conn.execute(text(f"SELECT pg_advisory_unlock({key})"), {"name": self.name})
            finally:
                conn.close()
        if handle is not None:
            handle.close()  # closing the file drops its flock

    def __enter__(self) -> NamedLock:
        self.acquire(wait=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
