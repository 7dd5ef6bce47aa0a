"""The dashboard's session: a Keystone token in an HttpOnly, SameSite=Strict cookie, and a
CSRF token derived from it for every form that changes something."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from urllib.parse import parse_qs

from starlette.requests import Request
from starlette.responses import Response

from stowage.api.auth import context_from_token
from stowage.api.common import ApiError, Context
from stowage.services.cloud import Cloud

__all__ = [
    "LOGIN_CSRF_COOKIE",
    "SESSION_COOKIE",
    "csrf_for",
    "current_context",
    "form_fields",
    "login_csrf",
    "set_session",
]

SESSION_COOKIE = "stowage_dashboard"
LOGIN_CSRF_COOKIE = "stowage_dashboard_login"
PATH = "/dashboard"
_CSRF_MESSAGE = b"stowage-dashboard-csrf"


def csrf_for(token: str) -> str:
    """The CSRF value of a session: only a page of this origin (which can read it from a form
    the server rendered) knows it; the cookie itself is HttpOnly."""
    return hmac.new(token.encode(), _CSRF_MESSAGE, hashlib.sha256).hexdigest()


def current_context(cloud: Cloud, request: Request) -> Context | None:
    """The caller's context from the session cookie, or None (no cookie, or a token that
    expired, was revoked, or whose user is gone): the same checks as every API's."""
    token = request.cookies.get(SESSION_COOKIE, "")
    if not token:
        return None
    try:
        return context_from_token(cloud, token)
    except ApiError:
        return None


def set_session(response: Response, request: Request, token: str, expires_at: float) -> None:
    import time

    response.set_cookie(
        SESSION_COOKIE,
        token,
        max_age=max(0, int(expires_at - time.time())),
        path=PATH,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


def login_csrf(request: Request) -> str:
    """The login form's CSRF value (double submit: a cookie and a form field that match),
    kept when the browser already has one."""
    return request.cookies.get(LOGIN_CSRF_COOKIE) or secrets.token_urlsafe(24)


def set_login_csrf(response: Response, request: Request, value: str) -> None:
    response.set_cookie(
        LOGIN_CSRF_COOKIE,
        value,
        path=PATH,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


def form_fields(raw: bytes) -> dict[str, str]:
    """An urlencoded form's fields (the last value of each)."""
    parsed = parse_qs(raw.decode("utf-8", errors="replace"), keep_blank_values=True)
    return {key: values[-1] for key, values in parsed.items()}


def csrf_ok(expected: str, given: str) -> bool:
    return bool(expected) and hmac.compare_digest(expected, given)
