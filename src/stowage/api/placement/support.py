"""What every Placement handler shares: policy, the store, bodies, query strings and links."""

from __future__ import annotations

import uuid as uuidlib
from collections.abc import Collection
from typing import Any

from fastapi import Request

from stowage.api.auth import cloud_of, require_context
from stowage.api.common import ApiError, Context, loads
from stowage.api.placement.microversion import require_version
from stowage.services.placement import PlacementStore

__all__ = [
    "authorize",
    "authorize_since",
    "body_of",
    "check_params",
    "one_param",
    "provider_url",
    "store_of",
    "valid_uuid",
]

_DUPLICATE_KEY = "placement.query.duplicate_key"
_BAD_VALUE = "placement.query.bad_value"


def authorize(request: Request, rule: str) -> Context:
    """Placement's default policy: every rule is admin (or service) only."""
    ctx = require_context(request)
    if not (ctx.is_admin or "service" in ctx.roles):
        raise ApiError(403, f"Policy does not allow {rule} to be performed.")
    return ctx


def authorize_since(
    request: Request, minimum: tuple[int, int], rule: str, *, status: int = 404
) -> Context:
    """A call that came with microversion `minimum`: the version is checked before the policy."""
    require_version(request, minimum, status=status)
    return authorize(request, rule)


def store_of(request: Request) -> PlacementStore:
    state = request.app.state
    store: PlacementStore | None = getattr(state, "placement_store", None)
    if store is None:
        cloud = cloud_of(request)
        store = PlacementStore(cloud.ledger.engine, cloud.objects, clock=cloud.clock)
        state.placement_store = store
    return store


async def body_of(request: Request) -> Any:
    """The JSON body of a PUT or POST; placement wants application/json and nothing else."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json":
        raise ApiError(
            415, f"The media type {media or 'None'} is not supported, use application/json"
        )
    raw = await request.body()
    try:
        return loads(raw)
    except ValueError:
        raise ApiError(400, "Malformed JSON: the request body is not valid JSON.") from None


def check_params(
    request: Request, allowed: Collection[str], *, suffixed: Collection[str] = ()
) -> None:
    """Refuse query parameters this microversion does not define, as placement's schemas do."""
    for key in request.query_params:
        if key in allowed:
            continue
        if any(key.startswith(base) and len(key) > len(base) for base in suffixed):
            continue
        raise ApiError(
            400,
            "Invalid query string parameters: Additional properties are not allowed "
            f"('{key}' was unexpected)",
        )


def one_param(request: Request, key: str) -> str | None:
    values = request.query_params.getlist(key)
    if len(values) > 1:
        raise ApiError(
            400,
            f"Query parameter {key!r} is allowed only once; it was given {len(values)} times.",
            code=_DUPLICATE_KEY,
        )
    return values[0] if values else None


def valid_uuid(value: str, what: str) -> str:
    try:
        return str(uuidlib.UUID(value))
    except ValueError:
        raise ApiError(
            400,
            f"Invalid query string parameters: Expected '{what}' parameter to contain "
            f"valid UUID(s), got {value!r}.",
            code=_BAD_VALUE,
        ) from None


def prefix(request: Request) -> str:
    """Placement's links are relative to where it is mounted, e.g. /placement."""
    return str(request.scope.get("root_path", "")).rstrip("/")


def provider_url(request: Request, rp_uuid: str) -> str:
    return f"{prefix(request)}/resource_providers/{rp_uuid}"
