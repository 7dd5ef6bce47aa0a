"""Token validation for every API but identity's own discovery and token issue."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from stowage.api.common import ApiError, Context
from stowage.services import app_credentials
from stowage.services.cloud import Cloud
from stowage.services.tokens import TokenError

__all__ = ["context_from_token", "require_admin", "require_context", "require_writer"]


def cloud_of(request: Request) -> Cloud:
    cloud: Cloud = request.app.state.cloud
    return cloud


def context_from_token(cloud: Cloud, token: str) -> Context:
    """Validate a token (signature, expiry, revocation, user still enabled) into a context
    (the cloud's `validated_tokens` remembers it briefly: services/tokens.py)."""
    cache = cloud.validated_tokens
    known = cache.get(token)
    if isinstance(known, Context) and known.expires_at > cloud.tokens.clock():
        return known
    generation = cache.generation
    ctx = _validate(cloud, token)
    cache.put(token, ctx, generation)
    return ctx


def _validate(cloud: Cloud, token: str) -> Context:
    try:
        payload = cloud.tokens.validate(token)
    except TokenError as exc:
        raise ApiError(401, str(exc)) from None
    if cloud.objects.find("revoked_token", payload.audit_id) is not None:
        raise ApiError(401, "The token has been revoked.")
    user = cloud.objects.find("user", payload.user_id)
    if user is None or not user.body.get("enabled", True):
        raise ApiError(401, "The user of this token is gone or disabled.")
    project = cloud.objects.find("project", payload.project_id)
    extras: dict[str, Any] = {}
    if "application_credential" in payload.methods:
        extras["application_credential"] = True
    roles = frozenset(payload.roles)
    if payload.domain_id:
        # A domain-scoped token shows its roles on the domain but authorizes no more than
        # an unscoped one: Keystone's domain-wide management policies are not offered, and
        # a role on a domain must not pass for the same role on the whole cloud.
        extras.update(domain_scope=payload.domain_id, domain_roles=payload.roles)
        roles = frozenset()
    return Context(
        user_id=payload.user_id,
        user_name=user.name or "",
        project_id=payload.project_id,
        project_name=project.name if project is not None and project.name else "",
        roles=roles,
        token=token,
        audit_id=payload.audit_id,
        expires_at=payload.expires_at,
        extras=extras,
    )


def require_context(request: Request) -> Context:
    """FastAPI dependency: the caller's context, or a 401."""
    token = request.headers.get("x-auth-token")
    if not token:
        raise ApiError(401, "The request you have made requires authentication.")
    cloud = cloud_of(request)
    ctx = context_from_token(cloud, token)
    if ctx.project_id == "" and not ctx.roles and request.scope.get("root_path") != "/identity":
        # An unscoped token is for identity only (to list projects and rescope), as
        # keystonemiddleware refuses one.
        raise ApiError(401, "The request you have made requires authentication.")
    if ctx.extras.get("application_credential"):
        _check_access_rules(cloud, request, ctx)
    return ctx


# The service type each mount prefix serves (access rules name services by type).
_SERVICE_TYPES = {
    "/identity": "identity",
    "/compute": "compute",
    "/image": "image",
    "/networking": "network",
    "/placement": "placement",
}


def _check_access_rules(cloud: Cloud, request: Request, ctx: Context) -> None:
    """A token from an application credential with access rules may make only the requests
    they allow (keystonemiddleware's check, here for every service of the cloud)."""
    cred = app_credentials.credential_of_token(cloud, ctx.audit_id)
    if cred is None:
        return
    prefix = str(request.scope.get("root_path", ""))
    service = _SERVICE_TYPES.get(prefix, prefix.strip("/"))
    path = request.url.path.removeprefix(prefix) or "/"
    if not app_credentials.access_allowed(cred, service, request.method, path):
        raise ApiError(
            401,
            f"The application credential's access rules do not allow {request.method} "
            f"{path} on {service}.",
        )


def require_writer(request: Request) -> Context:
    ctx = require_context(request)
    if not ctx.can_write:
        raise ApiError(403, "Policy does not allow this action: the reader role can only read.")
    return ctx


def require_admin(request: Request) -> Context:
    ctx = require_context(request)
    if not ctx.is_admin:
        raise ApiError(403, "Policy doesn't allow this operation to be performed.")
    return ctx
