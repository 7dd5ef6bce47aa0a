"""Role grants on the system (Keystone's /v3/system/users/{user_id}/roles)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from stowage.api.auth import cloud_of
from stowage.api.identity.policy import Caller, admin, caller, forbid, reader_of_all
from stowage.api.identity.views import base_of, collection, role_view
from stowage.api.responses import JSONResponse
from stowage.services import identity_system as svc
from stowage.services.identity_groups import GroupDirectory

__all__ = ["router"]

router = APIRouter()
_GRANT = "/v3/system/users/{user_id}/roles/{role_id}"


@router.put(_GRANT)
async def grant(request: Request, user_id: str, role_id: str) -> Response:
    admin(request, "create_system_grant_for_user")
    svc.grant_system(cloud_of(request), user_id, role_id)
    return Response(status_code=204)


@router.api_route(_GRANT, methods=["GET", "HEAD"])
async def check(request: Request, user_id: str, role_id: str) -> Response:
    who = caller(request)
    if not who.may_see_user(user_id):
        raise forbid("identity:check_system_grant_for_user")
    who.directory.user(user_id)
    who.directory.role(role_id)
    if not svc.has_system_grant(cloud_of(request), user_id, role_id):
        raise svc.missing_grant(user_id, role_id)
    return Response(status_code=204)


@router.delete(_GRANT)
async def revoke(request: Request, user_id: str, role_id: str) -> Response:
    admin(request, "revoke_system_grant_for_user")
    svc.revoke_system(cloud_of(request), user_id, role_id)
    return Response(status_code=204)


@router.get("/v3/system/users/{user_id}/roles")
async def list_grants(request: Request, user_id: str) -> JSONResponse:
    who = caller(request)
    if not who.may_see_user(user_id):
        raise forbid("identity:list_system_grants_for_user")
    who.directory.user(user_id)
    role_ids = {r for _u, r in svc.system_role_ids(cloud_of(request), user_id)}
    return _roles_page(request, who, role_ids, f"system/users/{user_id}/roles")


# -- groups' grants on the system ---------------------------------------------------------

_GROUP_GRANT = "/v3/system/groups/{group_id}/roles/{role_id}"


@router.put(_GROUP_GRANT)
async def grant_group(request: Request, group_id: str, role_id: str) -> Response:
    admin(request, "create_system_grant_for_group")
    svc.grant_group_system(cloud_of(request), group_id, role_id)
    return Response(status_code=204)


@router.api_route(_GROUP_GRANT, methods=["GET", "HEAD"])
async def check_group(request: Request, group_id: str, role_id: str) -> Response:
    who = reader_of_all(request, "check_system_grant_for_group")
    GroupDirectory(who.directory.cloud).group(group_id)
    who.directory.role(role_id)
    if not svc.has_group_system_grant(cloud_of(request), group_id, role_id):
        raise svc.missing_grant(group_id, role_id)
    return Response(status_code=204)


@router.delete(_GROUP_GRANT)
async def revoke_group(request: Request, group_id: str, role_id: str) -> Response:
    admin(request, "revoke_system_grant_for_group")
    svc.revoke_group_system(cloud_of(request), group_id, role_id)
    return Response(status_code=204)


@router.get("/v3/system/groups/{group_id}/roles")
async def list_group_grants(request: Request, group_id: str) -> JSONResponse:
    who = reader_of_all(request, "list_system_grants_for_group")
    GroupDirectory(who.directory.cloud).group(group_id)
    role_ids = {r for _g, r in svc.group_system_role_ids(cloud_of(request), group_id)}
    return _roles_page(request, who, role_ids, f"system/groups/{group_id}/roles")


def _roles_page(request: Request, who: Caller, role_ids: set[str], path: str) -> JSONResponse:
    """The roles of a user's or a group's system grants, as Keystone lists them."""
    docs = [r for r in who.directory.roles() if r.id in role_ids]
    base = base_of(request)
    return JSONResponse(collection(request, "roles", docs, lambda r: role_view(base, r), path=path))
