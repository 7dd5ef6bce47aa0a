"""Shelve and unshelve, each move of the claim through the ledger.

A shelve stops the guest and snapshots an image-backed server's disk into an image
(`<name>-shelved`, as Nova names it). Then, by Nova's `shelved_offload_time`
(`CloudConfig.shelved_offload_time_s`):

- 0 (the default): the guest is destroyed on its host at once and, in the commit that records
  SHELVED_OFFLOADED, every claim of the server goes (CPUs, pins, NUMA cells, memory, its
  server-group slot): a shelved-offloaded server holds nothing;
- otherwise the server is SHELVED: its stopped guest stays defined on its host and it keeps
  every claim, until `shelveOffload`, or (when positive) the conductor once that many seconds
  have passed, offloads it as above; -1 never offloads by itself.

A volume-backed server's volumes stay attached to it and need no snapshot. Unshelving a
SHELVED server starts its guest where it is; a SHELVED_OFFLOADED one is scheduled again, as a
build of the existing server (to a host or zone an admin names, 2.91), claiming all of it
anew, from the shelved image when there is one. That image is deleted once the server runs
again, or with the server (Nova's).
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
    "kept",
    "offload_due",
    "offload_shelved",
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

    body, host = _on_its_host(cloud, instance_id, "shelve", _SHELVABLE)
    image_backed = not body.get("boot_from_volume")
    keep = cloud.config.shelved_offload_time_s != 0
    after = {
        **body,
        "task_state": (
            "shelving_image_uploading"
            if image_backed
            else ("shelving" if keep else "shelving_offloading")
        ),
    }
    with cloud.objects.writing() as conn:  # its reads too (the base image's)
        payload: dict[str, Any] = {"request_id": request_id, "keep": keep}
        if image_backed:
            name = f"{body.get('name') or instance_id}-shelved"
            image = queued_snapshot(cloud, caller, conn, body, name, {})
            # Stopped first, as Nova does: the image is of a disk nothing writes to.
            payload = {
                **snapshot_payload(image, caller, request_id),
                "power_off": True,
                "keep": keep,
            }
            step = "snapshot"
        elif keep:
            payload["action"] = "os-stop"
            step = "power"
        else:
            step = "destroy"
        write_instance(cloud, instance_id, body, after, conn=conn)
        cloud.operations.enqueue("shelve", instance_id, host, step=step, payload=payload, conn=conn)
    cloud.kick()


def _on_its_host(
    cloud: Cloud, instance_id: str, action: str, states: frozenset[str]
) -> tuple[dict[str, Any], str]:
    """The server's document and host, for an `action` its host must do: refused (409) in
    another vm_state, while a task runs, or with its host down."""
    from stowage.services.migrations import host_is_up

    doc = cloud.objects.find("instance", instance_id)
    if doc is None:
        raise NotFound(f"Instance {instance_id} could not be found.")
    body = doc.body
    if body.get("vm_state") not in states or body.get("task_state"):
        raise ConflictError(
            f"Cannot '{action}' instance {instance_id} while it is in vm_state "
            f"{body.get('vm_state')}"
        )
    host = body.get("host")
    if not host or not host_is_up(cloud, str(host)):
        raise ConflictError(f"Cannot '{action}' instance {instance_id}: its compute host is down")
    return body, str(host)


def _shelved_doc(body: dict[str, Any], image_id: str | None, **state: Any) -> dict[str, Any]:
    after = {**body, "task_state": None, **state}
    if image_id:
        after["shelved_image_id"] = image_id
    return after


def kept(body: dict[str, Any], now: float, image_id: str | None = None) -> dict[str, Any]:
    """The document of a SHELVED server: its guest stopped on its host, its claims its own;
    with the image its disk was shelved into, if it was image-backed."""
    return _shelved_doc(
        body, image_id, status="SHELVED", vm_state="shelved", power_state=4, shelved_at=now
    )


def offload_shelved(cloud: Cloud, instance_id: str, request_id: str) -> None:
    """`shelveOffload`: a SHELVED server's guest is destroyed on its host and its claims go
    (the conductor's answer commits SHELVED_OFFLOADED with the release)."""
    body, host = _on_its_host(cloud, instance_id, "shelveOffload", frozenset({"shelved"}))
    _enqueue(cloud, instance_id, body, "shelving_offloading", "shelve", host, "destroy", request_id)


def offload_due(cloud: Cloud, offload_time_s: float) -> int:
    """The conductor's periodic part: SHELVED servers shelved longer than `offload_time_s`
    are offloaded; how many were."""
    now = cloud.clock()
    count = 0
    for doc in cloud.objects.list("instance"):
        body = doc.body
        if body.get("vm_state") != "shelved" or body.get("task_state"):
            continue
        if now - float(body.get("shelved_at") or now) < offload_time_s:
            continue
        try:
            offload_shelved(cloud, doc.id, f"req-offload-{doc.id}")
        except (ConflictError, NotFound):
            continue  # taken by a request meanwhile, or its host is down: next time
        count += 1
    return count


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
    return _shelved_doc(
        body,
        image_id,
        status="SHELVED_OFFLOADED",
        vm_state="shelved_offloaded",
        power_state=0,
        host=None,
    )


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
    if body.get("vm_state") == "shelved" and not body.get("task_state"):
        _start_shelved(cloud, instance_id, request_id, host=host, zone=zone)
        return
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


def _start_shelved(
    cloud: Cloud,
    instance_id: str,
    request_id: str,
    *,
    host: str | None,
    zone: str | None,
) -> None:
    """A SHELVED server holds its host's claims: its guest starts there (Nova's), so a
    host or zone to unshelve to is for an offloaded server only (Nova's 409)."""
    if host is not None or zone is not None:
        raise ConflictError(
            f"Instance {instance_id} is not in SHELVED_OFFLOADED state: it can be "
            "unshelved only where it is, with no host or availability zone"
        )
    body, where = _on_its_host(cloud, instance_id, "unshelve", frozenset({"shelved"}))
    _enqueue(
        cloud, instance_id, body, "spawning", "unshelve", where, "power", request_id,
        action="os-start",
    )  # fmt: skip


def _enqueue(
    cloud: Cloud,
    instance_id: str,
    body: dict[str, Any],
    task_state: str,
    kind: str,
    host: str,
    step: str,
    request_id: str,
    **payload: Any,
) -> None:
    """The server's task state and the operation its host does, in one commit."""
    with cloud.ledger.engine.begin() as conn:
        write_instance(cloud, instance_id, body, {**body, "task_state": task_state}, conn=conn)
        cloud.operations.enqueue(
            kind,
            instance_id,
            host,
            step=step,
            payload={"request_id": request_id, **payload},
            conn=conn,
        )
    cloud.kick()
