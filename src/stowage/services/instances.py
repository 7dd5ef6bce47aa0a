"""The one way an instance document is written: compare-and-swap of the fields a writer
changed.

A writer reads the instance, decides, and writes what it changed (`after` against the
`before` it read). The change is applied to the document as it is now, by compare-and-swap
(read again on a lost race), and only while each field it changes still holds what the writer
read: a concurrent writer's other fields (metadata set while the conductor finished a build,
a lock taken while a move ended) are never overwritten by a stale copy, and a field another
writer changed meanwhile (a delete's task state) is a ConflictError, not overwritten.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import Connection

from stowage.domain.errors import ConflictError, NotFound
from stowage.services.cloud import Cloud

__all__ = ["changes_of", "write_instance"]

_ATTEMPTS_MAX = 20


def changes_of(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    """The fields `after` sets differently from `before` (a removed field is set to None)."""
    out = {k: v for k, v in after.items() if k not in before or before[k] != v}
    out.update({k: None for k in before if k not in after})
    return out


def write_instance(
    cloud: Cloud,
    instance_id: str,
    before: Mapping[str, Any],
    after: Mapping[str, Any],
    *,
    conn: Connection | None = None,
    name: str | None = None,
) -> dict[str, Any]:
    """Apply what changed from `before` to `after` onto the stored instance, by
    compare-and-swap; inside `conn`'s transaction when given. Returns the document written."""
    if conn is not None:
        return _swap_changes(cloud, conn, instance_id, before, after, name)
    with cloud.ledger.engine.begin() as own:
        return _swap_changes(cloud, own, instance_id, before, after, name)


def _swap_changes(
    cloud: Cloud,
    conn: Connection,
    instance_id: str,
    before: Mapping[str, Any],
    after: Mapping[str, Any],
    name: str | None,
) -> dict[str, Any]:
    changes = changes_of(before, after)
    for _ in range(_ATTEMPTS_MAX):
        current = cloud.objects.find_in(conn, "instance", instance_id)
        if current is None:
            raise NotFound(f"Instance {instance_id} could not be found.")
        moved = sorted(
            k for k in changes if k in before and current.body.get(k) not in (before[k], changes[k])
        )
        if moved:
            raise ConflictError(
                f"Instance {instance_id} changed since it was read ({', '.join(moved)}); try again"
            )
        new = {**current.body, **changes}
        if cloud.objects.swap_in(conn, "instance", instance_id, current.body, new):
            if name is not None:
                cloud.objects.rename_in(conn, "instance", instance_id, name)
            return new
    raise RuntimeError(f"instance {instance_id} kept changing under {_ATTEMPTS_MAX} writes")
