"""Compute v2.1: absolute limits and quota sets (overrides stored as documents of kind "quota";
with the unified limits driver, Keystone's limits are shown and the updates change nothing)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from stowage.api.auth import cloud_of, require_admin, require_context
from stowage.api.common import ApiError, Context, json_body
from stowage.api.compute.microversion import mv
from stowage.api.responses import JSONResponse
from stowage.domain.errors import InvalidSpec
from stowage.services import compute_catalog as catalog
from stowage.services import identity_limits
from stowage.services import quotas as quotas_service

__all__ = ["router"]

router = APIRouter()

# Quotas that 2.36 dropped (nova-network proxies) and that 2.57 dropped (personality files).
_NETWORK = ("fixed_ips", "floating_ips", "security_groups", "security_group_rules")
_PERSONALITY = ("injected_files", "injected_file_content_bytes", "injected_file_path_bytes")
# Usage is counted for these; the others are per-request limits with nothing to count.

_LIMIT_NAMES: dict[str, tuple[str, ...]] = {
    "ram": ("maxTotalRAMSize",),
    "instances": ("maxTotalInstances",),
    "cores": ("maxTotalCores",),
    "key_pairs": ("maxTotalKeypairs",),
    "floating_ips": ("maxTotalFloatingIps",),
    "metadata_items": ("maxServerMeta", "maxImageMeta"),
    "injected_files": ("maxPersonality",),
    "injected_file_content_bytes": ("maxPersonalitySize",),
    "security_groups": ("maxSecurityGroups",),
    "security_group_rules": ("maxSecurityGroupRules",),
    "server_groups": ("maxServerGroups",),
    "server_group_members": ("maxServerGroupMembers",),
}
_USED_NAMES = {
    "ram": "totalRAMUsed",
    "cores": "totalCoresUsed",
    "instances": "totalInstancesUsed",
    "floating_ips": "totalFloatingIpsUsed",
    "security_groups": "totalSecurityGroupsUsed",
    "server_groups": "totalServerGroupsUsed",
}


def _resources(request: Request) -> list[str]:
    """The quota resources the request's microversion shows."""
    version = mv(request)
    names = list(catalog.DEFAULT_QUOTAS)
    if version >= (2, 36):
        names = [n for n in names if n not in _NETWORK]
    if version >= (2, 57):
        names = [n for n in names if n not in _PERSONALITY]
    return names


def _project(request: Request, ctx: Context, project_id: str) -> str:
    """Members may look at their own project's quotas only (Nova's policy answers 403)."""
    if project_id != ctx.project_id and not ctx.is_admin:
        raise ApiError(
            403, "Policy doesn't allow os_compute_api:os-quota-sets:show to be performed."
        )
    return project_id


# -- limits ---------------------------------------------------------------------------------


@router.get("/limits")
async def limits(request: Request) -> JSONResponse:
    ctx = require_context(request)
    cloud = cloud_of(request)
    project_id = request.query_params.get("tenant_id") or ctx.project_id
    if project_id != ctx.project_id and not ctx.is_admin:
        raise ApiError(
            403, "Policy doesn't allow os_compute_api:limits:other_project to be performed."
        )
    version = mv(request)
    shown = set(_resources(request))
    quotas = catalog.quota_limits(cloud, project_id)
    used = catalog.quota_usage(cloud, project_id)
    absolute: dict[str, int] = {}
    for resource, names in _LIMIT_NAMES.items():
        if resource not in shown:
            continue
        for name in names:
            if name == "maxImageMeta" and version >= (2, 39):
                continue
            absolute[name] = quotas[resource]
    for resource, name in _USED_NAMES.items():
        if resource in shown:
            absolute[name] = used[resource]
    return JSONResponse({"limits": {"rate": [], "absolute": absolute}})


# -- quota sets -----------------------------------------------------------------------------


@router.get("/os-quota-sets/{project_id}/defaults")
async def defaults(project_id: str, request: Request) -> JSONResponse:
    require_context(request)
    defaults = catalog.default_quotas(cloud_of(request))
    body: dict[str, Any] = {"id": project_id}
    body.update({r: defaults[r] for r in _resources(request)})
    return JSONResponse({"quota_set": body})


@router.get("/os-quota-sets/{project_id}/detail")
async def detail(project_id: str, request: Request) -> JSONResponse:
    ctx = require_context(request)
    cloud = cloud_of(request)
    _project(request, ctx, project_id)
    user_id = request.query_params.get("user_id")
    quotas = catalog.quota_limits(cloud, project_id, user_id)
    used = catalog.quota_usage(cloud, project_id, user_id)
    body: dict[str, Any] = {"id": project_id}
    for resource in _resources(request):
        body[resource] = {"limit": quotas[resource], "in_use": used[resource], "reserved": 0}
    return JSONResponse({"quota_set": body})


@router.get("/os-quota-sets/{project_id}")
async def show(project_id: str, request: Request) -> JSONResponse:
    ctx = require_context(request)
    _project(request, ctx, project_id)
    cloud = cloud_of(request)
    if catalog.parse_bool(request.query_params.get("usage", "false"), "usage"):
        return await detail(project_id, request)
    quotas = catalog.quota_limits(cloud, project_id, request.query_params.get("user_id"))
    body: dict[str, Any] = {"id": project_id}
    body.update({r: quotas[r] for r in _resources(request)})
    return JSONResponse({"quota_set": body})


@router.put("/os-quota-sets/{project_id}")
async def update(project_id: str, request: Request) -> JSONResponse:
    require_admin(request)
    cloud = cloud_of(request)
    if cloud.objects.find("project", project_id) is None:
        # Nova asks Keystone (nova.api.openstack.identity.verify_project_id): a 400.
        raise ApiError(400, f"Project ID {project_id} is not a valid project.")
    # A user's quota is kept and shown; servers are counted against the project's.
    user_id = request.query_params.get("user_id")
    payload = catalog.member(await json_body(request), "quota_set")
    shown = _resources(request)
    catalog.only_keys(payload, [*shown, "force"], "quota_set")
    force = catalog.parse_bool(payload.pop("force", False), "force")
    wanted = {key: catalog.parse_int(value, key, minimum=-1) for key, value in payload.items()}
    # With unified limits, Nova's update APIs behave as its noop driver's: nothing is stored
    # and the answer shows the limits as they are (they change in Keystone: /v3/limits).
    if not identity_limits.uses_unified_limits(cloud):
        try:
            quotas_service.set_quota(cloud, project_id, user_id, wanted, force=force)
        except InvalidSpec as exc:
            raise ApiError(400, str(exc)) from None
    quotas = catalog.quota_limits(cloud, project_id, user_id)
    return JSONResponse({"quota_set": {r: quotas[r] for r in shown}})


@router.delete("/os-quota-sets/{project_id}")
async def revert(project_id: str, request: Request) -> Response:
    require_admin(request)
    cloud = cloud_of(request)
    if not identity_limits.uses_unified_limits(cloud):
        quotas_service.revert_quota(cloud, project_id, request.query_params.get("user_id"))
    return Response(status_code=202)


# -- quota classes (only "default" means anything: it sets every project's defaults) --------


@router.get("/os-quota-class-sets/{class_name}")
async def show_class(class_name: str, request: Request) -> JSONResponse:
    require_admin(request)
    defaults = catalog.default_quotas(cloud_of(request))
    body: dict[str, Any] = {"id": class_name}
    body.update({r: defaults[r] for r in _resources(request)})
    return JSONResponse({"quota_class_set": body})


@router.put("/os-quota-class-sets/{class_name}")
async def update_class(class_name: str, request: Request) -> JSONResponse:
    require_admin(request)
    cloud = cloud_of(request)
    payload = catalog.member(await json_body(request), "quota_class_set")
    shown = _resources(request)
    catalog.only_keys(payload, shown, "quota_class_set")
    wanted = {key: catalog.parse_int(value, key, minimum=-1) for key, value in payload.items()}
    if class_name == "default" and not identity_limits.uses_unified_limits(cloud):
        quotas_service.set_default_quotas(cloud, wanted)
    defaults = catalog.default_quotas(cloud)
    return JSONResponse({"quota_class_set": {r: defaults[r] for r in shown}})
