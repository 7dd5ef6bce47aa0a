"""Block storage's shared vocabulary: errors, statuses, the pool, quotas and the backend in use."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from sqlalchemy import Connection, select

from stowage.domain.errors import StowageError
from stowage.ledger.schema import objects
from stowage.ledger.storage import ensure_pool
from stowage.services.cloud import Cloud
from stowage.services.volumes.backend import LocalFileBackend, VolumeBackend

__all__ = [
    "DEFAULT_TYPE_ID",
    "DEFAULT_TYPE_NAME",
    "DEFAULT_VOLUME_QUOTAS",
    "POOL",
    "InvalidVolume",
    "VolumeCaller",
    "VolumeQuotaExceeded",
    "backend_of",
    "pool_host",
    "register_pool",
    "volume_quota_limits",
]

POOL = "local"
# Cinder's default type since Wallaby: every volume has a type.
DEFAULT_TYPE_NAME = "__DEFAULT__"
DEFAULT_TYPE_ID = str(uuid.uuid5(uuid.NAMESPACE_URL, "stowage-volume-type:__DEFAULT__"))
# Cinder's defaults ([DEFAULT] quota_volumes, quota_snapshots, quota_gigabytes, ...).
DEFAULT_VOLUME_QUOTAS: dict[str, int] = {
    "volumes": 10,
    "snapshots": 10,
    "gigabytes": 1000,
    "per_volume_gigabytes": -1,
    "backups": 10,
    "backup_gigabytes": 1000,
    "groups": 10,
}
# Volume statuses from which a delete may start (Cinder's API checks the same list).
DELETABLE = frozenset({"available", "error", "error_restoring", "error_extending"})


class VolumeCaller(Protocol):
    @property
    def project_id(self) -> str: ...

    @property
    def user_id(self) -> str: ...

    @property
    def is_admin(self) -> bool: ...


class InvalidVolume(StowageError):
    """A request the volume's state or the arguments do not allow (Cinder's 400)."""

    code = "volume.invalid"


class VolumeQuotaExceeded(StowageError):
    """Past a project's volumes, snapshots or gigabytes quota (Cinder's 413)."""

    code = "volume.quota.exceeded"


def backend_of(cloud: Cloud) -> VolumeBackend:
    root = cloud.config.volume_dir or cloud.config.state_dir / "volumes"
    return LocalFileBackend(Path(root))


def pool_host(cloud: Cloud) -> str:
    """Cinder's `os-vol-host-attr:host`: host@backend#pool."""
    return f"stowage@{backend_of(cloud).kind}#{POOL}"


def register_pool(cloud: Cloud) -> None:
    """The local-file pool in the ledger, with the configured capacity if it is new."""
    from sqlalchemy.exc import IntegrityError

    try:
        with cloud.ledger.engine.begin() as conn:
            ensure_pool(conn, POOL, backend_of(cloud).kind, cloud.config.volume_pool_gb)
    except IntegrityError:
        pass  # another process registered it at the same moment


def volume_quota_limits(conn: Connection, project_id: str) -> dict[str, int]:
    """The project's block storage limits: Cinder's defaults, then the project's overrides."""
    limits = dict(DEFAULT_VOLUME_QUOTAS)
    raw = conn.execute(
        select(objects.c.body).where(objects.c.kind == "volume_quota", objects.c.id == project_id)
    ).scalar()
    if raw is not None:
        import json

        stored: Mapping[str, Any] = json.loads(raw)
        limits.update({k: int(v) for k, v in stored.items() if k in DEFAULT_VOLUME_QUOTAS})
    return limits
