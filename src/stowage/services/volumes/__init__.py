"""Block storage (Cinder's use cases): volumes, snapshots, types, quotas and attachments over a
volume backend, with capacity held as storage claims in the ledger."""

from stowage.services.volumes.backend import BackendError, LocalFileBackend, VolumeBackend
from stowage.services.volumes.model import (
    DEFAULT_TYPE_ID,
    DEFAULT_TYPE_NAME,
    DEFAULT_VOLUME_QUOTAS,
    InvalidVolume,
    VolumeQuotaExceeded,
    backend_of,
    pool_host,
    register_pool,
)

__all__ = [
    "DEFAULT_TYPE_ID",
    "DEFAULT_TYPE_NAME",
    "DEFAULT_VOLUME_QUOTAS",
    "BackendError",
    "InvalidVolume",
    "LocalFileBackend",
    "VolumeBackend",
    "VolumeQuotaExceeded",
    "backend_of",
    "pool_host",
    "register_pool",
]
