"""Compute v2.1: a server's metadata (/servers/{id}/metadata) and the checks Nova applies to it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from stowage.api.auth import cloud_of, require_context
from stowage.api.common import ApiError, Context, json_body
from stowage.api.compute.server_views import check_metadata
from stowage.api.compute.servers import load_server
from stowage.api.responses import JSONResponse
from stowage.services import compute_catalog as catalog
from stowage.services.instances import change_metadata

__all__ = ["check_metadata_quota", "router"]

router = APIRouter()


def check_metadata_quota(request: Request, project_id: str, metadata: dict[str, str]) -> None:
    limit = catalog.quota_limits(cloud_of(request), project_id)["metadata_items"]
    if 0 <= limit < len(metadata):
        raise ApiError(403, f"Quota exceeded for metadata_items: maximum {limit} items")


def _body_member(payload: Any, key: str) -> Any:
    if not isinstance(payload, dict) or key not in payload:
        raise ApiError(400, f"Invalid input for field/attribute {key}: '{key}' is required")
    return payload[key]


def _writer(request: Request, server_id: str) -> tuple[Context, dict[str, Any]]:
    ctx = require_context(request)
    if not ctx.can_write:
        raise ApiError(
            403, "Policy doesn't allow os_compute_api:server-metadata:update to be performed."
        )
    doc = load_server(cloud_of(request), ctx, server_id)
    if doc.body.get("locked") and not ctx.is_admin:
        raise ApiError(409, f"Instance {server_id} is locked")
    return ctx, dict(doc.body)


def _change(
    request: Request,
    ctx: Context,
    server_id: str,
    change: Callable[[dict[str, str]], dict[str, str]],
) -> dict[str, str]:
    """The server's metadata changed by `change` as it is at the write (not as read)."""

    def checked(metadata: dict[str, str]) -> dict[str, str]:
        new = change(metadata)
        check_metadata_quota(request, ctx.project_id, new)
        return new

    return change_metadata(cloud_of(request), server_id, checked)


def _metadata(request: Request, server_id: str) -> dict[str, str]:
    ctx = require_context(request)
    doc = load_server(cloud_of(request), ctx, server_id)
    return dict(doc.body.get("metadata") or {})


@router.get("/servers/{server_id}/metadata")
async def list_metadata(server_id: str, request: Request) -> JSONResponse:
    return JSONResponse({"metadata": _metadata(request, server_id)})


@router.post("/servers/{server_id}/metadata")
async def update_metadata(server_id: str, request: Request) -> JSONResponse:
    ctx, _ = _writer(request, server_id)
    wanted = check_metadata(_body_member(await json_body(request), "metadata"))
    merged = _change(request, ctx, server_id, lambda metadata: {**metadata, **wanted})
    return JSONResponse({"metadata": merged})


@router.put("/servers/{server_id}/metadata")
async def replace_metadata(server_id: str, request: Request) -> JSONResponse:
    ctx, _ = _writer(request, server_id)
    wanted = check_metadata(_body_member(await json_body(request), "metadata"))
    return JSONResponse({"metadata": _change(request, ctx, server_id, lambda _old: wanted)})


@router.get("/servers/{server_id}/metadata/{key}")
async def show_metadata_item(server_id: str, key: str, request: Request) -> JSONResponse:
    metadata = _metadata(request, server_id)
    if key not in metadata:
        raise ApiError(404, "Metadata item was not found")
    return JSONResponse({"meta": {key: metadata[key]}})


@router.put("/servers/{server_id}/metadata/{key}")
async def set_metadata_item(server_id: str, key: str, request: Request) -> JSONResponse:
    ctx, _ = _writer(request, server_id)
    meta = check_metadata(_body_member(await json_body(request), "meta"), field="meta")
    if len(meta) != 1:
        raise ApiError(400, "Request body contains too many items")
    if key not in meta:
        raise ApiError(400, "Request body and URI mismatch")
    _change(request, ctx, server_id, lambda metadata: {**metadata, **meta})
    return JSONResponse({"meta": meta})


@router.delete("/servers/{server_id}/metadata/{key}")
async def delete_metadata_item(server_id: str, key: str, request: Request) -> Response:
    ctx, _ = _writer(request, server_id)

    def without(metadata: dict[str, str]) -> dict[str, str]:
        if key not in metadata:
            raise ApiError(404, "Metadata item was not found")
        return {k: v for k, v in metadata.items() if k != key}

    _change(request, ctx, server_id, without)
    return Response(status_code=204)
