"""Host aggregates: create, change (name, zone, hosts, metadata), delete.

Each change is applied to the aggregate as it is now by compare-and-swap
(`documents.modify_document`), and the hosts it touches get their zone and metadata in the
ledger right after, so two admins adding two hosts at once both land. Names are checked by
the caller before the change (a rename racing a create of that name can make two).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from sqlalchemy import select

from stowage.domain.errors import ConflictError, InvalidSpec
from stowage.ledger.objects import Document
from stowage.ledger.schema import objects
from stowage.services.cloud import Cloud
from stowage.services.compute_catalog import sync_host_zones
from stowage.services.documents import lock_key, modify_document

__all__ = ["change_aggregate", "create_aggregate", "delete_aggregate"]

_LOCK = "stowage-aggregates"


def create_aggregate(cloud: Cloud, body: Mapping[str, Any]) -> Document:
    """A new aggregate with the next numeric id; ConflictError if the name exists."""
    name = str(body["name"])
    with cloud.ledger.engine.begin() as conn:
        lock_key(conn, _LOCK)
        ids = conn.execute(
            select(objects.c.id, objects.c.name).where(objects.c.kind == "aggregate")
        )
        rows = list(ids)
        if any(row.name == name for row in rows):
            raise ConflictError(f"Aggregate {name} already exists.")
        next_id = max((int(row.id) for row in rows), default=0) + 1
        return cloud.objects.create_in(conn, "aggregate", str(next_id), body, name=name)


def change_aggregate(
    cloud: Cloud,
    aggregate_id: str,
    change: Callable[[dict[str, Any]], dict[str, Any]],
    *,
    hosts: Iterable[str] = (),
) -> dict[str, Any]:
    """Apply `change` to the aggregate as it is now (it may raise to refuse), then bring the
    zone and metadata of its hosts, and of `hosts` (hosts it no longer holds), up to date."""
    before_hosts: list[str] = []

    def tracked(body: dict[str, Any]) -> dict[str, Any]:
        before_hosts[:] = list(body.get("hosts", []))
        return change(body)

    new = modify_document(cloud, "aggregate", aggregate_id, tracked, name_field="name")
    sync_host_zones(cloud, sorted({*before_hosts, *new.get("hosts", []), *hosts}))
    return new


def delete_aggregate(cloud: Cloud, aggregate_id: str) -> bool:
    """Delete an empty aggregate; InvalidSpec if it still holds hosts."""
    with cloud.ledger.engine.begin() as conn:
        lock_key(conn, _LOCK)
        doc = cloud.objects.find_in(conn, "aggregate", aggregate_id)
        if doc is None:
            return False
        if doc.body.get("hosts"):
            raise InvalidSpec(
                f"Cannot perform action 'delete' on aggregate {aggregate_id}. Reason: Host "
                "aggregate is not empty."
            )
        return cloud.objects.delete_in(conn, "aggregate", aggregate_id)
