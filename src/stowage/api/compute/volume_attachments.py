"""Compute v2.1: a server's volumes (/servers/{id}/os-volume_attachments): list, show, attach,
update delete_on_termination (2.85), detach. Swapping a volume is refused (501)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from stowage.api.auth import cloud_of, require_context
from stowage.api.common import ApiError, Context, json_body
from stowage.api.compute.microversion import mv
from stowage.api.compute.servers import load_server, settled
from stowage.api.responses import JSONResponse
from stowage.domain.errors import ConflictError, NotFound
from stowage.ledger.objects import Document
from stowage.services.compute import record_action
from stowage.services.instances import set_block_devices
from stowage.services.volumes import InvalidVolume
from stowage.services.volumes import server_volumes as service

__all__ = ["router"]

router = APIRouter()


def _view(request: Request, server_id: str, device: dict[str, Any]) -> dict[str, Any]:
    version = mv(request)
    view: dict[str, Any] = {
        "serverId": server_id,
        "volumeId": device["volume_id"],
        "device": device["device"],
    }
    if version < (2, 89):
        view["id"] = device["volume_id"]
    if version >= (2, 70):
        view["tag"] = device.get("tag")
    if version >= (2, 79):
        view["delete_on_termination"] = bool(device.get("delete_on_termination"))
    if version >= (2, 89):
        view["attachment_id"] = device["attachment_id"]
        view["bdm_uuid"] = str(uuid.uuid5(uuid.NAMESPACE_URL, device["attachment_id"]))
    return view


def _devices(doc: Document) -> list[dict[str, Any]]:
    return [d for d in doc.body.get("block_devices") or [] if not d.get("attaching")]


def _writer(request: Request, rule: str) -> Context:
    ctx = require_context(request)
    if not ctx.can_write:
        raise ApiError(403, f"Policy doesn't allow os_compute_api:os-volumes-attachments:{rule}.")
    return ctx


@router.get("/servers/{server_id}/os-volume_attachments")
async def list_attachments(request: Request, server_id: str) -> JSONResponse:
    ctx = require_context(request)
    doc = load_server(cloud_of(request), ctx, server_id)
    views = [_view(request, server_id, d) for d in _devices(doc)]
    return JSONResponse({"volumeAttachments": views})


@router.get("/servers/{server_id}/os-volume_attachments/{volume_id}")
async def show_attachment(request: Request, server_id: str, volume_id: str) -> JSONResponse:
    ctx = require_context(request)
    doc = load_server(cloud_of(request), ctx, server_id)
    for device in _devices(doc):
        if device["volume_id"] == volume_id:
            return JSONResponse({"volumeAttachment": _view(request, server_id, device)})
    raise ApiError(404, f"Volume {volume_id} is not attached to instance {server_id}.")


def _attachment_body(payload: Any) -> dict[str, Any]:
    if not isinstance(payload, dict) or not isinstance(payload.get("volumeAttachment"), dict):
        raise ApiError(
            400, "Invalid input for field/attribute volumeAttachment: a required property"
        )
    body: dict[str, Any] = payload["volumeAttachment"]
    if not isinstance(body.get("volumeId"), str) or not body["volumeId"]:
        raise ApiError(400, "Invalid input for field/attribute volumeId: a required property")
    return body


@router.post("/servers/{server_id}/os-volume_attachments")
async def attach_volume(request: Request, server_id: str) -> JSONResponse:
    ctx = _writer(request, "create")
    cloud = cloud_of(request)
    doc = load_server(cloud, ctx, server_id)
    body = _attachment_body(await json_body(request))
    version = mv(request)
    allowed = {"volumeId", "device"} | ({"tag"} if version >= (2, 49) else set())
    allowed |= {"delete_on_termination"} if version >= (2, 79) else set()
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ApiError(400, f"Invalid input for field/attribute volumeAttachment: {unknown}")
    device = body.get("device")
    if device is not None and (not isinstance(device, str) or not device.startswith("/dev/")):
        raise ApiError(400, f"The supplied device path ({device}) is invalid.")
    if doc.body.get("locked") and not ctx.is_admin:
        raise ApiError(409, f"Instance {server_id} is locked")
    try:
        added = await asyncio.to_thread(
            service.attach_to_server,
            cloud,
            ctx,
            server_id,
            body["volumeId"],
            device,
            delete_on_termination=body.get("delete_on_termination") is True,
            tag=body.get("tag"),
        )
    except InvalidVolume as exc:
        raise ApiError(400, exc.message) from None
    except NotFound as exc:
        raise ApiError(404, exc.message) from None
    except ConflictError as exc:
        raise ApiError(409, exc.message) from None
    rid = request.state.request_id
    record_action(cloud, server_id, "attach_volume", ctx.user_id, ctx.project_id, rid)
    await settled(cloud, [server_id])
    return JSONResponse({"volumeAttachment": _view(request, server_id, added)})


@router.put("/servers/{server_id}/os-volume_attachments/{volume_id}")
async def update_attachment(request: Request, server_id: str, volume_id: str) -> Response:
    ctx = _writer(request, "update")
    cloud = cloud_of(request)
    doc = load_server(cloud, ctx, server_id)
    body = _attachment_body(await json_body(request))
    devices = list(doc.body.get("block_devices") or [])
    if not any(d["volume_id"] == volume_id for d in devices):
        raise ApiError(404, f"Volume {volume_id} is not attached to instance {server_id}.")
    if body["volumeId"] != volume_id:
        raise ApiError(
            501, "Swapping a server's volume is not supported by this cloud's hypervisors."
        )
    if "delete_on_termination" not in body or mv(request) < (2, 85):
        raise ApiError(400, "Invalid input for field/attribute volumeAttachment: nothing to update")
    flag = body["delete_on_termination"]
    if not isinstance(flag, bool):
        raise ApiError(400, "Invalid input for field/attribute delete_on_termination")
    after = [
        {**d, "delete_on_termination": flag} if d["volume_id"] == volume_id else d for d in devices
    ]
    set_block_devices(cloud, server_id, doc.body, after)
    return Response(status_code=202)


@router.delete("/servers/{server_id}/os-volume_attachments/{volume_id}")
async def detach_volume(request: Request, server_id: str, volume_id: str) -> Response:
    ctx = _writer(request, "delete")
    cloud = cloud_of(request)
    doc = load_server(cloud, ctx, server_id)
    if doc.body.get("locked") and not ctx.is_admin:
        raise ApiError(409, f"Instance {server_id} is locked")
    try:
        await asyncio.to_thread(service.detach_from_server, cloud, server_id, volume_id)
    except InvalidVolume as exc:
        raise ApiError(400, exc.message) from None
    except NotFound as exc:
        raise ApiError(404, exc.message) from None
    except ConflictError as exc:
        raise ApiError(409, exc.message) from None
    rid = request.state.request_id
    record_action(cloud, server_id, "detach_volume", ctx.user_id, ctx.project_id, rid)
    await settled(cloud, [server_id])
    return Response(status_code=202)
