"""Key pairs: created under their user's key-pair quota, counted in the creating transaction."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from stowage.domain.errors import ConflictError, QuotaExceeded
from stowage.ledger.objects import Document
from stowage.ledger.schema import objects
from stowage.services.cloud import Cloud
from stowage.services.documents import lock_key
from stowage.services.quotas import quota_limits_in

__all__ = ["create_keypair", "delete_keypair"]


def create_keypair(cloud: Cloud, doc_id: str, project_id: str, body: Mapping[str, Any]) -> Document:
    """A new key pair for `body["user_id"]`; QuotaExceeded past the key_pairs limit (two
    creates at once take turns under the user's lock), ConflictError if the name exists."""
    user_id = str(body["user_id"])
    try:
        with cloud.ledger.engine.begin() as conn:
            lock_key(conn, f"stowage-keypairs:{user_id}")
            limit = quota_limits_in(cloud, conn, project_id)["key_pairs"]
            owned = sum(
                1
                for raw in conn.execute(
                    select(objects.c.body).where(objects.c.kind == "keypair")
                ).scalars()
                if json.loads(raw).get("user_id") == user_id
            )
            if 0 <= limit <= owned:
                raise QuotaExceeded("Quota exceeded, too many key pairs.")
            return cloud.objects.create_in(
                conn, "keypair", doc_id, body, project_id=project_id, name=str(body["name"])
            )
    except IntegrityError:
        raise ConflictError(f"Key pair '{body['name']}' already exists.") from None


def delete_keypair(cloud: Cloud, doc_id: str) -> bool:
    return cloud.objects.delete("keypair", doc_id)
