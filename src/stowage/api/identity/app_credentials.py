"""Application credentials (Keystone's /v3/users/{user_id}/application_credentials) and the
access rules they carry."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from stowage.api.auth import cloud_of, require_context
from stowage.api.common import Context
from stowage.api.identity.policy import forbid
from stowage.api.identity.views import base_of, collection, envelope, iso
from stowage.api.responses import JSONResponse
from stowage.domain.errors import NotFound
from stowage.ledger.objects import Document
from stowage.services import app_credentials as svc
from stowage.services.identity import Forbidden

__all__ = ["credential_view", "router"]

router = APIRouter()
_BASE = "/v3/users/{user_id}/application_credentials"


def credential_view(request: Request, doc: Document) -> dict[str, Any]:
    body = doc.body
    expires_at = body.get("expires_at")
    return {
        "id": doc.id,
        "name": body["name"],
        "description": body.get("description"),
        "user_id": body["user_id"],
        "project_id": body["project_id"],
        # Keystone shows a credential's expiry without the zone designator.
        "expires_at": iso(float(expires_at)).removesuffix("Z") if expires_at is not None else None,
        "roles": body.get("roles", []),
        "unrestricted": bool(body.get("unrestricted", False)),
        "access_rules": body.get("access_rules", []),
        "links": {
            "self": f"{base_of(request)}/users/{body['user_id']}/application_credentials/{doc.id}"
        },
    }


def _owner_or_admin(request: Request, user_id: str, action: str) -> Context:
    """Keystone's defaults: the credential's user, or an admin."""
    ctx = require_context(request)
    if ctx.user_id != user_id and not ctx.is_admin:
        raise forbid(f"identity:{action}")
    return ctx


@router.post(_BASE)
async def create_credential(request: Request, user_id: str) -> JSONResponse:
    ctx = require_context(request)
    if ctx.user_id != user_id:
        raise forbid("identity:create_application_credential")
    cloud = cloud_of(request)
    if svc.METHOD in cloud.tokens.validate(ctx.token).methods:
        own = svc.credential_of_token(cloud, ctx.audit_id)
        if own is None or not own.body.get("unrestricted"):
            raise Forbidden(
                "Using method 'application_credential' is not allowed for managing additional "
                "application credentials."
            )
    fields = await envelope(request, "application_credential")
    doc, secret = await asyncio.to_thread(
        svc.create,
        cloud,
        user_id=user_id,
        project_id=ctx.project_id,
        held_roles=sorted(ctx.roles),
        fields=fields,
    )
    view = {**credential_view(request, doc), "secret": secret}
    return JSONResponse({"application_credential": view}, status_code=201)


@router.get(_BASE)
async def list_credentials(request: Request, user_id: str) -> JSONResponse:
    _owner_or_admin(request, user_id, "list_application_credentials")
    docs = svc.list_of(cloud_of(request), user_id)
    if "name" in request.query_params:
        docs = [d for d in docs if d.body.get("name") == request.query_params["name"]]
    path = f"users/{user_id}/application_credentials"
    page = collection(
        request, "application_credentials", docs, lambda d: credential_view(request, d), path=path
    )
    return JSONResponse(page)


@router.api_route(_BASE + "/{cred_id}", methods=["GET", "HEAD"])
async def show_credential(request: Request, user_id: str, cred_id: str) -> JSONResponse:
    _owner_or_admin(request, user_id, "get_application_credential")
    doc = svc.get(cloud_of(request), user_id, cred_id)
    return JSONResponse({"application_credential": credential_view(request, doc)})


@router.delete(_BASE + "/{cred_id}")
async def delete_credential(request: Request, user_id: str, cred_id: str) -> Response:
    ctx = _owner_or_admin(request, user_id, "delete_application_credential")
    cloud = cloud_of(request)
    if ctx.user_id == user_id and svc.METHOD in cloud.tokens.validate(ctx.token).methods:
        own = svc.credential_of_token(cloud, ctx.audit_id)
        if own is None or not own.body.get("unrestricted"):
            raise Forbidden(
                "Using method 'application_credential' is not allowed for managing additional "
                "application credentials."
            )
    svc.delete(cloud, user_id, cred_id)
    return Response(status_code=204)


# -- access rules: those of the user's credentials ------------------------------------------


def _rules(request: Request, user_id: str) -> list[dict[str, Any]]:
    base = base_of(request)
    return [
        {
            "id": doc.id,
            "service": doc.body["service"],
            "method": doc.body["method"],
            "path": doc.body["path"],
            "links": {"self": f"{base}/users/{user_id}/access_rules/{doc.id}"},
        }
        for doc in svc.access_rules_of(cloud_of(request), user_id)
    ]


@router.get("/v3/users/{user_id}/access_rules")
async def list_access_rules(request: Request, user_id: str) -> JSONResponse:
    _owner_or_admin(request, user_id, "list_access_rules")
    return JSONResponse({"access_rules": _rules(request, user_id), "links": {"self": None}})


@router.get("/v3/users/{user_id}/access_rules/{rule_id}")
async def show_access_rule(request: Request, user_id: str, rule_id: str) -> JSONResponse:
    _owner_or_admin(request, user_id, "get_access_rule")
    rule = next((r for r in _rules(request, user_id) if r["id"] == rule_id), None)
    if rule is None:
        raise NotFound(f"Could not find Access Rule: {rule_id}.")
    return JSONResponse({"access_rule": rule})


@router.delete("/v3/users/{user_id}/access_rules/{rule_id}")
async def delete_access_rule(request: Request, user_id: str, rule_id: str) -> Response:
    _owner_or_admin(request, user_id, "delete_access_rule")
    svc.delete_access_rule(cloud_of(request), user_id, rule_id)
    return Response(status_code=204)
