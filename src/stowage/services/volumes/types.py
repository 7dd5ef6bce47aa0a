"""Volume types (an admin's catalogue; `__DEFAULT__` always exists) and block storage quotas."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from sqlalchemy.exc import IntegrityError

from stowage.domain.errors import ConflictError, NotFound
from stowage.services.cloud import Cloud
from stowage.services.quotas import lock_project
from stowage.services.volumes.model import (
    DEFAULT_TYPE_ID,
    DEFAULT_TYPE_NAME,
    DEFAULT_VOLUME_QUOTAS,
    InvalidVolume,
    volume_quota_limits,
)
from stowage.services.volumes.volumes import default_type, find_type, volume_usage

__all__ = [
    "create_type",
    "delete_type",
    "list_types",
    "quota_set",
    "reset_quotas",
    "set_quotas",
    "update_type",
]


def list_types(cloud: Cloud, *, is_admin: bool) -> list[dict[str, Any]]:
    made = [d.body for d in cloud.objects.list("volume_type")]
    return [default_type(), *(t for t in made if is_admin or t.get("is_public", True))]


def create_type(cloud: Cloud, request: Mapping[str, Any]) -> dict[str, Any]:
    name = request.get("name")
    if not isinstance(name, str) or not name.strip() or len(name) > 255:
        raise InvalidVolume("Invalid input for field/attribute name: 1 to 255 characters")
    if name == DEFAULT_TYPE_NAME or cloud.objects.list("volume_type", name=name):
        raise ConflictError(f"Volume Type {name} already exists.")
    body = {
        "id": str(uuid.uuid4()),
        "name": name,
        "description": request.get("description"),
        "is_public": request.get("is_public", True) is not False,
        "extra_specs": dict(request.get("extra_specs") or {}),
    }
    try:
        cloud.objects.create("volume_type", str(body["id"]), body, name=name)
    except ConflictError:
        raise ConflictError(f"Volume Type {name} already exists.") from None
    return body


def update_type(cloud: Cloud, type_id: str, changes: Mapping[str, Any]) -> dict[str, Any]:
    if type_id == DEFAULT_TYPE_ID:
        raise InvalidVolume("Invalid volume type: the default volume type cannot be changed")
    doc = cloud.objects.find("volume_type", type_id)
    if doc is None:
        raise NotFound(f"Volume type {type_id} could not be found.")
    body = dict(doc.body)
    for key in ("name", "description", "is_public"):
        if key in changes:
            body[key] = changes[key]
    if "extra_specs" in changes:
        body["extra_specs"] = {**body.get("extra_specs", {}), **changes["extra_specs"]}
    if "unset_spec" in changes:
        specs = dict(body.get("extra_specs") or {})
        if changes["unset_spec"] not in specs:
            raise NotFound(
                f"Volume Type {type_id} has no extra specs with key {changes['unset_spec']}."
            )
        specs.pop(changes["unset_spec"])
        body["extra_specs"] = specs
    cloud.objects.update("volume_type", type_id, body, name=body["name"])
    return body


def delete_type(cloud: Cloud, type_id: str) -> None:
    if type_id == DEFAULT_TYPE_ID:
        raise InvalidVolume("Invalid volume type: the default volume type cannot be deleted")
    find_type(cloud, type_id)
    with cloud.objects.writing() as conn:  # the volumes are listed in this transaction
        in_use = any(d.body.get("volume_type_id") == type_id for d in cloud.objects.list("volume"))
        if in_use:
            raise InvalidVolume(
                f"Target volume type is still in use. Volume Type {type_id} is in use."
            )
        cloud.objects.delete_in(conn, "volume_type", type_id)


def quota_set(cloud: Cloud, project_id: str, *, usage: bool) -> dict[str, Any]:
    """The project's limits (with what is in use when asked), Cinder's keys and the default
    type's per-type keys."""
    with cloud.ledger.engine.begin() as conn:
        limits = volume_quota_limits(conn, project_id)
        used = volume_usage(conn, project_id)
    out: dict[str, Any] = {"id": project_id}
    per_type = {
        f"volumes_{DEFAULT_TYPE_NAME}": ("volumes", limits["volumes"]),
        f"snapshots_{DEFAULT_TYPE_NAME}": ("snapshots", limits["snapshots"]),
        f"gigabytes_{DEFAULT_TYPE_NAME}": ("gigabytes", limits["gigabytes"]),
    }
    for key, limit in limits.items():
        out[key] = (
            {"limit": limit, "in_use": used.get(key, 0), "reserved": 0, "allocated": 0}
            if usage
            else limit
        )
    for key, (base, limit) in per_type.items():
        out[key] = (
            {"limit": limit, "in_use": used.get(base, 0), "reserved": 0, "allocated": 0}
            if usage
            else limit
        )
    return out


def set_quotas(cloud: Cloud, project_id: str, changes: Mapping[str, Any]) -> None:
    bad = sorted(k for k in changes if k not in DEFAULT_VOLUME_QUOTAS)
    if bad:
        raise InvalidVolume(f"Bad key(s) in quota set: {', '.join(bad)}")
    values: dict[str, int] = {}
    for key, value in changes.items():
        try:
            number = int(value)
        except (TypeError, ValueError):
            raise InvalidVolume(f"Quota {key} must be an integer") from None
        if number < -1:
            raise InvalidVolume(f"Quota limit {number} for {key} must be -1 or greater.")
        values[key] = number
    try:
        with cloud.ledger.engine.begin() as conn:
            lock_project(conn, project_id)
            used = volume_usage(conn, project_id)
            for key, number in values.items():
                if key in used and 0 <= number < used[key]:
                    raise InvalidVolume(
                        f"Quota limit {number} for {key} must be greater than or equal to "
                        f"already used and reserved {used[key]}."
                    )
            current = cloud.objects.find_in(conn, "volume_quota", project_id)
            if current is None:
                cloud.objects.create_in(conn, "volume_quota", project_id, values)
            else:
                cloud.objects.update_in(
                    conn, "volume_quota", project_id, {**current.body, **values}
                )
    except IntegrityError:
        raise ConflictError("the project's quotas changed meanwhile; try again") from None


def reset_quotas(cloud: Cloud, project_id: str) -> None:
    with cloud.ledger.engine.begin() as conn:
        cloud.objects.delete_in(conn, "volume_quota", project_id)
