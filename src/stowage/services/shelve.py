"""Shelve and unshelve, each move of the claim through the ledger.

Shelving offloads at once (Nova's `shelved_offload_time = 0`): an image-backed server's disk
is first snapshotted into an image (`<name>-shelved`, as Nova names it), then the guest is
destroyed on its host and, in the commit that records SHELVED_OFFLOADED, every claim of the
server goes (CPUs, pins, NUMA cells, memory, its server-group slot): a shelved-offloaded server
holds nothing. A volume-backed server's volumes stay attached to it and need no snapshot.
Unshelving schedules it again, as a build of the existing server (to a host or zone an admin
names, 2.91), claiming all of it anew, from the shelved image when there is one; that image is
deleted once the server runs again, or with the server (Nova's).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import Connection

from stowage.domain.errors import ConflictError, NotFound
from stowage.services.caller import Caller
from stowage.services.cloud import Cloud
from stowage.services.instances import write_instance

__all__ = [
    "drop_image_data",
    "drop_shelved_image_in",
    "offloaded",
    "shelve_server",
    "unshelve_server",
]

_SHELVABLE = frozenset({"active", "stopped", "paused", "suspended"})


def shelve_server(cloud: Cloud, caller: Caller, instance_id: str, request_id: str) -> None:
    """Mark the server shelving and enqueue its snapshot (image-backed) or the destroy on its
    host (one commit); the conductor's answers release its claims with the SHELVED_OFFLOADED
    document."""
    from stowage.services.compute import queued_snapshot, snapshot_payload
    from stowage.services.migrations import host_is_up

    doc = cloud.objects.find("instance", instance_id)
    if doc is None:
        raise NotFound(f"Instance {instance_id} could not be found.")
    body = doc.body
    if body.get("vm_state") not in _SHELVABLE or body.get("task_state"):
        raise ConflictError(
            f"Cannot 'shelve' instance {instance_id} while it is in vm_state {body.get('vm_state')}"
        )
    host = body.get("host")
    if not host or not host_is_up(cloud, str(host)):
        raise ConflictError(f"Cannot 'shelve' instance {instance_id}: its compute host is down")
    image_backed = not body.get("boot_from_volume")
    after = {
        **body,
        "task_state": "shelving_image_uploading" if image_backed else "shelving_offloading",
    }
    with cloud.ledger.engine.begin() as conn:
        payload: dict[str, Any] = {"request_id": request_id}
        if image_backed:
            name = f"{body.get('name') or instance_id}-shelved"
            image = queued_snapshot(cloud, caller, conn, body, name, {})
            # Stopped first, as Nova does: the image is of a disk nothing writes to.
            payload = {**snapshot_payload(image, caller, request_id), "power_off": True}
        write_instance(cloud, instance_id, body, after, conn=conn)
        cloud.operations.enqueue(
            "shelve",
            instance_id,
            str(host),
            step="snapshot" if image_backed else "destroy",
            payload=payload,
            conn=conn,
        )
    cloud.kick()


def drop_shelved_image_in(cloud: Cloud, conn: Connection, body: Mapping[str, Any]) -> str | None:
    """The image a shelve left for the server goes, in `conn`'s transaction (its data after
    the commit: `drop_image_data`); its id, or None when there is none."""
    image_id = body.get("shelved_image_id")
    if not image_id:
        return None
    cloud.objects.delete_in(conn, "image", str(image_id))
    return str(image_id)


def drop_image_data(cloud: Cloud, image_id: str | None) -> None:
    from stowage.services.images import image_file

    if image_id:
        image_file(cloud, image_id).unlink(missing_ok=True)


def offloaded(body: dict[str, Any], image_id: str | None = None) -> dict[str, Any]:
    """The document of a shelved-offloaded server: on no host, holding nothing; with the
    image its disk was shelved into, if it was image-backed."""
    after = {
        **body,
        "status": "SHELVED_OFFLOADED",
        "vm_state": "shelved_offloaded",
        "task_state": None,
        "power_state": 0,
        "host": None,
    }
    if image_id:
        after["shelved_image_id"] = image_id
    return after


def unshelve_server(
    cloud: Cloud,
    instance_id: str,
    request_id: str,
    *,
    host: str | None = None,
    zone: str | None = None,
    is_admin: bool = False,
) -> None:
    """Schedule the shelved-offloaded server again (one commit: its state and the build's
    schedule step); the conductor claims and spawns it, volumes included."""
    doc = cloud.objects.find("instance", instance_id)
    if doc is None:
        raise NotFound(f"Instance {instance_id} could not be found.")
    body = doc.body
    if body.get("vm_state") != "shelved_offloaded" or body.get("task_state"):
        raise ConflictError(
            f"Cannot 'unshelve' instance {instance_id} while it is in vm_state "
            f"{body.get('vm_state')}"
        )
    after = {**body, "task_state": "scheduling", "status": "SHELVED_OFFLOADED"}
    if zone is not None:
        after["availability_zone"] = zone
    with cloud.ledger.engine.begin() as conn:
        write_instance(cloud, instance_id, body, after, conn=conn)
        cloud.operations.enqueue(
            "build",
            instance_id,
            "",
            step="schedule",
            payload={
                "instances": [instance_id],
                "min_count": 1,
                "request_id": request_id,
                "force_host": host,
                "same_host": [],
                "different_host": [],
                "image_properties": {},
                "is_admin": is_admin,
            },
            conn=conn,
        )
    cloud.kick()
