"""The one way an instance document is written: compare-and-swap of the fields a writer
changed (`services.documents.write_document` for the kind "instance")."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import Connection

from stowage.services.cloud import Cloud
from stowage.services.documents import changes_of, write_document

__all__ = ["changes_of", "write_instance"]


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
    return write_document(cloud, "instance", instance_id, before, after, conn=conn, name=name)
