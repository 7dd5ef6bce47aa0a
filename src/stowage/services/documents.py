"""The one way a document that several writers share is changed: compare-and-swap of the
fields a writer changed.

A writer reads a document, decides, and writes what it changed (`after` against the `before`
it read). The change is applied to the document as it is now, by compare-and-swap (read again
on a lost race), and only while each field it changes still holds what the writer read: a
concurrent writer's other fields (metadata set while the conductor finished a build, a lock
taken while a move ended, one extra spec set beside another) are never overwritten by a stale
copy, and a field another writer changed meanwhile is a ConflictError, not overwritten.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy import Connection, text

from stowage.domain.errors import ConflictError, NotFound
from stowage.services.cloud import Cloud

__all__ = ["changes_of", "lock_key", "modify_document", "write_document"]

_ATTEMPTS_MAX = 20
_LOCK = text("SELECT pg_advisory_xact_lock(hashtextextended(:key, 0))")  # built once
_LOCK_SHARED = text("SELECT pg_advisory_xact_lock_shared(hashtextextended(:key, 0))")


def changes_of(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    """The fields `after` sets differently from `before` (a removed field is set to None)."""
    out = {k: v for k, v in after.items() if k not in before or before[k] != v}
    out.update({k: None for k in before if k not in after})
    return out


def lock_key(conn: Connection, key: str, *, shared: bool = False) -> None:
    """Hold a named lock until `conn`'s transaction ends: an advisory lock on PostgreSQL;
    SQLite's write transactions are serialized already. `shared`: many transactions hold it
    at once, and one that takes it exclusively waits for all of them (and they for it)."""
    if conn.dialect.name == "postgresql":
        conn.execute(_LOCK_SHARED if shared else _LOCK, {"key": key})


def write_document(
    cloud: Cloud,
    kind: str,
    doc_id: str,
    before: Mapping[str, Any],
    after: Mapping[str, Any],
    *,
    conn: Connection | None = None,
    name: str | None = None,
    current: Mapping[str, Any] | None = None,
    later: bool = False,
) -> dict[str, Any]:
    """Apply what changed from `before` to `after` onto the stored document, by
    compare-and-swap; inside `conn`'s transaction when given. Returns the body written.

    `current`: the stored body as `conn`'s transaction read it (a writer that read `before`
    there): the first swap is tried on it without reading the document again. `later`: that
    swap held to the end of the group write on `conn` (`ObjectStore.swap_in`)."""
    if conn is not None:
        return _swap_changes(cloud, conn, kind, doc_id, before, after, name, current, later)
    with cloud.ledger.engine.begin() as own:
        return _swap_changes(cloud, own, kind, doc_id, before, after, name, current)


def modify_document(
    cloud: Cloud,
    kind: str,
    doc_id: str,
    change: Callable[[dict[str, Any]], dict[str, Any]],
    *,
    name_field: str | None = None,
) -> dict[str, Any]:
    """Apply `change` to the document as it is now and swap the result in, again on a lost
    race: for changes that compose (a key added to a map, a member to a list), where a
    concurrent writer's change is kept rather than refused. `change` may raise to refuse.
    With `name_field`, the document's name follows that field of the new body.

    Each attempt is one `cloud.objects.writing()` transaction: the store's reads `change`
    makes (a quota's limits, the other aggregates' zones) join it instead of taking a second
    connection while this one holds the write (which can wait on it for good)."""
    label = kind.replace("_", " ").capitalize()
    for _ in range(_ATTEMPTS_MAX):
        with cloud.objects.writing() as conn:
            current = cloud.objects.find_in(conn, kind, doc_id)
            if current is None:
                raise NotFound(f"{label} {doc_id} could not be found.")
            new = change(dict(current.body))
            if cloud.objects.swap_in(conn, kind, doc_id, current.body, new):
                if name_field is not None and new.get(name_field) != current.name:
                    cloud.objects.rename_in(conn, kind, doc_id, str(new[name_field]))
                return new
    raise RuntimeError(f"{kind} {doc_id} kept changing under {_ATTEMPTS_MAX} writes")


def _swap_changes(
    cloud: Cloud,
    conn: Connection,
    kind: str,
    doc_id: str,
    before: Mapping[str, Any],
    after: Mapping[str, Any],
    name: str | None,
    known: Mapping[str, Any] | None = None,
    later: bool = False,
) -> dict[str, Any]:
    changes = changes_of(before, after)
    label = kind.replace("_", " ").capitalize()
    for _ in range(_ATTEMPTS_MAX):
        if known is None:
            found = cloud.objects.find_in(conn, kind, doc_id)
            if found is None:
                raise NotFound(f"{label} {doc_id} could not be found.")
            known = found.body
        current, known = known, None  # a lost swap reads the document again
        moved = sorted(
            k for k in changes if k in before and current.get(k) not in (before[k], changes[k])
        )
        if moved:
            raise ConflictError(
                f"{label} {doc_id} changed since it was read ({', '.join(moved)}); try again"
            )
        new = {**current, **changes}
        if cloud.objects.swap_in(conn, kind, doc_id, current, new, later=later):
            if name is not None:
                cloud.objects.rename_in(conn, kind, doc_id, name)
            return new
    raise RuntimeError(f"{kind} {doc_id} kept changing under {_ATTEMPTS_MAX} writes")
