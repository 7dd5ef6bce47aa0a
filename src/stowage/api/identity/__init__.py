"""Identity v3 (Keystone): version discovery, password tokens with a catalog."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from stowage.api.auth import cloud_of, context_from_token, require_context
from stowage.api.common import ApiError, Context, identity_error, install_common, json_body
from stowage.domain.errors import NotFound
from stowage.services.cloud import Cloud

__all__ = ["create_identity_app", "iso"]

API_VERSION = "v3.14"


def iso(ts: float) -> str:
    """Keystone's timestamp format: 2030-01-01T00:00:00.000000Z."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _version_doc(base: str) -> dict[str, Any]:
    return {
        "id": API_VERSION,
        "status": "stable",
        "updated": "2020-04-07T00:00:00Z",
        "links": [{"rel": "self", "href": f"{base}/identity/v3/"}],
        "media-types": [
            {"base": "application/json", "type": "application/vnd.openstack.identity-v3+json"}
        ],
    }


router = APIRouter()


@router.get("/")
async def versions(request: Request) -> JSONResponse:
    base = cloud_of(request).config.base_url
    return JSONResponse({"versions": {"values": [_version_doc(base)]}}, status_code=300)


@router.get("/v3")
@router.get("/v3/")
async def version(request: Request) -> JSONResponse:
    return JSONResponse({"version": _version_doc(cloud_of(request).config.base_url)})


def _resolve_user(cloud: Cloud, user: dict[str, Any]) -> str:
    if "id" in user:
        return str(user["id"])
    name = user.get("name")
    if not name:
        raise ApiError(400, "Invalid input for field 'identity/password/user': name or id required")
    domain = user.get("domain") or {}
    domain_id = domain.get("id") or _domain_id_by_name(cloud, domain.get("name", "Default"))
    try:
        return cloud.find_by_name("user", name, domain_id=domain_id).id
    except NotFound:
        raise ApiError(401, "The request you have made requires authentication.") from None


def _domain_id_by_name(cloud: Cloud, name: str) -> str:
    try:
        return cloud.find_by_name("domain", name).id
    except NotFound:
        raise ApiError(401, "The request you have made requires authentication.") from None


def _resolve_project(cloud: Cloud, scope: dict[str, Any] | None, user_id: str) -> str:
    if not scope:
        user = cloud.objects.get("user", user_id)
        default = user.body.get("default_project_id")
        if not default:
            raise ApiError(401, "An unscoped token needs a default project here.")
        return str(default)
    project = scope.get("project")
    if not project:
        raise ApiError(400, "Only project scope is supported.")
    if "id" in project:
        return str(project["id"])
    domain = project.get("domain") or {}
    domain_id = domain.get("id") or _domain_id_by_name(cloud, domain.get("name", "Default"))
    try:
        return cloud.find_by_name("project", project["name"], domain_id=domain_id).id
    except NotFound:
        raise ApiError(401, f"Could not find project: {project['name']}.") from None


def token_body(cloud: Cloud, ctx: Context, issued_at: float, methods: list[str]) -> dict[str, Any]:
    project = cloud.objects.find("project", ctx.project_id)
    role_docs = {d.name: d.id for d in cloud.objects.list("role")}
    return {
        "token": {
            "methods": methods,
            "expires_at": iso(ctx.expires_at),
            "issued_at": iso(issued_at),
            "audit_ids": [ctx.audit_id],
            "user": {
                "id": ctx.user_id,
                "name": ctx.user_name,
                "domain": {"id": "default", "name": "Default"},
                "password_expires_at": None,
            },
            "project": {
                "id": ctx.project_id,
                "name": project.name if project else "",
                "domain": {"id": "default", "name": "Default"},
            },
            "roles": [{"id": role_docs.get(r, r), "name": r} for r in sorted(ctx.roles)],
            "catalog": cloud.catalog(),
            "is_domain": False,
        }
    }


@router.post("/v3/auth/tokens")
async def issue_token(request: Request) -> JSONResponse:
    cloud = cloud_of(request)
    body = await json_body(request)
    try:
        identity = body["auth"]["identity"]
        methods = list(identity["methods"])
    except (KeyError, TypeError):
        raise ApiError(400, "Invalid input for field 'auth/identity': required") from None
    scope = body["auth"].get("scope")
    if "password" in methods:
        user_ref = identity.get("password", {}).get("user", {})
        user_id = _resolve_user(cloud, user_ref)
        if cloud.authenticate(user_id, str(user_ref.get("password", ""))) is None:
            raise ApiError(401, "The request you have made requires authentication.")
    elif "token" in methods:
        existing = context_from_token(cloud, identity.get("token", {}).get("id", ""))
        user_id = existing.user_id
    else:
        raise ApiError(401, f"Unsupported authentication methods: {methods}")
    project_id = _resolve_project(cloud, scope, user_id)
    roles = cloud.roles_of(user_id, project_id)
    if not roles:
        raise ApiError(401, "The user has no role on the requested project.")
    token, payload = cloud.tokens.issue(user_id, project_id, roles, methods=tuple(methods))
    ctx = context_from_token(cloud, token)
    return JSONResponse(
        token_body(cloud, ctx, payload.issued_at, methods),
        status_code=201,
        headers={"X-Subject-Token": token},
    )


@router.get("/v3/auth/tokens")
async def validate_token(request: Request) -> JSONResponse:
    cloud = cloud_of(request)
    require_context(request)
    subject = context_from_token(cloud, request.headers.get("x-subject-token", ""))
    payload = cloud.tokens.validate(subject.token)
    return JSONResponse(
        token_body(cloud, subject, payload.issued_at, list(payload.methods)),
        headers={"X-Subject-Token": subject.token},
    )


@router.head("/v3/auth/tokens")
async def check_token(request: Request) -> Response:
    cloud = cloud_of(request)
    require_context(request)
    context_from_token(cloud, request.headers.get("x-subject-token", ""))
    return Response(status_code=200)


@router.delete("/v3/auth/tokens")
async def revoke_token(request: Request) -> Response:
    cloud = cloud_of(request)
    require_context(request)
    subject = context_from_token(cloud, request.headers.get("x-subject-token", ""))
    cloud.objects.put("revoked_token", subject.audit_id, {"expires_at": subject.expires_at})
    return Response(status_code=204)


@router.get("/v3/auth/catalog")
async def catalog(request: Request) -> JSONResponse:
    require_context(request)
    return JSONResponse({"catalog": cloud_of(request).catalog()})


def create_identity_app(cloud: Cloud) -> FastAPI:
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    app.state.cloud = cloud
    install_common(app, identity_error)
    app.include_router(router)
    return app
