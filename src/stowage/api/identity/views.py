"""How identity resources look on the wire, and the list plumbing (filters, limit and marker)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode

from fastapi import Request

from stowage.api.auth import cloud_of
from stowage.api.common import ApiError, json_body
from stowage.ledger.objects import Document
from stowage.services.cloud import DEFAULT_DOMAIN
from stowage.services.identity import role_options

__all__ = [
    "as_bool",
    "base_of",
    "collection",
    "domain_view",
    "envelope",
    "iso",
    "keep",
    "matches_name",
    "project_view",
    "role_view",
    "user_view",
]

_FALSE = {"0", "false", "f", "no", "n", "off"}
_NAME_OPERATORS: dict[str, Callable[[str, str], bool]] = {
    "contains": lambda have, want: want in have,
    "icontains": lambda have, want: want.lower() in have.lower(),
    "startswith": lambda have, want: have.startswith(want),
    "istartswith": lambda have, want: have.lower().startswith(want.lower()),
    "endswith": lambda have, want: have.endswith(want),
    "iendswith": lambda have, want: have.lower().endswith(want.lower()),
    "equals": lambda have, want: have == want,
    "iequals": lambda have, want: have.lower() == want.lower(),
}


def iso(ts: float) -> str:
    """Keystone's timestamp format: 2030-01-01T00:00:00.000000Z."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def base_of(request: Request) -> str:
    return f"{cloud_of(request).config.base_url}/identity/v3"


def as_bool(value: str) -> bool:
    """Keystone's reading of a boolean query parameter."""
    return value.strip().lower() not in _FALSE


async def envelope(request: Request, key: str) -> dict[str, Any]:
    """The `{"user": {...}}` of a request body, or a 400 naming the missing key."""
    body = await json_body(request)
    if not isinstance(body, dict) or not isinstance(body.get(key), dict):
        raise ApiError(400, f"Invalid input for field '{key}': a JSON object is required.")
    inner: dict[str, Any] = body[key]
    return inner


def matches_name(request: Request, name: str) -> bool:
    """Keystone's name filters: `name=x` and the inexact `name__contains=x` and the like."""
    params = request.query_params
    if "name" in params and params["name"] != name:
        return False
    for key, want in params.items():
        if key.startswith("name__"):
            operator = _NAME_OPERATORS.get(key.removeprefix("name__"))
            if operator is None:
                raise ApiError(400, f"Invalid input for field '{key}': unknown filter.")
            if not operator(name, want):
                return False
    return True


def collection(
    request: Request,
    key: str,
    items: Sequence[Document],
    render: Callable[[Document], dict[str, Any]],
    *,
    path: str | None = None,
) -> dict[str, Any]:
    """A page of `items` (limit and marker as in the request) with Keystone's links.

    `path` is the collection's URL under /v3 when it is not `key` (a user's projects).
    """
    params = request.query_params
    limit: int | None = None
    if "limit" in params:
        try:
            limit = int(params["limit"])
        except ValueError:
            raise ApiError(400, "Invalid input for field 'limit': not an integer.") from None
        if limit < 0:
            raise ApiError(400, "Invalid input for field 'limit': must not be negative.")
    start = 0
    marker = params.get("marker")
    if marker:
        ids = [doc.id for doc in items]
        if marker not in ids:
            raise ApiError(400, f"Invalid input for field 'marker': {marker} is not in the list.")
        start = ids.index(marker) + 1
    page = list(items[start:])
    more = False
    if limit is not None and len(page) > limit:
        page, more = page[:limit], True
    self_url = f"{base_of(request)}/{path or key}"
    query = urlencode(list(params.multi_items()))
    links: dict[str, Any] = {
        "self": f"{self_url}?{query}" if query else self_url,
        "previous": None,
        "next": None,
    }
    if more and page:
        rest = [(k, v) for k, v in params.multi_items() if k != "marker"]
        links["next"] = f"{self_url}?{urlencode([*rest, ('marker', page[-1].id)])}"
    out: dict[str, Any] = {key: [render(doc) for doc in page], "links": links}
    if more:
        out["truncated"] = True
    return out


def _self(base: str, kind: str, id: str) -> dict[str, str]:
    return {"self": f"{base}/{kind}/{id}"}


def domain_view(base: str, doc: Document) -> dict[str, Any]:
    body = doc.body
    return {
        "id": doc.id,
        "name": body.get("name", doc.name),
        "description": body.get("description") or "",
        "enabled": bool(body.get("enabled", True)),
        "tags": list(body.get("tags", [])),
        "options": dict(body.get("options", {})),
        "links": _self(base, "domains", doc.id),
    }


def project_view(base: str, doc: Document) -> dict[str, Any]:
    body = doc.body
    view: dict[str, Any] = dict(body.get("extra", {}))
    domain_id = body.get("domain_id", DEFAULT_DOMAIN)
    view.update(
        {
            "id": doc.id,
            "name": body.get("name", doc.name),
            "domain_id": domain_id,
            "parent_id": body.get("parent_id") or domain_id,
            "description": body.get("description") or "",
            "enabled": bool(body.get("enabled", True)),
            "is_domain": bool(body.get("is_domain", False)),
            "tags": list(body.get("tags", [])),
            "options": dict(body.get("options", {})),
            "links": _self(base, "projects", doc.id),
        }
    )
    return view


def user_view(base: str, doc: Document) -> dict[str, Any]:
    """Never the password nor its hash."""
    body = doc.body
    view: dict[str, Any] = dict(body.get("extra", {}))
    view.update(
        {
            "id": doc.id,
            "name": body.get("name", doc.name),
            "domain_id": body.get("domain_id", DEFAULT_DOMAIN),
            "enabled": bool(body.get("enabled", True)),
            "password_expires_at": None,
            "options": dict(body.get("options", {})),
            "links": _self(base, "users", doc.id),
        }
    )
    for optional in ("default_project_id", "description"):
        if body.get(optional) is not None:
            view[optional] = body[optional]
    return view


def role_view(base: str, doc: Document) -> dict[str, Any]:
    body = doc.body
    return {
        "id": doc.id,
        "name": body.get("name", doc.name),
        "domain_id": body.get("domain_id"),
        "description": body.get("description"),
        "options": role_options(doc),
        "links": _self(base, "roles", doc.id),
    }


def keep(request: Request, doc: Document, fields: Mapping[str, str]) -> bool:
    """Exact-match query filters: `fields` maps a query parameter to a body key."""
    params = request.query_params
    for param, attr in fields.items():
        if param not in params:
            continue
        have = doc.body.get(attr)
        want = params[param]
        if isinstance(have, bool) or attr in {"enabled", "is_domain"}:
            if bool(have if have is not None else attr == "enabled") != as_bool(want):
                return False
        elif (have or "") != want:
            return False
    return True
