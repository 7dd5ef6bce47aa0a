"""Soft delete (Nova's `reclaim_instance_interval`), restore, forceDelete and the reclaim.

With an interval, a delete stops the guest and leaves the server SOFT_DELETED: it keeps its
claims (its host's CPUs and memory stay its own, as in Nova) and counts for quota, so a
restore can always start it again where it was. Past the interval the conductor deletes it
for good; forceDelete does so at once. With no interval (the default) deletes are immediate.
"""

from __future__ import annotations

from typing import Any

from stowage.domain.errors import ConflictError, NotFound
from stowage.services.cloud import Cloud
from stowage.services.instances import write_instance

__all__ = ["force_delete", "reclaim", "restore_server", "soft_delete_server", "soft_deleted"]

_SOFT = "soft-delete"


def soft_deleted(body: dict[str, Any], now: float) -> dict[str, Any]:
    return {
        **body,
        "status": "SOFT_DELETED",
        "vm_state": _SOFT,
        "task_state": None,
        "power_state": 4,
        "soft_deleted_at": now,
    }


def _load(cloud: Cloud, instance_id: str) -> dict[str, Any]:
    doc = cloud.objects.find("instance", instance_id)
    if doc is None:
        raise NotFound(f"Instance {instance_id} could not be found.")
    return doc.body


def soft_delete_server(cloud: Cloud, instance_id: str, request_id: str) -> None:
    """Stop the guest on its host (an operation) and mark it SOFT_DELETED, or at once when
    it runs nowhere or is stopped already (one commit either way)."""
    from stowage.services.migrations import host_is_up

    body = _load(cloud, instance_id)
    if body.get("task_state") or cloud.operations.active(instance_id=instance_id):
        raise ConflictError(
            f"Cannot 'delete' instance {instance_id} while it is in task_state "
            f"{body.get('task_state')}"
        )
    host = body.get("host")
    running = body.get("vm_state") in ("active", "paused", "suspended", "rescued")
    if host and running and host_is_up(cloud, str(host)):
        after = {**body, "task_state": "soft-deleting"}
        with cloud.ledger.engine.begin() as conn:
            write_instance(cloud, instance_id, body, after, conn=conn)
            cloud.operations.enqueue(
                "soft-delete",
                instance_id,
                str(host),
                step="power",
                payload={"action": "os-stop", "request_id": request_id},
                conn=conn,
            )
        cloud.kick()
        return
    write_instance(cloud, instance_id, body, soft_deleted(body, cloud.clock()))


def restore_server(cloud: Cloud, instance_id: str, request_id: str) -> None:
    """A SOFT_DELETED server started again on the host whose claims it kept."""
    from stowage.services.migrations import host_is_up

    body = _load(cloud, instance_id)
    if body.get("vm_state") != _SOFT:
        raise ConflictError(
            f"Cannot 'restore' instance {instance_id} while it is in vm_state "
            f"{body.get('vm_state')}"
        )
    host = body.get("host")
    if not host or not host_is_up(cloud, str(host)):
        raise ConflictError(f"Cannot 'restore' instance {instance_id}: its host is down")
    after = {**body, "task_state": "restoring", "soft_deleted_at": None}
    with cloud.ledger.engine.begin() as conn:
        write_instance(cloud, instance_id, body, after, conn=conn)
        cloud.operations.enqueue(
            "restore",
            instance_id,
            str(host),
            step="power",
            payload={"action": "os-start", "request_id": request_id},
            conn=conn,
        )
    cloud.kick()


def force_delete(cloud: Cloud, instance_id: str) -> None:
    from stowage.services.compute import delete_server

    body = _load(cloud, instance_id)
    if body.get("vm_state") != _SOFT:
        raise ConflictError(
            f"Cannot 'forceDelete' instance {instance_id} while it is in vm_state "
            f"{body.get('vm_state')}"
        )
    delete_server(cloud, instance_id)


def reclaim(cloud: Cloud, interval_s: float) -> int:
    """Delete for good the servers SOFT_DELETED longer than `interval_s`; how many."""
    from stowage.services.compute import delete_server

    now = cloud.clock()
    count = 0
    for doc in cloud.objects.list("instance"):
        body = doc.body
        if body.get("vm_state") == _SOFT and now - float(body.get("soft_deleted_at") or now) >= (
            interval_s
        ):
            try:
                delete_server(cloud, doc.id)
            except (ConflictError, NotFound):
                continue
            count += 1
    return count
