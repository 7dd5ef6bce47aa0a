"""The one way an instance document is written: compare-and-swap of the fields a writer
changed (`services.documents.write_document` for the kind "instance")."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy import Connection

from stowage.services.cloud import Cloud
from stowage.services.documents import changes_of, modify_document, write_document

__all__ = [
    "change_metadata",
    "changes_of",
    "clear_password",
    "set_block_devices",
    "set_tags",
    "update_server",
    "write_instance",
]


def write_instance(
    cloud: Cloud,
    instance_id: str,
    before: Mapping[str, Any],
    after: Mapping[str, Any],
    *,
    conn: Connection | None = None,
    name: str | None = None,
    current: Mapping[str, Any] | None = None,
    later: bool = False,
) -> dict[str, Any]:
    """Apply what changed from `before` to `after` onto the stored instance, by
    compare-and-swap; inside `conn`'s transaction when given (`current`, `later`: as
    `write_document`). Returns the document written."""
    return write_document(
        cloud,
        "instance",
        instance_id,
        before,
        after,
        conn=conn,
        name=name,
        current=current,
        later=later,
    )


def change_metadata(
    cloud: Cloud,
    instance_id: str,
    change: Callable[[dict[str, str]], dict[str, str]],
) -> dict[str, str]:
    """Apply `change` to the server's metadata as it is now, by compare-and-swap (again on a
    lost race): concurrent writers of different keys keep each other's. `change` may raise
    to refuse (a quota, a missing key). Returns the metadata written."""
    written: dict[str, str] = {}

    def apply(body: dict[str, Any]) -> dict[str, Any]:
        new = change(dict(body.get("metadata") or {}))
        written.clear()
        written.update(new)
        return {**body, "metadata": new}

    modify_document(cloud, "instance", instance_id, apply)
    return dict(written)


def update_server(
    cloud: Cloud, instance_id: str, before: Mapping[str, Any], after: Mapping[str, Any]
) -> dict[str, Any]:
    """PUT /servers/{id}: the fields a request changed (name, description, access
    addresses), compare-and-swap against what it read; the document's name follows."""
    return write_instance(cloud, instance_id, before, after, name=str(after.get("name") or ""))


def set_tags(
    cloud: Cloud, instance_id: str, before: Mapping[str, Any], tags: list[str]
) -> dict[str, Any]:
    """The server's tags as a request sets them, compare-and-swap against what it read."""
    return write_instance(cloud, instance_id, before, {**before, "tags": tags})


def clear_password(cloud: Cloud, instance_id: str, before: Mapping[str, Any]) -> None:
    """DELETE /os-server-password: the stored password goes."""
    if before.get("password"):
        write_instance(cloud, instance_id, before, {**before, "password": ""})


def set_block_devices(
    cloud: Cloud, instance_id: str, before: Mapping[str, Any], devices: list[dict[str, Any]]
) -> dict[str, Any]:
    """The server's block devices as a request changed them (delete_on_termination, 2.85)."""
    return write_instance(cloud, instance_id, before, {**before, "block_devices": devices})
