"""Compute v2.1: the image proxy (/images and their metadata), which 2.36 removed.

The images are the image service's; this only renders them the way Nova's proxy did
(`minRam`, `metadata`, upper-case statuses) and maps metadata calls to property changes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import Response

from stowage.api.auth import cloud_of, require_context
from stowage.api.common import ApiError, Context, json_body
from stowage.api.compute.microversion import mv
from stowage.api.responses import JSONResponse
from stowage.services import images as image_service

__all__ = ["router"]

router = APIRouter()

# The proxy's statuses and progress per glance status (nova/api/openstack/compute/views/images).
_STATUS = {
    "active": "ACTIVE",
    "queued": "SAVING",
    "saving": "SAVING",
    "importing": "SAVING",
    "uploading": "SAVING",
    "deleted": "DELETED",
    "pending_delete": "DELETED",
    "killed": "ERROR",
}
_PROGRESS = {"queued": 25, "saving": 50, "active": 100}
_METADATA_MAX = 128

T = TypeVar("T")


def _proxied(request: Request, *, write: bool = False) -> Context:
    ctx = require_context(request)
    if mv(request) >= (2, 36):
        raise ApiError(404, "The resource could not be found.")
    if write and not ctx.can_write:
        # The image service refuses a reader's change; its proxy may not make it either.
        raise ApiError(403, "Policy does not allow this action: the reader role can only read.")
    return ctx


async def _call(func: Callable[..., T], *args: Any) -> T:
    """Run an image service call; its errors become the compute API's."""
    try:
        return await asyncio.to_thread(func, *args)
    except image_service.ImageNotFound:
        raise ApiError(404, "Image not found.") from None
    except image_service.ImageError as exc:
        raise ApiError(exc.status, exc.message) from None


def _links(request: Request, image_id: str) -> list[dict[str, str]]:
    base = cloud_of(request).config.base_url
    return [
        {"rel": "self", "href": f"{base}/compute/v2.1/images/{image_id}"},
        {"rel": "bookmark", "href": f"{base}/compute/images/{image_id}"},
        {
            "rel": "alternate",
            "type": "application/vnd.openstack.image",
            "href": f"{base}/image/images/{image_id}",
        },
    ]


def _stamp(raw: Any) -> str | None:
    return str(raw) if raw else None


def _view(request: Request, body: dict[str, Any]) -> dict[str, Any]:
    status = str(body.get("status") or "")
    properties = image_service.properties_of(body)
    view: dict[str, Any] = {
        "id": body["id"],
        "name": body.get("name"),
        "minRam": int(body.get("min_ram") or 0),
        "minDisk": int(body.get("min_disk") or 0),
        "metadata": {k: str(v) for k, v in properties.items()},
        "created": _stamp(body.get("created_at")),
        "updated": _stamp(body.get("updated_at")),
        "status": _STATUS.get(status, "UNKNOWN"),
        "progress": _PROGRESS.get(status, 0),
        "links": _links(request, body["id"]),
        "OS-EXT-IMG-SIZE:size": body.get("size"),
    }
    server_id = properties.get("instance_uuid")
    if server_id:
        base = cloud_of(request).config.base_url
        view["server"] = {
            "id": server_id,
            "links": [
                {"rel": "self", "href": f"{base}/compute/v2.1/servers/{server_id}"},
                {"rel": "bookmark", "href": f"{base}/compute/servers/{server_id}"},
            ],
        }
    return view


def _brief(request: Request, body: dict[str, Any]) -> dict[str, Any]:
    return {"id": body["id"], "name": body.get("name"), "links": _links(request, body["id"])}


def _int_filter(query: Any, name: str) -> int | None:
    raw = query.get(name)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ApiError(400, f"Invalid input for query parameters {name}. Value: {raw}.") from None


def _selected(request: Request, images: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Nova's proxy filters: name, status, server, type, minRam, minDisk, changes-since."""
    query = request.query_params
    min_ram = _int_filter(query, "minRam")
    min_disk = _int_filter(query, "minDisk")
    since = query.get("changes-since")
    stamp = None
    if since:
        try:
            stamp = datetime.fromisoformat(since.replace("Z", "+00:00"))
        except ValueError:
            raise ApiError(
                400, f"Invalid input for query parameters changes-since. Value: {since}."
            ) from None
    server = (query.get("server") or "").rstrip("/").rsplit("/", 1)[-1]
    out = []
    for body in images:
        properties = image_service.properties_of(body)
        if query.get("name") and body.get("name") != query["name"]:
            continue
        if query.get("status") and _STATUS.get(body.get("status") or "") != query["status"].upper():
            continue
        if server and properties.get("instance_uuid") != server:
            continue
        kind = query.get("type")
        if kind and (properties.get("image_type") == "snapshot") != (kind == "snapshot"):
            continue
        if min_ram is not None and int(body.get("min_ram") or 0) < min_ram:
            continue
        if min_disk is not None and int(body.get("min_disk") or 0) < min_disk:
            continue
        if stamp is not None:
            updated = datetime.fromisoformat(str(body["updated_at"]).replace("Z", "+00:00"))
            if updated < stamp:
                continue
        out.append(body)
    return out


def _page(request: Request, images: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    query = request.query_params
    images = sorted(images, key=lambda b: (str(b.get("created_at") or ""), b["id"]), reverse=True)
    marker = query.get("marker")
    if marker:
        ids = [b["id"] for b in images]
        if marker not in ids:
            raise ApiError(400, f"marker [{marker}] not found")
        images = images[ids.index(marker) + 1 :]
    limit = _int_filter(query, "limit")
    body: dict[str, Any] = {}
    if limit is not None and 0 <= limit < len(images):
        images = images[:limit]
        if images:
            base = cloud_of(request).config.base_url
            body["images_links"] = [
                {
                    "rel": "next",
                    "href": f"{base}/compute/v2.1/{kind}?limit={limit}&marker={images[-1]['id']}",
                }
            ]
    body["images"] = images
    return body


def _visible_images(request: Request, ctx: Context) -> list[dict[str, Any]]:
    cloud = cloud_of(request)
    query = image_service.ImageQuery({}, [], [], limit=100000)
    images, _ = image_service.list_images(cloud, ctx, query)
    return images


async def _list(request: Request, *, detail: bool) -> JSONResponse:
    ctx = _proxied(request)
    images = await _call(_visible_images, request, ctx)
    kind = "images/detail" if detail else "images"
    body = _page(request, _selected(request, images), kind)
    render = _view if detail else _brief
    body["images"] = [render(request, b) for b in body["images"]]
    return JSONResponse(body)


@router.get("/images")
async def list_images(request: Request) -> JSONResponse:
    return await _list(request, detail=False)


@router.get("/images/detail")
async def list_images_detail(request: Request) -> JSONResponse:
    return await _list(request, detail=True)


@router.get("/images/{image_id}")
async def show_image(image_id: str, request: Request) -> JSONResponse:
    ctx = _proxied(request)
    body = await _call(image_service.get_image, cloud_of(request), ctx, image_id)
    return JSONResponse({"image": _view(request, body)})


@router.delete("/images/{image_id}")
async def delete_image(image_id: str, request: Request) -> Response:
    ctx = _proxied(request, write=True)
    await _call(image_service.delete_image, cloud_of(request), ctx, image_id)
    return Response(status_code=204)


# -- metadata: the image's custom properties --------------------------------------------------


def _metadata_of(payload: Any, key: str) -> dict[str, str]:
    value = payload.get(key) if isinstance(payload, dict) else None
    if not isinstance(value, dict):
        raise ApiError(400, f"Invalid input for field/attribute {key}: '{key}' is required")
    for name, item in value.items():
        if not isinstance(name, str) or not 1 <= len(name) <= 255:
            raise ApiError(400, "Invalid input for field/attribute metadata: bad key")
        if not isinstance(item, str) or len(item) > 255:
            raise ApiError(400, f"Invalid input for field/attribute metadata: bad value of {name}")
    return dict(value)


async def _set_properties(
    request: Request, ctx: Context, image_id: str, wanted: dict[str, str], *, replace: bool
) -> dict[str, Any]:
    cloud = cloud_of(request)
    body = await _call(image_service.get_image, cloud, ctx, image_id)
    current = image_service.properties_of(body)
    merged = dict(wanted) if replace else {**current, **wanted}
    if len(merged) > _METADATA_MAX:
        raise ApiError(403, "Quota exceeded for metadata_items: maximum 128 items")
    changes = [image_service.Change("remove", (k,)) for k in current if k not in merged]
    changes += [
        image_service.Change("replace" if k in current else "add", (k,), v)
        for k, v in merged.items()
        if current.get(k) != v
    ]
    return await _call(image_service.update_image, cloud, ctx, image_id, changes)


def _shown_metadata(body: dict[str, Any]) -> dict[str, str]:
    return {k: str(v) for k, v in image_service.properties_of(body).items()}


@router.get("/images/{image_id}/metadata")
async def list_metadata(image_id: str, request: Request) -> JSONResponse:
    ctx = _proxied(request)
    body = await _call(image_service.get_image, cloud_of(request), ctx, image_id)
    return JSONResponse({"metadata": _shown_metadata(body)})


@router.post("/images/{image_id}/metadata")
async def update_metadata(image_id: str, request: Request) -> JSONResponse:
    ctx = _proxied(request, write=True)
    wanted = _metadata_of(await json_body(request), "metadata")
    body = await _set_properties(request, ctx, image_id, wanted, replace=False)
    return JSONResponse({"metadata": _shown_metadata(body)})


@router.put("/images/{image_id}/metadata")
async def replace_metadata(image_id: str, request: Request) -> JSONResponse:
    ctx = _proxied(request, write=True)
    wanted = _metadata_of(await json_body(request), "metadata")
    body = await _set_properties(request, ctx, image_id, wanted, replace=True)
    return JSONResponse({"metadata": _shown_metadata(body)})


@router.get("/images/{image_id}/metadata/{key}")
async def show_metadata_item(image_id: str, key: str, request: Request) -> JSONResponse:
    ctx = _proxied(request)
    body = await _call(image_service.get_image, cloud_of(request), ctx, image_id)
    metadata = _shown_metadata(body)
    if key not in metadata:
        raise ApiError(404, f"Image {image_id} has no metadata item {key}.")
    return JSONResponse({"meta": {key: metadata[key]}})


@router.put("/images/{image_id}/metadata/{key}")
async def set_metadata_item(image_id: str, key: str, request: Request) -> JSONResponse:
    ctx = _proxied(request, write=True)
    wanted = _metadata_of(await json_body(request), "meta")
    if list(wanted) != [key]:
        raise ApiError(400, "Request body and URI mismatch")
    await _set_properties(request, ctx, image_id, wanted, replace=False)
    return JSONResponse({"meta": wanted})


@router.delete("/images/{image_id}/metadata/{key}")
async def delete_metadata_item(image_id: str, key: str, request: Request) -> Response:
    ctx = _proxied(request, write=True)
    body = await _call(image_service.get_image, cloud_of(request), ctx, image_id)
    if key not in image_service.properties_of(body):
        raise ApiError(404, f"Image {image_id} has no metadata item {key}.")
    changes = [image_service.Change("remove", (key,))]
    await _call(image_service.update_image, cloud_of(request), ctx, image_id, changes)
    return Response(status_code=204)


@router.delete("/images/")
async def delete_without_id(request: Request) -> Response:
    """A DELETE that names no image: Nova's router answers 404, not 405."""
    _proxied(request)
    raise ApiError(404, "The resource could not be found.")
