"""Stowage's extensions for whole hosts (admin only): evacuate every instance of a down host
as one plan, and run a host's reconciler now."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from stowage.api.auth import cloud_of, require_admin
from stowage.api.common import ApiError, on_loop
from stowage.api.responses import JSONResponse
from stowage.services.migrations import evacuate_host, outcome, planned

router = APIRouter()


@router.post("/os-stowage-hosts/{host}/evacuate")
async def evacuate(request: Request, host: str) -> JSONResponse:
    """Every instance of the host: where it went, or why it could not go (it never stops
    half-way: an instance that cannot start its evacuation is reported and the rest go on)."""
    ctx = require_admin(request)
    cloud = cloud_of(request)
    rid = request.state.request_id
    results = await asyncio.to_thread(
        evacuate_host, cloud, host, user_id=ctx.user_id, project_id=ctx.project_id, request_id=rid
    )
    # `?wait=S`: answer once each evacuation ended (bounded by S seconds), as the CLI asks;
    # otherwise once each has its destination planned (or failed).
    try:
        wait_s = float(request.query_params.get("wait", "0"))
    except ValueError:
        raise ApiError(400, "wait must be a number of seconds") from None
    out = []
    for server_id, started in results.items():
        result = await asyncio.to_thread(planned, cloud, started, max(wait_s, 10.0))
        if wait_s > 0:
            result = await asyncio.to_thread(outcome, cloud, result, wait_s)
        out.append(
            {
                "server_id": server_id,
                "migration_id": result.migration_id or None,
                "status": result.status,
                "host": result.dest,
                "reason": result.reason,
            }
        )
    return JSONResponse({"host": host, "evacuations": out})


@router.post("/os-stowage-hosts/{host}/reconcile")
@on_loop  # awaits the agent over the bus
async def reconcile(request: Request, host: str) -> JSONResponse:
    """The host's reconciler, on demand: its report, divergences recorded as faults."""
    from stowage.api.compute.sim import control

    require_admin(request)
    report = await control(request, host, "reconcile", {})
    return JSONResponse({"reconcile": report})
