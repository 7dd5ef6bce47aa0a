"""Volume and snapshot use cases: each commits its document, quota count and storage claim in
one transaction, and the backend's work follows as a durable intent.

A volume document in a transitional status (creating, extending, deleting; a snapshot's
creating, deleting) is the intent: `drive` carries it to its end (available, error, gone)
whoever calls it, any number of times, because each backend step is idempotent and each end
is a compare-and-swap on that status. The API submits a drive right after the commit;
`resume` drives whatever a dead process left in flight.
"""

from __future__ import annotations

import contextlib
import json
import logging
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, select

from stowage.domain.errors import ConflictError, NotFound
from stowage.ledger.objects import Document
from stowage.ledger.schema import objects
from stowage.ledger.storage import (
    PoolUsage,
    StorageCapacityExceeded,
    claim_storage,
    pool_usage,
    release_storage,
    resize_storage,
)
from stowage.services import images as image_service
from stowage.services.cloud import Cloud
from stowage.services.guest_spec import image_spec
from stowage.services.quotas import lock_project
from stowage.services.volumes.backend import GIB, BackendError
from stowage.services.volumes.model import (
    DEFAULT_TYPE_ID,
    DEFAULT_TYPE_NAME,
    DELETABLE,
    POOL,
    InvalidVolume,
    VolumeCaller,
    VolumeQuotaExceeded,
    backend_of,
    volume_quota_limits,
)
from stowage.virt.driver import DriverError, ImageSpec

__all__ = [
    "change_volume",
    "create_snapshot",
    "create_volume",
    "delete_snapshot",
    "delete_volume",
    "drive",
    "extend_volume",
    "find_type",
    "get_snapshot",
    "get_volume",
    "pools",
    "resume",
    "submit",
    "submit_resume",
    "update_snapshot",
    "update_volume",
    "volume_usage",
]

log = logging.getLogger(__name__)

VOLUME = "volume"
SNAPSHOT = "volume_snapshot"
_ATTEMPTS_MAX = 20
# Backend work (copies, conversions) runs here, off every request: a bounded pool.
_WORKERS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="stowage-volume")


# -- reads ------------------------------------------------------------------------------------


def _visible(caller: VolumeCaller, doc: Document) -> bool:
    return caller.is_admin or doc.project_id == caller.project_id


def get_volume(cloud: Cloud, caller: VolumeCaller, volume_id: str) -> Document:
    doc = cloud.objects.find(VOLUME, volume_id)
    if doc is None or not _visible(caller, doc):
        raise NotFound(f"Volume {volume_id} could not be found.")
    return doc


def get_snapshot(cloud: Cloud, caller: VolumeCaller, snapshot_id: str) -> Document:
    doc = cloud.objects.find(SNAPSHOT, snapshot_id)
    if doc is None or not _visible(caller, doc):
        raise NotFound(f"Snapshot {snapshot_id} could not be found.")
    return doc


def find_type(cloud: Cloud, ref: str | None) -> dict[str, Any]:
    """A volume type by id or name (None: the default type)."""
    if ref is None or ref in (DEFAULT_TYPE_ID, DEFAULT_TYPE_NAME):
        return default_type()
    doc = cloud.objects.find("volume_type", ref)
    if doc is None:
        doc = next(iter(cloud.objects.list("volume_type", name=ref)), None)
    if doc is None:
        raise NotFound(f"Volume type {ref} could not be found.")
    return doc.body


def default_type() -> dict[str, Any]:
    return {
        "id": DEFAULT_TYPE_ID,
        "name": DEFAULT_TYPE_NAME,
        "description": "Default Volume Type",
        "is_public": True,
        "extra_specs": {},
    }


def volume_usage(conn: Connection, project_id: str) -> dict[str, int]:
    """What the project's volume and snapshot documents use, read inside `conn`."""
    used = {"volumes": 0, "snapshots": 0, "gigabytes": 0}
    for kind, key in ((VOLUME, "volumes"), (SNAPSHOT, "snapshots")):
        for raw in conn.execute(
            select(objects.c.body).where(objects.c.kind == kind, objects.c.project_id == project_id)
        ).scalars():
            used[key] += 1
            used["gigabytes"] += int(json.loads(raw).get("size", 0))
    return used


def _reserve(conn: Connection, project_id: str, what: str, size_gb: int) -> None:
    """Refuse one more volume or snapshot of `size_gb` past the project's quotas (Cinder's
    messages), counting inside `conn` under the project's quota lock."""
    lock_project(conn, project_id)
    limits = volume_quota_limits(conn, project_id)
    used = volume_usage(conn, project_id)
    per_volume = limits["per_volume_gigabytes"]
    if what == "volumes" and 0 <= per_volume < size_gb:
        raise VolumeQuotaExceeded(
            f"VolumeSizeExceedsLimit: Requested volume size {size_gb}G is larger than maximum "
            f"allowed limit {per_volume}G."
        )
    limit = limits[what]
    if 0 <= limit < used[what] + 1:
        name = "VolumeLimitExceeded" if what == "volumes" else "SnapshotLimitExceeded"
        raise VolumeQuotaExceeded(
            f"{name}: Maximum number of {what} allowed ({limit}) exceeded for quota '{what}'."
        )
    limit = limits["gigabytes"]
    if 0 <= limit < used["gigabytes"] + size_gb:
        raise VolumeQuotaExceeded(
            "VolumeSizeExceedsAvailableQuota: Requested volume or snapshot exceeds allowed "
            f"gigabytes quota. Requested {size_gb}G, quota is {limit}G and "
            f"{used['gigabytes']}G has been consumed."
        )


# -- writes -----------------------------------------------------------------------------------


def _transition(
    cloud: Cloud,
    kind: str,
    doc_id: str,
    allowed: frozenset[str] | None,
    change: Callable[[dict[str, Any]], dict[str, Any]],
    *,
    conn: Connection | None = None,
    refusal: str = "",
) -> dict[str, Any]:
    """Compare-and-swap the document from a status in `allowed` (None: any) to `change(body)`.

    The status is read again on a lost race, so two requests from the same status cannot both
    win (two reserves of one volume: one attaches, the other is refused)."""
    if conn is None:
        with cloud.ledger.engine.begin() as own:
            return _transition(cloud, kind, doc_id, allowed, change, conn=own, refusal=refusal)
    for _ in range(_ATTEMPTS_MAX):
        current = cloud.objects.find_in(conn, kind, doc_id)
        if current is None:
            what = "Volume" if kind == VOLUME else "Snapshot"
            raise NotFound(f"{what} {doc_id} could not be found.")
        if allowed is not None and current.body.get("status") not in allowed:
            raise InvalidVolume(
                refusal.format(status=current.body.get("status"))
                or f"Invalid volume: status {current.body.get('status')} does not allow this"
            )
        new = change(dict(current.body))
        if cloud.objects.swap_in(conn, kind, doc_id, current.body, new):
            if new.get("name") != current.body.get("name"):
                cloud.objects.rename_in(conn, kind, doc_id, new.get("name") or "")
            return new
    raise ConflictError(f"{kind} {doc_id} kept changing; try again")


def _size(value: Any, field: str = "size") -> int:
    if isinstance(value, bool):
        raise InvalidVolume(f"Invalid input for field/attribute {field}: {value!r}")
    try:
        size = int(value)
    except (TypeError, ValueError):
        raise InvalidVolume(
            f"Invalid input received: Volume size '{value}' must be an integer and greater than 0"
        ) from None
    if size < 1 or str(value).strip() != str(size):
        raise InvalidVolume(
            f"Invalid input received: Volume size '{value}' must be an integer and greater than 0"
        )
    return size


def create_volume(cloud: Cloud, caller: VolumeCaller, request: Mapping[str, Any]) -> Document:
    """A new volume (blank, from an image, a snapshot or another volume): its document in
    `creating`, its quota and its storage claim in one commit. The backend's work is then
    `drive`'s. Past the pool's capacity the volume is recorded in `error`, as Cinder's
    scheduler leaves it ("No valid backend"), holding no storage."""
    source = _source(cloud, caller, request)
    size_given = request.get("size")
    if size_given is None and source.get("size"):
        size_given = source["size"]
    size = _size(size_given)
    if size < int(source.get("size", 0)):
        raise InvalidVolume(
            f"Invalid input received: Volume size '{size}'GB cannot be smaller than the "
            f"{source['what']} size {source['size']}GB. They must be >= original size."
        )
    vtype = find_type(cloud, request.get("volume_type") or source.get("volume_type"))
    zone = request.get("availability_zone") or "nova"
    if zone != "nova":
        raise InvalidVolume(f"Invalid input received: Availability zone '{zone}' is invalid.")
    volume_id = str(uuid.uuid4())
    backend_name = vtype.get("extra_specs", {}).get("volume_backend_name")
    body: dict[str, Any] = {
        "id": volume_id,
        "name": request.get("name"),
        "description": request.get("description"),
        "size": size,
        "status": "creating",
        "project_id": caller.project_id,
        "user_id": caller.user_id,
        "availability_zone": zone,
        "volume_type": vtype["name"],
        "volume_type_id": vtype["id"],
        "snapshot_id": source.get("snapshot_id"),
        "source_volid": source.get("source_volid"),
        "image_id": source.get("image_id"),
        "volume_image_metadata": source.get("image_metadata"),
        "metadata": dict(request.get("metadata") or {}),
        "bootable": bool(source.get("image_id")) or bool(source.get("bootable")),
        "multiattach": bool(request.get("multiattach")),
        "attachments": {},
        "pool": POOL,
        "fault": None,
    }
    with cloud.ledger.engine.begin() as conn:
        _reserve(conn, caller.project_id, "volumes", size)
        if backend_name not in (None, backend_of(cloud).kind):
            body.update(status="error", fault=f"No valid backend was found: {backend_name}")
        else:
            try:
                claim_storage(conn, POOL, volume_id, "volume", caller.project_id, size)
            except StorageCapacityExceeded as exc:
                body.update(status="error", fault=f"No valid backend was found. {exc}")
        return cloud.objects.create_in(
            conn, VOLUME, volume_id, body, project_id=caller.project_id, name=body["name"]
        )


def _source(cloud: Cloud, caller: VolumeCaller, request: Mapping[str, Any]) -> dict[str, Any]:
    """What the volume is made from: nothing, an image, a snapshot or a volume."""
    given = [k for k in ("imageRef", "snapshot_id", "source_volid", "backup_id") if request.get(k)]
    if len(given) > 1:
        raise InvalidVolume(
            "Invalid input received: only one of snapshot_id, source_volid, imageRef and "
            "backup_id may be given"
        )
    if request.get("backup_id"):
        raise InvalidVolume("Invalid input received: backups are not available in this cloud")
    if request.get("snapshot_id"):
        snap = get_snapshot(cloud, caller, str(request["snapshot_id"]))
        if snap.body["status"] != "available":
            raise InvalidVolume(
                f"Invalid snapshot: Originating snapshot status must be one of 'available' "
                f"values (is {snap.body['status']})"
            )
        origin = cloud.objects.find(VOLUME, snap.body["volume_id"])
        return {
            "what": "snapshot",
            "snapshot_id": snap.id,
            "size": snap.body["size"],
            "volume_type": origin.body.get("volume_type_id") if origin else None,
            "bootable": origin.body.get("bootable") if origin else False,
            "image_metadata": origin.body.get("volume_image_metadata") if origin else None,
        }
    if request.get("source_volid"):
        src = get_volume(cloud, caller, str(request["source_volid"]))
        if src.body["status"] not in ("available", "in-use"):
            raise InvalidVolume(
                f"Invalid volume: Volume {src.id} status must be available or in-use "
                f"(is {src.body['status']})"
            )
        return {
            "what": "source volume",
            "source_volid": src.id,
            "size": src.body["size"],
            "volume_type": src.body.get("volume_type_id"),
            "bootable": src.body.get("bootable"),
            "image_metadata": src.body.get("volume_image_metadata"),
        }
    if request.get("imageRef"):
        image_id = str(request["imageRef"]).rstrip("/").rsplit("/", 1)[-1]
        image = cloud.objects.find("image", image_id)
        visible = image is not None and (
            caller.is_admin
            or image.body.get("visibility") in ("public", "community")
            or image.body.get("owner") == caller.project_id
        )
        if image is None or not visible:
            raise InvalidVolume("Invalid image identifier or unable to access requested image.")
        if image.body.get("status") != "active":
            raise InvalidVolume(f"Invalid image: Image {image_id} is not active.")
        virtual = int(image.body.get("virtual_size") or image.body.get("size") or 0)
        min_gb = max(int(image.body.get("min_disk") or 0), -(-virtual // GIB))
        return {
            "what": "image",
            "image_id": image_id,
            "size": min_gb,
            "image_metadata": {
                "image_id": image_id,
                "image_name": image.body.get("name"),
                "disk_format": image.body.get("disk_format"),
                "container_format": image.body.get("container_format"),
                "checksum": image.body.get("checksum"),
                "min_disk": str(image.body.get("min_disk") or 0),
                "min_ram": str(image.body.get("min_ram") or 0),
                "size": str(image.body.get("size") or 0),
            },
        }
    return {}


def _renamed(changes: Mapping[str, Any]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The change of an update: name, description and metadata, as given."""

    def apply(body: dict[str, Any]) -> dict[str, Any]:
        for key in ("name", "description"):
            if key in changes:
                body[key] = changes[key]
        if "metadata" in changes:
            body["metadata"] = dict(changes["metadata"] or {})
        return body

    return apply


def update_volume(
    cloud: Cloud, caller: VolumeCaller, volume_id: str, changes: Mapping[str, Any]
) -> Document:
    get_volume(cloud, caller, volume_id)

    _transition(cloud, VOLUME, volume_id, None, _renamed(changes))
    return cloud.objects.get(VOLUME, volume_id)


def change_volume(
    cloud: Cloud,
    volume_id: str,
    allowed: frozenset[str] | None,
    change: Callable[[dict[str, Any]], dict[str, Any]],
    refusal: str = "",
    *,
    conn: Connection | None = None,
) -> dict[str, Any]:
    """A status move of the volume by compare-and-swap (the attach actions' one write)."""
    return _transition(cloud, VOLUME, volume_id, allowed, change, conn=conn, refusal=refusal)


def delete_volume(
    cloud: Cloud,
    caller: VolumeCaller,
    volume_id: str,
    *,
    cascade: bool = False,
    force: bool = False,
) -> None:
    """Mark the volume `deleting` (the intent); `drive` removes its file, releases its claim
    and its document in one commit. Snapshots block it unless `cascade` deletes them too."""
    get_volume(cloud, caller, volume_id)
    with cloud.objects.writing() as conn:  # the snapshots read in it too
        snaps = [
            doc for doc in cloud.objects.list(SNAPSHOT) if doc.body.get("volume_id") == volume_id
        ]
        if snaps and not cascade:
            raise InvalidVolume(
                f"Invalid volume: Volume {volume_id} still has {len(snaps)} dependent snapshots."
            )
        allowed = None if force else DELETABLE

        def mark(body: dict[str, Any]) -> dict[str, Any]:
            if body.get("attachments") and not force:
                raise InvalidVolume(
                    "Invalid volume: Volume status must be available or error or "
                    "error_restoring or error_extending or error_managing and must not be "
                    "migrating, attached, belong to a group, have snapshots or be "
                    "disassociated from snapshots after volume transfer."
                )
            body["status"] = "deleting"
            return body

        _transition(
            cloud,
            VOLUME,
            volume_id,
            allowed,
            mark,
            conn=conn,
            refusal=(
                "Invalid volume: Volume status must be available or error or error_restoring "
                "or error_extending or error_managing and must not be migrating, attached, "
                "belong to a group, have snapshots or be disassociated from snapshots after "
                "volume transfer."
            ),
        )
        for snap in snaps:
            _transition(
                cloud,
                SNAPSHOT,
                snap.id,
                frozenset({"available", "error"}),
                lambda b: {**b, "status": "deleting"},
                conn=conn,
                refusal="Invalid snapshot: snapshot status must be available or error",
            )


def extend_volume(cloud: Cloud, caller: VolumeCaller, volume_id: str, new_size: Any) -> None:
    """Grow the volume's claim and quota count to `new_size` in one commit, marked
    `extending`; `drive` grows the file and makes it available."""
    doc = get_volume(cloud, caller, volume_id)
    size = _size(new_size, "new_size")
    if size <= int(doc.body["size"]):
        raise InvalidVolume(
            f"Invalid input received: New size for extend must be greater than current size. "
            f"(current: {doc.body['size']}, extended: {size})."
        )
    with cloud.ledger.engine.begin() as conn:
        lock_project(conn, doc.body["project_id"])
        _grow_quota(conn, doc.body["project_id"], size - int(doc.body["size"]))

        def mark(body: dict[str, Any]) -> dict[str, Any]:
            body["previous_size"] = body["size"]
            body["size"] = size
            body["status"] = "extending"
            return body

        _transition(
            cloud,
            VOLUME,
            volume_id,
            frozenset({"available"}),
            mark,
            conn=conn,
            refusal="Invalid volume: Volume status must be 'available' to extend, currently in "
            "'{status}' status.",
        )
        try:
            resize_storage(conn, volume_id, size)
        except StorageCapacityExceeded:
            raise InvalidVolume(
                f"Invalid volume: Insufficient free space in the pool to extend to {size}G"
            ) from None


def _grow_quota(conn: Connection, project_id: str, more_gb: int) -> None:
    limit = volume_quota_limits(conn, project_id)["gigabytes"]
    used = volume_usage(conn, project_id)["gigabytes"]
    if 0 <= limit < used + more_gb:
        raise VolumeQuotaExceeded(
            "VolumeSizeExceedsAvailableQuota: Requested volume or snapshot exceeds allowed "
            f"gigabytes quota. Requested {more_gb}G, quota is {limit}G and {used}G has been "
            "consumed."
        )


def create_snapshot(cloud: Cloud, caller: VolumeCaller, request: Mapping[str, Any]) -> Document:
    """A snapshot of a volume: document `creating`, quota and claim in one commit."""
    volume_id = request.get("volume_id")
    if not isinstance(volume_id, str) or not volume_id:
        # Cinder looks the volume up first: no volume id is a volume not found.
        raise NotFound(f"Volume {volume_id} could not be found.")
    volume = get_volume(cloud, caller, volume_id)
    force = str(request.get("force", False)).lower() in ("true", "1", "yes")
    allowed = {"available", "in-use"} if force else {"available"}
    if volume.body["status"] not in allowed:
        raise InvalidVolume(
            f"Invalid volume: Volume {volume_id} status must be available, but current status "
            f"is: {volume.body['status']}."
        )
    snapshot_id = str(uuid.uuid4())
    size = int(volume.body["size"])
    body = {
        "id": snapshot_id,
        "name": request.get("name"),
        "description": request.get("description"),
        "volume_id": volume_id,
        "size": size,
        "status": "creating",
        "project_id": volume.body["project_id"],
        "user_id": caller.user_id,
        "metadata": dict(request.get("metadata") or {}),
        "progress": "0%",
    }
    with cloud.ledger.engine.begin() as conn:
        _reserve(conn, volume.body["project_id"], "snapshots", size)
        try:
            claim_storage(conn, POOL, snapshot_id, "snapshot", volume.body["project_id"], size)
        except StorageCapacityExceeded as exc:
            body["status"] = "error"
            body["fault"] = str(exc)
        return cloud.objects.create_in(
            conn,
            SNAPSHOT,
            snapshot_id,
            body,
            project_id=volume.body["project_id"],
            name=body["name"],
        )


def update_snapshot(
    cloud: Cloud, caller: VolumeCaller, snapshot_id: str, changes: Mapping[str, Any]
) -> Document:
    get_snapshot(cloud, caller, snapshot_id)

    _transition(cloud, SNAPSHOT, snapshot_id, None, _renamed(changes))
    return cloud.objects.get(SNAPSHOT, snapshot_id)


def delete_snapshot(
    cloud: Cloud, caller: VolumeCaller, snapshot_id: str, *, force: bool = False
) -> None:
    """Mark the snapshot `deleting` (from available or error; from any status with `force`,
    an admin's os-force_delete); the backend's work follows as a durable intent."""
    get_snapshot(cloud, caller, snapshot_id)
    _transition(
        cloud,
        SNAPSHOT,
        snapshot_id,
        None if force else frozenset({"available", "error"}),
        lambda b: {**b, "status": "deleting"},
        refusal="Invalid snapshot: Volume Snapshot status must be available or error",
    )


def change_snapshot(
    cloud: Cloud,
    snapshot_id: str,
    allowed: frozenset[str] | None,
    change: Callable[[dict[str, Any]], dict[str, Any]],
    refusal: str = "",
) -> dict[str, Any]:
    """An admin's change of a snapshot's status (os-reset_status, os-update_snapshot_status),
    from a status in `allowed` (None: any), compare-and-swap."""
    return _transition(cloud, SNAPSHOT, snapshot_id, allowed, change, refusal=refusal)


# -- the durable intents, driven --------------------------------------------------------------


def submit(cloud: Cloud, kind: str, doc_id: str) -> Future[None]:
    """Drive the document's intent in the volume workers (bounded), not in the request."""
    return _WORKERS.submit(drive, cloud, kind, doc_id)


def submit_resume(cloud: Cloud) -> Future[int]:
    return _WORKERS.submit(resume, cloud)


def resume(cloud: Cloud) -> int:
    """Drive every volume and snapshot left in a transitional status (after a crash)."""
    count = 0
    for kind in (SNAPSHOT, VOLUME):
        for doc in cloud.objects.list(kind):
            if doc.body.get("status") in ("creating", "extending", "deleting"):
                drive(cloud, kind, doc.id)
                count += 1
    return count


def drive(cloud: Cloud, kind: str, doc_id: str) -> None:
    """Carry the document's transitional status to its end; a no-op on a settled one."""
    doc = cloud.objects.find(kind, doc_id)
    if doc is None:
        return
    status = doc.body.get("status")
    backend = backend_of(cloud)
    try:
        if kind == VOLUME and status == "creating":
            _make_volume(cloud, doc)
            _settle(cloud, kind, doc_id, "creating", "available")
        elif kind == VOLUME and status == "extending":
            backend.extend(doc_id, int(doc.body["size"]))
            _settle(cloud, kind, doc_id, "extending", "available")
        elif kind == SNAPSHOT and status == "creating":
            backend.snapshot(doc_id, doc.body["volume_id"])
            _settle(cloud, kind, doc_id, "creating", "available", progress="100%")
        elif status == "deleting":
            if kind == VOLUME:
                backend.delete(doc_id)
            else:
                backend.delete_snapshot(doc_id)
            _remove(cloud, kind, doc_id)
    except (BackendError, OSError) as exc:
        log.warning("volume backend step of %s %s failed: %s", kind, doc_id, exc)
        failed = {"creating": "error", "extending": "error_extending", "deleting": "error_deleting"}
        _settle(cloud, kind, doc_id, str(status), failed.get(str(status), "error"), fault=str(exc))
        if status == "creating":
            # A volume that failed to be made holds no storage (it still counts for quota).
            with cloud.ledger.engine.begin() as conn:
                release_storage(conn, doc_id)


def _make_volume(cloud: Cloud, doc: Document) -> None:
    backend = backend_of(cloud)
    size = int(doc.body["size"])
    if doc.body.get("snapshot_id"):
        backend.create_from_snapshot(doc.id, size, doc.body["snapshot_id"])
    elif doc.body.get("source_volid"):
        backend.clone(doc.id, size, doc.body["source_volid"])
    elif doc.body.get("image_id"):
        image = cloud.objects.find("image", doc.body["image_id"])
        if image is None:
            raise BackendError(f"image {doc.body['image_id']} has no data")
        path = _image_data(cloud, image.id)
        backend.create_from_image(doc.id, size, path, str(image.body.get("disk_format") or "raw"))
    else:
        backend.create_blank(doc.id, size)


def _image_data(cloud: Cloud, image_id: str) -> Path:
    """The image's data: the image API's own file where this process has it (`stowage up`,
    the API's volume workers), else fetched from the image API into this host's cache."""
    path = image_service.image_file(cloud, image_id)
    if path.exists():
        return path
    cache = cloud.remote_images
    spec = image_spec(cloud, image_id) if cache is not None else None
    if cache is None or spec is None:
        raise BackendError(f"image {image_id} has no data")
    try:
        return cache.path(ImageSpec(**spec))
    except DriverError as exc:
        raise BackendError(str(exc)) from None


def _settle(cloud: Cloud, kind: str, doc_id: str, was: str, status: str, **extra: Any) -> None:
    def end(body: dict[str, Any]) -> dict[str, Any]:
        body["status"] = status
        body.pop("previous_size", None)
        body.update(extra)
        return body

    with contextlib.suppress(InvalidVolume, NotFound):  # another driver ended it first
        _transition(cloud, kind, doc_id, frozenset({was}), end)


def _remove(cloud: Cloud, kind: str, doc_id: str) -> None:
    """The document and its claim, gone in one commit."""
    with cloud.ledger.engine.begin() as conn:
        current = cloud.objects.find_in(conn, kind, doc_id)
        if current is None or current.body.get("status") != "deleting":
            return
        release_storage(conn, doc_id)
        cloud.objects.delete_in(conn, kind, doc_id)


# -- lists ------------------------------------------------------------------------------------

_SORT_KEYS = {"created_at", "updated_at", "name", "size", "status", "id", "availability_zone"}


def list_docs(
    cloud: Cloud,
    caller: VolumeCaller,
    kind: str,
    *,
    filters: Mapping[str, Any],
    all_projects: bool = False,
    sort: list[tuple[str, str]] | None = None,
    limit: int | None = None,
    marker: str | None = None,
    offset: int = 0,
) -> list[Document]:
    """The caller's volumes or snapshots (every project's for an admin asking for them),
    filtered by exact field values (`metadata`: every given key and value; a name ending
    in `~`: a substring), sorted (`display_name` is `name`, as Cinder maps it), then paged
    after `marker`, `offset` skipped."""
    project = None if caller.is_admin and all_projects else caller.project_id
    if caller.is_admin and all_projects and filters.get("project_id"):
        project = str(filters["project_id"])
    docs = [d for d in cloud.objects.list(kind, project_id=project) if _matches(d, filters)]
    for given, direction in reversed(sort or [("created_at", "desc")]):
        key = "name" if given == "display_name" else given
        if key not in _SORT_KEYS:
            raise InvalidVolume(f"Invalid input received: Invalid sort key {key}")

        def value(doc: Document, key: str = key) -> tuple[int, Any]:
            got = {"created_at": doc.created_at, "updated_at": doc.updated_at, "id": doc.id}.get(
                key, doc.body.get(key)
            )
            return (got is None, got if got is not None else 0)

        docs.sort(key=value, reverse=direction == "desc")
    if marker is not None:
        ids = [d.id for d in docs]
        if marker not in ids:
            raise NotFound(f"Marker {marker} could not be found.")
        docs = docs[ids.index(marker) + 1 :]
    docs = docs[offset:]
    return docs if limit is None else docs[:limit]


def _matches(doc: Document, filters: Mapping[str, Any]) -> bool:
    for key, wanted in filters.items():
        if key == "project_id":
            continue
        if key == "metadata":
            have = doc.body.get("metadata") or {}
            if any(have.get(k) != v for k, v in dict(wanted).items()):
                return False
        elif key.endswith("~"):
            if str(wanted).lower() not in str(doc.body.get(key[:-1]) or "").lower():
                return False
        elif key == "bootable":
            if bool(doc.body.get("bootable")) != (str(wanted).lower() in ("true", "1")):
                return False
        elif str(doc.body.get(key)) != str(wanted):
            return False
    return True


def pools(cloud: Cloud) -> list[PoolUsage]:
    """The storage pools and their usage, from the ledger."""
    from stowage.ledger.db import READONLY

    with cloud.ledger.engine.connect().execution_options(**READONLY) as conn:
        return pool_usage(conn)
