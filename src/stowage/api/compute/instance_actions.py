"""Compute v2.1: instance actions and their events (os-instance-actions)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request

from stowage.api.auth import cloud_of, require_context
from stowage.api.common import ApiError, Context
from stowage.api.compute.microversion import mv
from stowage.api.compute.servers import load_server
from stowage.api.responses import JSONResponse

router = APIRouter()


def _iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")


def _action_view(
    body: dict[str, Any], *, events: bool, admin: bool, version: Any
) -> dict[str, Any]:
    view = {
        "action": body["action"],
        "instance_uuid": body["instance_uuid"],
        "request_id": body["request_id"],
        "user_id": body["user_id"],
        "project_id": body["project_id"],
        "start_time": _iso(body["start_time"]),
        "message": body.get("message"),
    }
    if version >= (2, 58):
        view["updated_at"] = _iso(body.get("updated_at"))
    if events:
        out = []
        for event in body.get("events", []):
            item = {
                "event": event["event"],
                "start_time": _iso(event["start_time"]),
                "finish_time": _iso(event["finish_time"]),
                "result": event["result"],
            }
            if admin:
                item["traceback"] = event.get("traceback")
            if version >= (2, 62):
                item["hostId"] = event.get("hostId") or ""
                if admin:
                    item["host"] = event.get("host") or ""
            if version >= (2, 84) and admin:
                item["details"] = event.get("details")
            out.append(item)
        view["events"] = out
    return view


def _check_server(request: Request, ctx: Context, server_id: str) -> None:
    """The server exists and is the caller's; from 2.21 a deleted server's actions stay
    readable by its project (they outlive the server)."""
    cloud = cloud_of(request)
    if mv(request) >= (2, 21) and cloud.objects.find("instance", server_id) is None:
        actions = cloud.objects.list("instance_action", project_id=server_id)
        if actions and (ctx.is_admin or actions[0].body.get("project_id") == ctx.project_id):
            return
    load_server(cloud, ctx, server_id)


@router.get("/servers/{server_id}/os-instance-actions")
async def list_actions(request: Request, server_id: str) -> JSONResponse:
    ctx = require_context(request)
    cloud = cloud_of(request)
    _check_server(request, ctx, server_id)
    docs = sorted(
        cloud.objects.list("instance_action", project_id=server_id),
        key=lambda d: d.created_at,
        reverse=True,
    )
    return JSONResponse(
        {
            "instanceActions": [
                _action_view(d.body, events=False, admin=ctx.is_admin, version=mv(request))
                for d in docs
            ]
        }
    )


@router.get("/servers/{server_id}/os-instance-actions/{request_id}")
async def show_action(request: Request, server_id: str, request_id: str) -> JSONResponse:
    ctx = require_context(request)
    cloud = cloud_of(request)
    _check_server(request, ctx, server_id)
    doc = cloud.objects.find("instance_action", f"{request_id}:{server_id}")
    if doc is None:
        raise ApiError(404, f"Action for request_id {request_id} on instance {server_id} not found")
    return JSONResponse(
        {
            "instanceAction": _action_view(
                doc.body, events=True, admin=ctx.is_admin, version=mv(request)
            )
        }
    )
