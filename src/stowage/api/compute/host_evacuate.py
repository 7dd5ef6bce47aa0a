"""Stowage's extensions for whole hosts (admin only): evacuate every instance of a down host
as one plan, and run a host's reconciler now."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from stowage.api.auth import cloud_of, require_admin
from stowage.services.compute import record_action
from stowage.services.migrations import evacuate_host, outcome

router = APIRouter()


@router.post("/os-stowage-hosts/{host}/evacuate")
async def evacuate(request: Request, host: str) -> JSONResponse:
    ctx = require_admin(request)
    cloud = cloud_of(request)
    results = await asyncio.to_thread(
        evacuate_host, cloud, host, user_id=ctx.user_id, project_id=ctx.project_id
    )
    rid = request.state.request_id
    out = []
    for server_id, started in results.items():
        result = await asyncio.to_thread(outcome, cloud, started, cloud.config.api_wait_s)
        record_action(
            cloud,
            server_id,
            "evacuate",
            ctx.user_id,
            ctx.project_id,
            rid,
            result="Error" if result.status in ("failed", "error") else "Success",
            message=result.reason or None,
        )
        out.append(
            {
                "server_id": server_id,
                "migration_id": result.migration_id,
                "status": result.status,
                "host": result.dest,
                "reason": result.reason,
            }
        )
    return JSONResponse({"host": host, "evacuations": out})


@router.post("/os-stowage-hosts/{host}/reconcile")
async def reconcile(request: Request, host: str) -> JSONResponse:
    """The host's reconciler, on demand: its report, divergences recorded as faults."""
    from stowage.api.compute.sim import control

    require_admin(request)
    report = await control(request, host, "reconcile", {})
    return JSONResponse({"reconcile": report})
