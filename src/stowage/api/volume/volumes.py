"""Block storage v3: volumes (create, list with filters, show, update, delete, metadata) and
their actions (extend, the attach flow's legacy actions, bootable, status resets)."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from stowage.api.auth import cloud_of
from stowage.api.common import ApiError, Context, json_body, parse_limit
from stowage.api.responses import JSONResponse
from stowage.api.volume.metadata import check_metadata
from stowage.api.volume.microversion import vmv
from stowage.api.volume.views import context, mapped, volume_view, writer
from stowage.domain.errors import StowageError
from stowage.ledger.objects import Document
from stowage.services.cloud import Cloud
from stowage.services.volumes import attach as attach_service
from stowage.services.volumes import volumes as service

__all__ = ["VOLUME_FILTERS", "offset_of", "router", "settle", "sort_of"]

router = APIRouter()

_CREATE_FIELDS = {
    "size",
    "name",
    "description",
    "volume_type",
    "availability_zone",
    "snapshot_id",
    "source_volid",
    "imageRef",
    "image_id",
    "metadata",
    "multiattach",
    "backup_id",
    "consistencygroup_id",
    "group_id",
    "display_name",
    "display_description",
    "scheduler_hints",
}
VOLUME_FILTERS = {
    "name",
    "status",
    "metadata",
    "bootable",
    "availability_zone",
    "project_id",
    "volume_type",
    "size",
    "name~",
    "description~",
}
# Actions Cinder has that this cloud cannot carry out honestly: refused (501), never dropped.
_NOT_IMPLEMENTED = {
    "os-retype": "Retyping volumes",
    "os-migrate_volume": "Volume migration",
    "os-migrate_volume_completion": "Volume migration",
    "os-volume_upload_image": "Uploading a volume to an image",
    "revert": "Reverting a volume to a snapshot",
    "os-reimage": "Re-imaging a volume",
    "os-extend_volume_completion": "Extend completion callbacks",
    "os-enable_replication": "Replication",
    "os-disable_replication": "Replication",
    "os-failover_replication": "Replication",
    "os-list_replication_targets": "Replication",
}


def settle(cloud: Cloud, kind: str, doc_id: str) -> None:
    """Drive the intent in the volume workers; wait for it up to the cloud's api_wait_s (0 by
    default: Cinder answers 202 with the transitional status and clients poll)."""
    future = service.submit(cloud, kind, doc_id)
    if cloud.config.api_wait_s > 0:
        import concurrent.futures
        import contextlib

        with contextlib.suppress(concurrent.futures.TimeoutError):
            future.result(timeout=cloud.config.api_wait_s)


def _member(payload: Any, key: str) -> dict[str, Any]:
    if not isinstance(payload, dict) or not isinstance(payload.get(key), dict):
        raise ApiError(400, f"Missing required element '{key}' in request body.")
    found: dict[str, Any] = payload[key]
    return found


def _text(value: Any, field: str, limit: int = 255) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > limit:
        raise ApiError(
            400, f"Invalid input for field/attribute {field}: a string of at most {limit}"
        )
    return value


def _load(request: Request, ctx: Context, volume_id: str) -> Document:
    try:
        return service.get_volume(cloud_of(request), ctx, volume_id)
    except StowageError as exc:
        raise mapped(exc) from None


@router.post("/volumes")
async def create_volume(request: Request, project_id: str) -> JSONResponse:
    ctx = writer(request, project_id, "volume:create")
    cloud = cloud_of(request)
    volume = _member(await json_body(request), "volume")
    unknown = sorted(set(volume) - _CREATE_FIELDS)
    if unknown:
        raise ApiError(
            400, f"Invalid input for field/attribute volume: additional properties {unknown}"
        )
    for key in ("consistencygroup_id", "group_id"):
        if volume.get(key):
            raise ApiError(400, f"Invalid input received: {key}: groups are not available")
    wanted = {
        "size": volume.get("size"),
        "name": _text(volume.get("name", volume.get("display_name")), "name"),
        "description": _text(
            volume.get("description", volume.get("display_description")), "description", 65535
        ),
        "volume_type": volume.get("volume_type"),
        "availability_zone": volume.get("availability_zone"),
        "snapshot_id": volume.get("snapshot_id"),
        "source_volid": volume.get("source_volid"),
        "imageRef": volume.get("imageRef") or volume.get("image_id"),
        "backup_id": volume.get("backup_id"),
        "metadata": check_metadata(volume.get("metadata")),
        "multiattach": volume.get("multiattach") is True,
    }
    try:
        doc = service.create_volume(cloud, ctx, wanted)
    except StowageError as exc:
        raise mapped(exc) from None
    if doc.body["status"] == "creating":
        settle(cloud, "volume", doc.id)
    shown = cloud.objects.find("volume", doc.id) or doc
    return JSONResponse({"volume": volume_view(request, ctx, shown, changed=True)}, status_code=202)


def _filters(request: Request, ctx: Context) -> dict[str, Any]:
    query = request.query_params
    skip = {
        "all_tenants",
        "sort",
        "sort_key",
        "sort_dir",
        "limit",
        "marker",
        "with_count",
        "offset",
        "is_public",
    }
    filters: dict[str, Any] = {}
    for key, value in query.items():
        if key in skip:
            continue
        if key not in VOLUME_FILTERS:
            raise ApiError(400, f"Invalid filters {key} are found in query options.")
        if key == "metadata":
            try:
                parsed = json.loads(value.replace("'", '"'))
            except ValueError:
                raise ApiError(400, f"Invalid input received: metadata filter {value}") from None
            if not isinstance(parsed, dict):
                raise ApiError(400, f"Invalid input received: metadata filter {value}")
            filters[key] = parsed
        else:
            filters[key] = value
    return filters


def sort_of(request: Request) -> list[tuple[str, str]] | None:
    query = request.query_params
    if query.get("sort"):
        out = []
        for part in query["sort"].split(","):
            key, _, direction = part.strip().partition(":")
            out.append((key, direction or "desc"))
        return out
    if query.get("sort_key"):
        return [(query["sort_key"], query.get("sort_dir", "desc"))]
    return None


def offset_of(request: Request) -> int:
    """The `offset` of a list (Cinder's, beside marker and limit): 400 unless 0 or more."""
    given = request.query_params.get("offset")
    if given is None:
        return 0
    try:
        offset = int(given)
    except ValueError:
        offset = -1
    if offset < 0:
        raise ApiError(400, f"Invalid input received: offset {given!r} is not 0 or more")
    return offset


def _list(request: Request, project_id: str, *, detail: bool) -> JSONResponse:
    ctx = context(request, project_id)
    cloud = cloud_of(request)
    all_projects = request.query_params.get("all_tenants", "").lower() in ("1", "true", "yes")
    limit = parse_limit(request.query_params.get("limit"), maximum=1000)
    try:
        docs = service.list_docs(
            cloud,
            ctx,
            "volume",
            filters=_filters(request, ctx),
            all_projects=all_projects,
            sort=sort_of(request),
            limit=None,
            marker=request.query_params.get("marker"),
            offset=offset_of(request),
        )
    except StowageError as exc:
        raise mapped(exc) from None
    page = docs if limit is None else docs[:limit]
    body: dict[str, Any] = {
        "volumes": [volume_view(request, ctx, d, brief=not detail) for d in page]
    }
    # A full page links to the next, even if that one is empty (Cinder's, which Tempest
    # pins down).
    if limit is not None and len(page) == limit and page:
        base = cloud.config.base_url
        suffix = "/detail" if detail else ""
        body["volumes_links"] = [
            {
                "rel": "next",
                "href": f"{base}/volume/v3/{project_id}/volumes{suffix}?limit={limit}"
                f"&marker={page[-1].id}",
            }
        ]
    if vmv(request) >= (3, 45) and request.query_params.get("with_count", "").lower() in (
        "true",
        "1",
    ):
        body["count"] = len(docs)
    return JSONResponse(body)


@router.get("/volumes")
async def list_volumes(request: Request, project_id: str) -> JSONResponse:
    return _list(request, project_id, detail=False)


@router.get("/volumes/detail")
async def list_volumes_detail(request: Request, project_id: str) -> JSONResponse:
    return _list(request, project_id, detail=True)


@router.get("/volumes/summary")
async def volumes_summary(request: Request, project_id: str) -> JSONResponse:
    ctx = context(request, project_id)
    docs = service.list_docs(cloud_of(request), ctx, "volume", filters={})
    summary: dict[str, Any] = {
        "total_size": sum(int(d.body["size"]) for d in docs),
        "total_count": len(docs),
    }
    if vmv(request) >= (3, 36):
        keys: dict[str, set[str]] = {}
        for d in docs:
            for k, v in (d.body.get("metadata") or {}).items():
                keys.setdefault(k, set()).add(v)
        summary["metadata"] = {k: sorted(v) for k, v in keys.items()}
    return JSONResponse({"volume-summary": summary})


@router.get("/volumes/{volume_id}")
async def show_volume(request: Request, project_id: str, volume_id: str) -> JSONResponse:
    ctx = context(request, project_id)
    return JSONResponse({"volume": volume_view(request, ctx, _load(request, ctx, volume_id))})


@router.put("/volumes/{volume_id}")
async def update_volume(request: Request, project_id: str, volume_id: str) -> JSONResponse:
    ctx = writer(request, project_id, "volume:update")
    volume = _member(await json_body(request), "volume")
    allowed = {"name", "description", "metadata", "display_name", "display_description"}
    unknown = sorted(set(volume) - allowed)
    if unknown or not volume:
        raise ApiError(400, f"Invalid input for field/attribute volume: {unknown or 'empty'}")
    changes: dict[str, Any] = {}
    if "name" in volume or "display_name" in volume:
        changes["name"] = _text(volume.get("name", volume.get("display_name")), "name")
    if "description" in volume or "display_description" in volume:
        changes["description"] = _text(
            volume.get("description", volume.get("display_description")), "description", 65535
        )
    if "metadata" in volume:
        changes["metadata"] = check_metadata(volume["metadata"])
    try:
        doc = service.update_volume(cloud_of(request), ctx, volume_id, changes)
    except StowageError as exc:
        raise mapped(exc) from None
    return JSONResponse({"volume": volume_view(request, ctx, doc, changed=True)})


@router.delete("/volumes/{volume_id}")
async def delete_volume(request: Request, project_id: str, volume_id: str) -> Response:
    ctx = writer(request, project_id, "volume:delete")
    cloud = cloud_of(request)
    query = request.query_params
    cascade = query.get("cascade", "").lower() in ("true", "1")
    force = query.get("force", "").lower() in ("true", "1")
    if force and not ctx.is_admin:
        raise ApiError(403, "Policy doesn't allow volume:force_delete to be performed.")
    _load(request, ctx, volume_id)
    try:
        service.delete_volume(cloud, ctx, volume_id, cascade=cascade, force=force)
    except StowageError as exc:
        raise mapped(exc) from None
    for snap in cloud.objects.list("volume_snapshot"):
        if snap.body.get("volume_id") == volume_id and snap.body["status"] == "deleting":
            settle(cloud, "volume_snapshot", snap.id)
    settle(cloud, "volume", volume_id)
    return Response(status_code=202)


# -- actions ----------------------------------------------------------------------------------

_ADMIN_ACTIONS = {"os-reset_status", "os-force_delete", "os-force_detach"}


@router.post("/volumes/{volume_id}/action")
async def volume_action(request: Request, project_id: str, volume_id: str) -> Response:
    ctx = writer(request, project_id, "volume:action")
    cloud = cloud_of(request)
    payload = await json_body(request)
    if not isinstance(payload, dict) or len(payload) != 1:
        raise ApiError(400, "Invalid request body: the body must name exactly one action")
    action, args = next(iter(payload.items()))
    args = args if isinstance(args, dict) else {}
    if action in _ADMIN_ACTIONS and not ctx.is_admin:
        raise ApiError(403, f"Policy doesn't allow volume_extension:{action} to be performed.")
    _load(request, ctx, volume_id)
    if action in _NOT_IMPLEMENTED:
        raise ApiError(501, f"{_NOT_IMPLEMENTED[action]} is not supported by this cloud.")
    try:
        return _act(request, ctx, cloud, volume_id, action, args)
    except StowageError as exc:
        raise mapped(exc) from None


def _act(
    request: Request, ctx: Context, cloud: Cloud, volume_id: str, action: str, args: dict[str, Any]
) -> Response:
    if action == "os-extend":
        if "new_size" not in args:
            raise ApiError(400, "Invalid input for field/attribute os-extend: new_size required")
        service.extend_volume(cloud, ctx, volume_id, args["new_size"])
        settle(cloud, "volume", volume_id)
        return Response(status_code=202)
    if action == "os-reserve":
        attach_service.reserve(cloud, ctx, volume_id)
    elif action == "os-unreserve":
        attach_service.unreserve(cloud, ctx, volume_id)
    elif action == "os-attach":
        attach_service.attach(cloud, ctx, volume_id, args)
    elif action == "os-begin_detaching":
        attach_service.begin_detaching(cloud, ctx, volume_id)
    elif action == "os-roll_detaching":
        attach_service.roll_detaching(cloud, ctx, volume_id)
    elif action in ("os-detach", "os-force_detach"):
        attach_service.detach(cloud, ctx, volume_id, args.get("attachment_id"))
    elif action == "os-initialize_connection":
        info = attach_service.connection_info(cloud, ctx, volume_id, args.get("connector"))
        return JSONResponse({"connection_info": info})
    elif action == "os-terminate_connection":
        if not isinstance(args.get("connector"), dict):
            raise ApiError(400, "Invalid input received: connector is required")
    elif action == "os-set_bootable":
        bootable = _boolean(args.get("bootable"), "bootable")
        service.change_volume(cloud, volume_id, None, lambda b: {**b, "bootable": bootable})
        return Response(status_code=200)
    elif action == "os-update_readonly_flag":
        readonly = _boolean(args.get("readonly"), "readonly")

        def flag(body: dict[str, Any]) -> dict[str, Any]:
            body["metadata"] = {**(body.get("metadata") or {}), "readonly": str(readonly)}
            return body

        service.change_volume(cloud, volume_id, None, flag)
    elif action == "os-reset_status":
        return _reset_status(cloud, volume_id, args)
    elif action == "os-force_delete":
        service.delete_volume(cloud, ctx, volume_id, force=True)
        settle(cloud, "volume", volume_id)
    elif action in ("os-set_image_metadata", "os-unset_image_metadata", "os-show_image_metadata"):
        return _image_metadata(cloud, volume_id, action, args)
    else:
        raise ApiError(400, f"There is no such action: {action}")
    return Response(status_code=202)


def _boolean(value: Any, field: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.lower() in ("true", "1", "yes")
    raise ApiError(400, f"Invalid input for field/attribute {field}: {value!r} is not a boolean")


_STATUSES = {
    "available",
    "error",
    "in-use",
    "creating",
    "deleting",
    "attaching",
    "detaching",
    "reserved",
    "error_deleting",
    "error_extending",
    "maintenance",
}


def _reset_status(cloud: Cloud, volume_id: str, args: dict[str, Any]) -> Response:
    status = args.get("status")
    if status not in _STATUSES:
        raise ApiError(400, f"Invalid input received: Must specify a valid status ({status})")
    service.change_volume(cloud, volume_id, None, lambda b: {**b, "status": status})
    return Response(status_code=202)


def _image_metadata(cloud: Cloud, volume_id: str, action: str, args: dict[str, Any]) -> Response:
    if action == "os-show_image_metadata":
        doc = cloud.objects.get("volume", volume_id)
        return JSONResponse({"metadata": doc.body.get("volume_image_metadata") or {}})
    if action == "os-set_image_metadata":
        given = check_metadata(args.get("metadata"))

        def put(body: dict[str, Any]) -> dict[str, Any]:
            body["volume_image_metadata"] = {**(body.get("volume_image_metadata") or {}), **given}
            return body

        body = service.change_volume(cloud, volume_id, None, put)
        return JSONResponse({"metadata": body["volume_image_metadata"]})
    key = args.get("key")
    doc = cloud.objects.get("volume", volume_id)
    if key not in (doc.body.get("volume_image_metadata") or {}):
        raise ApiError(404, f"Glance metadata for volume {volume_id} with key {key} not found")

    def drop(body: dict[str, Any]) -> dict[str, Any]:
        body["volume_image_metadata"] = {
            k: v for k, v in (body.get("volume_image_metadata") or {}).items() if k != key
        }
        return body

    service.change_volume(cloud, volume_id, None, drop)
    return Response(status_code=200)
