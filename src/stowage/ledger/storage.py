"""Block storage claims: gigabytes of a storage pool held by a volume or a snapshot.

Each function runs inside a transaction the caller holds, so a volume's document, its quota
count and its claim commit together. Usage moves by a guarded update that the pool's CHECK
bounds: an overcommit is a refused statement (CapacityExceeded), never a violation.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Connection, delete, insert, select, update
from sqlalchemy.exc import IntegrityError

from stowage.domain.errors import ConflictError, NotFound
from stowage.ledger.schema import storage_pools, volume_claims

__all__ = [
    "PoolUsage",
    "StorageCapacityExceeded",
    "claim_storage",
    "ensure_pool",
    "pool_usage",
    "release_storage",
    "resize_storage",
]


class StorageCapacityExceeded(ConflictError):
    """The pool has not that many gigabytes free."""

    code = "storage.capacity.exceeded"


@dataclass(frozen=True, slots=True)
class PoolUsage:
    name: str
    backend: str
    total_gb: int
    reserved_gb: int
    allocation_ratio: float
    used_gb: int

    @property
    def free_gb(self) -> int:
        return int((self.total_gb - self.reserved_gb) * self.allocation_ratio) - self.used_gb


def ensure_pool(conn: Connection, name: str, backend: str, total_gb: int) -> int:
    """The pool's id, registering it with `total_gb` if it is new (a known pool keeps its
    inventory: resizing one is an operator's act, not a restart's)."""
    found = conn.execute(select(storage_pools.c.id).where(storage_pools.c.name == name)).scalar()
    if found is not None:
        return int(found)
    conn.execute(
        insert(storage_pools),
        {
            "name": name,
            "backend": backend,
            "total_gb": total_gb,
            "reserved_gb": 0,
            "allocation_ratio": 1.0,
            "used_gb": 0,
        },
    )
    return int(
        conn.execute(select(storage_pools.c.id).where(storage_pools.c.name == name)).scalar_one()
    )


def _pool_id(conn: Connection, name: str) -> int:
    found = conn.execute(select(storage_pools.c.id).where(storage_pools.c.name == name)).scalar()
    if found is None:
        raise NotFound(f"storage pool {name} could not be found")
    return int(found)


def _take(conn: Connection, pool_id: int, gigabytes: int) -> None:
    """used_gb += gigabytes, refused by the pool's CHECK past its capacity."""
    try:
        with conn.begin_nested():
            conn.execute(
                update(storage_pools)
                .where(storage_pools.c.id == pool_id)
                .values(used_gb=storage_pools.c.used_gb + gigabytes)
            )
    except IntegrityError:
        raise StorageCapacityExceeded(
            f"Insufficient free space for volume creation (requested {gigabytes} GB)"
        ) from None


def claim_storage(
    conn: Connection, pool: str, consumer_id: str, kind: str, project_id: str, gigabytes: int
) -> None:
    """Hold `gigabytes` of `pool` for a volume or snapshot (a second claim of it is refused)."""
    pool_id = _pool_id(conn, pool)
    _take(conn, pool_id, gigabytes)
    try:
        with conn.begin_nested():
            conn.execute(
                insert(volume_claims),
                {
                    "consumer_id": consumer_id,
                    "kind": kind,
                    "pool_id": pool_id,
                    "project_id": project_id,
                    "gigabytes": gigabytes,
                },
            )
    except IntegrityError:
        raise ConflictError(f"{kind} {consumer_id} already holds storage") from None


def resize_storage(conn: Connection, consumer_id: str, gigabytes: int) -> None:
    """Grow (or shrink) a held claim to `gigabytes`, in the pool it is in."""
    row = conn.execute(
        select(volume_claims.c.pool_id, volume_claims.c.gigabytes).where(
            volume_claims.c.consumer_id == consumer_id
        )
    ).first()
    if row is None:
        raise NotFound(f"{consumer_id} holds no storage")
    delta = gigabytes - int(row.gigabytes)
    if delta:
        _take(conn, int(row.pool_id), delta)
        conn.execute(
            update(volume_claims)
            .where(volume_claims.c.consumer_id == consumer_id)
            .values(gigabytes=gigabytes)
        )


def release_storage(conn: Connection, consumer_id: str) -> bool:
    """Give the claim's gigabytes back; idempotent (False when nothing was held)."""
    row = conn.execute(
        select(volume_claims.c.pool_id, volume_claims.c.gigabytes).where(
            volume_claims.c.consumer_id == consumer_id
        )
    ).first()
    if row is None:
        return False
    conn.execute(delete(volume_claims).where(volume_claims.c.consumer_id == consumer_id))
    conn.execute(
        update(storage_pools)
        .where(storage_pools.c.id == row.pool_id)
        .values(used_gb=storage_pools.c.used_gb - int(row.gigabytes))
    )
    return True


def pool_usage(conn: Connection) -> list[PoolUsage]:
    rows = conn.execute(select(storage_pools).order_by(storage_pools.c.id))
    return [
        PoolUsage(
            r.name, r.backend, r.total_gb, r.reserved_gb, float(r.allocation_ratio), r.used_gb
        )
        for r in rows
    ]
