"""Keystone's policy blobs (/v3/policies): stored and served, never enforced, as in Keystone
(whose API is deprecated and whose own enforcement reads policy files, not these)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from stowage.domain.errors import InvalidSpec, NotFound
from stowage.ledger.objects import Document
from stowage.services.cloud import Cloud

__all__ = ["create", "delete", "get", "list_all", "update"]

KIND = "policy_blob"


def _invalid(field: str, why: str) -> InvalidSpec:
    return InvalidSpec(f"Invalid input for field '{field}': {why}", code="identity.invalid")


def _text(field: str, value: Any) -> str:
    if not isinstance(value, str) or not value or (field == "type" and len(value) > 255):
        raise _invalid(field, f"{value!r} is not a non-empty string")
    return value


def get(cloud: Cloud, policy_id: str) -> Document:
    doc = cloud.objects.find(KIND, policy_id)
    if doc is None:
        raise NotFound(f"Could not find policy: {policy_id}.", code="identity.policy.not_found")
    return doc


def list_all(cloud: Cloud) -> list[Document]:
    return cloud.objects.list(KIND)


def create(cloud: Cloud, fields: Mapping[str, Any]) -> Document:
    body = {k: v for k, v in fields.items() if k not in {"id", "links"}}
    body["type"] = _text("type", fields.get("type"))
    body["blob"] = _text("blob", fields.get("blob"))
    return cloud.objects.create(KIND, uuid.uuid4().hex, body)


def update(cloud: Cloud, policy_id: str, changes: Mapping[str, Any]) -> Document:
    doc = get(cloud, policy_id)
    body = dict(doc.body)
    for key, value in changes.items():
        if key in {"type", "blob"}:
            body[key] = _text(key, value)
        elif key not in {"id", "links"}:
            body[key] = value
    return cloud.objects.update(KIND, doc.id, body)


def delete(cloud: Cloud, policy_id: str) -> None:
    get(cloud, policy_id)
    cloud.objects.delete(KIND, policy_id)
