"""Compute v2.1: Nova's volume proxy (/os-volumes, /os-snapshots), which 2.36 removed.

The volumes and snapshots are the block storage service's: each call here is the one the
volume API makes (the same service functions, the same reader/writer rule), rendered the way
Nova's proxy rendered Cinder's answers (`displayName`, `availabilityZone`, attachments with
`serverId`, snapshot `volumeId`).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from stowage.api.auth import cloud_of, require_context
from stowage.api.common import ApiError, Context, json_body
from stowage.api.compute.microversion import mv
from stowage.api.responses import JSONResponse
from stowage.api.volume.metadata import check_metadata
from stowage.api.volume.views import iso
from stowage.api.volume.volumes import settle
from stowage.domain.errors import NotFound, QuotaExceeded, StowageError
from stowage.ledger.objects import Document
from stowage.services.volumes import VolumeQuotaExceeded
from stowage.services.volumes import volumes as service

__all__ = ["router"]

router = APIRouter()

_MAX_LIMIT = 1000  # Nova's osapi_max_limit
_VOLUME_FIELDS = {
    "size",
    "display_name",
    "display_description",
    "volume_type",
    "metadata",
    "availability_zone",
    "snapshot_id",
}
_SNAPSHOT_FIELDS = {"volume_id", "force", "display_name", "display_description"}


def _proxied(request: Request, rule: str, *, write: bool = False) -> Context:
    """The caller, if this microversion has the proxy (to 2.35) and, for a change, the caller
    may write: the volume API refuses a reader's create or delete, so its proxy does too."""
    ctx = require_context(request)
    if mv(request) >= (2, 36):
        raise ApiError(404, "The resource could not be found.")
    if write and not ctx.can_write:
        raise ApiError(403, f"Policy doesn't allow os_compute_api:{rule} to be performed.")
    return ctx


def _failed(exc: StowageError) -> ApiError:
    """The block storage service's refusal as Nova's proxy answered Cinder's: 404 for what is
    not found, 403 over quota (Nova's OverQuota), 400 for the rest (Cinder's 400s, which Nova
    passes on as invalid input)."""
    if isinstance(exc, NotFound):
        return ApiError(404, exc.message)
    if isinstance(exc, VolumeQuotaExceeded | QuotaExceeded):
        return ApiError(403, exc.message)
    return ApiError(400, exc.message)


def _volume_view(doc: Document) -> dict[str, Any]:
    body = doc.body
    attached = [
        {
            "id": doc.id,
            "volumeId": doc.id,
            "serverId": a.get("instance"),
            **({"device": a["mountpoint"]} if a.get("mountpoint") else {}),
        }
        for a in (body.get("attachments") or {}).values()
        if a.get("status") == "attached"
    ]
    return {
        "id": doc.id,
        "status": body["status"],
        "size": body["size"],
        "availabilityZone": body.get("availability_zone", "nova"),
        "createdAt": iso(doc.created_at),
        # Nova's proxy shows one empty attachment for a volume attached nowhere.
        "attachments": attached or [{}],
        "displayName": body.get("name"),
        "displayDescription": body.get("description"),
        "volumeType": body.get("volume_type"),
        "snapshotId": body.get("snapshot_id"),
        "metadata": body.get("metadata") or {},
    }


def _snapshot_view(doc: Document) -> dict[str, Any]:
    body = doc.body
    return {
        "id": doc.id,
        "volumeId": body["volume_id"],
        "status": body["status"],
        "size": body["size"],
        "createdAt": iso(doc.created_at),
        "displayName": body.get("name"),
        "displayDescription": body.get("description"),
    }


def _int_param(request: Request, name: str) -> int | None:
    raw = request.query_params.get(name)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ApiError(400, f"Invalid input for query parameters {name}. Value: {raw}.")
    return value


def _limited(request: Request, docs: list[Document]) -> list[Document]:
    """Nova's `common.limited`: `offset` skipped, then at most `limit` (capped at 1,000)."""
    offset = _int_param(request, "offset") or 0
    limit = _int_param(request, "limit")
    limit = _MAX_LIMIT if limit is None else min(limit, _MAX_LIMIT)
    return docs[offset : offset + limit]


def _body(payload: Any, key: str, allowed: set[str], required: str) -> dict[str, Any]:
    """Nova's schema for the proxy's creates: one object under `key`, no other property,
    the required one present."""
    if not isinstance(payload, dict) or set(payload) != {key} or not isinstance(payload[key], dict):
        raise ApiError(400, f"Invalid input for field/attribute {key}: an object is required.")
    given: dict[str, Any] = payload[key]
    unknown = sorted(set(given) - allowed)
    if unknown:
        raise ApiError(
            400,
            f"Invalid input for field/attribute {key}. Value: {given}. Additional properties "
            f"are not allowed ({', '.join(repr(u) for u in unknown)} were unexpected)",
        )
    if required not in given:
        raise ApiError(400, f"Invalid input for field/attribute {key}: '{required}' is required")
    for field in allowed - {"metadata", "size", "force"}:
        if field in given and not isinstance(given[field], str):
            raise ApiError(400, f"Invalid input for field/attribute {field}: not a string")
    return given


# -- volumes ----------------------------------------------------------------------------------


def _list_volumes(request: Request) -> JSONResponse:
    ctx = _proxied(request, "os-volumes:list")
    try:
        docs = service.list_docs(cloud_of(request), ctx, "volume", filters={})
    except StowageError as exc:
        raise _failed(exc) from None
    return JSONResponse({"volumes": [_volume_view(d) for d in _limited(request, docs)]})


@router.get("/os-volumes")
async def list_volumes(request: Request) -> JSONResponse:
    return _list_volumes(request)


@router.get("/os-volumes/detail")
async def list_volumes_detail(request: Request) -> JSONResponse:
    return _list_volumes(request)


@router.get("/os-volumes/{volume_id}")
async def show_volume(request: Request, volume_id: str) -> JSONResponse:
    ctx = _proxied(request, "os-volumes:show")
    try:
        doc = service.get_volume(cloud_of(request), ctx, volume_id)
    except StowageError as exc:
        raise _failed(exc) from None
    return JSONResponse({"volume": _volume_view(doc)})


@router.post("/os-volumes")
async def create_volume(request: Request) -> JSONResponse:
    ctx = _proxied(request, "os-volumes:create", write=True)
    cloud = cloud_of(request)
    given = _body(await json_body(request), "volume", _VOLUME_FIELDS, "size")
    size = given["size"]
    if isinstance(size, bool) or not isinstance(size, int | str) or not str(size).isdigit():
        raise ApiError(400, f"Invalid input for field/attribute size. Value: {size}.")
    if int(size) < 1:
        raise ApiError(400, f"Invalid input for field/attribute size. Value: {size}.")
    for field in ("display_name", "volume_type", "availability_zone", "snapshot_id"):
        if len(given.get(field) or "") > 255:
            raise ApiError(400, f"Invalid input for field/attribute {field}: at most 255 long")
    wanted = {
        "size": int(size),
        "name": given.get("display_name"),
        "description": given.get("display_description"),
        "volume_type": given.get("volume_type"),
        "availability_zone": given.get("availability_zone"),
        "snapshot_id": given.get("snapshot_id"),
        "metadata": check_metadata(given.get("metadata")),
    }
    try:
        doc = service.create_volume(cloud, ctx, wanted)
    except StowageError as exc:
        raise _failed(exc) from None
    if doc.body["status"] == "creating":
        settle(cloud, "volume", doc.id)
    shown = cloud.objects.find("volume", doc.id) or doc
    location = f"{cloud.config.base_url}/compute/v2.1/os-volumes/{doc.id}"
    return JSONResponse({"volume": _volume_view(shown)}, headers={"Location": location})


@router.delete("/os-volumes/{volume_id}")
async def delete_volume(request: Request, volume_id: str) -> Response:
    ctx = _proxied(request, "os-volumes:delete", write=True)
    cloud = cloud_of(request)
    try:
        service.delete_volume(cloud, ctx, volume_id)
    except StowageError as exc:
        raise _failed(exc) from None
    settle(cloud, "volume", volume_id)
    return Response(status_code=202)


# -- snapshots --------------------------------------------------------------------------------


def _list_snapshots(request: Request) -> JSONResponse:
    ctx = _proxied(request, "os-snapshots:list")
    try:
        docs = service.list_docs(cloud_of(request), ctx, "volume_snapshot", filters={})
    except StowageError as exc:
        raise _failed(exc) from None
    return JSONResponse({"snapshots": [_snapshot_view(d) for d in _limited(request, docs)]})


@router.get("/os-snapshots")
async def list_snapshots(request: Request) -> JSONResponse:
    return _list_snapshots(request)


@router.get("/os-snapshots/detail")
async def list_snapshots_detail(request: Request) -> JSONResponse:
    return _list_snapshots(request)


@router.get("/os-snapshots/{snapshot_id}")
async def show_snapshot(request: Request, snapshot_id: str) -> JSONResponse:
    ctx = _proxied(request, "os-snapshots:show")
    try:
        doc = service.get_snapshot(cloud_of(request), ctx, snapshot_id)
    except StowageError as exc:
        raise _failed(exc) from None
    return JSONResponse({"snapshot": _snapshot_view(doc)})


_TRUE = {"true", "1", "yes", "on", "y", "t"}
_FALSE = {"false", "0", "no", "off", "n", "f"}


@router.post("/os-snapshots")
async def create_snapshot(request: Request) -> JSONResponse:
    ctx = _proxied(request, "os-snapshots:create", write=True)
    cloud = cloud_of(request)
    given = _body(await json_body(request), "snapshot", _SNAPSHOT_FIELDS, "volume_id")
    force = given.get("force", False)
    if not isinstance(force, bool):
        if str(force).lower() not in _TRUE | _FALSE:
            raise ApiError(400, f"Invalid input for field/attribute force. Value: {force}.")
        force = str(force).lower() in _TRUE
    wanted = {
        "volume_id": given["volume_id"],
        "name": given.get("display_name"),
        "description": given.get("display_description"),
        "force": force,
        "metadata": {},
    }
    try:
        doc = service.create_snapshot(cloud, ctx, wanted)
    except StowageError as exc:
        raise _failed(exc) from None
    if doc.body["status"] == "creating":
        settle(cloud, "volume_snapshot", doc.id)
    shown = cloud.objects.find("volume_snapshot", doc.id) or doc
    return JSONResponse({"snapshot": _snapshot_view(shown)})


@router.delete("/os-snapshots/{snapshot_id}")
async def delete_snapshot(request: Request, snapshot_id: str) -> Response:
    ctx = _proxied(request, "os-snapshots:delete", write=True)
    cloud = cloud_of(request)
    try:
        service.delete_snapshot(cloud, ctx, snapshot_id)
    except StowageError as exc:
        raise _failed(exc) from None
    settle(cloud, "volume_snapshot", snapshot_id)
    return Response(status_code=202)
