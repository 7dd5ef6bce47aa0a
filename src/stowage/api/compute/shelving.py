"""Compute v2.1: shelve, shelveOffload and unshelve (2.77 zone, 2.91 host) of a server, and
forceDelete of a soft-deleted one."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from stowage.api.auth import cloud_of
from stowage.api.common import ApiError, Context
from stowage.api.compute.microversion import mv
from stowage.domain.errors import ConflictError, NotFound
from stowage.ledger.objects import Document
from stowage.services.compute import record_action
from stowage.services.shelve import offload_shelved, shelve_server, unshelve_server
from stowage.services.soft_delete import force_delete

__all__ = ["SHELVE_ACTIONS", "shelve_action"]

SHELVE_ACTIONS = frozenset({"shelve", "shelveOffload", "unshelve", "forceDelete"})


async def shelve_action(
    request: Request, ctx: Context, doc: Document, action: str, args: Any
) -> Response:
    cloud = cloud_of(request)
    rid = request.state.request_id
    try:
        if action == "shelve":
            await asyncio.to_thread(shelve_server, cloud, ctx, doc.id, rid)
        elif action == "forceDelete":
            await asyncio.to_thread(force_delete, cloud, doc.id)
        elif action == "shelveOffload":
            await asyncio.to_thread(offload_shelved, cloud, doc.id, rid)
        else:
            host, zone = _unshelve_args(request, ctx, args)
            await asyncio.to_thread(
                unshelve_server, cloud, doc.id, rid, host=host, zone=zone, is_admin=ctx.is_admin
            )
    except ConflictError as exc:
        raise ApiError(409, exc.message) from None
    except NotFound as exc:
        raise ApiError(404, exc.message) from None
    record_action(cloud, doc.id, action, ctx.user_id, ctx.project_id, rid)
    from stowage.api.compute.servers import settled

    await settled(cloud, [doc.id])
    return Response(status_code=202)


def _unshelve_args(request: Request, ctx: Context, args: Any) -> tuple[str | None, str | None]:
    if args is None:
        return None, None
    version = mv(request)
    if not isinstance(args, dict) or version < (2, 77):
        raise ApiError(400, "Invalid input for field/attribute unshelve: must be null")
    allowed = {"availability_zone"} | ({"host"} if version >= (2, 91) else set())
    unknown = sorted(set(args) - allowed)
    if unknown:
        raise ApiError(400, f"Invalid input for field/attribute unshelve: {unknown}")
    host = args.get("host")
    if host is not None and not ctx.is_admin:
        raise ApiError(403, "Policy doesn't allow os_compute_api:os-shelve:unshelve_to_host.")
    zone = args.get("availability_zone")
    for field, value in (("host", host), ("availability_zone", zone)):
        if value is not None and (not isinstance(value, str) or not value):
            raise ApiError(400, f"Invalid input for field/attribute {field}")
    return host, zone
