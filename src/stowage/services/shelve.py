"""Shelve and unshelve of volume-backed servers, each move of the claim through the ledger.

Shelving offloads at once (Nova's `shelved_offload_time = 0`): the guest is destroyed on its
host and, in the commit that records SHELVED_OFFLOADED, every claim of the server goes
(CPUs, pins, NUMA cells, memory, its server-group slot): a shelved-offloaded server holds
nothing. Its volumes stay attached to it. Unshelving schedules it again, as a build of the
existing server (to a host or zone an admin names, 2.91), claiming all of it anew.

An image-backed server would need its disk snapshotted into an image first; that is refused
(501) rather than shelved without its disk.
"""

from __future__ import annotations

from typing import Any

from stowage.domain.errors import ConflictError, NotFound, StowageError
from stowage.services.cloud import Cloud
from stowage.services.instances import write_instance

__all__ = ["ShelveUnsupported", "shelve_server", "unshelve_server"]

_SHELVABLE = frozenset({"active", "stopped", "paused", "suspended"})


class ShelveUnsupported(StowageError):
    """What this cloud cannot shelve (an image-backed server): the API's 501."""

    code = "compute.shelve.unsupported"


def shelve_server(cloud: Cloud, instance_id: str, request_id: str) -> None:
    """Mark the server shelving and enqueue the destroy on its host (one commit); the
    conductor's answer releases its claims with the SHELVED_OFFLOADED document."""
    from stowage.services.migrations import host_is_up

    doc = cloud.objects.find("instance", instance_id)
    if doc is None:
        raise NotFound(f"Instance {instance_id} could not be found.")
    body = doc.body
    if body.get("vm_state") not in _SHELVABLE or body.get("task_state"):
        raise ConflictError(
            f"Cannot 'shelve' instance {instance_id} while it is in vm_state {body.get('vm_state')}"
        )
    if not body.get("boot_from_volume"):
        raise ShelveUnsupported(
            "Shelving an image-backed server is not supported by this cloud yet (its disk "
            "would have to be snapshotted); volume-backed servers can be shelved."
        )
    host = body.get("host")
    if not host or not host_is_up(cloud, str(host)):
        raise ConflictError(f"Cannot 'shelve' instance {instance_id}: its compute host is down")
    after = {**body, "task_state": "shelving_offloading"}
    with cloud.ledger.engine.begin() as conn:
        write_instance(cloud, instance_id, body, after, conn=conn)
        cloud.operations.enqueue(
            "shelve",
            instance_id,
            str(host),
            step="destroy",
            payload={"request_id": request_id},
            conn=conn,
        )
    cloud.kick()


def offloaded(body: dict[str, Any]) -> dict[str, Any]:
    """The document of a shelved-offloaded server: on no host, holding nothing."""
    return {
        **body,
        "status": "SHELVED_OFFLOADED",
        "vm_state": "shelved_offloaded",
        "task_state": None,
        "power_state": 0,
        "host": None,
    }


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
