"""Compute v2.1: the server actions beside power, moves, images and rebuild: security groups
(added to and removed from the server's ports), backups, restore, injectNetworkInfo and the
console log (os-getConsoleOutput, read from the host's hypervisor)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from stowage.api.auth import cloud_of
from stowage.api.common import ApiError, Context
from stowage.api.compute.microversion import mv
from stowage.api.responses import JSONResponse
from stowage.domain.errors import ConflictError
from stowage.ledger.objects import Document
from stowage.services import consoles
from stowage.services import images as image_service
from stowage.services.cloud import Cloud
from stowage.services.compute import record_action, snapshot_server
from stowage.services.server_security_groups import change_server_group

__all__ = ["EXTRA_ACTIONS", "extra_action"]

EXTRA_ACTIONS = frozenset(
    {
        "addSecurityGroup",
        "removeSecurityGroup",
        "createBackup",
        "injectNetworkInfo",
        "restore",
        "os-getConsoleOutput",
    }
)


async def extra_action(
    request: Request, ctx: Context, doc: Document, action: str, args: Any
) -> Response:
    """Carry out one of EXTRA_ACTIONS (or an admin's injectNetworkInfo) on the server."""
    cloud = cloud_of(request)
    rid = request.state.request_id
    args = args if isinstance(args, dict) else {}
    if action == "injectNetworkInfo":
        if not ctx.is_admin:
            raise ApiError(
                403, "Policy doesn't allow os_compute_api:os-admin-actions:inject_network_info."
            )
        # Addresses come from the ports; a simulated guest has no agent to inject them into.
        record_action(cloud, doc.id, "inject_network_info", ctx.user_id, ctx.project_id, rid)
        return Response(status_code=202)
    if action == "restore":
        # Only a SOFT_DELETED server (reclaim_instance_interval > 0) can be restored: 409 else.
        from stowage.domain.errors import ConflictError
        from stowage.services.soft_delete import restore_server

        try:
            await asyncio.to_thread(restore_server, cloud, doc.id, rid)
        except ConflictError as exc:
            raise ApiError(409, exc.message) from None
        record_action(cloud, doc.id, "restore", ctx.user_id, ctx.project_id, rid)
        if cloud.config.api_wait_s > 0:
            await asyncio.to_thread(
                cloud.operations.wait_instances, [doc.id], cloud.config.api_wait_s
            )
        return Response(status_code=202)
    if action == "createBackup":
        return await _backup(request, ctx, doc, args)
    if action == "os-getConsoleOutput":
        return await _console_output(cloud, doc, args)
    name = args.get("name")
    if not isinstance(name, str) or not name:
        raise ApiError(400, f"Invalid input for field/attribute {action}: 'name' is required")
    add = action == "addSecurityGroup"
    await asyncio.to_thread(change_server_group, cloud, ctx, doc.id, name, add=add)
    return Response(status_code=202)


async def _console_output(cloud: Cloud, doc: Document, args: dict[str, Any]) -> Response:
    """The guest's serial console log from its host's hypervisor; `length` last lines."""
    length = args.get("length")
    if isinstance(length, str):
        try:
            length = int(length)
        except ValueError:
            raise ApiError(400, f"Invalid input for field/attribute length: {length!r}") from None
    if length is not None and (isinstance(length, bool) or not isinstance(length, int)):
        raise ApiError(400, f"Invalid input for field/attribute length: {length!r}")
    if isinstance(length, int) and length < -1:
        raise ApiError(400, "Invalid input for field/attribute length: must be -1 or more")
    try:
        output = await consoles.console_output(
            cloud, doc.id, doc.body, None if length in (None, -1) else length
        )
    except ConflictError as exc:
        raise ApiError(409, str(exc)) from None
    return JSONResponse({"output": output})


async def _backup(request: Request, ctx: Context, doc: Document, args: dict[str, Any]) -> Response:
    """A snapshot tagged as a backup; the oldest backups of the same type beyond `rotation`
    are deleted, as Nova's rotation does."""
    cloud = cloud_of(request)
    name, kind = args.get("name"), args.get("backup_type")
    rotation: Any = args.get("rotation")
    if not isinstance(name, str) or not name.strip():
        raise ApiError(400, "Invalid input for field/attribute name: required")
    if not isinstance(kind, str) or not kind:
        raise ApiError(400, "Invalid input for field/attribute backup_type: required")
    try:
        keep = int(rotation)
    except (TypeError, ValueError):
        raise ApiError(400, "Invalid input for field/attribute rotation: an integer") from None
    if keep < 0:
        raise ApiError(400, "Invalid input for field/attribute rotation: at least 0")
    given = args.get("metadata") or {}
    if not isinstance(given, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and len(k) <= 255 and len(v) <= 255
        for k, v in given.items()
    ):
        raise ApiError(400, "Invalid input for field/attribute metadata: an object of strings")
    metadata = {**given, "image_type": "backup", "backup_type": kind}
    rid = request.state.request_id
    image_id = await asyncio.to_thread(snapshot_server, cloud, ctx, doc.id, name, metadata, rid)
    record_action(cloud, doc.id, "createBackup", ctx.user_id, ctx.project_id, rid)
    await asyncio.to_thread(_rotate, cloud, ctx, doc.id, kind, keep)
    if mv(request) >= (2, 45):
        return JSONResponse({"image_id": image_id}, status_code=202)
    location = f"{cloud.config.base_url}/image/v2/images/{image_id}"
    return Response(status_code=202, headers={"Location": location})


def _rotate(cloud: Cloud, ctx: Context, server_id: str, kind: str, keep: int) -> None:
    backups = [
        d
        for d in cloud.objects.list("image")
        if d.body.get("instance_uuid") == server_id
        and d.body.get("image_type") == "backup"
        and d.body.get("backup_type") == kind
    ]
    backups.sort(key=lambda d: (d.created_at, d.id), reverse=True)
    for old in backups[keep:]:
        image_service.delete_image(cloud, ctx, old.id)
