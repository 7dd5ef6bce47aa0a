"""Groups (Keystone's /v3/groups), their members, and their role grants on projects and
domains. Admins manage them; a user reads the groups it belongs to."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from stowage.api.auth import cloud_of
from stowage.api.common import ApiError
from stowage.api.identity.policy import admin, caller, forbid, reader_of_all
from stowage.api.identity.views import (
    base_of,
    collection,
    envelope,
    keep,
    matches_name,
    role_view,
    user_view,
)
from stowage.api.responses import JSONResponse
from stowage.ledger.objects import Document
from stowage.services.identity_groups import GroupDirectory

__all__ = ["group_view", "router"]

router = APIRouter()
_GET_HEAD = ["GET", "HEAD"]


def _directory(request: Request) -> GroupDirectory:
    return GroupDirectory(cloud_of(request))


def group_view(base: str, doc: Document) -> dict[str, Any]:
    return {
        **doc.body.get("extra", {}),
        "id": doc.id,
        "name": doc.body.get("name", doc.name),
        "description": doc.body.get("description") or "",
        "domain_id": doc.body.get("domain_id"),
        "links": {"self": f"{base}/groups/{doc.id}"},
    }


def _groups_page(request: Request, docs: list[Document], path: str = "groups") -> JSONResponse:
    base = base_of(request)
    kept = [
        d
        for d in docs
        if matches_name(request, d.body.get("name", ""))
        and keep(request, d, {"domain_id": "domain_id"})
    ]
    return JSONResponse(
        collection(request, "groups", kept, lambda d: group_view(base, d), path=path)
    )


@router.get("/v3/groups")
async def list_groups(request: Request) -> JSONResponse:
    reader_of_all(request, "list_groups")
    return _groups_page(request, _directory(request).groups())


@router.post("/v3/groups")
async def create_group(request: Request) -> JSONResponse:
    admin(request, "create_group")
    doc = _directory(request).create_group(await envelope(request, "group"))
    return JSONResponse({"group": group_view(base_of(request), doc)}, status_code=201)


@router.api_route("/v3/groups/{group_id}", methods=_GET_HEAD)
async def show_group(request: Request, group_id: str) -> JSONResponse:
    who = caller(request)
    directory = _directory(request)
    doc = directory.group(group_id)
    if not who.reads_all and doc.id not in {g.id for g in directory.groups_of(who.ctx.user_id)}:
        raise forbid("identity:get_group")
    return JSONResponse({"group": group_view(base_of(request), doc)})


@router.patch("/v3/groups/{group_id}")
async def update_group(request: Request, group_id: str) -> JSONResponse:
    admin(request, "update_group")
    doc = _directory(request).update_group(group_id, await envelope(request, "group"))
    return JSONResponse({"group": group_view(base_of(request), doc)})


@router.delete("/v3/groups/{group_id}")
async def delete_group(request: Request, group_id: str) -> Response:
    admin(request, "delete_group")
    _directory(request).delete_group(group_id)
    return Response(status_code=204)


# -- membership -----------------------------------------------------------------------------


@router.get("/v3/groups/{group_id}/users")
async def list_members(request: Request, group_id: str) -> JSONResponse:
    reader_of_all(request, "list_users_in_group")
    directory = _directory(request)
    directory.group(group_id)
    ids = directory.member_ids(group_id)
    docs = directory.objects.list("user", ids=ids) if ids else []
    base = base_of(request)
    path = f"groups/{group_id}/users"
    return JSONResponse(collection(request, "users", docs, lambda d: user_view(base, d), path=path))


@router.put("/v3/groups/{group_id}/users/{user_id}")
async def add_member(request: Request, group_id: str, user_id: str) -> Response:
    admin(request, "add_user_to_group")
    _directory(request).add_member(group_id, user_id)
    return Response(status_code=204)


@router.api_route("/v3/groups/{group_id}/users/{user_id}", methods=_GET_HEAD)
async def check_member(request: Request, group_id: str, user_id: str) -> Response:
    who = caller(request)
    if not who.may_see_user(user_id):
        raise forbid("identity:check_user_in_group")
    if not _directory(request).is_member(group_id, user_id):
        raise ApiError(404, f"User {user_id} is not a member of group {group_id}.")
    return Response(status_code=204)


@router.delete("/v3/groups/{group_id}/users/{user_id}")
async def remove_member(request: Request, group_id: str, user_id: str) -> Response:
    admin(request, "remove_user_from_group")
    _directory(request).remove_member(group_id, user_id)
    return Response(status_code=204)


@router.get("/v3/users/{user_id}/groups")
async def list_user_groups(request: Request, user_id: str) -> JSONResponse:
    who = caller(request)
    directory = _directory(request)
    directory.user(user_id)
    if not who.may_see_user(user_id):
        raise forbid("identity:list_groups_for_user")
    return _groups_page(request, directory.groups_of(user_id), f"users/{user_id}/groups")


# -- a group's grants -----------------------------------------------------------------------

_SCOPES = {"projects", "domains"}


def _scope(directory: GroupDirectory, kind: str, target: str) -> dict[str, str | None]:
    if kind not in _SCOPES:
        raise ApiError(404, "The resource could not be found.")
    if kind == "projects":
        directory.project(target)
        return {"project_id": target, "domain_id": None}
    directory.domain(target)
    return {"project_id": None, "domain_id": target}


_GRANT = "/v3/{kind}/{target}/groups/{group_id}/roles/{role_id}"


@router.put(_GRANT)
async def grant_role(
    request: Request, kind: str, target: str, group_id: str, role_id: str
) -> Response:
    admin(request, "create_grant")
    directory = _directory(request)
    directory.grant_group(group_id, role_id, **_scope(directory, kind, target))
    return Response(status_code=204)


@router.api_route(_GRANT, methods=_GET_HEAD)
async def check_role(
    request: Request, kind: str, target: str, group_id: str, role_id: str
) -> Response:
    reader_of_all(request, "check_grant")
    directory = _directory(request)
    scope = _scope(directory, kind, target)
    directory.group(group_id)
    directory.role(role_id)
    if directory.find_group_grant(group_id, role_id, **scope) is None:
        raise ApiError(
            404,
            f"Could not find role assignment with role: {role_id}, user or group: {group_id}, "
            f"project, domain, or system: {target}.",
        )
    return Response(status_code=204)


@router.delete(_GRANT)
async def revoke_role(
    request: Request, kind: str, target: str, group_id: str, role_id: str
) -> Response:
    admin(request, "revoke_grant")
    directory = _directory(request)
    directory.revoke_group(group_id, role_id, **_scope(directory, kind, target))
    return Response(status_code=204)


@router.get("/v3/{kind}/{target}/groups/{group_id}/roles")
async def list_grants(request: Request, kind: str, target: str, group_id: str) -> JSONResponse:
    reader_of_all(request, "list_grants")
    directory = _directory(request)
    scope = _scope(directory, kind, target)
    directory.group(group_id)
    role_ids = {
        g.role_id
        for g in directory.group_grants(group_id=group_id, **scope)
        if g.project_id == scope["project_id"] and g.domain_id == scope["domain_id"]
    }
    docs = [r for r in directory.roles() if r.id in role_ids]
    base = base_of(request)
    path = f"{kind}/{target}/groups/{group_id}/roles"
    return JSONResponse(collection(request, "roles", docs, lambda r: role_view(base, r), path=path))
