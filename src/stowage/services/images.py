"""Images: metadata as documents of kind "image", data as files in `<state_dir>/images`.

An image document's body is the image as glance returns it: the base fields (id, name, status,
visibility, protected, os_hidden, container_format, disk_format, min_disk, min_ram, size,
virtual_size, checksum, os_hash_algo, os_hash_value, owner, created_at, updated_at, tags,
self, file, schema) and every custom property at top level beside them, so other services
may read `image.body["hw_cpu_policy"]` directly. The document's project_id column is the
owner.

Data arrive through an `Upload`: bytes go to a temporary file beside the final one, and only a
complete upload is renamed into place and turns the image active. An aborted one removes its
temporary file and puts the image back to queued.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from stowage.domain.errors import ConflictError, InvalidSpec, NotFound, StowageError
from stowage.services.caller import Caller, SystemCaller

if TYPE_CHECKING:
    from sqlalchemy import Connection

    from stowage.ledger.objects import Document
    from stowage.ledger.operations import Operation
    from stowage.services.cloud import Cloud

__all__ = [
    "CIRROS_NAME",
    "CONTAINER_FORMATS",
    "DISK_FORMATS",
    "MEMBER_STATUSES",
    "Caller",
    "Change",
    "ImageConflict",
    "ImageError",
    "ImageForbidden",
    "ImageInvalid",
    "ImageNotFound",
    "ImageQuery",
    "Upload",
    "add_tag",
    "begin_upload",
    "bootstrap_images",
    "create_image",
    "data_of",
    "delete_image",
    "end_snapshot_in",
    "find_image",
    "get_image",
    "image_file",
    "list_images",
    "properties_of",
    "remove_tag",
    "render",
    "set_active",
    "store_image_bytes",
    "update_image",
]

CIRROS_NAME = "cirros-0.6.2-x86_64-disk"
DISK_FORMATS = (
    "ami",
    "ari",
    "aki",
    "vhd",
    "vhdx",
    "vmdk",
    "raw",
    "qcow2",
    "vdi",
    "iso",
    "ploop",
)
CONTAINER_FORMATS = ("ami", "ari", "aki", "bare", "ovf", "ova", "docker", "compressed")
VISIBILITIES = ("public", "private", "shared", "community")
STATUSES = (
    "queued",
    "saving",
    "active",
    "killed",
    "deleted",
    "pending_delete",
    "deactivated",
    "uploading",
    "importing",
)
# Glance's base properties that a caller may set, and those only glance sets.
WRITABLE = (
    "name",
    "visibility",
    "protected",
    "os_hidden",
    "container_format",
    "disk_format",
    "min_disk",
    "min_ram",
    "tags",
    "owner",
)
READ_ONLY = (
    "id",
    "checksum",
    "created_at",
    "updated_at",
    "status",
    "size",
    "virtual_size",
    "file",
    "self",
    "schema",
    "direct_url",
    "os_hash_algo",
    "os_hash_value",
    "locations",
    "stores",
)
RESERVED = ("location", "deleted", "deleted_at", "_members")
RESERVED_PREFIX = "os_glance"
TAGS_MAX = 128
PROPERTIES_MAX = 128
SIZE_MAX_BYTES = 64 * 1024**3
HASH_ALGO = "sha512"

# One upload per image at a time in this process; the status column tells other readers.
_uploads_lock = threading.Lock()
_uploads: set[str] = set()


class ImageError(StowageError):
    """A refused image request; `status` is the HTTP status glance answers with."""

    code = "image.error"
    status = 400

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        if status is not None:
            self.status = status


class ImageNotFound(ImageError, NotFound):
    code = "image.not_found"
    status = 404


class ImageConflict(ImageError, ConflictError):
    code = "image.conflict"
    status = 409


class ImageInvalid(ImageError, InvalidSpec):
    code = "image.invalid"
    status = 400


class ImageForbidden(ImageError):
    code = "image.forbidden"
    status = 403


@dataclass(frozen=True, slots=True)
class Change:
    """One JSON-patch operation on an image: op is add, replace or remove; path is decoded."""

    op: str
    path: tuple[str, ...]
    value: Any = None


@dataclass(slots=True)
class ImageQuery:
    """A list request: filters as glance names them (values may use the `in:` operator)."""

    filters: dict[str, str]
    tags: list[str]
    sort: list[tuple[str, str]]
    limit: int
    marker: str | None = None


# -- time, paths, rendering -------------------------------------------------------------------


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def images_dir(cloud: Cloud) -> Path:
    path = cloud.config.state_dir / "images"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def image_file(cloud: Cloud, image_id: str) -> Path:
    """Where an active image's data lives."""
    return images_dir(cloud) / image_id


MEMBERS = "_members"  # project id -> {status, created_at, updated_at}; never rendered
MEMBER_STATUSES = ("pending", "accepted", "rejected")


def render(body: Mapping[str, Any]) -> dict[str, Any]:
    """The image as glance returns it: base fields first, then the custom properties."""
    out: dict[str, Any] = {key: body.get(key) for key in _BASE_ORDER}
    out["tags"] = list(body.get("tags") or [])
    out["protected"] = bool(body.get("protected", False))
    out["os_hidden"] = bool(body.get("os_hidden", False))
    out["min_disk"] = int(body.get("min_disk") or 0)
    out["min_ram"] = int(body.get("min_ram") or 0)
    image_id = body["id"]
    out["self"] = f"/v2/images/{image_id}"
    out["file"] = f"/v2/images/{image_id}/file"
    out["schema"] = "/v2/schemas/image"
    out.update(properties_of(body))
    return out


def properties_of(body: Mapping[str, Any]) -> dict[str, Any]:
    """An image's custom properties: whatever is not one of glance's own fields."""
    return {key: value for key, value in body.items() if key not in _OWN_FIELDS}


_BASE_ORDER = (
    "id",
    "name",
    "status",
    "visibility",
    "protected",
    "os_hidden",
    "container_format",
    "disk_format",
    "min_disk",
    "min_ram",
    "size",
    "virtual_size",
    "checksum",
    "os_hash_algo",
    "os_hash_value",
    "owner",
    "created_at",
    "updated_at",
    "tags",
)
_OWN_FIELDS = frozenset((*_BASE_ORDER, "self", "file", "schema", MEMBERS))


# -- visibility -------------------------------------------------------------------------------


def _visible(body: Mapping[str, Any], caller: Caller) -> bool:
    if caller.is_admin:
        return True
    if body.get("visibility") in ("public", "community"):
        return True
    return bool(body.get("owner") == caller.project_id) or _member_status(body, caller) is not None


def _member_status(body: Mapping[str, Any], caller: Caller) -> str | None:
    """The caller's status as a member of a shared image (None: not a member)."""
    if body.get("visibility") != "shared":
        return None
    member = (body.get(MEMBERS) or {}).get(caller.project_id)
    return None if member is None else str(member["status"])


def _may_change(body: Mapping[str, Any], caller: Caller) -> bool:
    return caller.is_admin or body.get("owner") == caller.project_id


def _load_to_change(cloud: Cloud, caller: Caller, image_id: str, what: str) -> dict[str, Any]:
    """The image, if the caller may change it; otherwise a 403 saying what it may not do."""
    body = _load(cloud, caller, image_id)
    if not _may_change(body, caller):
        raise ImageForbidden(f"You are not permitted to {what}.")
    return body


def find_image(cloud: Cloud, image_id: str) -> dict[str, Any] | None:
    """The stored body of an image, whoever may see it (for other services' checks)."""
    doc = cloud.objects.find("image", image_id)
    return None if doc is None else doc.body


def _load(cloud: Cloud, caller: Caller, image_id: str) -> dict[str, Any]:
    body = find_image(cloud, image_id)
    if body is None or not _visible(body, caller):
        raise ImageNotFound(f"No image found with ID {image_id}")
    return body


def get_image(cloud: Cloud, caller: Caller, image_id: str) -> dict[str, Any]:
    """The stored body of an image the caller may see, or ImageNotFound."""
    return _load(cloud, caller, image_id)


def _save(cloud: Cloud, body: dict[str, Any]) -> dict[str, Any]:
    body["updated_at"] = _iso(cloud.clock())
    cloud.objects.update(
        "image", body["id"], body, project_id=body.get("owner") or None, name=body.get("name")
    )
    return body


# -- validation -------------------------------------------------------------------------------


def _check_key(key: str) -> None:
    if key in READ_ONLY:
        raise ImageForbidden(f"Attribute '{key}' is read-only.")
    if key in RESERVED or key.startswith(RESERVED_PREFIX):
        raise ImageForbidden(f"Attribute '{key}' is reserved.")
    if not key or len(key) > 255:
        raise ImageInvalid("Custom property should not be greater than 255 characters.")


def _schema_error(detail: str) -> ImageInvalid:
    return ImageInvalid(f"Provided object does not match schema 'image': {detail}")


def _validated(key: str, value: Any, caller: Caller) -> Any:
    """The value to store for base property `key`, or a 400/403 naming the field."""
    if key == "name":
        if value is not None and (not isinstance(value, str) or len(value) > 255):
            raise _schema_error(f"{value!r} is not valid under any of the given schemas (name)")
        return value
    if key == "visibility":
        if value not in VISIBILITIES:
            raise _schema_error(f"{value!r} is not one of {list(VISIBILITIES)} (visibility)")
        if value == "public" and not caller.is_admin:
            raise ImageForbidden("You are not authorized to complete publicize_image action.")
        return value
    if key in ("protected", "os_hidden"):
        if not isinstance(value, bool):
            raise _schema_error(f"{value!r} is not of type 'boolean' ({key})")
        return value
    if key in ("min_disk", "min_ram"):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _schema_error(f"{value!r} is not a non-negative integer ({key})")
        return value
    if key == "disk_format":
        if value is not None and value not in DISK_FORMATS:
            raise _schema_error(f"{value!r} is not one of {[None, *DISK_FORMATS]} (disk_format)")
        return value
    if key == "container_format":
        if value is not None and value not in CONTAINER_FORMATS:
            raise _schema_error(
                f"{value!r} is not one of {[None, *CONTAINER_FORMATS]} (container_format)"
            )
        return value
    if key == "tags":
        return _validated_tags(value)
    if key == "owner":
        if value is not None and (not isinstance(value, str) or len(value) > 255):
            raise _schema_error(f"{value!r} is not valid under any of the given schemas (owner)")
        if not caller.is_admin and value != caller.project_id:
            raise ImageForbidden(f"You are not permitted to create images owned by '{value}'.")
        return value
    raise AssertionError(f"not a writable base property: {key}")


def _validated_tags(value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise _schema_error(f"{value!r} is not of type 'array' of strings (tags)")
    tags = list(dict.fromkeys(value))
    for tag in tags:
        if len(tag) > 255:
            raise _schema_error(f"{tag!r} is too long (tags)")
    if len(tags) > TAGS_MAX:
        raise ImageError(f"Maximum number of tags exceeded: {len(tags)} > {TAGS_MAX}", status=413)
    return tags


def _validated_property(key: str, value: Any) -> str:
    _check_key(key)
    if not isinstance(value, str):
        raise _schema_error(f"{value!r} is not of type 'string' ({key})")
    return value


# -- create, update, delete -------------------------------------------------------------------


def create_image(
    cloud: Cloud, caller: Caller, request: Mapping[str, Any], *, conn: Connection | None = None
) -> dict[str, Any]:
    """A new queued image from a glance create body; every field is checked before any write.
    With `conn`, the image is written in the caller's transaction (a snapshot's use case)."""
    if not isinstance(request, Mapping):
        raise ImageInvalid("Request body must be a JSON object.")
    now = _iso(cloud.clock())
    image_id = request.get("id")
    if image_id is None:
        image_id = str(uuid.uuid4())
    else:
        try:
            image_id = str(uuid.UUID(str(image_id)))
        except ValueError:
            raise _schema_error(f"{image_id!r} is not a 'uuid' (id)") from None
    body: dict[str, Any] = {
        "id": image_id,
        "name": None,
        "status": "queued",
        "visibility": "shared",
        "protected": False,
        "os_hidden": False,
        "container_format": None,
        "disk_format": None,
        "min_disk": 0,
        "min_ram": 0,
        "size": None,
        "virtual_size": None,
        "checksum": None,
        "os_hash_algo": None,
        "os_hash_value": None,
        "owner": caller.project_id,
        "created_at": now,
        "updated_at": now,
        "tags": [],
    }
    properties = {}
    for key, value in request.items():
        if key == "id":
            continue
        if key in WRITABLE:
            body[key] = _validated(key, value, caller)
        else:
            properties[key] = _validated_property(key, value)
    body = render({**body, **properties})
    if len(properties) > PROPERTIES_MAX:
        raise ImageError(f"Maximum number of properties exceeded: {PROPERTIES_MAX}", status=413)
    try:
        if conn is None:
            cloud.objects.create(
                "image", image_id, body, project_id=body["owner"], name=body["name"]
            )
        else:
            cloud.objects.create_in(
                conn, "image", image_id, body, project_id=body["owner"], name=body["name"]
            )
    except ConflictError:
        raise ImageConflict(f"Image with identifier {image_id} already exists!") from None
    return body


def update_image(
    cloud: Cloud, caller: Caller, image_id: str, changes: Sequence[Change]
) -> dict[str, Any]:
    """Apply JSON-patch changes all together, or none of them."""
    body = _load_to_change(cloud, caller, image_id, "modify this image")
    new = dict(body)
    new["tags"] = list(body.get("tags") or [])
    for change in changes:
        _apply(new, change, caller)
    if len(properties_of(new)) > PROPERTIES_MAX:
        raise ImageError(f"Maximum number of properties exceeded: {PROPERTIES_MAX}", status=413)
    return _save(cloud, new)


def _apply(body: dict[str, Any], change: Change, caller: Caller) -> None:
    key = change.path[0]
    if len(change.path) != 1:
        raise ImageInvalid(f"Invalid JSON pointer for this resource: '/{'/'.join(change.path)}'")
    _check_key(key)
    if key in WRITABLE:
        if change.op == "remove":
            raise ImageForbidden(f"Attribute '{key}' is a base property and cannot be removed.")
        if key in ("disk_format", "container_format") and body["status"] != "queued":
            raise ImageForbidden(f"Attribute {key} can be only replaced for a queued image.")
        body[key] = _validated(key, change.value, caller)
        return
    if change.op in ("remove", "replace") and key not in body:
        raise ImageConflict(f"Property {key} does not exist.")
    if change.op == "remove":
        del body[key]
    else:
        body[key] = _validated_property(key, change.value)


def delete_image(cloud: Cloud, caller: Caller, image_id: str) -> None:
    """Remove the record and its data; protected images and others' images are refused."""
    body = _load_to_change(cloud, caller, image_id, "delete this image")
    if body.get("protected"):
        raise ImageForbidden(f"Image {image_id} is protected and cannot be deleted.")
    cloud.objects.delete("image", image_id)
    image_file(cloud, image_id).unlink(missing_ok=True)


def end_snapshot_in(cloud: Cloud, conn: Connection, op: Operation) -> None:
    """A snapshot operation ends without its image (it failed, a delete or an evacuation
    overtook it, its agent died under the upload): the image goes, in the transaction that
    ends the operation, as Nova deletes a failed snapshot's image. An upload still running
    somewhere finds it gone when it commits (410) and keeps nothing."""
    if op.kind not in ("snapshot", "shelve") or not op.payload.get("image_id"):
        return
    doc = cloud.objects.find_in(conn, "image", str(op.payload.get("image_id") or ""))
    if doc is not None and doc.body.get("status") in ("queued", "saving"):
        cloud.objects.delete_in(conn, "image", doc.id)


def add_tag(cloud: Cloud, caller: Caller, image_id: str, tag: str) -> None:
    body = _load_to_change(cloud, caller, image_id, "modify tags on this image")
    tags = list(body.get("tags") or [])
    if tag in tags:
        return
    body["tags"] = _validated_tags([*tags, tag])
    _save(cloud, body)


def remove_tag(cloud: Cloud, caller: Caller, image_id: str, tag: str) -> None:
    body = _load_to_change(cloud, caller, image_id, "modify tags on this image")
    tags = list(body.get("tags") or [])
    if tag not in tags:
        raise ImageNotFound(f"Tag {tag} not found.")
    tags.remove(tag)
    body["tags"] = tags
    _save(cloud, body)


def set_active(cloud: Cloud, caller: Caller, image_id: str, *, active: bool) -> None:
    """Deactivate (active -> deactivated) or reactivate (deactivated -> active)."""
    body = _load_to_change(cloud, caller, image_id, "change the status of this image")
    target, source, verb = (
        ("active", "deactivated", "reactivate")
        if active
        else ("deactivated", "active", "deactivate")
    )
    if body["status"] == target:
        return
    if body["status"] != source:
        raise ImageInvalid(f"Not allowed to {verb} image in status '{body['status']}'")
    body["status"] = target
    _save(cloud, body)


# -- listing ----------------------------------------------------------------------------------

SORT_KEYS = (
    "name",
    "status",
    "container_format",
    "disk_format",
    "size",
    "id",
    "created_at",
    "updated_at",
)


def _in_values(raw: str) -> list[str]:
    """`in:a,b` or `in:"a,b",c` as a list; anything else as one value (an optional `eq:`)."""
    if raw.startswith("eq:"):
        return [raw[3:]]
    if not raw.startswith("in:"):
        return [raw]
    values: list[str] = []
    current, quoted = "", False
    for char in raw[3:]:
        if char == '"':
            quoted = not quoted
        elif char == "," and not quoted:
            values.append(current)
            current = ""
        else:
            current += char
    values.append(current)
    return values


def _matches(body: Mapping[str, Any], query: ImageQuery) -> bool:
    for key, raw in query.filters.items():
        if key == "size_min":
            if body.get("size") is None or body["size"] < int(raw):
                return False
            continue
        if key == "size_max":
            if body.get("size") is None or body["size"] > int(raw):
                return False
            continue
        value = body.get(key)
        if isinstance(value, bool):
            value = "true" if value else "false"
        if value is None or str(value) not in _in_values(raw):
            return False
    tags = set(body.get("tags") or [])
    return all(tag in tags for tag in query.tags)


def _listed(
    body: Mapping[str, Any], caller: Caller, visibility: str | None, member_status: str
) -> bool:
    """Glance's default list: public, the caller's own, shared ones whose membership has
    `member_status` (accepted unless asked), but others' community only on request."""
    mine = body.get("owner") == caller.project_id
    kind = body.get("visibility")
    membership = _member_status(body, caller)
    shared = membership is not None and member_status in (membership, "all")
    if visibility is None:
        return caller.is_admin or kind == "public" or mine or shared
    if visibility == "shared":
        return kind == "shared" and (caller.is_admin or mine or shared)
    if visibility == "all":
        return _visible(body, caller)
    return kind == visibility and (caller.is_admin or kind in ("public", "community") or mine)


def _sort_key(key: str) -> Callable[[Document], tuple[int, Any]]:
    """Sort by `key` with missing values first, as a database sorts NULLs; the timestamps
    sort by the store's own clock, finer than the seconds glance shows."""

    def value(doc: Document) -> tuple[int, Any]:
        if key in ("created_at", "updated_at"):
            return (1, getattr(doc, key))
        found = doc.body.get(key)
        return (0, "") if found is None else (1, found)

    return value


def list_images(
    cloud: Cloud, caller: Caller, query: ImageQuery
) -> tuple[list[dict[str, Any]], bool]:
    """One page of the images the caller may list, and whether a next page may follow."""
    filters = dict(query.filters)
    visibility = filters.pop("visibility", None)
    if visibility is not None and visibility not in (*VISIBILITIES, "all"):
        raise ImageInvalid(f"Invalid visibility value: {visibility}")
    hidden = filters.pop("os_hidden", "false").lower() in ("true", "1", "yes")
    member_status = filters.pop("member_status", "accepted")
    if member_status not in (*MEMBER_STATUSES, "all"):
        raise ImageInvalid(f"Invalid status value: {member_status}")
    filtered = ImageQuery(filters, query.tags, query.sort, query.limit, query.marker)
    docs = [
        doc
        for doc in cloud.objects.list("image")
        if _listed(doc.body, caller, visibility, member_status)
        and bool(doc.body.get("os_hidden")) == hidden
        and _matches(doc.body, filtered)
    ]
    for key, direction in reversed([*query.sort, ("id", "asc")]):
        docs.sort(key=_sort_key(key), reverse=direction == "desc")
    images = [doc.body for doc in docs]
    if query.marker is not None:
        index = next((i for i, b in enumerate(images) if b["id"] == query.marker), None)
        if index is None:
            marker = find_image(cloud, query.marker)
            if marker is None or not _visible(marker, caller):
                raise ImageInvalid(f"Invalid marker. Image {query.marker} could not be found.")
            raise ImageInvalid(f"Invalid marker {query.marker}: not in this listing.")
        images = images[index + 1 :]
    page = images[: query.limit]
    return page, len(page) == query.limit and query.limit > 0


# -- members ----------------------------------------------------------------------------------


def member_view(image_id: str, member_id: str, member: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "image_id": image_id,
        "member_id": member_id,
        "status": member["status"],
        "created_at": member["created_at"],
        "updated_at": member["updated_at"],
        "schema": "/v2/schemas/member",
    }


def _shared(cloud: Cloud, caller: Caller, image_id: str) -> dict[str, Any]:
    body = _load(cloud, caller, image_id)
    if body.get("visibility") != "shared":
        raise ImageForbidden(
            f"Only shared images have members. Image {image_id} is {body.get('visibility')}."
        )
    return body


def list_members(cloud: Cloud, caller: Caller, image_id: str) -> list[dict[str, Any]]:
    """The owner (or an admin) sees every member; a member sees its own membership."""
    body = _shared(cloud, caller, image_id)
    members = dict(body.get(MEMBERS) or {})
    if not _may_change(body, caller):
        members = {k: v for k, v in members.items() if k == caller.project_id}
    return [member_view(image_id, k, v) for k, v in sorted(members.items())]


def get_member(cloud: Cloud, caller: Caller, image_id: str, member_id: str) -> dict[str, Any]:
    body = _shared(cloud, caller, image_id)
    member = (body.get(MEMBERS) or {}).get(member_id)
    if member is None or not (_may_change(body, caller) or member_id == caller.project_id):
        raise ImageNotFound(f"{member_id} is not a member of image {image_id}")
    return member_view(image_id, member_id, member)


def add_member(cloud: Cloud, caller: Caller, image_id: str, member_id: Any) -> dict[str, Any]:
    if not isinstance(member_id, str) or not member_id or len(member_id) > 255:
        raise ImageInvalid("Invalid input for field member: a project id (1-255 characters)")
    body = _shared(cloud, caller, image_id)
    if not _may_change(body, caller):
        raise ImageForbidden("You are not permitted to add members to this image.")
    members = dict(body.get(MEMBERS) or {})
    if member_id in members:
        raise ImageConflict(f"Member {member_id} already exists for image {image_id}.")
    now = _iso(cloud.clock())
    members[member_id] = {"status": "pending", "created_at": now, "updated_at": now}
    body[MEMBERS] = members
    _save(cloud, body)
    return member_view(image_id, member_id, members[member_id])


def set_member_status(
    cloud: Cloud, caller: Caller, image_id: str, member_id: str, status: Any
) -> dict[str, Any]:
    """Only the member itself accepts, rejects or defers a shared image (Glance's rule)."""
    if status not in MEMBER_STATUSES:
        raise ImageInvalid(f"Invalid status {status!r}: one of {', '.join(MEMBER_STATUSES)}")
    body = _shared(cloud, caller, image_id)
    members = dict(body.get(MEMBERS) or {})
    if member_id not in members:
        raise ImageNotFound(f"{member_id} is not a member of image {image_id}")
    if member_id != caller.project_id:
        raise ImageForbidden("Only the member itself may change its membership status.")
    members[member_id] = {**members[member_id], "status": status, "updated_at": _iso(cloud.clock())}
    body[MEMBERS] = members
    _save(cloud, body)
    return member_view(image_id, member_id, members[member_id])


def remove_member(cloud: Cloud, caller: Caller, image_id: str, member_id: str) -> None:
    body = _shared(cloud, caller, image_id)
    if not _may_change(body, caller):
        raise ImageForbidden("You are not permitted to remove members of this image.")
    members = dict(body.get(MEMBERS) or {})
    if members.pop(member_id, None) is None:
        raise ImageNotFound(f"{member_id} is not a member of image {image_id}")
    body[MEMBERS] = members
    _save(cloud, body)


# -- data -------------------------------------------------------------------------------------


class Upload:
    """Image data on its way in: a temporary file and running hashes, then commit or abort."""

    def __init__(self, cloud: Cloud, image_id: str) -> None:
        self.cloud = cloud
        self.image_id = image_id
        self.tmp = images_dir(cloud) / f".{image_id}.{uuid.uuid4().hex}.part"
        fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        self._file: BinaryIO | None = os.fdopen(fd, "wb")
        self._md5 = hashlib.md5(usedforsecurity=False)
        self._hash = hashlib.new(HASH_ALGO)
        self._head = bytearray()
        self.size = 0
        self.done = False

    def write(self, chunk: bytes) -> None:
        assert self._file is not None, "write after commit or abort"
        if self.size + len(chunk) > SIZE_MAX_BYTES:
            raise ImageError(
                f"Image exceeds the storage quota: more than {SIZE_MAX_BYTES} bytes", status=413
            )
        self._file.write(chunk)
        self._md5.update(chunk)
        self._hash.update(chunk)
        if len(self._head) < 512:
            self._head.extend(chunk[: 512 - len(self._head)])
        self.size += len(chunk)

    def commit(self) -> dict[str, Any]:
        """Move the data into place and make the image active; 410 if it was deleted meanwhile."""
        assert self._file is not None, "commit after commit or abort"
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        final = image_file(self.cloud, self.image_id)
        gone = ImageError(
            f"Image {self.image_id} could not be found after upload: it was deleted during "
            "the upload.",
            status=410,
        )
        try:
            os.replace(self.tmp, final)
            body = find_image(self.cloud, self.image_id)
            if body is None:
                final.unlink(missing_ok=True)
                raise gone
            body.update(
                status="active",
                size=self.size,
                checksum=self._md5.hexdigest(),
                os_hash_algo=HASH_ALGO,
                os_hash_value=self._hash.hexdigest(),
                virtual_size=_virtual_size(bytes(self._head), body.get("disk_format"), self.size),
            )
            try:
                return _save(self.cloud, body)
            except NotFound:
                final.unlink(missing_ok=True)
                raise gone from None
        finally:
            self.tmp.unlink(missing_ok=True)
            self._finish()

    def abort(self) -> None:
        """Drop the partial data and put the image back to queued."""
        if self._file is not None:
            self._file.close()
            self._file = None
        self.tmp.unlink(missing_ok=True)
        try:
            body = find_image(self.cloud, self.image_id)
            if body is not None and body.get("status") == "saving":
                body["status"] = "queued"
                _save(self.cloud, body)
        finally:
            self._finish()

    def _finish(self) -> None:
        if not self.done:
            self.done = True
            with _uploads_lock:
                _uploads.discard(self.image_id)


def begin_upload(cloud: Cloud, caller: Caller, image_id: str) -> Upload:
    """Start taking data for a queued image: it is `saving` until commit or abort."""
    body = _load_to_change(cloud, caller, image_id, "upload data for this image")
    with _uploads_lock:
        if image_id in _uploads or body["status"] != "queued":
            raise ImageConflict(
                f"Image status transition from {body['status']} to saving is not allowed"
            )
        _uploads.add(image_id)
    try:
        body["status"] = "saving"
        _save(cloud, body)
        return Upload(cloud, image_id)
    except BaseException:
        with _uploads_lock:
            _uploads.discard(image_id)
        raise


def store_image_bytes(
    cloud: Cloud, caller: Caller, image_id: str, chunks: Iterable[bytes]
) -> dict[str, Any]:
    """Upload data synchronously (snapshots and bootstrap use this); all or nothing."""
    upload = begin_upload(cloud, caller, image_id)
    try:
        for chunk in chunks:
            upload.write(chunk)
    except BaseException:
        upload.abort()
        raise
    return upload.commit()


def data_of(cloud: Cloud, caller: Caller, image_id: str) -> tuple[dict[str, Any], Path | None]:
    """An image and the path of its data (None when it has none yet)."""
    body = _load(cloud, caller, image_id)
    if body["status"] == "deactivated" and not caller.is_admin:
        raise ImageForbidden(
            "The requested image has been deactivated. Image data download is forbidden."
        )
    path = image_file(cloud, image_id)
    if body["status"] not in ("active", "deactivated") or not path.exists():
        return body, None
    return body, path


def _virtual_size(head: bytes, disk_format: str | None, size: int) -> int | None:
    """What glance's format inspector reports: the qcow2 header's size, or a raw file's size."""
    if head[:4] == b"QFI\xfb" and len(head) >= 32:
        return int(struct.unpack(">Q", head[24:32])[0])
    if disk_format in ("raw", "iso"):
        return size
    return None


# -- bootstrap --------------------------------------------------------------------------------


def _tiny_qcow2(virtual_size: int) -> bytes:
    """A valid, empty qcow2 v2 image: header, refcount table and block, L1 table (16 KiB)."""
    cluster_bits = 12
    cluster = 1 << cluster_bits
    l2_span = cluster * (cluster // 8)
    l1_size = -(-virtual_size // l2_span)
    header = struct.pack(
        ">4sIQIIQIIQQIIQ",
        b"QFI\xfb",
        2,  # version
        0,  # backing file offset
        0,  # backing file size
        cluster_bits,
        virtual_size,
        0,  # no encryption
        l1_size,
        3 * cluster,  # L1 table offset
        1 * cluster,  # refcount table offset
        1,  # refcount table clusters
        0,  # snapshots
        0,  # snapshots offset
    )
    refcount_table = struct.pack(">Q", 2 * cluster)
    refcount_block = struct.pack(">4H", 1, 1, 1, 1)
    l1_table = bytes(8 * l1_size)
    return b"".join(
        part.ljust(cluster, b"\0") for part in (header, refcount_table, refcount_block, l1_table)
    )


def bootstrap_images(cloud: Cloud, owner: str) -> None:
    """The small public cirros image a fresh cloud starts with; nothing if it is already there."""
    for doc in cloud.objects.list("image"):
        if doc.body.get("name") == CIRROS_NAME and doc.body.get("status") == "active":
            return
    admin = SystemCaller(owner)
    body = create_image(
        cloud,
        admin,
        {
            "name": CIRROS_NAME,
            "visibility": "public",
            "disk_format": "qcow2",
            "container_format": "bare",
            "hw_rng_model": "virtio",
        },
    )
    store_image_bytes(cloud, admin, body["id"], [_tiny_qcow2(112 * 1024 * 1024)])
