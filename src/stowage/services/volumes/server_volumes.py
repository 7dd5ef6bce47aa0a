"""Volumes of servers: block device mappings on create (boot from volume), attach and detach
(`os-volume_attachments`), and what a server's delete does to its volumes.

The instance document holds its block devices (`block_devices`: volume, attachment, device,
boot index, delete_on_termination); the volume holds the attachment. Both change in one
commit, with the conductor operation that carries the change to the host's hypervisor:
attach reserves and the operation completes (or undoes) it; detach marks the volume
detaching and the operation ends the attachment.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Connection

from stowage.domain.errors import ConflictError, NotFound
from stowage.ledger.storage import StorageCapacityExceeded, claim_storage
from stowage.services.cloud import Cloud
from stowage.services.instances import write_instance
from stowage.services.volumes.attach import ATTACHMENT
from stowage.services.volumes.model import POOL, InvalidVolume, backend_of
from stowage.services.volumes.volumes import (
    VOLUME,
    _reserve,
    _source,
    change_volume,
    drive,
    find_type,
)

__all__ = [
    "BlockDevice",
    "attach_to_server",
    "attached_ended",
    "detach_from_server",
    "detached",
    "parse_block_devices",
    "prepare_block_devices",
    "release_server_volumes",
    "spawn_volumes",
]

# Server states Nova attaches and detaches volumes in.
_ATTACHABLE = frozenset({"active", "stopped", "paused", "suspended", "shelved_offloaded"})


class BlockDevice(dict[str, Any]):
    """One validated mapping of `block_device_mapping_v2` whose destination is a volume."""


def parse_block_devices(mappings: Sequence[Mapping[str, Any]]) -> list[BlockDevice]:
    """Nova's checks of block_device_mapping_v2 (volume destinations), as 400s."""
    out: list[BlockDevice] = []
    boot_indexes = []
    for raw in mappings:
        source = raw.get("source_type")
        dest = raw.get("destination_type") or ("volume" if source != "image" else "local")
        if dest == "local":
            if source not in ("image", "blank"):
                raise InvalidVolume(
                    f"Block Device Mapping is Invalid: source {source} cannot be local"
                )
            if source == "blank":
                raise InvalidVolume(
                    "Block Device Mapping is Invalid: local blank disks (ephemeral and swap "
                    "mappings) are not supported by this cloud"
                )
            continue
        if dest != "volume":
            raise InvalidVolume(f"Block Device Mapping is Invalid: bad destination {dest}")
        if source not in ("image", "volume", "snapshot", "blank"):
            raise InvalidVolume(f"Block Device Mapping is Invalid: bad source {source}")
        if source != "blank" and not raw.get("uuid"):
            raise InvalidVolume(f"Block Device Mapping is Invalid: a {source} mapping needs a uuid")
        size = raw.get("volume_size")
        if source == "blank" and not size:
            raise InvalidVolume("Block Device Mapping is Invalid: a blank volume needs a size")
        if size is not None:
            try:
                size = int(size)
            except (TypeError, ValueError):
                raise InvalidVolume(f"Invalid volume_size {size!r}") from None
            if size < 1:
                raise InvalidVolume(f"Invalid volume_size {size}")
        boot_index = raw.get("boot_index")
        if boot_index is not None and str(boot_index) not in ("", "none", "None"):
            try:
                boot_index = int(boot_index)
            except (TypeError, ValueError):
                raise InvalidVolume(f"Invalid boot_index {boot_index!r}") from None
            if boot_index >= 0:
                boot_indexes.append(boot_index)
        else:
            boot_index = None
        if raw.get("volume_type") and source == "volume":
            raise InvalidVolume("Block Device Mapping is Invalid: volume_type with a volume")
        out.append(
            BlockDevice(
                source=source,
                uuid=raw.get("uuid"),
                size=size,
                boot_index=boot_index if boot_index is None or boot_index >= 0 else None,
                delete_on_termination=raw.get("delete_on_termination") in (True, "true", "True"),
                device_name=raw.get("device_name"),
                volume_type=raw.get("volume_type"),
                tag=raw.get("tag"),
            )
        )
    if len(boot_indexes) != len(set(boot_indexes)):
        raise InvalidVolume(
            "Block Device Mapping is Invalid: Boot sequence for the instance and "
            "image/block device mapping combination is not valid."
        )
    return out


def boots_from_volume(devices: Sequence[Mapping[str, Any]]) -> bool:
    return any(d.get("boot_index") == 0 for d in devices)


def _device_names(count: int, taken: set[str]) -> list[str]:
    """Free /dev/vdX names after the root disk (vda), as libvirt assigns them."""
    names = []
    for letter in "bcdefghijklmnopqrstuvwxyz":
        name = f"/dev/vd{letter}"
        if name not in taken:
            names.append(name)
        if len(names) == count:
            break
    return names


def prepare_block_devices(
    cloud: Cloud,
    conn: Connection,
    caller: Any,
    instance_id: str,
    devices: Sequence[Mapping[str, Any]],
) -> list[dict[str, Any]]:
    """Inside the build's transaction: make or reserve each mapping's volume for the
    instance (quota and storage claim with it), and return the instance's `block_devices`.
    New volumes stay `creating` until the conductor's spawn step drives them."""
    out: list[dict[str, Any]] = []
    boot_first = sorted(devices, key=lambda d: (d["boot_index"] is None, d["boot_index"] or 0))
    taken = {"/dev/vda"} if not boots_from_volume(devices) else set()
    names = iter(
        ["/dev/vda"] * boots_from_volume(devices)
        + _device_names(
            len(devices), taken | {d["device_name"] for d in devices if d["device_name"]}
        )
    )
    for device in boot_first:
        if device["source"] == "volume":
            volume_id = str(device["uuid"])
            _reserve_existing(cloud, conn, caller, volume_id, root=device["boot_index"] == 0)
        else:
            volume_id = _new_volume(cloud, conn, caller, device)
        attachment_id = str(uuid.uuid4())
        _add_attachment(cloud, conn, volume_id, attachment_id, instance_id, "reserved")
        name = device["device_name"] or next(names)
        out.append(
            {
                "volume_id": volume_id,
                "attachment_id": attachment_id,
                "device": name if name.startswith("/dev/") else f"/dev/{name}",
                "boot_index": device["boot_index"],
                "delete_on_termination": device["delete_on_termination"],
                "tag": device["tag"],
            }
        )
    return out


def _reserve_existing(
    cloud: Cloud, conn: Connection, caller: Any, volume_id: str, *, root: bool
) -> None:
    volume = cloud.objects.find_in(conn, VOLUME, volume_id)
    if volume is None or not (caller.is_admin or volume.project_id == caller.project_id):
        raise InvalidVolume(f"Invalid volume: Volume {volume_id} could not be found.")
    if root and not volume.body.get("bootable"):
        # Nova's InvalidBDMVolumeNotBootable: the root disk must be a bootable volume.
        raise InvalidVolume(f"Block Device {volume_id} is not bootable.")
    if volume.body["status"] != "available":
        raise InvalidVolume(
            f"Invalid volume: volume {volume_id} status must be 'available'. Currently in "
            f"'{volume.body['status']}'"
        )


def _new_volume(cloud: Cloud, conn: Connection, caller: Any, device: Mapping[str, Any]) -> str:
    source_key = {"image": "imageRef", "snapshot": "snapshot_id"}.get(device["source"])
    request = {source_key: device["uuid"]} if source_key else {}
    try:
        source = _source(cloud, caller, request)
    except NotFound as exc:
        raise InvalidVolume(exc.message) from None
    size = int(device["size"] or source.get("size") or 1)
    if size < int(source.get("size") or 0):
        raise InvalidVolume(
            f"Volume size {size}GB is smaller than the {source['what']} ({source['size']}GB)"
        )
    vtype = find_type(cloud, device["volume_type"] or source.get("volume_type"))
    volume_id = str(uuid.uuid4())
    body: dict[str, Any] = {
        "id": volume_id,
        "name": "",
        "description": None,
        "size": size,
        "status": "creating",
        "project_id": caller.project_id,
        "user_id": caller.user_id,
        "availability_zone": "nova",
        "volume_type": vtype["name"],
        "volume_type_id": vtype["id"],
        "snapshot_id": source.get("snapshot_id"),
        "source_volid": None,
        "image_id": source.get("image_id"),
        "volume_image_metadata": source.get("image_metadata"),
        "metadata": {},
        "bootable": bool(source.get("image_id")) or bool(source.get("bootable")),
        "multiattach": False,
        "attachments": {},
        "pool": POOL,
        "fault": None,
    }
    _reserve(conn, caller.project_id, "volumes", size)
    try:
        claim_storage(conn, POOL, volume_id, "volume", caller.project_id, size)
    except StorageCapacityExceeded as exc:
        raise InvalidVolume(f"Volume could not be created: {exc}") from None
    cloud.objects.create_in(conn, VOLUME, volume_id, body, project_id=caller.project_id, name="")
    return volume_id


def _add_attachment(
    cloud: Cloud,
    conn: Connection,
    volume_id: str,
    attachment_id: str,
    instance_id: str,
    status: str,
    device: str | None = None,
) -> None:
    def on(body: dict[str, Any]) -> dict[str, Any]:
        attachments = dict(body.get("attachments") or {})
        attachments[attachment_id] = {
            "id": attachment_id,
            "volume_id": volume_id,
            "instance": instance_id,
            "status": status,
            "attach_mode": "rw",
            "mountpoint": device,
            "host_name": None,
            "connector": None,
            "connection_info": None,
            "attached_at": None,
        }
        body["attachments"] = attachments
        if body["status"] == "available":
            body["status"] = "reserved"
        return body

    change_volume(cloud, volume_id, None, on, conn=conn)
    owner = cloud.objects.find_in(conn, VOLUME, volume_id)
    cloud.objects.create_in(
        conn,
        ATTACHMENT,
        attachment_id,
        {"volume_id": volume_id},
        project_id=owner.project_id if owner else None,
    )


def spawn_volumes(
    cloud: Cloud,
    instance_id: str,
    *,
    new: list[str] | None = None,
    body: Mapping[str, Any] | None = None,
) -> tuple[list[dict[str, Any]], str | None]:
    """Before a spawn: drive the instance's new volumes to available, and answer the devices
    with their connections, or why the build cannot go on (Nova's "Volume did not finish
    being created"). Given `new`, nothing is driven: the volumes still being created are
    listed there, and not finished (a caller reading in one transaction, where nothing may be
    written, drives them after it and asks again). `body`: the instance, as the caller read
    it (read here otherwise)."""
    if body is None:
        doc = cloud.objects.find("instance", instance_id)
        body = doc.body if doc else {}
    devices = list(body.get("block_devices") or [])
    backend = backend_of(cloud)
    out = []
    for device in devices:
        volume = cloud.objects.find(VOLUME, device["volume_id"])
        if volume is not None and volume.body["status"] == "creating":
            if new is not None:
                new.append(volume.id)
                continue
            drive(cloud, VOLUME, volume.id)
            volume = cloud.objects.find(VOLUME, volume.id)
        if volume is None or volume.body["status"] not in ("available", "reserved", "in-use"):
            status = volume.body["status"] if volume else "gone"
            return [], f"Volume {device['volume_id']} did not finish being created ({status})"
        out.append({**device, "connection": backend.connection_info(volume.id)})
    if new:
        return [], f"Volume {new[0]} did not finish being created (creating)"
    return out, None


def attached_ended(cloud: Cloud, conn: Connection, body: Mapping[str, Any], ok: bool) -> None:
    """After the spawn (in its commit, `body` the instance as read there): the instance's
    reserved attachments complete, or, when the build failed, stay reserved until the server
    is deleted (as Nova leaves them)."""
    if not ok:
        return
    for device in body.get("block_devices") or []:
        _complete(cloud, conn, device["volume_id"], device["attachment_id"], device["device"])


def _complete(
    cloud: Cloud, conn: Connection, volume_id: str, attachment_id: str, device: str
) -> None:
    def on(body: dict[str, Any]) -> dict[str, Any]:
        attachments = dict(body.get("attachments") or {})
        if attachment_id in attachments:
            one = dict(attachments[attachment_id])
            one.update(status="attached", attached_at=cloud.clock(), mountpoint=device)
            attachments[attachment_id] = one
        body["attachments"] = attachments
        body["status"] = "in-use"
        return body

    change_volume(cloud, volume_id, None, on, conn=conn)


def attach_to_server(
    cloud: Cloud,
    caller: Any,
    instance_id: str,
    volume_id: str,
    device: str | None,
    *,
    delete_on_termination: bool = False,
    tag: str | None = None,
) -> dict[str, Any]:
    """os-volume_attachments POST: reserve the volume for the server and enqueue the attach
    on its host, in one commit. Returns the block device (with its device name)."""
    with cloud.ledger.engine.begin() as conn:
        doc = cloud.objects.find_in(conn, "instance", instance_id)
        if doc is None:
            raise NotFound(f"Instance {instance_id} could not be found.")
        body = doc.body
        if (
            body.get("vm_state") not in _ATTACHABLE
            or body.get("task_state")
            or not body.get("host")
        ):
            raise ConflictError(
                f"Cannot 'attach_volume' instance {instance_id} while it is in vm_state "
                f"{body.get('vm_state')}"
            )
        devices = list(body.get("block_devices") or [])
        if any(d["volume_id"] == volume_id for d in devices):
            raise InvalidVolume(f"Invalid volume: volume {volume_id} is already attached")
        volume = cloud.objects.find_in(conn, VOLUME, volume_id)
        if volume is None or not (caller.is_admin or volume.project_id == caller.project_id):
            raise NotFound(f"Volume {volume_id} could not be found.")
        if volume.body["status"] != "available":
            raise InvalidVolume(
                f"Invalid volume: volume '{volume_id}' status must be 'available'. Currently "
                f"in '{volume.body['status']}'"
            )
        taken = {d["device"] for d in devices} | ({"/dev/vda"})
        name = device if device else _device_names(1, taken)[0]
        if name in taken:
            raise InvalidVolume(f"The supplied device path ({name}) is in use.")
        attachment_id = str(uuid.uuid4())
        _add_attachment(cloud, conn, volume_id, attachment_id, instance_id, "attaching", name)
        added = {
            "volume_id": volume_id,
            "attachment_id": attachment_id,
            "device": name,
            "boot_index": None,
            "delete_on_termination": delete_on_termination,
            "tag": tag,
            "attaching": True,
        }
        after = {**body, "block_devices": [*devices, added]}
        write_instance(cloud, instance_id, body, after, conn=conn)
        cloud.operations.enqueue(
            "volume-attach",
            instance_id,
            body["host"],
            step="attach_volume",
            payload={
                "volume_id": volume_id,
                "attachment_id": attachment_id,
                "device": name,
                "connection": backend_of(cloud).connection_info(volume_id),
            },
            conn=conn,
        )
    cloud.kick()
    return added


def attach_answered(
    cloud: Cloud, conn: Connection, instance_id: str, payload: Mapping[str, Any], ok: bool
) -> None:
    """The host attached the volume (the attachment completes) or refused (it is undone)."""
    volume_id = str(payload["volume_id"])
    attachment_id = str(payload["attachment_id"])
    doc = cloud.objects.find_in(conn, "instance", instance_id)
    if ok and doc is not None:
        _complete(cloud, conn, volume_id, attachment_id, str(payload["device"]))
        devices = [
            {k: v for k, v in d.items() if k != "attaching"} if d["volume_id"] == volume_id else d
            for d in doc.body.get("block_devices") or []
        ]
        write_instance(
            cloud, instance_id, doc.body, {**doc.body, "block_devices": devices}, conn=conn
        )
        return
    _end(cloud, conn, volume_id, attachment_id)
    if doc is not None:
        devices = [d for d in doc.body.get("block_devices") or [] if d["volume_id"] != volume_id]
        write_instance(
            cloud, instance_id, doc.body, {**doc.body, "block_devices": devices}, conn=conn
        )


def detach_from_server(cloud: Cloud, instance_id: str, volume_id: str) -> None:
    """os-volume_attachments DELETE: the volume `detaching` and the detach enqueued on the
    host, in one commit. A root volume (boot index 0) cannot be detached, as in Nova."""
    with cloud.ledger.engine.begin() as conn:
        doc = cloud.objects.find_in(conn, "instance", instance_id)
        if doc is None:
            raise NotFound(f"Instance {instance_id} could not be found.")
        device = next(
            (d for d in doc.body.get("block_devices") or [] if d["volume_id"] == volume_id), None
        )
        if device is None:
            raise NotFound(f"Volume {volume_id} is not attached to instance {instance_id}.")
        if device.get("boot_index") == 0:
            raise InvalidVolume("Cannot detach a root device volume")
        if doc.body.get("vm_state") not in _ATTACHABLE or doc.body.get("task_state"):
            raise ConflictError(
                f"Cannot 'detach_volume' instance {instance_id} while it is in vm_state "
                f"{doc.body.get('vm_state')}"
            )
        change_volume(
            cloud,
            volume_id,
            frozenset({"in-use"}),
            lambda b: {**b, "status": "detaching"},
            "Invalid volume: Unable to detach volume. Volume status must be 'in-use' "
            "(is {status}).",
            conn=conn,
        )
        cloud.operations.enqueue(
            "volume-detach",
            instance_id,
            str(doc.body["host"]),
            step="detach_volume",
            payload={
                "volume_id": volume_id,
                "attachment_id": device["attachment_id"],
                "device": device["device"],
            },
            conn=conn,
        )
    cloud.kick()


def detached(
    cloud: Cloud, conn: Connection, instance_id: str, payload: Mapping[str, Any], ok: bool
) -> None:
    """The host let the volume go (the attachment ends) or could not (back to in-use)."""
    volume_id = str(payload["volume_id"])
    if not ok:
        change_volume(cloud, volume_id, None, lambda b: {**b, "status": "in-use"}, conn=conn)
        return
    _end(cloud, conn, volume_id, str(payload["attachment_id"]))
    doc = cloud.objects.find_in(conn, "instance", instance_id)
    if doc is not None:
        devices = [d for d in doc.body.get("block_devices") or [] if d["volume_id"] != volume_id]
        write_instance(
            cloud, instance_id, doc.body, {**doc.body, "block_devices": devices}, conn=conn
        )


def _end(cloud: Cloud, conn: Connection, volume_id: str, attachment_id: str) -> None:
    def off(body: dict[str, Any]) -> dict[str, Any]:
        attachments = dict(body.get("attachments") or {})
        attachments.pop(attachment_id, None)
        body["attachments"] = attachments
        if not attachments:
            body["status"] = "available"
        elif any(a["status"] == "attached" for a in attachments.values()):
            body["status"] = "in-use"
        return body

    with contextlib.suppress(NotFound):
        change_volume(cloud, volume_id, None, off, conn=conn)
    cloud.objects.delete_in(conn, ATTACHMENT, attachment_id)


def release_server_volumes(cloud: Cloud, conn: Connection, body: Mapping[str, Any]) -> list[str]:
    """In the commit that forgets a server: each of its attachments ends, and the volumes it
    was to delete on termination are marked `deleting` (their intents: driven after it).
    Returns those volumes' ids."""
    doomed = []
    for device in body.get("block_devices") or []:
        _end(cloud, conn, device["volume_id"], device["attachment_id"])
        if device.get("delete_on_termination"):
            volume = cloud.objects.find_in(conn, VOLUME, device["volume_id"])
            if volume is not None and volume.body["status"] in ("available", "error"):
                change_volume(
                    cloud, volume.id, None, lambda b: {**b, "status": "deleting"}, conn=conn
                )
                doomed.append(volume.id)
    return doomed
