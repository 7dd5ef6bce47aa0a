"""Compute v2.1: rescue, unrescue, changePassword and trigger_crash_dump (2.17+) of a server.

Each commits its operation (services/guest_actions.py) and answers as Nova does: rescue 200
with the rescue's adminPass, unrescue and trigger_crash_dump 202 at once; changePassword,
synchronous in Nova (the password "has been changed when returning a response"), waits for
the host's answer: 202 when the guest took it, 409 when it could not (no guest agent).
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from stowage.api.auth import cloud_of
from stowage.api.common import ApiError, Context
from stowage.api.compute.microversion import mv
from stowage.api.responses import JSONResponse
from stowage.domain.errors import ConflictError, InvalidSpec, NotFound
from stowage.ledger.objects import Document
from stowage.services import guest_actions
from stowage.services.cloud import Cloud

__all__ = ["GUEST_ACTIONS", "guest_action"]

GUEST_ACTIONS = frozenset({"rescue", "unrescue", "changePassword", "trigger_crash_dump"})


async def guest_action(
    request: Request, ctx: Context, doc: Document, action: str, args: Any
) -> Response:
    cloud = cloud_of(request)
    rid = request.state.request_id
    try:
        if action == "rescue":
            return await _rescue(request, cloud, ctx, doc, args)
        if action == "unrescue":
            await asyncio.to_thread(
                guest_actions.unrescue_server, cloud, ctx, doc.id, request_id=rid
            )
        elif action == "changePassword":
            return await _change_password(cloud, ctx, doc, args, rid)
        else:
            if mv(request) < (2, 17):
                raise ApiError(404, "The resource could not be found.")
            if args is not None:
                raise ApiError(400, "Invalid input for field/attribute trigger_crash_dump: null")
            await asyncio.to_thread(
                guest_actions.trigger_crash_dump, cloud, ctx, doc.id, request_id=rid
            )
    except ConflictError as exc:
        raise ApiError(409, exc.message) from None
    except InvalidSpec as exc:
        raise ApiError(400, exc.message) from None
    except NotFound as exc:
        raise ApiError(404, exc.message) from None
    from stowage.api.compute.servers import settled

    await settled(cloud, [doc.id])
    return Response(status_code=202)


async def _rescue(
    request: Request, cloud: Cloud, ctx: Context, doc: Document, args: Any
) -> Response:
    if args is not None and not isinstance(args, dict):
        raise ApiError(400, "Invalid input for field/attribute rescue: an object or null")
    args = args or {}
    unknown = sorted(set(args) - {"adminPass", "rescue_image_ref"})
    if unknown:
        raise ApiError(400, f"Additional properties are not allowed ({unknown} unexpected)")
    password = args.get("adminPass")
    if password is not None and not isinstance(password, str):
        raise ApiError(400, "Invalid input for field/attribute adminPass: a string")
    ref = args.get("rescue_image_ref")
    image_id: str | None = None
    if ref is not None:
        if not isinstance(ref, str) or not ref:
            raise ApiError(400, "Invalid input for field/attribute rescue_image_ref: a UUID")
        from stowage.api.compute.servers import bootable_image

        image_id = bootable_image(cloud, ctx, ref).id
    password = password or secrets.token_urlsafe(9)
    await asyncio.to_thread(
        guest_actions.rescue_server,
        cloud,
        ctx,
        doc.id,
        image_id=image_id,
        password=password,
        request_id=request.state.request_id,
    )
    from stowage.api.compute.servers import settled

    await settled(cloud, [doc.id])
    return JSONResponse({"adminPass": password})


async def _change_password(
    cloud: Cloud, ctx: Context, doc: Document, args: Any, rid: str
) -> Response:
    password = args.get("adminPass") if isinstance(args, dict) else None
    if not isinstance(password, str):
        raise ApiError(400, "Invalid input for field/attribute adminPass: a string is required")
    if set(args) - {"adminPass"}:
        raise ApiError(400, "Additional properties are not allowed in changePassword")
    op_id = await asyncio.to_thread(
        guest_actions.change_password, cloud, ctx, doc.id, password, request_id=rid
    )
    # The host's answer, bounded: past it the operation goes on (durable) and its instance
    # action tells how it ended.
    wait_s = 2 * cloud.config.op_timeout_s + 5
    await asyncio.to_thread(cloud.operations.wait, [op_id], wait_s)
    op = await asyncio.to_thread(cloud.operations.find, op_id)
    if op is not None and op.state == "failed":
        why = (op.result or {}).get("error") or "error setting admin password"
        raise ApiError(409, f"Failed to set admin password on {doc.id} because {why}")
    return Response(status_code=202)
