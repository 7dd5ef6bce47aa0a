"""Compute v2.1: a server's metadata (/servers/{id}/metadata) and the checks Nova applies to it."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from stowage.api.auth import cloud_of, require_context
from stowage.api.common import ApiError, Context, json_body
from stowage.api.compute.server_views import check_metadata
from stowage.api.compute.servers import load_server
from stowage.api.responses import JSONResponse
from stowage.services import compute_catalog as catalog
from stowage.services.instances import write_instance

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


def _save(request: Request, ctx: Context, server_id: str, body: dict[str, Any]) -> None:
    check_metadata_quota(request, ctx.project_id, body["metadata"])
    write_instance(cloud_of(request), server_id, {}, {"metadata": body["metadata"]})


def _metadata(request: Request, server_id: str) -> dict[str, str]:
    ctx = require_context(request)
    doc = load_server(cloud_of(request), ctx, server_id)
    return dict(doc.body.get("metadata") or {})


@router.get("/servers/{server_id}/metadata")
async def list_metadata(server_id: str, request: Request) -> JSONResponse:
    return JSONResponse({"metadata": _metadata(request, server_id)})


@router.post("/servers/{server_id}/metadata")
async def update_metadata(server_id: str, request: Request) -> JSONResponse:
    ctx, body = _writer(request, server_id)
    wanted = check_metadata(_body_member(await json_body(request), "metadata"))
    body["metadata"] = {**(body.get("metadata") or {}), **wanted}
    _save(request, ctx, server_id, body)
    return JSONResponse({"metadata": body["metadata"]})


@router.put("/servers/{server_id}/metadata")
async def replace_metadata(server_id: str, request: Request) -> JSONResponse:
    ctx, body = _writer(request, server_id)
    body["metadata"] = check_metadata(_body_member(await json_body(request), "metadata"))
    _save(request, ctx, server_id, body)
    return JSONResponse({"metadata": body["metadata"]})


@router.get("/servers/{server_id}/metadata/{key}")
async def show_metadata_item(server_id: str, key: str, request: Request) -> JSONResponse:
    metadata = _metadata(request, server_id)
    if key not in metadata:
        raise ApiError(404, "Metadata item was not found")
    return JSONResponse({"meta": {key: metadata[key]}})


@router.put("/servers/{server_id}/metadata/{key}")
async def set_metadata_item(server_id: str, key: str, request: Request) -> JSONResponse:
    ctx, body = _writer(request, server_id)
    meta = check_metadata(_body_member(await json_body(request), "meta"), field="meta")
    if len(meta) != 1:
        raise ApiError(400, "Request body contains too many items")
    if key not in meta:
        raise ApiError(400, "Request body and URI mismatch")
    body["metadata"] = {**(body.get("metadata") or {}), **meta}
    _save(request, ctx, server_id, body)
    return JSONResponse({"meta": meta})


@router.delete("/servers/{server_id}/metadata/{key}")
async def delete_metadata_item(server_id: str, key: str, request: Request) -> Response:
    ctx, body = _writer(request, server_id)
    metadata = dict(body.get("metadata") or {})
    if key not in metadata:
        raise ApiError(404, "Metadata item was not found")
    del metadata[key]
    body["metadata"] = metadata
    _save(request, ctx, server_id, body)
    return Response(status_code=204)
