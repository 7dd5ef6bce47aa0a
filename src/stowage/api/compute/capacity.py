"""Stowage's extension: what if a host failed? Where its instances would go, and room left."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from stowage.api.auth import cloud_of, require_admin
from stowage.api.common import ApiError
from stowage.api.responses import JSONResponse
from stowage.services.capacity import capacity_if_host_fails

__all__ = ["router"]

router = APIRouter()


@router.get("/os-stowage-capacity")
async def capacity(request: Request) -> JSONResponse:
    """`?fail_host=HOST`: plan HOST's instances elsewhere in memory; nothing is claimed."""
    require_admin(request)
    host = request.query_params.get("fail_host")
    if not host:
        raise ApiError(400, "Invalid input for query parameter fail_host: a host is required")
    report = await asyncio.to_thread(capacity_if_host_fails, cloud_of(request), host)
    return JSONResponse({"capacity": report.to_dict()})
