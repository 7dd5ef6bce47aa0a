"""Flavor administration: create, change (description, access list, extra specs), delete.

A flavor's name is unique: creates of one name take turns under a named lock, so two at
once make one flavor. Every change is applied to the flavor as it is now by compare-and-swap
(`documents.modify_document`): two admins setting different extra specs at once, or giving
two projects access, both keep theirs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from stowage.domain.errors import ConflictError
from stowage.ledger.schema import objects
from stowage.services.cloud import Cloud
from stowage.services.documents import lock_key, modify_document

__all__ = ["change_flavor", "create_flavor", "delete_flavor"]


def create_flavor(cloud: Cloud, body: Mapping[str, Any]) -> dict[str, Any]:
    """A new flavor; ConflictError naming the name or the id that exists already."""
    name, flavor_id = str(body["name"]), str(body["id"])
    try:
        with cloud.ledger.engine.begin() as conn:
            lock_key(conn, f"stowage-flavor-name:{name}")
            taken = conn.execute(
                select(objects.c.id).where(objects.c.kind == "flavor", objects.c.name == name)
            ).first()
            if taken is not None:
                raise ConflictError(f"Flavor with name {name} already exists.")
            cloud.objects.create_in(conn, "flavor", flavor_id, body, name=name)
    except IntegrityError:
        raise ConflictError(f"Flavor with ID {flavor_id} already exists.") from None
    return dict(body)


def change_flavor(
    cloud: Cloud, flavor_id: str, change: Callable[[dict[str, Any]], dict[str, Any]]
) -> dict[str, Any]:
    """Apply `change` to the flavor as it is now (it may raise to refuse); the body written."""
    return modify_document(cloud, "flavor", flavor_id, change)


def delete_flavor(cloud: Cloud, flavor_id: str) -> bool:
    return cloud.objects.delete("flavor", flavor_id)
