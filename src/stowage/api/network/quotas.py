"""Network v2.0 quotas (Neutron's quotas and quota_details extensions) and availability zones."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from stowage.api.auth import cloud_of, require_context
from stowage.api.common import ApiError, Context, json_body
from stowage.api.network.resources import NeutronRoute
from stowage.api.responses import JSONResponse
from stowage.services.networks import AVAILABILITY_ZONE
from stowage.services.networks import quotas as svc

__all__ = ["router"]

router = APIRouter(route_class=NeutronRoute)
Reader = Annotated[Context, Depends(require_context)]


@router.get("/quotas")
async def list_quotas(request: Request, ctx: Reader) -> JSONResponse:
    return JSONResponse({"quotas": svc.list_quotas(cloud_of(request), ctx)})


@router.get("/quotas/tenant")
async def own_project(ctx: Reader) -> JSONResponse:
    return JSONResponse({"tenant": {"tenant_id": ctx.project_id}})


@router.get("/quotas/{project_id}")
async def show_quota(project_id: str, request: Request, ctx: Reader) -> JSONResponse:
    return JSONResponse({"quota": svc.show_quota(cloud_of(request), ctx, project_id)})


@router.get("/quotas/{project_id}/default")
async def default_quota(project_id: str, request: Request, ctx: Reader) -> JSONResponse:
    return JSONResponse({"quota": svc.default_quota(cloud_of(request), ctx, project_id)})


@router.get("/quotas/{project_id}/details")
async def quota_details(project_id: str, request: Request, ctx: Reader) -> JSONResponse:
    return JSONResponse({"quota": svc.quota_details(cloud_of(request), ctx, project_id)})


@router.put("/quotas/{project_id}")
async def update_quota(project_id: str, request: Request, ctx: Reader) -> JSONResponse:
    body = await json_body(request)
    if not isinstance(body, dict) or "quota" not in body:
        raise ApiError(400, "Unable to find 'quota' in request body", code="HTTPBadRequest")
    quota = svc.update_quota(cloud_of(request), ctx, project_id, body["quota"])
    return JSONResponse({"quota": quota})


@router.delete("/quotas/{project_id}")
async def delete_quota(project_id: str, request: Request, ctx: Reader) -> Response:
    svc.delete_quota(cloud_of(request), ctx, project_id)
    return Response(status_code=204)


# Neutron's availability_zone extension: one zone, for networks and routers (what the DHCP
# and L3 agents would report).
_ZONE_FIELDS = ("name", "resource", "state")


@router.get("/availability_zones")
async def list_zones(request: Request, ctx: Reader) -> JSONResponse:
    zones = [
        {"name": AVAILABILITY_ZONE, "resource": resource, "state": "available"}
        for resource in ("network", "router")
    ]
    for key, value in request.query_params.multi_items():
        if key == "fields":
            continue
        if key not in _ZONE_FIELDS:
            raise ApiError(
                400, f"[{key}] is invalid attribute for filtering", code="HTTPBadRequest"
            )
        zones = [z for z in zones if z[key] == value]
    fields = [v for k, v in request.query_params.multi_items() if k == "fields"]
    if fields:
        zones = [{k: v for k, v in z.items() if k in fields} for z in zones]
    return JSONResponse({"availability_zones": zones})
