"""A document store for API-level resources: flavors, users, images, networks and the like."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from sqlalchemy import (
    Connection,
    Engine,
    Insert,
    Integer,
    Select,
    Table,
    and_,
    bindparam,
    delete,
    insert,
    or_,
    select,
    update,
)
from sqlalchemy.exc import IntegrityError

from stowage.domain.errors import ConflictError, NotFound
from stowage.ledger.db import READONLY, direct_rows
from stowage.ledger.schema import objects

__all__ = [
    "Document",
    "HeldWriteMissed",
    "NewDocument",
    "ObjectStore",
    "decode_body",
    "flush_inserts",
    "group_memo",
    "held_inserts",
    "insert_rows",
    "update_later",
]

log = logging.getLogger(__name__)

T = TypeVar("T")


# The most frequent read of all (a flavor, an image, a token's user and project: several per
# request), built once: building the statement anew took most of its CPU (about 170 of 290 us
# per call, measured 2026-12-02), the SQL is the same.
_KEY = (objects.c.kind == bindparam("k_kind"), objects.c.id == bindparam("k_id"))
_FIND = select(objects).where(*_KEY)


@functools.lru_cache(maxsize=256)
def _find_each(shape: tuple[int, ...]) -> Select[Any]:
    """The read of several documents, `shape` giving how many ids of each kind: `kind = ? AND
    id IN (?, ...)` per kind, which both databases answer from the primary key. A row value
    list, `(kind, id) IN ((?, ?), ...)`, scanned the whole table on SQLite (3.40 plans it as a
    list subquery, not a search of the key): every create read its flavor and image by a walk
    of every document, its servers' and their actions' included (2026-12-06).

    Up to `_LISTED` ids of a kind are bound one by one (`id{kind}_{n}`), each shape's
    statement built and compiled once; more are one expanding parameter (`ids{kind}`), whose
    list SQLAlchemy renders into the statement on each execution (a fifth of a create's read
    of its flavor and image)."""
    return select(objects).where(
        or_(
            *(
                and_(
                    objects.c.kind == bindparam(f"kind{i}"),
                    objects.c.id.in_(
                        [bindparam(f"id{i}_{n}") for n in range(count)]
                        if count <= _LISTED
                        else bindparam(f"ids{i}", expanding=True)
                    ),
                )
                for i, count in enumerate(shape)
            )
        )
    )


_LISTED = 16


# The same holds for the insert of every new document (`_insert_of`), and for the writes of
# every step (a boot's spawn, its ports, its action record): a prebuilt statement runs in about
# a quarter of the CPU of one built per call (55 against 190 us for a read by key on SQLite,
# measured 2026-12-02, session 8).
_FIND_FOR_UPDATE = select(objects.c.body).where(*_KEY).with_for_update()
_UPDATE = (
    update(objects)
    .where(*_KEY)
    .values(body=bindparam("v_body"), updated_at=bindparam("v_at"), ref=bindparam("v_ref"))
)
_SWAP = (
    update(objects)
    .where(*_KEY, objects.c.body == bindparam("k_body"))
    .values(body=bindparam("v_body"), updated_at=bindparam("v_at"), ref=bindparam("v_ref"))
)
_RENAME = update(objects).where(*_KEY).values(name=bindparam("v_name"))
_DELETE = delete(objects).where(*_KEY)


@dataclass(frozen=True, slots=True)
class NewDocument:
    """A document to create (`ObjectStore.create_each_in`)."""

    kind: str
    id: str
    body: Mapping[str, Any]
    project_id: str | None = None
    name: str | None = None


@dataclass(slots=True)
class _Held:
    """The transaction `ObjectStore.reading()` or `writing()` holds for the running thread
    (or greenlet: each has a context of its own), and the kinds written in it."""

    engine: Engine
    conn: Connection
    write: bool
    kinds: set[str]


_HELD: ContextVar[_Held | None] = ContextVar("stowage_held", default=None)


@functools.cache
def _insert_of(table: Table) -> Insert:
    return insert(table)  # built once a table, as `_FIND`


_PENDING = "stowage_pending_inserts"  # in `Connection.info` while a group's works run


def _pending_of(conn: Connection) -> _Pending | None:
    pending: _Pending | None = conn.info.get(_PENDING)
    return pending


def insert_rows(conn: Connection, table: Table, rows: Sequence[Mapping[str, Any]]) -> None:
    """Insert `rows` into `table` in `conn`'s transaction: at once, or, inside `held_inserts`
    (the works of a group write, `ObjectStore.write_together`, run inside one), with the
    other rows held there, in one statement a table as it ends.

    Rows held so are not seen by the reads of the same transaction until they are written: a
    work that reads what another work of its group may have inserted (a quota count of the
    project's instances) calls `flush_inserts(conn)` first."""
    pending = _pending_of(conn)
    if pending is None:
        _insert_now(conn, table, rows)
    else:
        if table is objects:
            pending.forget((row["kind"], row["id"]) for row in rows)
        pending.add(table, rows)


class HeldWriteMissed(Exception):
    """A write held to the end of a group (`update_later`) found fewer rows than it was
    given: a document it swaps had moved, or an operation it ends had ended. The group's
    transaction is to be undone and its works run again, each alone, where the same write
    runs at once and its caller sees the miss as it always did."""


def update_later(
    conn: Connection,
    table: Table,
    match: Mapping[str, Any],
    values: Mapping[str, Any],
    *,
    where: str = "",
) -> bool:
    """Hold `UPDATE table SET values WHERE match [AND where]` to the end of the group write or
    `held_inserts` block running on `conn`, where the held updates of a shape (table, columns,
    `where`) are written as one statement, which must change one row for each (else
    `HeldWriteMissed`). True if held; False when nothing holds writes on `conn`, or on
    PostgreSQL: the caller runs its own statement at once.

    Only on SQLite: there the group holds the database's one write lock from its first
    statement, so a row the work read in the group cannot change before the end (a held
    compare-and-swap can miss only through the group's own writes); and each statement held
    so is one hand-over of the interpreter less with that lock held (docs/performance.md,
    session 20). `where` is SQL on the table's own columns, fixed for the shape."""
    pending = _pending_of(conn)
    if pending is None or conn.dialect.paramstyle != "qmark":
        return False
    pending.update(table, match, values, where)
    return True


def group_memo(conn: Connection) -> dict[Any, Any] | None:
    """While the works of a group write run on `conn` (`ObjectStore.write_together`; or
    inside `held_inserts`), a dict that lasts as long as the block, for what its works read
    and none of them writes (a project's quota limits): read once a group instead of once a
    work, each read one more hand-over of the interpreter with the write lock held. None
    outside."""
    pending = _pending_of(conn)
    return None if pending is None else pending.memo


def _insert_now(conn: Connection, table: Table, rows: Sequence[Mapping[str, Any]]) -> None:
    conn.execute(_insert_of(table), list(rows))


@contextlib.contextmanager
def held_inserts(conn: Connection) -> Iterator[None]:
    """The rows `insert_rows` is asked for inside, held and written together as the block
    ends (one statement a table: a batch of claims' next operations); inside a group write,
    or another `held_inserts` on `conn`, with the rows held there. Nothing is written if the
    block raises: its transaction is to be rolled back."""
    with _holding(conn):
        yield


@contextlib.contextmanager
def _holding(conn: Connection) -> Iterator[_Pending]:
    held = _pending_of(conn)
    if held is not None:
        yield held
        return
    pending = _Pending()
    conn.info[_PENDING] = pending
    try:
        yield pending
        pending.write(conn)
    finally:
        conn.info.pop(_PENDING, None)


def flush_inserts(conn: Connection) -> None:
    """Write the rows `insert_rows` holds for `conn`'s group, and the updates `update_later`
    holds, so that its next reads see them."""
    pending = _pending_of(conn)
    if pending is not None:
        pending.write(conn)


_UpdateShape = tuple[str, tuple[str, ...], tuple[str, ...], str]  # table, match, set, where


class _Pending:
    """The rows a group's works insert (`insert_rows`), written in one multi-row INSERT a
    table and set of columns, and the rows they update (`update_later`), in one UPDATE a
    shape. Inserted one work at a time, SQLite stepped each row alone (an executemany is one
    step a row), and each step let go of the interpreter while the group held the write lock:
    a hand-over to another thread and a wait to get it back, the most of a hold
    (docs/performance.md, session 18).

    A read by key of a document whose update is held (`ObjectStore.find_in` and the reads
    built on it) writes what is held first, so a work sees the writes of the works before
    it; held inserts are seen only after `flush_inserts`."""

    rows_max = 300  # a statement's rows: SQLite allows 32,766 parameters in one

    def __init__(self) -> None:
        self.work = 0  # the index of the work running now
        self.others = 0  # rows written for works other than the one running then
        self.memo: dict[Any, Any] = {}  # `group_memo`
        self.touched: set[tuple[str, str]] = set()  # documents (kind, id) with held updates
        self.missed: HeldWriteMissed | None = None  # raised again by every later write
        # The documents the works said they read (`write_together(reads=)`), read for the
        # group in one statement: (kind, id) -> the document, or None if there is none. A key
        # leaves as the group writes it through the store (`forget`).
        self.read: dict[tuple[str, str], Document | None] = {}
        self._rows: list[tuple[int, Table, Mapping[str, Any]]] = []
        self._updates: list[tuple[int, _UpdateShape, tuple[Any, ...]]] = []

    def add(self, table: Table, rows: Sequence[Mapping[str, Any]]) -> None:
        self._rows.extend((self.work, table, row) for row in rows)

    def update(
        self, table: Table, match: Mapping[str, Any], values: Mapping[str, Any], where: str
    ) -> None:
        shape = (table.name, tuple(match), tuple(values), where)
        self._updates.append((self.work, shape, (*match.values(), *values.values())))

    def drop(self, work: int) -> None:
        """Forget what the `work`th work asked for (it failed)."""
        self._rows = [held for held in self._rows if held[0] != work]
        self._updates = [held for held in self._updates if held[0] != work]

    def write(self, conn: Connection) -> None:
        if self.missed is not None:  # a work caught it: the group's end must not commit
            raise self.missed
        shapes: dict[tuple[Table, tuple[str, ...]], list[Mapping[str, Any]]] = {}
        for work, table, row in self._rows:
            shapes.setdefault((table, tuple(row)), []).append(row)
            self.others += work != self.work
        self._rows = []
        for (table, columns), rows in shapes.items():
            if conn.dialect.paramstyle != "qmark":  # PostgreSQL: the driver's executemany
                _insert_now(conn, table, rows)
                continue
            for start in range(0, len(rows), self.rows_max):
                chunk = rows[start : start + self.rows_max]
                sql = _multi_insert(table.name, columns, len(chunk))
                conn.exec_driver_sql(sql, tuple(row[c] for row in chunk for c in columns))
        # After the inserts: an update may be of a row the group inserted.
        updates: dict[_UpdateShape, list[tuple[Any, ...]]] = {}
        for _work, shape, params in self._updates:
            updates.setdefault(shape, []).append(params)
        others = sum(work != self.work for work, _shape, _params in self._updates)
        self._updates = []
        self.touched = set()
        for shape, values in updates.items():
            for start in range(0, len(values), self.rows_max):
                part = values[start : start + self.rows_max]
                sql = _multi_update(*shape, len(part))
                changed = conn.exec_driver_sql(sql, tuple(v for row in part for v in row))
                if changed.rowcount != len(part):
                    self.missed = HeldWriteMissed(
                        f"{len(part) - changed.rowcount} of {len(part)} held updates of "
                        f"{shape[0]} found no row"
                    )
                    raise self.missed
        self.others += others

    def forget(self, keys: Iterable[tuple[str, str]]) -> None:
        """These documents are written in the group: a read of them goes to the database."""
        if self.read:
            for key in keys:
                self.read.pop(key, None)

    def see(self, conn: Connection, keys: Iterable[tuple[str, str]]) -> None:
        """Before a read of these documents in the group: write what is held if one of them
        has an update held."""
        if self.touched and not self.touched.isdisjoint(keys):
            self.write(conn)


@functools.lru_cache(maxsize=256)
def _multi_insert(table: str, columns: tuple[str, ...], rows: int) -> str:
    """`INSERT INTO table (columns) VALUES (?, ...), ...` with `rows` rows (SQLite's qmark
    parameters)."""
    one = "(" + ", ".join("?" * len(columns)) + ")"
    names = ", ".join(f'"{c}"' for c in columns)
    return f'INSERT INTO "{table}" ({names}) VALUES ' + ", ".join([one] * rows)


@functools.lru_cache(maxsize=256)
def _multi_update(
    table: str, match: tuple[str, ...], values: tuple[str, ...], where: str, rows: int
) -> str:
    """`UPDATE table SET ... FROM (VALUES ...) AS v WHERE ...`: `rows` updates of one shape
    in one statement (SQLite's UPDATE FROM, 3.33 and later), each row's `match` columns equal
    to its first values and its `values` columns set to the rest. Two rows of one target
    change it once, and the statement's count of changed rows says so. (Not a `WITH v(...)`
    before the UPDATE: Python's sqlite3 counts the changed rows only of a statement that
    begins with its verb.)"""
    width = len(match) + len(values)
    one = "(" + ", ".join("?" * width) + ")"
    # VALUES names its columns column1, column2, ...
    sets = ", ".join(f'"{c}" = v.column{len(match) + i + 1}' for i, c in enumerate(values))
    conditions = [f'"{table}"."{c}" = v.column{i + 1}' for i, c in enumerate(match)]
    if where:
        conditions.append(where)
    return (
        f'UPDATE "{table}" SET {sets} FROM (VALUES {", ".join([one] * rows)}) AS v '
        f"WHERE {' AND '.join(conditions)}"
    )


@dataclass(frozen=True, slots=True)
class Document:
    kind: str
    id: str
    project_id: str | None
    name: str | None
    created_at: float
    updated_at: float
    body: dict[str, Any]


class ObjectStore:
    """Put, get, list (filtered, paged by marker) and delete documents of one kind at a time."""

    REFS: Mapping[str, str] = {"port": "device_id"}
    """The body field each kind's `ref` column copies (indexed: `list(kind, ref=...)`). Every
    write of this store sets it from the body it writes, so it can never disagree with it."""

    def __init__(
        self,
        engine: Engine,
        *,
        clock: Callable[[], float] = time.time,
        group_writes: bool = False,
    ) -> None:
        self.engine = engine
        self.clock = clock
        self._watchers: list[tuple[frozenset[str], Callable[[], None]]] = []
        self._group = _GroupWriter(self) if group_writes else None

    def watch(self, kinds: Iterable[str], changed: Callable[[], None]) -> None:
        """Call `changed()` whenever this store writes a document of one of `kinds`: as the
        write is made, and once more after its commit where this store commits it (a cache
        of what these documents say is dropped before and after the new version is seen)."""
        self._watchers.append((frozenset(kinds), changed))

    @contextlib.contextmanager
    def reading(self) -> Iterator[Connection]:
        """One read connection for every read of this store the calling thread makes inside
        (`find`, `get`, `list`, `ids`), and for the caller's own reads on the connection it
        yields. On SQLite they are one transaction and read as of one moment; on PostgreSQL
        each statement reads as of its own start (READ COMMITTED, where a read transaction
        gives no more), outside any transaction (`db._ReadStatements`). Nothing may be written
        inside: a write takes a second connection while this one is held (the test suite's
        guard refuses it). Inside `writing()`, its transaction."""
        held = self._held()
        if held is not None:
            yield held.conn
            return
        with self.engine.connect().execution_options(**READONLY) as conn:
            token = _HELD.set(_Held(self.engine, conn, False, set()))
            try:
                yield conn
            finally:
                _HELD.reset(token)

    @contextlib.contextmanager
    def writing(self) -> Iterator[Connection]:
        """One write transaction for every read and write of this store the calling thread
        makes inside, and for the caller's own on the connection it yields: they commit
        together at its end, or none does (a document created twice fails only its own
        savepoint, as `create` outside fails only itself)."""
        held = self._held()
        if held is not None and held.write:
            yield held.conn
            return
        kinds: set[str] = set()
        with self.engine.begin() as conn:
            token = _HELD.set(_Held(self.engine, conn, True, kinds))
            try:
                yield conn
            finally:
                _HELD.reset(token)
        for kind in kinds:
            self._changed(kind)

    def write_together(
        self, work: Callable[[Connection], T], *, reads: Iterable[tuple[str, str]] = ()
    ) -> T:
        """`work(conn)` inside a write transaction, as `with writing() as conn` would run it,
        and its value once that transaction has committed; its exception if it raised (then
        nothing it wrote is kept).

        With `group_writes` (a SQLite ledger, whose writers take turns at one lock anyway),
        the work of callers that ask at the same moment runs in one transaction on the
        store's writer thread: one BEGIN, one COMMIT and one write of each page they share
        for all of them, and one turn at the lock (`_GroupWriter._run_each`: a work that
        raises having written nothing fails alone; otherwise, as when the commit fails, each
        work runs again in a transaction of its own). `work` must do nothing but its reads and
        writes on `conn` (it may run twice, and in another thread): what follows the commit,
        its caller does. Inside an open `writing()`, it joins that transaction.

        `reads`: the documents (kind, id) the work reads by key (`find_in`, `find_each_in`):
        in a group, read for all its works in one statement before the first runs, and each
        work's reads of them answered from it until the group writes one (a spawn's instance
        and action: one read a group, not one a spawn, with the write lock held)."""
        soon = self.write_together_soon(work, reads=reads)
        if soon is None:
            with self.writing() as conn:
                return work(conn)
        return soon.result()

    def write_together_soon(
        self, work: Callable[[Connection], T], *, reads: Iterable[tuple[str, str]] = ()
    ) -> Future[T] | None:
        """`write_together` that does not wait: the future of its value where the work joins
        a group on the store's writer thread (`group_writes`, outside an open `writing()`),
        which an event loop awaits without a thread of its own waiting for it; None where
        the work would run in the caller's transaction (call `write_together` from a thread
        that may block)."""
        if self._group is None or self._held() is not None:
            return None
        return self._group.submit(work, tuple(reads))

    def _held(self) -> _Held | None:
        held = _HELD.get()
        return held if held is not None and held.engine is self.engine else None

    def _changed(self, kind: str) -> None:
        held = _HELD.get()
        if held is not None and held.write:
            held.kinds.add(kind)  # and again once `writing()` commits
        for kinds, changed in self._watchers:
            if kind in kinds:
                changed()

    def create(
        self,
        kind: str,
        id: str,
        body: Mapping[str, Any],
        *,
        project_id: str | None = None,
        name: str | None = None,
    ) -> Document:
        held = self._held()
        try:
            if held is not None and held.write:
                with held.conn.begin_nested():
                    created = self.create_in(
                        held.conn, kind, id, body, project_id=project_id, name=name
                    )
            else:
                with self.engine.begin() as conn:
                    created = self.create_in(conn, kind, id, body, project_id=project_id, name=name)
        except IntegrityError:
            raise ConflictError(f"{kind} {id} already exists") from None
        self._changed(kind)
        return created

    def create_in(
        self,
        conn: Connection,
        kind: str,
        id: str,
        body: Mapping[str, Any],
        *,
        project_id: str | None = None,
        name: str | None = None,
    ) -> Document:
        """`create` inside a transaction the caller holds (an existing id fails the commit)."""
        (created,) = self.create_each_in(conn, [NewDocument(kind, id, body, project_id, name)])
        return created

    def create_each_in(
        self, conn: Connection, new: Sequence[NewDocument], *, later: bool = False
    ) -> list[Document]:
        """`create_in` of several documents in one statement (a create's servers and their
        action records: one round trip, not one each). `later`: inside a group write, with
        the group's other inserts just before it commits (`insert_rows`)."""
        now = self.clock()
        for kind in {n.kind for n in new}:
            self._changed(kind)
        _forget(conn, [(n.kind, n.id) for n in new])
        (insert_rows if later else _insert_now)(
            conn,
            objects,
            [
                {
                    "kind": n.kind,
                    "id": n.id,
                    "project_id": n.project_id,
                    "name": n.name,
                    "created_at": now,
                    "updated_at": now,
                    "body": json.dumps(dict(n.body), sort_keys=True),
                    "ref": _ref(n.kind, n.body),
                }
                for n in new
            ],
        )
        return [Document(n.kind, n.id, n.project_id, n.name, now, now, dict(n.body)) for n in new]

    def put(
        self,
        kind: str,
        id: str,
        body: Mapping[str, Any],
        *,
        project_id: str | None = None,
        name: str | None = None,
    ) -> Document:
        """Create or replace."""
        existing = self.find(kind, id)
        if existing is None:
            return self.create(kind, id, body, project_id=project_id, name=name)
        return self.update(kind, id, body, project_id=project_id, name=name)

    def update(
        self,
        kind: str,
        id: str,
        body: Mapping[str, Any],
        *,
        project_id: str | None = None,
        name: str | None = None,
    ) -> Document:
        now = self.clock()
        values: dict[str, Any] = {
            "body": json.dumps(dict(body), sort_keys=True),
            "updated_at": now,
            "ref": _ref(kind, body),
        }
        if project_id is not None:
            values["project_id"] = project_id
        if name is not None:
            values["name"] = name
        self._changed(kind)
        with self.writing() as conn:
            _forget(conn, ((kind, id),))
            changed = conn.execute(
                update(objects).where(objects.c.kind == kind, objects.c.id == id).values(**values)
            ).rowcount
        self._changed(kind)
        if not changed:
            raise NotFound(f"{kind} {id} could not be found")
        return self.get(kind, id)

    def update_in(
        self,
        conn: Connection,
        kind: str,
        id: str,
        body: Mapping[str, Any],
        *,
        keep: tuple[str, ...] = (),
        later: bool = False,
    ) -> None:
        """Replace a document inside a transaction the caller holds (with a ledger change).

        `keep` names fields whose stored values win over `body`'s: requests that another
        writer may have set since `body` was read (an abort of a migration in flight).
        `later`: held to the end of the group write on `conn` (`update_later`), where a
        document gone undoes the group instead of raising NotFound here.
        """
        self._changed(kind)
        _forget(conn, ((kind, id),))
        if later and not keep and self._hold(conn, kind, id, None, body):
            return
        if keep:
            current = conn.execute(_FIND_FOR_UPDATE, {"k_kind": kind, "k_id": id}).scalar()
            if current is not None:
                stored = decode_body(current)
                body = {**body, **{k: stored[k] for k in keep if k in stored}}
        values = {
            "k_kind": kind,
            "k_id": id,
            "v_body": json.dumps(dict(body), sort_keys=True),
            "v_at": self.clock(),
            "v_ref": _ref(kind, body),
        }
        changed = conn.execute(_UPDATE, values).rowcount
        if not changed:
            raise NotFound(f"{kind} {id} could not be found")

    def swap(self, kind: str, id: str, old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
        """Replace a document only if it is still `old` (compare-and-swap); False if it moved.

        Two requests that read the same instance and both decide to act on it: one wins.
        """
        with self.writing() as conn:
            swapped = self.swap_in(conn, kind, id, old, new)
        self._changed(kind)
        return swapped

    def swap_in(
        self,
        conn: Connection,
        kind: str,
        id: str,
        old: Mapping[str, Any],
        new: Mapping[str, Any],
        *,
        later: bool = False,
    ) -> bool:
        """`swap` inside a transaction the caller holds. `later`: held to the end of the group
        write on `conn` (`update_later`) and True; a document that moved by then undoes the
        group, whose works run again alone, where this swap runs at once and says False."""
        self._changed(kind)
        _forget(conn, ((kind, id),))
        if later and self._hold(conn, kind, id, old, new):
            return True
        values = {
            "k_kind": kind,
            "k_id": id,
            "k_body": json.dumps(dict(old), sort_keys=True),
            "v_body": json.dumps(dict(new), sort_keys=True),
            "v_at": self.clock(),
            "v_ref": _ref(kind, new),
        }
        return bool(conn.execute(_SWAP, values).rowcount)

    def _hold(
        self,
        conn: Connection,
        kind: str,
        id: str,
        old: Mapping[str, Any] | None,
        new: Mapping[str, Any],
    ) -> bool:
        match: dict[str, Any] = {"kind": kind, "id": id}
        if old is not None:
            match["body"] = json.dumps(dict(old), sort_keys=True)
        values = {
            "body": json.dumps(dict(new), sort_keys=True),
            "updated_at": self.clock(),
            "ref": _ref(kind, new),
        }
        if not update_later(conn, objects, match, values):
            return False
        pending = _pending_of(conn)
        assert pending is not None
        pending.touched.add((kind, id))
        return True

    def next_number(self, counter: str, first: Callable[[], int] = lambda: 1) -> int:
        """The next value of a named counter, unique across processes; `first` starts it."""
        while True:
            found = self.find("counter", counter)
            if found is None:
                start = first()
                try:
                    self.create("counter", counter, {"value": start})
                except ConflictError:
                    continue
                return start
            value = int(found.body["value"]) + 1
            if self.swap("counter", counter, found.body, {"value": value}):
                return value

    def rename_in(self, conn: Connection, kind: str, id: str, name: str) -> None:
        self._changed(kind)
        _forget(conn, ((kind, id),))
        conn.execute(_RENAME, {"k_kind": kind, "k_id": id, "v_name": name})

    def delete_in(self, conn: Connection, kind: str, id: str) -> bool:
        """Delete a document inside a transaction the caller holds."""
        self._changed(kind)
        _forget(conn, ((kind, id),))
        return bool(conn.execute(_DELETE, {"k_kind": kind, "k_id": id}).rowcount)

    def find_in(self, conn: Connection, kind: str, id: str) -> Document | None:
        """`find` inside a transaction the caller holds (its own writes are seen)."""
        key = (kind, id)
        pending = _pending_of(conn)
        if pending is not None:
            if key in pending.read:
                return pending.read[key]
            pending.see(conn, (key,))
        rows = direct_rows(conn, _FIND, {"k_kind": kind, "k_id": id})
        return _doc(rows[0]) if rows else None

    def find(self, kind: str, id: str) -> Document | None:
        with self.reading() as conn:
            return self.find_in(conn, kind, id)

    def find_each(self, keys: Iterable[tuple[str, str]]) -> dict[tuple[str, str], Document]:
        """The documents of these (kind, id) pairs that exist, by pair: one statement (a
        request that needs several documents, such as a create's flavor and image); inside
        `reading()` or `writing()`, in its transaction."""
        keys = list(keys)
        if not keys:
            return {}
        with self.reading() as conn:
            return self.find_each_in(conn, keys)

    def find_each_in(
        self, conn: Connection, keys: Iterable[tuple[str, str]]
    ) -> dict[tuple[str, str], Document]:
        """`find_each` inside a transaction the caller holds (its own writes are seen)."""
        keys = list(keys)
        pending = _pending_of(conn)
        if pending is not None:
            read = pending.read
            if read and all(key in read for key in keys):
                return {key: doc for key in keys if (doc := read[key]) is not None}
            pending.see(conn, keys)
        by_kind: dict[str, list[str]] = {}
        for kind, id in keys:
            by_kind.setdefault(kind, []).append(id)
        if not by_kind:
            return {}
        params: dict[str, Any] = {}
        for i, (kind, ids) in enumerate(by_kind.items()):
            params[f"kind{i}"] = kind
            if len(ids) > _LISTED:
                params[f"ids{i}"] = ids
            else:
                params.update((f"id{i}_{n}", id) for n, id in enumerate(ids))
        shape = tuple(len(ids) for ids in by_kind.values())
        rows = direct_rows(conn, _find_each(shape), params)
        return {(row[0], row[1]): _doc(row) for row in rows}

    def get(self, kind: str, id: str) -> Document:
        found = self.find(kind, id)
        if found is None:
            raise NotFound(f"{kind} {id} could not be found")
        return found

    def delete(self, kind: str, id: str) -> bool:
        self._changed(kind)
        with self.writing() as conn:
            _forget(conn, ((kind, id),))
            deleted = bool(conn.execute(_DELETE, {"k_kind": kind, "k_id": id}).rowcount)
        self._changed(kind)
        return deleted

    def ids(self, kind: str, *, name: str | None = None) -> list[str]:
        """The ids of `kind`'s documents (of that `name`), oldest first, none decoded."""
        query = select(objects.c.id).where(objects.c.kind == kind)
        if name is not None:
            query = query.where(objects.c.name == name)
        with self.reading() as conn:
            return list(conn.execute(query.order_by(objects.c.created_at, objects.c.id)).scalars())

    def list(
        self,
        kind: str,
        *,
        project_id: str | None = None,
        name: str | None = None,
        ids: Iterable[str] | None = None,
        ref: str | None = None,
        limit: int | None = None,
        marker: str | None = None,
    ) -> list[Document]:
        """Oldest first; `marker` is the id of the last document of the previous page; `ref`
        (a kind of `REFS`) selects the documents whose body field says so, by the index."""
        if ref is not None and kind not in self.REFS:
            raise ValueError(f"{kind} documents keep no ref")
        params: dict[str, Any] = {"kind": kind, "ref": ref, "project_id": project_id}
        params.update(name=name, ids=None if ids is None else list(ids), limit=limit)
        query = _list_statement(params)
        with self.reading() as conn:
            if marker is not None:
                anchor = conn.execute(
                    select(objects.c.created_at).where(
                        objects.c.kind == kind, objects.c.id == marker
                    )
                ).scalar()
                if anchor is None:
                    raise NotFound(f"marker {marker} could not be found")
                # The page after the marker: the same filters, order and limit.
                query = query.where(
                    or_(
                        objects.c.created_at > anchor,
                        and_(objects.c.created_at == anchor, objects.c.id > marker),
                    )
                )
            return [_doc(row) for row in conn.execute(query, params)]


_LISTS: dict[frozenset[str], Select[Any]] = {}


def _forget(conn: Connection, keys: Iterable[tuple[str, str]]) -> None:
    """A write of these documents in a group: its later reads of them go to the database."""
    pending = _pending_of(conn)
    if pending is not None:
        pending.forget(keys)


def _list_statement(params: Mapping[str, Any]) -> Select[Any]:
    """`list`'s SELECT (without a marker) for the filters given in `params`, built once per
    set of filters; each filter's value is the bound parameter of its name."""
    given = frozenset(name for name, value in params.items() if value is not None)
    query = _LISTS.get(given)
    if query is None:
        query = select(objects).where(objects.c.kind == bindparam("kind"))
        for column in ("ref", "project_id", "name"):
            if column in given:
                query = query.where(objects.c[column] == bindparam(column))
        if "ids" in given:
            query = query.where(objects.c.id.in_(bindparam("ids", expanding=True)))
        query = query.order_by(objects.c.created_at, objects.c.id)
        if "limit" in given:
            query = query.limit(bindparam("limit", type_=Integer))
        _LISTS[given] = query
    return query


def _ref(kind: str, body: Mapping[str, Any]) -> str | None:
    field = ObjectStore.REFS.get(kind)
    value = body.get(field) if field is not None else None
    return str(value) if value else None


def _doc(row: Any) -> Document:
    """A document of a row of `select(objects)`, read by position: SQLAlchemy's row or the
    driver's tuple (`db.direct_rows`)."""
    return Document(row[0], row[1], row[2], row[3], row[4], row[5], decode_body(row[6]))


def decode_body(text: str) -> Any:
    """A stored body: orjson (2-3x faster than json; a quarter of a server list's time was
    decoding), unless the text holds 19 digits in a row (orjson reads an integer past 64 bits
    as a float, silently) or orjson refuses it (NaN, a lone surrogate): then json, which
    wrote it. Bodies are still written by json.dumps: the compare-and-swap compares text.

    The look for 19 digits maps every ASCII digit to one and searches the bytes (1.5-3 us a
    document; a regular expression took 17-28 us, five times orjson's decoding). JSON's
    numbers are ASCII: another script's digits cannot make one."""
    if _DIGIT_RUN not in text.encode("utf-8", "surrogatepass").translate(_DIGITS_AS_ZERO):
        try:
            return orjson.loads(text)
        except orjson.JSONDecodeError:
            pass
    return json.loads(text)


_DIGITS_AS_ZERO = bytes(b if b not in b"0123456789" else ord("0") for b in range(256))
_DIGIT_RUN = b"0" * 19


_Asked = tuple[Callable[[Connection], Any], "Future[Any]", tuple[tuple[str, str], ...]]
"""A work asked of the group writer: the work, its caller's answer, the documents it reads."""


class _GroupWriter:
    """The writer thread of `ObjectStore.write_together`: it takes what is waiting (up to
    `most` works), runs it in one transaction and answers each caller after the commit."""

    most = 64

    def __init__(self, store: ObjectStore) -> None:
        self._store = store
        self._waiting: queue.SimpleQueue[_Asked] = queue.SimpleQueue()
        self._start = threading.Lock()
        self._thread: threading.Thread | None = None

    def submit(
        self, work: Callable[[Connection], T], reads: tuple[tuple[str, str], ...]
    ) -> Future[T]:
        answer: Future[T] = Future()
        # Running from now on: a caller that stops waiting (a cancelled task) cannot cancel
        # it, and the group answers it whatever the caller does, as a pool's running call.
        answer.set_running_or_notify_cancel()
        self._waiting.put((work, answer, reads))
        if self._thread is None:
            with self._start:
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._loop, name="stowage-group-writer", daemon=True
                    )
                    self._thread.start()
        return answer

    def _loop(self) -> None:
        while True:
            batch = [self._waiting.get()]
            while len(batch) < self.most:
                try:
                    batch.append(self._waiting.get_nowait())
                except queue.Empty:
                    break
            try:
                self._commit(batch)
            except BaseException as exc:  # never leave a caller waiting
                log.exception("the group writer failed a batch of %d", len(batch))
                for _work, answer, _reads in batch:
                    if not answer.done():
                        answer.set_exception(exc)

    def _commit(self, batch: list[_Asked]) -> None:
        done: list[tuple[Future[Any], Any, BaseException | None]] = []
        try:
            # This thread holds no transaction: `writing()` begins one, and tells the store's
            # watchers of what it wrote once it has committed.
            with self._store.writing() as conn:
                if len(batch) == 1:  # alone: its transaction is its savepoint
                    done.append((batch[0][1], batch[0][0](conn), None))
                else:
                    self._run_each(self._store, conn, batch, done)
        except Exception as exc:
            if len(batch) == 1:
                batch[0][1].set_exception(exc)
                return
            # Nothing of the batch is written: each work again, alone, so that only what
            # fails alone fails.
            log.warning("a group commit of %d failed; each runs alone", len(batch), exc_info=True)
            for item in batch:
                self._commit([item])  # alone, it answers its caller whatever happens
            return
        for answer, value, failure in done:
            if failure is None:
                answer.set_result(value)
            else:
                answer.set_exception(failure)

    @staticmethod
    def _run_each(
        store: ObjectStore,
        conn: Connection,
        batch: list[_Asked],
        done: list[tuple[Future[Any], Any, BaseException | None]],
    ) -> None:
        """Each work of a group in the group's transaction, and the rows they asked to insert
        (`insert_rows`) at the end, together.

        No savepoint a work: each was two statements more (and two hand-overs of the
        interpreter, the lock held). A work that raises having written nothing of its own
        (SQLite's count of changed rows moved by no more than the rows of the works before
        it that it flushed; what it asked to insert is dropped) fails alone, as its
        savepoint's rollback made it; one that raises after a write of its own undoes the
        whole group, whose works then run again each alone (`_commit`)."""
        raw: Any = conn.connection.dbapi_connection
        with _holding(conn) as pending:
            keys = list(dict.fromkeys(key for _work, _answer, reads in batch for key in reads))
            if keys:  # what the works said they read, in one statement
                found = store.find_each_in(conn, keys)
                pending.read = {key: found.get(key) for key in keys}
            for index, (work, answer, _reads) in enumerate(batch):
                pending.work = index
                changed, others = raw.total_changes, pending.others
                try:
                    value = work(conn)
                except Exception as exc:
                    # Rows it made the group write for the works before it (a quota count's
                    # `flush_inserts`) are theirs, not its own; a held update that missed
                    # may be any work's.
                    wrote = raw.total_changes - changed != pending.others - others
                    if wrote or isinstance(exc, HeldWriteMissed):
                        raise _WroteThenFailed(index) from exc
                    pending.drop(index)
                    done.append((answer, None, exc))
                else:
                    done.append((answer, value, None))


class _WroteThenFailed(Exception):
    """A work of a group raised after writing: the group's transaction is undone."""
