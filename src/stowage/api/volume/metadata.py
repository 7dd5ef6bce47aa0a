"""Block storage v3: the metadata of volumes and snapshots, whole (`/metadata`) and one key
at a time (`/metadata/{key}`, Cinder's `{"meta": {key: value}}`), one set of handlers for
both kinds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from stowage.api.auth import cloud_of
from stowage.api.common import ApiError, Context, json_body
from stowage.api.responses import JSONResponse
from stowage.api.volume.refusals import NOT_HERE, not_here_message
from stowage.api.volume.views import context, mapped, writer
from stowage.domain.errors import StowageError
from stowage.ledger.objects import Document
from stowage.services.cloud import Cloud
from stowage.services.volumes import volumes as service

__all__ = ["check_metadata", "router"]

router = APIRouter()


@dataclass(frozen=True)
class _Kind:
    get: Callable[[Cloud, Context, str], Document]
    update: Callable[[Cloud, Context, str, dict[str, Any]], Document]
    rule: str  # the policy name's stem: volume:update_volume_metadata, ...


_KINDS = {
    "volumes": _Kind(service.get_volume, service.update_volume, "volume"),
    "snapshots": _Kind(service.get_snapshot, service.update_snapshot, "snapshot"),
}


def check_metadata(value: Any) -> dict[str, str]:
    """Cinder's metadata: string keys of 1-255 characters, string values of at most 255."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and 0 < len(k) <= 255 and len(v) <= 255
        for k, v in value.items()
    ):
        raise ApiError(400, "Invalid input for field/attribute metadata: strings of 1-255 only")
    return dict(value)


def _kind(kind: str) -> _Kind:
    found = _KINDS.get(kind)
    if found is None and kind in NOT_HERE:
        raise ApiError(501, not_here_message(NOT_HERE[kind]))
    if found is None:
        raise ApiError(404, "The resource could not be found.")
    return found


def _load(request: Request, ctx: Context, kind: str, item_id: str) -> dict[str, str]:
    try:
        doc = _kind(kind).get(cloud_of(request), ctx, item_id)
    except StowageError as exc:
        raise mapped(exc) from None
    return dict(doc.body.get("metadata") or {})


def _store(
    request: Request, ctx: Context, kind: str, item_id: str, metadata: dict[str, str]
) -> dict[str, str]:
    try:
        doc = _kind(kind).update(cloud_of(request), ctx, item_id, {"metadata": metadata})
    except StowageError as exc:
        raise mapped(exc) from None
    return dict(doc.body.get("metadata") or {})


def _writer(request: Request, project_id: str, kind: str, verb: str) -> Context:
    context(request, project_id)  # the caller first: a 401 before any other answer
    stem = _kind(kind).rule
    return writer(request, project_id, f"volume:{verb}_{stem}_metadata")


@router.get("/{kind}/{item_id}/metadata")
async def show_metadata(request: Request, project_id: str, kind: str, item_id: str) -> Response:
    ctx = context(request, project_id)
    return JSONResponse({"metadata": _load(request, ctx, kind, item_id)})


async def _set(
    request: Request, project_id: str, kind: str, item_id: str, *, replace: bool
) -> Response:
    ctx = _writer(request, project_id, kind, "update")
    payload = await json_body(request)
    if not isinstance(payload, dict) or "metadata" not in payload:
        raise ApiError(400, "Malformed request body: 'metadata' is required")
    given = check_metadata(payload["metadata"])
    merged = given if replace else {**_load(request, ctx, kind, item_id), **given}
    return JSONResponse({"metadata": _store(request, ctx, kind, item_id, merged)})


@router.post("/{kind}/{item_id}/metadata")
async def add_metadata(request: Request, project_id: str, kind: str, item_id: str) -> Response:
    return await _set(request, project_id, kind, item_id, replace=False)


@router.put("/{kind}/{item_id}/metadata")
async def replace_metadata(request: Request, project_id: str, kind: str, item_id: str) -> Response:
    return await _set(request, project_id, kind, item_id, replace=True)


@router.get("/{kind}/{item_id}/metadata/{key}")
async def show_item(
    request: Request, project_id: str, kind: str, item_id: str, key: str
) -> Response:
    ctx = context(request, project_id)
    metadata = _load(request, ctx, kind, item_id)
    if key not in metadata:
        raise ApiError(404, f"Metadata item was not found: {key}")
    return JSONResponse({"meta": {key: metadata[key]}})


@router.put("/{kind}/{item_id}/metadata/{key}")
async def update_item(
    request: Request, project_id: str, kind: str, item_id: str, key: str
) -> Response:
    """One key: the body's `meta` names exactly the key of the path (Cinder's 400 else)."""
    ctx = _writer(request, project_id, kind, "update")
    payload = await json_body(request)
    meta = payload.get("meta") if isinstance(payload, dict) else None
    if not isinstance(meta, dict):
        raise ApiError(400, "Malformed request body: 'meta' is required")
    if len(meta) != 1:
        raise ApiError(400, "Request body contains too many items.")
    if key not in meta:
        raise ApiError(400, "Request body and URI mismatch")
    given = check_metadata(meta)
    _store(request, ctx, kind, item_id, {**_load(request, ctx, kind, item_id), **given})
    return JSONResponse({"meta": given})


@router.delete("/{kind}/{item_id}/metadata/{key}")
async def delete_item(
    request: Request, project_id: str, kind: str, item_id: str, key: str
) -> Response:
    ctx = _writer(request, project_id, kind, "delete")
    metadata = _load(request, ctx, kind, item_id)
    if key not in metadata:
        raise ApiError(404, f"Metadata item was not found: {key}")
    del metadata[key]
    _store(request, ctx, kind, item_id, metadata)
    return Response(status_code=200)
