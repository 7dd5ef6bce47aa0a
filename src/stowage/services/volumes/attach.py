"""Attaching volumes: the legacy actions Nova's old flow uses (os-reserve, os-attach, ...) and
the attachments API (3.27+). Each is one compare-and-swap of the volume's document, with the
attachment's index document in the same commit."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from sqlalchemy import Connection

from stowage.domain.errors import NotFound
from stowage.ledger.objects import Document
from stowage.services.cloud import Cloud
from stowage.services.volumes.model import InvalidVolume, VolumeCaller, backend_of
from stowage.services.volumes.volumes import VOLUME, change_volume, get_volume

__all__ = [
    "ATTACHMENT",
    "attach",
    "begin_detaching",
    "complete_attachment",
    "connection_info",
    "create_attachment",
    "delete_attachment",
    "detach",
    "find_attachment",
    "list_attachments",
    "reserve",
    "roll_detaching",
    "unreserve",
    "update_attachment",
]

ATTACHMENT = "volume_attachment"  # an index: attachment id -> its volume


def _attachable(body: Mapping[str, Any]) -> frozenset[str]:
    """Where a new attachment may start: available, or in-use for a multiattach volume."""
    return frozenset({"available", "in-use"} if body.get("multiattach") else {"available"})


# Where a detach of a volume that is not attached (as named) settles the status; a volume
# being created or deleted keeps its status.
_DETACH_SETTLES = frozenset({"available", "in-use", "attaching", "detaching", "reserved", "error"})


def _now(cloud: Cloud) -> float:
    return cloud.clock()


def _settled_status(attachments: Mapping[str, Any]) -> str:
    return (
        "in-use"
        if any(a["status"] == "attached" for a in attachments.values())
        else ("available" if not attachments else "reserved")
    )


# -- the legacy actions -----------------------------------------------------------------------


def reserve(cloud: Cloud, caller: VolumeCaller, volume_id: str) -> None:
    doc = get_volume(cloud, caller, volume_id)
    change_volume(
        cloud,
        volume_id,
        _attachable(doc.body),
        lambda b: {**b, "status": "attaching"},
        "Invalid volume: Volume status must be available to reserve, but the status is {status}.",
    )


def unreserve(cloud: Cloud, caller: VolumeCaller, volume_id: str) -> None:
    get_volume(cloud, caller, volume_id)

    def undo(body: dict[str, Any]) -> dict[str, Any]:
        body["status"] = _settled_status(body.get("attachments") or {})
        return body

    change_volume(
        cloud,
        volume_id,
        frozenset({"attaching", "reserved"}),
        undo,
        "Invalid volume: Unable to unreserve volume, volume status is {status}.",
    )


def attach(cloud: Cloud, caller: VolumeCaller, volume_id: str, args: Mapping[str, Any]) -> None:
    """os-attach: the volume is in use by an instance (or a host) at a mountpoint."""
    get_volume(cloud, caller, volume_id)
    instance = args.get("instance_uuid")
    host_name = args.get("host_name")
    if not instance and not host_name:
        raise InvalidVolume("Invalid request to attach volume: Invalid instance_uuid or host_name")
    mode = args.get("mode", "rw")
    if mode not in ("rw", "ro"):
        raise InvalidVolume(f"Invalid request to attach volume with an invalid mode: {mode}")
    attachment_id = str(uuid.uuid4())

    def on(body: dict[str, Any]) -> dict[str, Any]:
        attachments = dict(body.get("attachments") or {})
        attachments[attachment_id] = _attachment(
            cloud, volume_id, attachment_id, instance, "attached", mode, args
        )
        body["attachments"] = attachments
        body["status"] = "in-use"
        return body

    with cloud.ledger.engine.begin() as conn:
        change_volume(
            cloud,
            volume_id,
            frozenset({"attaching", "reserved", "available", "in-use"}),
            on,
            "Invalid volume: Volume status must be attaching to attach, but is {status}.",
            conn=conn,
        )
        _index(cloud, conn, attachment_id, volume_id)


def begin_detaching(cloud: Cloud, caller: VolumeCaller, volume_id: str) -> None:
    get_volume(cloud, caller, volume_id)
    change_volume(
        cloud,
        volume_id,
        frozenset({"in-use"}),
        lambda b: {**b, "status": "detaching"},
        "Invalid volume: Unable to detach volume. Volume status must be 'in-use' and "
        "attach_status must be 'attached' to detach (is {status}).",
    )


def roll_detaching(cloud: Cloud, caller: VolumeCaller, volume_id: str) -> None:
    get_volume(cloud, caller, volume_id)
    change_volume(
        cloud,
        volume_id,
        frozenset({"detaching"}),
        lambda b: {**b, "status": "in-use"},
        "Invalid volume: volume status is {status}, not detaching",
    )


def detach(cloud: Cloud, caller: VolumeCaller, volume_id: str, attachment_id: Any) -> None:
    """os-detach: the attachment (or the only one) ends."""
    doc = get_volume(cloud, caller, volume_id)
    current = doc.body.get("attachments") or {}
    if attachment_id is None and len(current) > 1:
        raise InvalidVolume(
            "Invalid volume: Detach volume failed: More than one attachment, but no "
            "attachment_id provided."
        )
    if attachment_id is None and current:
        attachment_id = next(iter(current))
    if attachment_id is None or str(attachment_id) not in current:
        # Cinder's manager: "Volume detach called, but volume not attached." The status
        # settles from the attachments left (available when none) and the call succeeds.
        change_volume(
            cloud,
            volume_id,
            _DETACH_SETTLES,
            lambda b: {**b, "status": _settled_status(b.get("attachments") or {})},
            "Invalid volume: Unable to detach volume, volume status is {status}.",
        )
        return
    _end_attachment(cloud, volume_id, str(attachment_id))


def connection_info(
    cloud: Cloud, caller: VolumeCaller, volume_id: str, connector: Any
) -> dict[str, Any]:
    """os-initialize_connection: how the connector's host reaches the volume."""
    doc = get_volume(cloud, caller, volume_id)
    if not isinstance(connector, dict):
        raise InvalidVolume("Invalid input received: connector is required")
    if doc.body["status"] in ("creating", "deleting", "error", "extending"):
        raise InvalidVolume(
            f"Invalid volume: Volume {volume_id} status must be available or in-use "
            f"(is {doc.body['status']})"
        )
    return backend_of(cloud).connection_info(volume_id)


# -- the attachments API ----------------------------------------------------------------------


def _attachment(
    cloud: Cloud,
    volume_id: str,
    attachment_id: str,
    instance: Any,
    status: str,
    mode: str,
    args: Mapping[str, Any],
) -> dict[str, Any]:
    return {
        "id": attachment_id,
        "volume_id": volume_id,
        "instance": instance,
        "status": status,
        "attach_mode": mode,
        "mountpoint": args.get("mountpoint"),
        "host_name": args.get("host_name"),
        "connector": args.get("connector"),
        "connection_info": None,
        "attached_at": _now(cloud) if status == "attached" else None,
    }


def _index(cloud: Cloud, conn: Connection, attachment_id: str, volume_id: str) -> None:
    doc = cloud.objects.find_in(conn, VOLUME, volume_id)
    project = doc.project_id if doc is not None else None
    cloud.objects.create_in(
        conn, ATTACHMENT, attachment_id, {"volume_id": volume_id}, project_id=project
    )


def find_attachment(
    cloud: Cloud, caller: VolumeCaller, attachment_id: str
) -> tuple[Document, dict[str, Any]]:
    """The attachment and the volume it belongs to."""
    index = cloud.objects.find(ATTACHMENT, attachment_id)
    if index is not None:
        volume = cloud.objects.find(VOLUME, index.body["volume_id"])
        if volume is not None and (caller.is_admin or volume.project_id == caller.project_id):
            found = (volume.body.get("attachments") or {}).get(attachment_id)
            if found is not None:
                return volume, found
    raise NotFound(f"Volume attachment {attachment_id} could not be found.")


def list_attachments(
    cloud: Cloud, caller: VolumeCaller, all_projects: bool
) -> list[dict[str, Any]]:
    project = None if caller.is_admin and all_projects else caller.project_id
    out: list[dict[str, Any]] = []
    for volume in cloud.objects.list(VOLUME, project_id=project):
        out.extend((volume.body.get("attachments") or {}).values())
    return out


def create_attachment(
    cloud: Cloud,
    caller: VolumeCaller,
    volume_id: str,
    instance_uuid: Any,
    connector: Any,
    mode: str,
) -> dict[str, Any]:
    """A new attachment, `reserved` (or `attaching` with a connector, with its connection)."""
    doc = get_volume(cloud, caller, volume_id)
    if not isinstance(instance_uuid, str) or not instance_uuid:
        raise InvalidVolume("Invalid input received: instance_uuid is required")
    if mode not in ("rw", "ro"):
        raise InvalidVolume(f"Invalid input received: invalid attach mode {mode}")
    attachment_id = str(uuid.uuid4())
    info = backend_of(cloud).connection_info(volume_id) if connector else None
    status = "attaching" if connector else "reserved"

    def on(body: dict[str, Any]) -> dict[str, Any]:
        attachments = dict(body.get("attachments") or {})
        made = _attachment(
            cloud, volume_id, attachment_id, instance_uuid, status, mode, {"connector": connector}
        )
        made["connection_info"] = info
        attachments[attachment_id] = made
        body["attachments"] = attachments
        if body["status"] != "in-use":
            body["status"] = "attaching" if connector else "reserved"
        return body

    with cloud.ledger.engine.begin() as conn:
        body = change_volume(
            cloud,
            volume_id,
            _attachable(doc.body),
            on,
            "Invalid volume: Volume {status} status must be available or downloading",
            conn=conn,
        )
        _index(cloud, conn, attachment_id, volume_id)
    return dict(body["attachments"][attachment_id])


def update_attachment(
    cloud: Cloud, caller: VolumeCaller, attachment_id: str, connector: Any
) -> dict[str, Any]:
    """The connector arrives: the attachment gets its connection info and is `attaching`."""
    volume, _ = find_attachment(cloud, caller, attachment_id)
    if not isinstance(connector, dict):
        raise InvalidVolume("Invalid input received: connector is required")
    info = backend_of(cloud).connection_info(volume.id)

    def on(body: dict[str, Any]) -> dict[str, Any]:
        attachments = dict(body.get("attachments") or {})
        if attachment_id not in attachments:
            raise NotFound(f"Volume attachment {attachment_id} could not be found.")
        one = dict(attachments[attachment_id])
        one.update(connector=connector, connection_info=info)
        if one["status"] == "reserved":
            one["status"] = "attaching"
        attachments[attachment_id] = one
        body["attachments"] = attachments
        if body["status"] == "reserved":
            body["status"] = "attaching"
        return body

    body = change_volume(cloud, volume.id, None, on)
    return dict(body["attachments"][attachment_id])


def complete_attachment(cloud: Cloud, caller: VolumeCaller, attachment_id: str) -> None:
    """os-complete (3.44): the hypervisor has the disk; the volume is in-use."""
    volume, _ = find_attachment(cloud, caller, attachment_id)

    def on(body: dict[str, Any]) -> dict[str, Any]:
        attachments = dict(body.get("attachments") or {})
        one = dict(attachments[attachment_id])
        one["status"] = "attached"
        one["attached_at"] = one.get("attached_at") or _now(cloud)
        attachments[attachment_id] = one
        body["attachments"] = attachments
        body["status"] = "in-use"
        return body

    change_volume(cloud, volume.id, None, on)


def delete_attachment(cloud: Cloud, caller: VolumeCaller, attachment_id: str) -> list[str]:
    """The attachment ends; the volume is available again when it was the last one."""
    volume, _ = find_attachment(cloud, caller, attachment_id)
    body = _end_attachment(cloud, volume.id, attachment_id)
    return list(body.get("attachments") or {})


def _end_attachment(cloud: Cloud, volume_id: str, attachment_id: str) -> dict[str, Any]:
    def off(body: dict[str, Any]) -> dict[str, Any]:
        attachments = dict(body.get("attachments") or {})
        if attachment_id not in attachments:
            raise InvalidVolume(
                f"Invalid volume: attachment {attachment_id} is not an attachment of this volume"
            )
        del attachments[attachment_id]
        body["attachments"] = attachments
        body["status"] = _settled_status(attachments)
        return body

    with cloud.ledger.engine.begin() as conn:
        body = change_volume(cloud, volume_id, None, off, conn=conn)
        cloud.objects.delete_in(conn, ATTACHMENT, attachment_id)
    return body
