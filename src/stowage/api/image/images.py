"""Image v2: images, their data, tags, (de)activation and the JSON schemas clients fetch."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Coroutine
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import APIRouter, Depends, Request
from fastapi.responses import FileResponse, Response
from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect

from stowage.api.auth import cloud_of, require_context, require_writer
from stowage.api.common import ApiError, Context, json_body, on_loop, parse_limit
from stowage.api.image.schemas import image_schema, images_schema, member_schema, members_schema
from stowage.api.responses import JSONResponse
from stowage.services import images as svc

__all__ = ["LIMIT_DEFAULT", "LIMIT_MAX", "ImageRoute", "router"]

LIMIT_DEFAULT = 25
LIMIT_MAX = 1000
UPLOAD_BATCH_BYTES = 1 << 20
"""Image data is written in pieces of about this size, each in the thread pool."""
PATCH_TYPES = {
    "application/openstack-images-v2.0-json-patch": 4,
    "application/openstack-images-v2.1-json-patch": 10,
}


class ImageRoute(APIRoute):
    """Render the image service's refusals (403, 410, 413 too) in glance's error shape."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def translated(request: Request) -> Response:
            try:
                return await handler(request)
            except svc.ImageError as exc:
                raise ApiError(exc.status, exc.message) from None

        return translated


router = APIRouter(route_class=ImageRoute)
Reader = Annotated[Context, Depends(require_context)]
Writer = Annotated[Context, Depends(require_writer)]


def _json(body: Any, status: int = 200) -> JSONResponse:
    return JSONResponse(body, status_code=status)


# -- list -------------------------------------------------------------------------------------


def _limit(raw: str | None) -> int:
    limit = parse_limit(raw, maximum=LIMIT_MAX)
    return LIMIT_DEFAULT if limit is None else limit


def _sort(items: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Glance's two sort syntaxes: sort=k:dir,k2 or repeated sort_key and sort_dir."""
    keys = [v.strip() for k, v in items if k == "sort_key"]
    dirs = [v.strip() for k, v in items if k == "sort_dir"]
    new = [v for k, v in items if k == "sort"]
    pairs: list[tuple[str, str]] = []
    if new:
        if keys or dirs:
            raise ApiError(400, "Old and new sorting syntax cannot be combined")
        for part in new[-1].split(","):
            key, _sep, direction = part.partition(":")
            pairs.append((key.strip(), direction.strip() or "desc"))
    else:
        if len(dirs) > 1 and len(dirs) != len(keys):
            raise ApiError(400, "Number of sort dirs does not match the number of sort keys")
        keys = keys or ["created_at"]
        dirs = dirs or ["desc"]
        pairs = [(key, dirs[i] if len(dirs) > 1 else dirs[0]) for i, key in enumerate(keys)]
    for key, direction in pairs:
        if key not in svc.SORT_KEYS:
            raise ApiError(
                400,
                f"Invalid sort key: {key}. It must be one of the following: "
                f"{', '.join(svc.SORT_KEYS)}.",
            )
        if direction not in ("asc", "desc"):
            raise ApiError(400, f"Invalid sort direction: {direction}")
    return pairs


_NOT_FILTERS = {"limit", "marker", "sort", "sort_key", "sort_dir", "tag"}


@router.get("/images")
async def list_images(request: Request, ctx: Reader) -> JSONResponse:
    items = list(request.query_params.multi_items())
    params = dict(items)
    query = svc.ImageQuery(
        filters={k: v for k, v in params.items() if k not in _NOT_FILTERS},
        tags=[v.strip() for k, v in items if k == "tag"],
        sort=_sort(items),
        limit=_limit(params.get("limit")),
        marker=params.get("marker"),
    )
    page, more = svc.list_images(cloud_of(request), ctx, query)
    body: dict[str, Any] = {
        "images": [svc.render(image) for image in page],
        "first": "/v2/images",
        "schema": "/v2/schemas/images",
    }
    if more:
        following = [(k, v) for k, v in items if k != "marker"] + [("marker", page[-1]["id"])]
        body["next"] = f"/v2/images?{urlencode(following)}"
    return _json(body)


# -- one image --------------------------------------------------------------------------------


@router.post("/images")
async def create_image(request: Request, ctx: Writer) -> JSONResponse:
    body = await json_body(request)
    if not isinstance(body, dict):
        raise ApiError(400, "Request body must be a JSON object.")
    image = svc.create_image(cloud_of(request), ctx, body)
    return JSONResponse(
        svc.render(image),
        status_code=201,
        headers={"Location": f"{cloud_of(request).config.base_url}/image/v2/images/{image['id']}"},
    )


@router.get("/images/")
@router.delete("/images/")
async def image_without_id(ctx: Reader) -> JSONResponse:
    """An empty image id (`/v2/images/`) names no image: 404 as glance, not the list."""
    raise ApiError(404, "No image found with ID ")


@router.get("/images/{image_id}")
async def show_image(image_id: str, request: Request, ctx: Reader) -> JSONResponse:
    return _json(svc.render(svc.get_image(cloud_of(request), ctx, image_id)))


@router.get("/images/{image_id}/tasks")
async def image_tasks(image_id: str, request: Request, ctx: Reader) -> JSONResponse:
    """Glance 2.12's import tasks of an image; data arrives only by upload here, so none."""
    svc.get_image(cloud_of(request), ctx, image_id)
    return _json({"tasks": []})


def _pointer(path: Any) -> tuple[str, ...]:
    """Decode a JSON pointer the way glance accepts one (no empty parts, only ~0 and ~1)."""
    if not isinstance(path, str) or not path.startswith("/"):
        raise ApiError(400, f'Pointer `{path}` does not start with "/".')
    if re.search(r"/\s*?/", path[1:]):
        raise ApiError(400, f'Pointer `{path}` contains adjacent "/".')
    if len(path) > 1 and path.endswith("/"):
        raise ApiError(400, f'Pointer `{path}` end with "/".')
    if re.search("~[^01]", path) or path.endswith("~"):
        raise ApiError(400, f'Pointer `{path}` contains "~" not part of a recognized escape.')
    return tuple(p.replace("~1", "/").replace("~0", "~").strip() for p in path[1:].split("/"))


def _changes(raw: Any, draft: int) -> list[svc.Change]:
    if not isinstance(raw, list):
        raise ApiError(400, "Request body must be a JSON array of operation objects.")
    changes = []
    ops = ("add", "remove", "replace")
    for item in raw:
        if not isinstance(item, dict):
            raise ApiError(400, "Operations must be JSON objects.")
        if draft == 10:
            op = item.get("op")
            if op not in ops:
                raise ApiError(
                    400,
                    f"Invalid operation: `{op}`. It must be one of the following: "
                    "add, remove, replace.",
                )
            if "path" not in item:
                raise ApiError(400, "Unable to find 'path' in JSON Schema change")
            path = item["path"]
        else:
            present = [name for name in ops if name in item]
            if len(present) != 1:
                raise ApiError(
                    400,
                    'Operation objects must contain exactly one member named "add", '
                    '"remove", or "replace".',
                )
            op = present[0]
            path = item[op]
        if op != "remove" and "value" not in item:
            raise ApiError(400, f'Operation "{op}" requires a member named "value".')
        changes.append(svc.Change(op, _pointer(path), item.get("value")))
    return changes


@router.patch("/images/{image_id}")
async def update_image(image_id: str, request: Request, ctx: Writer) -> JSONResponse:
    content_type = request.headers.get("content-type", "").split(";")[0].strip()
    draft = PATCH_TYPES.get(content_type)
    if draft is None:
        raise ApiError(
            415,
            f"Unsupported Content-Type for PATCH: {content_type or 'none'}; use one of "
            f"{', '.join(sorted(PATCH_TYPES))}.",
        )
    changes = _changes(await json_body(request), draft)
    image = svc.update_image(cloud_of(request), ctx, image_id, changes)
    return _json(svc.render(image))


@router.delete("/images/{image_id}")
async def delete_image(image_id: str, request: Request, ctx: Writer) -> Response:
    svc.delete_image(cloud_of(request), ctx, image_id)
    return Response(status_code=204)


# -- data -------------------------------------------------------------------------------------


@router.put("/images/{image_id}/file")
@on_loop  # streams the body as it arrives; the disk and the hashing work in the thread pool
async def upload_data(image_id: str, request: Request, ctx: Writer) -> Response:
    content_type = request.headers.get("content-type", "").split(";")[0].strip()
    if content_type != "application/octet-stream":
        raise ApiError(415, "Image data must be sent as application/octet-stream.")
    upload = await asyncio.to_thread(svc.begin_upload, cloud_of(request), ctx, image_id)
    # Never on the event loop: writing, hashing and the final fsync of a large image there
    # stalled every other request of this process for seconds (a client's keep-alive
    # connection was then reset under it).
    pending = bytearray()
    try:
        async for chunk in request.stream():
            pending += chunk
            if len(pending) >= UPLOAD_BATCH_BYTES:
                await asyncio.to_thread(upload.write, bytes(pending))
                pending.clear()
        if pending:
            await asyncio.to_thread(upload.write, bytes(pending))
    except ClientDisconnect:
        await asyncio.to_thread(upload.abort)
        return Response(status_code=400)
    except BaseException:
        await asyncio.to_thread(upload.abort)
        raise
    expected = request.headers.get("x-openstack-image-size")
    if expected is not None and expected.isdigit() and int(expected) != upload.size:
        await asyncio.to_thread(upload.abort)
        raise ApiError(
            400, f"Image size mismatch: X-OpenStack-Image-Size is {expected}, got {upload.size}"
        )
    await asyncio.to_thread(upload.commit)
    return Response(status_code=204)


@router.put("/images/{image_id}/stage")
async def stage_data(image_id: str, ctx: Writer) -> JSONResponse:
    """Glance's answer when the glance-direct import method is not enabled."""
    raise ApiError(404, "'glance-direct' method is not available at this site.")


@router.post("/images/{image_id}/import")
async def import_image(image_id: str, request: Request, ctx: Writer) -> JSONResponse:
    """Interoperable import is not offered: no import method is enabled, and glance with
    `enabled_import_methods = []` refuses each by name as it reads the body."""
    body = await json_body(request)
    method = body.get("method") if isinstance(body, dict) else None
    if not isinstance(method, dict):
        raise ApiError(400, "Import request requires a 'method' field.")
    if "name" not in method:
        raise ApiError(400, "Import request requires a 'name' field.")
    raise ApiError(400, f"Unknown import method name '{method['name']}'.")


@router.post("/tasks")
async def create_task(ctx: Writer) -> JSONResponse:
    """Glance's tasks (import from a URL, conversion) are not offered."""
    raise ApiError(501, "Image tasks are not offered here: upload image data instead.")


@router.get("/info/import")
async def info_import(ctx: Reader) -> JSONResponse:
    """The import methods enabled here: none (data arrive by upload only)."""
    return _json(
        {
            "import-methods": {
                "description": "Import methods available.",
                "type": "array",
                "value": [],
            }
        }
    )


@router.get("/info/stores")
async def info_stores(ctx: Reader) -> JSONResponse:
    """One store, so no multi-store API: glance without `enabled_backends` answers 404."""
    raise ApiError(404, "Multi backend is not supported at this site.")


@router.get("/images/{image_id}/file")
async def download_data(image_id: str, request: Request, ctx: Reader) -> Response:
    image, path = svc.data_of(cloud_of(request), ctx, image_id)
    if path is None:
        return Response(status_code=204)
    headers = {"Content-MD5": image["checksum"]} if image.get("checksum") else {}
    return FileResponse(path, media_type="application/octet-stream", headers=headers)


# -- tags and actions -------------------------------------------------------------------------


@router.put("/images/{image_id}/tags/{tag}")
async def add_tag(image_id: str, tag: str, request: Request, ctx: Writer) -> Response:
    svc.add_tag(cloud_of(request), ctx, image_id, tag)
    return Response(status_code=204)


@router.delete("/images/{image_id}/tags/{tag}")
async def remove_tag(image_id: str, tag: str, request: Request, ctx: Writer) -> Response:
    svc.remove_tag(cloud_of(request), ctx, image_id, tag)
    return Response(status_code=204)


@router.post("/images/{image_id}/actions/deactivate")
async def deactivate(image_id: str, request: Request, ctx: Writer) -> Response:
    svc.set_active(cloud_of(request), ctx, image_id, active=False)
    return Response(status_code=204)


@router.post("/images/{image_id}/actions/reactivate")
async def reactivate(image_id: str, request: Request, ctx: Writer) -> Response:
    svc.set_active(cloud_of(request), ctx, image_id, active=True)
    return Response(status_code=204)


# -- schemas ----------------------------------------------------------------------------------


@router.get("/schemas/image")
async def schema_image(ctx: Reader) -> JSONResponse:
    return _json(image_schema())


@router.get("/schemas/images")
async def schema_images(ctx: Reader) -> JSONResponse:
    return _json(images_schema())


@router.get("/schemas/member")
async def schema_member(ctx: Reader) -> JSONResponse:
    return _json(member_schema())


@router.get("/schemas/members")
async def schema_members(ctx: Reader) -> JSONResponse:
    return _json(members_schema())


# -- members ----------------------------------------------------------------------------------


@router.get("/images/{image_id}/members")
async def list_members(image_id: str, request: Request, ctx: Reader) -> JSONResponse:
    members = svc.list_members(cloud_of(request), ctx, image_id)
    return _json({"members": members, "schema": "/v2/schemas/members"})


@router.post("/images/{image_id}/members")
async def add_member(image_id: str, request: Request, ctx: Writer) -> JSONResponse:
    body = await json_body(request)
    if not isinstance(body, dict) or "member" not in body:
        raise ApiError(400, "Request body must be a JSON object with a 'member'.")
    return _json(svc.add_member(cloud_of(request), ctx, image_id, body["member"]))


@router.get("/images/{image_id}/members/{member_id}")
async def show_member(image_id: str, member_id: str, request: Request, ctx: Reader) -> JSONResponse:
    return _json(svc.get_member(cloud_of(request), ctx, image_id, member_id))


@router.put("/images/{image_id}/members/{member_id}")
async def update_member(
    image_id: str, member_id: str, request: Request, ctx: Writer
) -> JSONResponse:
    body = await json_body(request)
    if not isinstance(body, dict) or "status" not in body:
        raise ApiError(400, "Request body must be a JSON object with a 'status'.")
    cloud = cloud_of(request)
    return _json(svc.set_member_status(cloud, ctx, image_id, member_id, body["status"]))


@router.delete("/images/{image_id}/members/{member_id}")
async def remove_member(image_id: str, member_id: str, request: Request, ctx: Writer) -> Response:
    svc.remove_member(cloud_of(request), ctx, image_id, member_id)
    return Response(status_code=204)
