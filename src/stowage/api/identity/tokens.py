"""Password and token authentication: issue, validate, check and revoke tokens; the catalog."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from stowage.api.auth import cloud_of, context_from_token, require_context
from stowage.api.common import ApiError, Context, json_body
from stowage.api.identity.views import iso
from stowage.api.responses import JSONResponse
from stowage.domain.errors import NotFound
from stowage.ledger.objects import Document
from stowage.services import app_credentials
from stowage.services.catalog import catalog_of
from stowage.services.cloud import DEFAULT_DOMAIN, Cloud
from stowage.services.identity import IdentityDirectory, Unauthorized, domain_scope_key
from stowage.services.identity_groups import GroupDirectory
from stowage.services.identity_system import system_roles_of

__all__ = ["router", "token_body"]

router = APIRouter()

_UNAUTHORIZED = "The request you have made requires authentication."


def _domain_id(cloud: Cloud, ref: Any) -> str:
    ref = ref or {}
    if not isinstance(ref, dict):
        raise ApiError(400, "Invalid input for field 'domain': an object with a name or id")
    if ref.get("id"):
        return str(ref["id"])
    try:
        return cloud.find_by_name("domain", str(ref.get("name", "Default"))).id
    except NotFound:
        raise ApiError(401, _UNAUTHORIZED) from None


def _resolve_user(cloud: Cloud, ref: Any) -> Document | None:
    """The user a password login names, or None when there is none (the caller still hashes
    the password, so that the answer's time does not tell)."""
    if not isinstance(ref, dict) or not (ref.get("id") or ref.get("name")):
        raise ApiError(400, "Invalid input for field 'identity/password/user': name or id required")
    if ref.get("id"):
        return cloud.objects.find("user", str(ref["id"]))
    try:
        domain_id = _domain_id(cloud, ref.get("domain"))
        return cloud.find_by_name("user", str(ref["name"]), domain_id=domain_id)
    except (ApiError, NotFound):
        return None


def _password_user(cloud: Cloud, ref: Any) -> Document:
    user = _resolve_user(cloud, ref)
    assert isinstance(ref, dict)  # _resolve_user refuses anything else
    password = ref.get("password", "")
    if not isinstance(password, str):
        raise ApiError(400, "Invalid input for field 'identity/password/user/password'")
    return IdentityDirectory(cloud).password_login(user, password)


def _wants_system(scope: Any) -> bool:
    """Keystone's system scope: {"system": {"all": true}}."""
    if not isinstance(scope, dict) or "system" not in scope:
        return False
    if scope["system"] != {"all": True}:
        raise ApiError(400, "Invalid input for field 'scope/system': only {\"all\": true}")
    return True


def _wanted_domain(cloud: Cloud, scope: Any) -> Document | None:
    """The domain a domain-scoped request names ({"domain": {"id"|"name"}}), or None when
    the scope is not a domain's; 401 for one that is missing or disabled, as Keystone."""
    if not isinstance(scope, dict) or "domain" not in scope:
        return None
    ref = scope["domain"]
    if not isinstance(ref, dict) or not (ref.get("id") or ref.get("name")):
        raise ApiError(400, "Invalid input for field 'scope/domain': name or id required")
    if ref.get("id"):
        domain = cloud.objects.find("domain", str(ref["id"]))
    else:
        try:
            domain = cloud.find_by_name("domain", str(ref["name"]))
        except NotFound:
            domain = None
    if domain is None:
        raise ApiError(401, f"Could not find domain: {ref.get('id') or ref.get('name')}.")
    if not domain.body.get("enabled", True):
        raise ApiError(401, f"Domain is disabled: {domain.id}.")
    return domain


def _resolve_project(cloud: Cloud, scope: Any, user: Document) -> Document | None:
    """The project to scope to: the one asked for, or else the user's default project; None
    for an unscoped token (no scope and no default project)."""
    if not scope:
        default = user.body.get("default_project_id")
        if not default:
            return None
        project = cloud.objects.find("project", str(default))
        if project is None:
            raise ApiError(401, f"Could not find the default project {default} of the user.")
        return project
    if not isinstance(scope, dict) or not isinstance(scope.get("project"), dict):
        raise ApiError(400, "Only project scope is supported.")
    ref = scope["project"]
    if ref.get("id"):
        project = cloud.objects.find("project", str(ref["id"]))
        if project is None:
            raise ApiError(401, f"Could not find project: {ref['id']}.")
        return project
    if not ref.get("name"):
        raise ApiError(400, "Invalid input for field 'scope/project': name or id required")
    domain_id = _domain_id(cloud, ref.get("domain"))
    try:
        return cloud.find_by_name("project", str(ref["name"]), domain_id=domain_id)
    except NotFound:
        raise ApiError(401, f"Could not find project: {ref['name']}.") from None


def _domain_ref(cloud: Cloud, domain_id: str) -> dict[str, str]:
    domain = cloud.objects.find("domain", domain_id)
    return {"id": domain_id, "name": domain.name or "" if domain is not None else ""}


def token_body(
    cloud: Cloud,
    ctx: Context,
    issued_at: float,
    methods: list[str],
    audit_ids: list[str] | None = None,
) -> dict[str, Any]:
    user = cloud.objects.find("user", ctx.user_id)
    project = cloud.objects.find("project", ctx.project_id)
    user_domain = str(user.body.get("domain_id", DEFAULT_DOMAIN)) if user else DEFAULT_DOMAIN
    project_domain = (
        str(project.body.get("domain_id", DEFAULT_DOMAIN)) if project else DEFAULT_DOMAIN
    )
    who = {
        "methods": methods,
        "expires_at": iso(ctx.expires_at),
        "issued_at": iso(issued_at),
        "audit_ids": audit_ids or [ctx.audit_id],
        "user": {
            "id": ctx.user_id,
            "name": ctx.user_name,
            "domain": _domain_ref(cloud, user_domain),
            "password_expires_at": None,
        },
    }
    role_ids = {d.name: d.id for d in cloud.objects.list("role")}
    domain_scope = ctx.extras.get("domain_scope")
    if domain_scope:
        held = sorted(ctx.extras.get("domain_roles", ()))
        return {
            "token": {
                **who,
                "domain": _domain_ref(cloud, str(domain_scope)),
                "roles": [{"id": role_ids.get(r, r), "name": r} for r in held],
                "catalog": catalog_of(cloud, None),
            }
        }
    if ctx.project_id == "" and not ctx.roles:
        # Unscoped (Keystone's): who and until when, no scope, roles or catalog.
        return {"token": who}
    return {
        "token": {
            **who,
            **_scope_part(cloud, ctx, project, project_domain),
            "roles": [{"id": role_ids.get(r, r), "name": r} for r in sorted(ctx.roles)],
            "catalog": catalog_of(cloud, ctx.project_id or None),
            "is_domain": False,
            **_credential_part(cloud, ctx, methods),
        }
    }


def _scope_part(
    cloud: Cloud, ctx: Context, project: Document | None, project_domain: str
) -> dict[str, Any]:
    if ctx.project_id == "":
        return {"system": {"all": True}}
    return {
        "project": {
            "id": ctx.project_id,
            "name": project.name if project else "",
            "domain": _domain_ref(cloud, project_domain),
        }
    }


def _credential_part(cloud: Cloud, ctx: Context, methods: list[str]) -> dict[str, Any]:
    """Keystone's `application_credential` of a token issued from one."""
    if app_credentials.METHOD not in methods:
        return {}
    cred = app_credentials.credential_of_token(cloud, ctx.audit_id)
    if cred is None:
        return {}
    part: dict[str, Any] = {
        "id": cred.id,
        "name": cred.body["name"],
        "restricted": not cred.body.get("unrestricted", False),
    }
    if cred.body.get("access_rules"):
        part["access_rules"] = cred.body["access_rules"]
    return {"application_credential": part}


@router.post("/v3/auth/tokens")
async def issue_token(request: Request) -> JSONResponse:
    cloud = cloud_of(request)
    directory = IdentityDirectory(cloud)
    body = await json_body(request)
    try:
        identity = body["auth"]["identity"]
        methods = list(identity["methods"])
    except (KeyError, TypeError):
        raise ApiError(400, "Invalid input for field 'auth/identity': required") from None
    scope = body["auth"].get("scope")
    parent = None
    if "password" in methods:
        password = identity.get("password")
        ref = password.get("user") if isinstance(password, dict) else None
        try:
            # scrypt takes tens of milliseconds: off the event loop.
            user = await asyncio.to_thread(_password_user, cloud, ref)
        except Unauthorized as exc:
            raise ApiError(401, exc.message) from None
    elif "token" in methods:
        token_ref = identity.get("token")
        token_id = token_ref.get("id", "") if isinstance(token_ref, dict) else ""
        user = cloud.objects.get("user", context_from_token(cloud, str(token_id)).user_id)
        # A rescoped token expires with its parent and carries its audit chain, and names
        # the parent's methods beside "token" (Keystone's: how the user first proved itself).
        parent = cloud.tokens.validate(str(token_id))
        if app_credentials.METHOD in parent.methods:
            # Its access rules and roles bind the credential's own tokens only: a token
            # made from one would shed them.
            raise ApiError(
                403,
                "You are not authorized to perform the requested action: using a token "
                "issued from an application credential to obtain another token.",
            )
        methods += [m for m in parent.methods if m not in methods]
    elif app_credentials.METHOD in methods:
        return await _issue_for_credential(cloud, identity.get(app_credentials.METHOD), scope)
    else:
        raise ApiError(401, f"Unsupported authentication methods: {methods}")
    try:
        directory.check_user_may_log_in(user)
        project_id, domain_id, roles = _scope_and_roles(cloud, directory, user, scope)
    except Unauthorized as exc:
        raise ApiError(401, exc.message) from None
    token, payload = cloud.tokens.issue(
        user.id, project_id, roles, methods=tuple(methods), parent=parent, domain_id=domain_id
    )
    scope_key = domain_scope_key(domain_id) if domain_id else project_id
    directory.record_token(payload.audit_id, user.id, scope_key, payload.expires_at)
    ctx = context_from_token(cloud, token)
    return JSONResponse(
        token_body(cloud, ctx, payload.issued_at, methods, payload.audit_ids),
        status_code=201,
        headers={"X-Subject-Token": token},
    )


def _scope_and_roles(
    cloud: Cloud, directory: IdentityDirectory, user: Document, scope: Any
) -> tuple[str, str, tuple[str, ...]]:
    """The project id and domain id a token is scoped to (both empty: system-scoped with
    roles, unscoped without) and its roles; Unauthorized without a role there."""
    domain = _wanted_domain(cloud, scope)
    if _wants_system(scope):
        roles = system_roles_of(cloud, user.id)
        if not roles:
            raise Unauthorized(f"The user {user.id} has no role on the system.")
        return "", "", roles
    if domain is not None:
        roles = GroupDirectory(cloud).domain_roles_of(user.id, domain.id)
        if not roles:
            raise Unauthorized(f"The user {user.id} has no role on domain {domain.id}.")
        return "", domain.id, roles
    project = _resolve_project(cloud, scope, user)
    if project is None:  # unscoped: no project, no roles, no catalog
        return "", "", ()
    directory.check_project_usable(project)
    roles = cloud.roles_of(user.id, project.id)
    if not roles:
        raise Unauthorized(f"The user {user.id} has no role on project {project.id}.")
    return project.id, "", roles


async def _issue_for_credential(cloud: Cloud, ref: Any, scope: Any) -> JSONResponse:
    """A token from an application credential: its project, its roles, never another scope."""
    directory = IdentityDirectory(cloud)
    if scope:
        raise ApiError(401, "Application credentials cannot request a scope.")
    try:
        # The secret is hashed like a password: off the event loop.
        cred = await asyncio.to_thread(app_credentials.authenticate, cloud, ref)
        user = cloud.objects.get("user", str(cred.body["user_id"]))
        directory.check_user_may_log_in(user)
        project = directory.project(str(cred.body["project_id"]))
        directory.check_project_usable(project)
        roles = app_credentials.token_roles(cloud, cred)
    except (Unauthorized, NotFound) as exc:
        raise ApiError(401, exc.message) from None
    methods = [app_credentials.METHOD]
    token, payload = cloud.tokens.issue(user.id, project.id, roles, methods=tuple(methods))
    directory.record_token(payload.audit_id, user.id, project.id, payload.expires_at)
    app_credentials.record_token(cloud, payload.audit_id, cred, payload.expires_at)
    ctx = context_from_token(cloud, token)
    return JSONResponse(
        token_body(cloud, ctx, payload.issued_at, methods, payload.audit_ids),
        status_code=201,
        headers={"X-Subject-Token": token},
    )


def _subject(request: Request, action: str) -> Context:
    """The token in X-Subject-Token, when the caller may see it: Keystone's policy for
    identity:validate_token, check_token and revoke_token allows admin, service or the
    token's own user."""
    cloud = cloud_of(request)
    caller = require_context(request)
    try:
        subject = context_from_token(cloud, request.headers.get("x-subject-token", ""))
    except ApiError as exc:
        # The caller authenticated; the token it asks about is not valid: Keystone's
        # TokenNotFound (404), whether forged, expired or revoked.
        if exc.status != 401:
            raise
        raise ApiError(404, f"Could not find token: {exc.message}") from None
    if not (caller.roles & {"admin", "service"} or caller.user_id == subject.user_id):
        raise ApiError(403, f"You are not authorized to perform the requested action: {action}.")
    return subject


@router.get("/v3/auth/tokens")
async def validate_token(request: Request) -> JSONResponse:
    cloud = cloud_of(request)
    subject = _subject(request, "identity:validate_token")
    payload = cloud.tokens.validate(subject.token)
    return JSONResponse(
        token_body(cloud, subject, payload.issued_at, list(payload.methods), payload.audit_ids),
        headers={"X-Subject-Token": subject.token},
    )


@router.head("/v3/auth/tokens")
async def check_token(request: Request) -> Response:
    _subject(request, "identity:check_token")
    return Response(status_code=200)


@router.delete("/v3/auth/tokens")
async def revoke_token(request: Request) -> Response:
    cloud = cloud_of(request)
    subject = _subject(request, "identity:revoke_token")
    IdentityDirectory(cloud).revoke_token(subject.audit_id, subject.expires_at)
    return Response(status_code=204)
