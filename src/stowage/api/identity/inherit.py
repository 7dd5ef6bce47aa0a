"""Inherited role grants (Keystone's OS-INHERIT): on a domain or a project, for its projects."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from stowage.api.common import ApiError
from stowage.api.identity.policy import Caller, admin, caller, forbid
from stowage.api.identity.views import base_of, collection, role_view
from stowage.api.responses import JSONResponse
from stowage.services.identity_inherit import InheritedGrants

__all__ = ["router"]

router = APIRouter()

_GRANT = "/v3/OS-INHERIT/{kind}/{target}/{actors}/{actor_id}/roles/{role_id}/inherited_to_projects"
_KINDS = {"domains": "domain_id", "projects": "project_id"}
_ACTORS = {"users": "user", "groups": "group"}


def _scope(kind: str, actors: str, target: str) -> tuple[str, dict[str, str | None]]:
    if kind not in _KINDS or actors not in _ACTORS:
        raise ApiError(404, "The resource could not be found.")
    return _ACTORS[actors], {
        "domain_id": target if kind == "domains" else None,
        "project_id": target if kind == "projects" else None,
    }


def _may_read(who: Caller, actor: str, actor_id: str, action: str) -> None:
    """Keystone's check_grant and list_grants: a reader of the system, or one's own grants."""
    if not (who.reads_all or (actor == "user" and actor_id == who.ctx.user_id)):
        raise forbid(f"identity:{action}")


@router.put(_GRANT)
async def grant(
    request: Request, kind: str, target: str, actors: str, actor_id: str, role_id: str
) -> Response:
    actor, scope = _scope(kind, actors, target)
    who = admin(request, "create_grant")
    InheritedGrants(who.directory.cloud).grant(actor, actor_id, role_id, **scope)
    return Response(status_code=204)


@router.api_route(_GRANT, methods=["GET", "HEAD"])
async def check(
    request: Request, kind: str, target: str, actors: str, actor_id: str, role_id: str
) -> Response:
    actor, scope = _scope(kind, actors, target)
    who = caller(request)
    _may_read(who, actor, actor_id, "check_grant")
    InheritedGrants(who.directory.cloud).find(actor, actor_id, role_id, **scope)
    return Response(status_code=204)


@router.delete(_GRANT)
async def revoke(
    request: Request, kind: str, target: str, actors: str, actor_id: str, role_id: str
) -> Response:
    actor, scope = _scope(kind, actors, target)
    who = admin(request, "revoke_grant")
    InheritedGrants(who.directory.cloud).revoke(actor, actor_id, role_id, **scope)
    return Response(status_code=204)


@router.get("/v3/OS-INHERIT/domains/{domain_id}/{actors}/{actor_id}/roles/inherited_to_projects")
async def list_grants(request: Request, domain_id: str, actors: str, actor_id: str) -> JSONResponse:
    actor, _ = _scope("domains", actors, domain_id)
    who = caller(request)
    _may_read(who, actor, actor_id, "list_grants")
    inherited = InheritedGrants(who.directory.cloud)
    who.directory.domain(domain_id)
    if actor == "user":
        who.directory.user(actor_id)
    else:
        inherited.directory.group(actor_id)
    role_ids = {
        g.role_id for g in inherited.grants(actor=actor, actor_id=actor_id, domain_id=domain_id)
    }
    docs = [r for r in who.directory.roles() if r.id in role_ids]
    base = base_of(request)
    path = f"OS-INHERIT/domains/{domain_id}/{actors}/{actor_id}/roles/inherited_to_projects"
    return JSONResponse(collection(request, "roles", docs, lambda r: role_view(base, r), path=path))
