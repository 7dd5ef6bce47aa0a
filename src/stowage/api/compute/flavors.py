"""Compute v2.1: flavors, their extra specs and their access lists."""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlencode

from fastapi import APIRouter, Request
from fastapi.responses import Response

from stowage.api.auth import cloud_of, require_admin, require_context
from stowage.api.common import ApiError, Context, json_body, parse_limit
from stowage.api.compute.microversion import mv
from stowage.api.responses import JSONResponse
from stowage.domain.errors import ConflictError, InvalidSpec
from stowage.ledger.objects import Document
from stowage.services import compute_catalog as catalog
from stowage.services import flavors

__all__ = ["flavor_view", "router"]

router = APIRouter()

_ID_PATTERN = re.compile(r"^(?! )[a-zA-Z0-9. _-]+(?<! )$")
_SPEC_KEY = re.compile(r"^[a-zA-Z0-9-_:. ]{1,255}$")
# Nova's sort keys, mapped onto the document's fields.
_SORT_KEYS = {
    "flavorid": "id",
    "id": "created_at",
    "name": "name",
    "memory_mb": "ram",
    "root_gb": "disk",
    "ephemeral_gb": "ephemeral",
    "swap": "swap",
    "vcpus": "vcpus",
    "rxtx_factor": "rxtx_factor",
    "is_public": "is_public",
    "disabled": "disabled",
    "description": "description",
    "created_at": "created_at",
    "updated_at": "updated_at",
    "vcpu_weight": "vcpu_weight",
}
_MAX_LIMIT = 1000
# The documents' id column holds at most 64 characters.
_ID_MAX = 64


def _links(request: Request, collection: str, ident: str) -> list[dict[str, str]]:
    base = cloud_of(request).config.base_url
    return [
        {"rel": "self", "href": f"{base}/compute/v2.1/{collection}/{ident}"},
        {"rel": "bookmark", "href": f"{base}/compute/{collection}/{ident}"},
    ]


def flavor_view(
    request: Request, body: Mapping[str, Any], *, detail: bool = True
) -> dict[str, Any]:
    """A flavor in the shape the request's microversion asks for."""
    version = mv(request)
    out: dict[str, Any] = {"id": body["id"], "name": body["name"]}
    if detail:
        swap = int(body.get("swap", 0) or 0)
        out.update(
            {
                "ram": body["ram"],
                "disk": body["disk"],
                "vcpus": body["vcpus"],
                # Before 2.75 a flavor without swap said "" rather than 0.
                "swap": swap if swap or version >= (2, 75) else "",
                "OS-FLV-EXT-DATA:ephemeral": body.get("ephemeral", 0),
                "OS-FLV-DISABLED:disabled": bool(body.get("disabled", False)),
                "os-flavor-access:is_public": bool(body.get("is_public", True)),
                "rxtx_factor": float(body.get("rxtx_factor", 1.0)),
            }
        )
    out["links"] = _links(request, "flavors", str(body["id"]))
    if version >= (2, 55):
        out["description"] = body.get("description")
    if detail and version >= (2, 61):
        out["extra_specs"] = dict(body.get("extra_specs", {}))
    return out


def _get(request: Request, ctx: Context, flavor_id: str) -> Document:
    return catalog.visible_flavor(cloud_of(request), flavor_id, ctx.project_id, ctx.is_admin)


# -- listing --------------------------------------------------------------------------------


def _is_public_filter(raw: str | None) -> bool | None:
    """Nova's is_public query: absent means public, the string "none" means every flavor."""
    if raw is None:
        return True
    if raw.strip().lower() == "none":
        return None
    try:
        return catalog.parse_bool(raw, "is_public")
    except InvalidSpec:
        raise ApiError(400, f"Invalid is_public filter [{raw}]") from None


def _int_filter(request: Request, name: str) -> int | None:
    raw = request.query_params.get(name)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ApiError(400, f"Invalid {name} filter [{raw}]") from None


def _limit(request: Request) -> int | None:
    return parse_limit(request.query_params.get("limit"), maximum=_MAX_LIMIT)


def _sort_value(body: Mapping[str, Any], doc: Document, key: str) -> Any:
    if key == "created_at":
        return doc.created_at
    if key == "updated_at":
        return doc.updated_at
    value = body.get(key)
    if value is None:
        return (0, "")
    return (1, value)


def _visible_docs(request: Request, ctx: Context) -> list[Document]:
    params = request.query_params
    # Only admins choose; everyone else sees public flavors and those shared with them.
    is_public = _is_public_filter(params.get("is_public")) if ctx.is_admin else True
    min_ram = _int_filter(request, "minRam")
    min_disk = _int_filter(request, "minDisk")
    docs = []
    for doc in cloud_of(request).objects.list("flavor"):
        body = doc.body
        public = bool(body.get("is_public", True))
        mine = ctx.project_id in body.get("projects", [])
        if is_public is True and not (public or mine):
            continue
        if is_public is False and public:
            continue
        if not ctx.is_admin and body.get("disabled", False):
            continue
        if min_ram is not None and int(body.get("ram", 0)) < min_ram:
            continue
        if min_disk is not None and int(body.get("disk", 0)) < min_disk:
            continue
        docs.append(doc)
    sort_key = params.get("sort_key") or "flavorid"
    sort_dir = params.get("sort_dir") or "asc"
    if sort_key not in _SORT_KEYS:
        raise ApiError(400, f"Invalid input for query parameters sort_key. Value: {sort_key}.")
    if sort_dir not in ("asc", "desc"):
        raise ApiError(400, f"Invalid input for query parameters sort_dir. Value: {sort_dir}.")
    field = _SORT_KEYS[sort_key]
    docs.sort(key=lambda d: (_sort_value(d.body, d, field), d.id), reverse=sort_dir == "desc")
    return docs


def _page(request: Request, docs: list[Document]) -> list[Document]:
    marker = request.query_params.get("marker")
    if marker is not None:
        ids = [d.id for d in docs]
        if marker not in ids:
            raise ApiError(400, f"marker [{marker}] not found")
        docs = docs[ids.index(marker) + 1 :]
    limit = _limit(request)
    return docs[: limit if limit else _MAX_LIMIT]


def _next_links(request: Request, collection: str, page: list[Document]) -> list[dict[str, str]]:
    limit = _limit(request) or _MAX_LIMIT
    if not page or len(page) != limit:
        return []
    params = dict(request.query_params)
    params["marker"] = page[-1].id
    base = cloud_of(request).config.base_url
    return [{"rel": "next", "href": f"{base}/compute/v2.1/{collection}?{urlencode(params)}"}]


def _list(request: Request, *, detail: bool) -> JSONResponse:
    ctx = require_context(request)
    page = _page(request, _visible_docs(request, ctx))
    body: dict[str, Any] = {"flavors": [flavor_view(request, d.body, detail=detail) for d in page]}
    links = _next_links(request, "flavors/detail" if detail else "flavors", page)
    if links:
        body["flavors_links"] = links
    return JSONResponse(body)


@router.get("/flavors")
async def list_flavors(request: Request) -> JSONResponse:
    return _list(request, detail=False)


@router.get("/flavors/detail")
async def list_flavors_detail(request: Request) -> JSONResponse:
    return _list(request, detail=True)


@router.get("/flavors/{flavor_id}")
async def show_flavor(flavor_id: str, request: Request) -> JSONResponse:
    ctx = require_context(request)
    return JSONResponse({"flavor": flavor_view(request, _get(request, ctx, flavor_id).body)})


# -- create, update, delete -----------------------------------------------------------------


def _flavor_id(value: Any) -> str:
    if value is None:
        return str(uuid.uuid4())
    if isinstance(value, int | float) and not isinstance(value, bool):
        # Nova's schema takes a number too (novaclient and tempest send ints) and stores str().
        value = str(value)
    if not isinstance(value, str) or not value or len(value) > _ID_MAX:
        raise ApiError(
            400,
            f"Invalid input for field/attribute id: {value!r} must be a string of 1 to "
            f"{_ID_MAX} characters",
        )
    if not _ID_PATTERN.match(value):
        raise ApiError(
            400,
            f"Invalid input for field/attribute id: {value!r} may hold only letters, digits, "
            "'.', '_', '-' and inner spaces",
        )
    return value


def _rxtx(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ApiError(400, f"Invalid input for field/attribute rxtx_factor: {value!r}")
    try:
        factor = float(value)
    except ValueError:
        raise ApiError(400, f"Invalid input for field/attribute rxtx_factor: {value!r}") from None
    if not factor > 0:
        raise ApiError(400, "Invalid input for field/attribute rxtx_factor: must be above 0")
    if factor > _RXTX_MAX:
        # Nova's schema bound: the column is a 32-bit float.
        raise ApiError(
            400, f"Invalid input for field/attribute rxtx_factor: {value!r} is above {_RXTX_MAX}"
        )
    return factor


_RXTX_MAX = 3.40282e38


def _description(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > 65535:
        raise ApiError(
            400, "Invalid input for field/attribute description: a string of at most 65535"
        )
    return value


@router.post("/flavors")
async def create_flavor(request: Request) -> JSONResponse:
    require_admin(request)
    cloud = cloud_of(request)
    payload = catalog.member(await json_body(request), "flavor")
    allowed = {
        "name",
        "id",
        "ram",
        "vcpus",
        "disk",
        "OS-FLV-EXT-DATA:ephemeral",
        "swap",
        "rxtx_factor",
        "os-flavor-access:is_public",
    }
    if mv(request) >= (2, 55):
        allowed.add("description")
    catalog.only_keys(payload, allowed, "flavor")
    for required in ("name", "ram", "vcpus", "disk"):
        if required not in payload:
            raise ApiError(
                400,
                f"Invalid input for field/attribute flavor: '{required}' is a required property",
            )
    name = catalog.parse_name(payload["name"], "name")
    flavor_id = _flavor_id(payload.get("id"))
    is_public = payload.get("os-flavor-access:is_public", True)
    body = {
        "id": flavor_id,
        "name": name,
        "ram": catalog.parse_int(payload["ram"], "ram", minimum=1),
        "vcpus": catalog.parse_int(payload["vcpus"], "vcpus", minimum=1),
        "disk": catalog.parse_int(payload["disk"], "disk", minimum=0),
        "ephemeral": catalog.parse_int(
            payload.get("OS-FLV-EXT-DATA:ephemeral", 0), "OS-FLV-EXT-DATA:ephemeral", minimum=0
        ),
        "swap": catalog.parse_int(payload.get("swap", 0), "swap", minimum=0),
        "rxtx_factor": _rxtx(payload.get("rxtx_factor", 1.0)),
        "is_public": catalog.parse_bool(is_public, "os-flavor-access:is_public"),
        "disabled": False,
        "description": _description(payload.get("description")),
        "extra_specs": {},
        "projects": [],
    }
    try:
        flavors.create_flavor(cloud, body)
    except ConflictError as exc:
        raise ApiError(409, str(exc)) from None
    return JSONResponse({"flavor": flavor_view(request, body)})


@router.put("/flavors/{flavor_id}")
async def update_flavor(flavor_id: str, request: Request) -> JSONResponse:
    if mv(request) < (2, 55):
        raise ApiError(404, "The resource could not be found.")
    ctx = require_admin(request)
    payload = catalog.member(await json_body(request), "flavor")
    catalog.only_keys(payload, {"description"}, "flavor")
    if "description" not in payload:
        raise ApiError(
            400, "Invalid input for field/attribute flavor: 'description' is a required property"
        )
    _get(request, ctx, flavor_id)
    description = _description(payload["description"])
    body = flavors.change_flavor(
        cloud_of(request), flavor_id, lambda body: dict(body, description=description)
    )
    return JSONResponse({"flavor": flavor_view(request, body)})


@router.delete("/flavors/{flavor_id}")
async def delete_flavor(flavor_id: str, request: Request) -> Response:
    require_admin(request)
    if not flavors.delete_flavor(cloud_of(request), flavor_id):
        raise ApiError(404, f"Flavor {flavor_id} could not be found.")
    return Response(status_code=202)


# -- access lists ---------------------------------------------------------------------------


def _access(flavor_id: str, projects: list[str]) -> JSONResponse:
    return JSONResponse(
        {"flavor_access": [{"flavor_id": flavor_id, "tenant_id": p} for p in projects]}
    )


@router.get("/flavors/{flavor_id}/os-flavor-access")
async def list_access(flavor_id: str, request: Request) -> JSONResponse:
    ctx = require_admin(request)
    doc = _get(request, ctx, flavor_id)
    if doc.body.get("is_public", True):
        raise ApiError(404, "Access list not available for public flavors.")
    return _access(flavor_id, list(doc.body.get("projects", [])))


def _tenant(payload: Any, action: str) -> str:
    if not isinstance(payload, dict) or "tenant" not in payload:
        raise ApiError(
            400, f"Invalid input for field/attribute {action}: 'tenant' is a required property"
        )
    tenant = payload["tenant"]
    if not isinstance(tenant, str) or not tenant:
        raise ApiError(400, f"Invalid input for field/attribute tenant: {tenant!r}")
    return tenant


@router.post("/flavors/{flavor_id}/action")
async def flavor_action(flavor_id: str, request: Request) -> JSONResponse:
    ctx = require_admin(request)
    cloud = cloud_of(request)
    body = await json_body(request)
    if not isinstance(body, dict) or len(body) != 1:
        raise ApiError(400, "Malformed request body: one action expected")
    action, payload = next(iter(body.items()))
    if action not in ("addTenantAccess", "removeTenantAccess"):
        raise ApiError(400, f"There is no such action: {action}")
    tenant = _tenant(payload, action)
    _get(request, ctx, flavor_id)
    if action == "addTenantAccess" and cloud.objects.find("project", tenant) is None:
        raise ApiError(400, f"Project ID {tenant} is not a valid project.")

    def change(body: dict[str, Any]) -> dict[str, Any]:
        projects = list(body.get("projects", []))
        if action == "addTenantAccess":
            if body.get("is_public", True):
                raise ApiError(409, "Can not add access to a public flavor.")
            if tenant in projects:
                raise ApiError(
                    409,
                    f"Flavor access already exists for flavor {flavor_id} and project {tenant} "
                    "combination.",
                )
            projects.append(tenant)
        else:
            if tenant not in projects:
                raise ApiError(
                    404, f"Flavor access not found for {flavor_id} / {tenant} combination."
                )
            projects.remove(tenant)
        return dict(body, projects=projects)

    return _access(flavor_id, flavors.change_flavor(cloud, flavor_id, change)["projects"])


# -- extra specs ----------------------------------------------------------------------------


def _specs(raw: Any) -> dict[str, str]:
    if not isinstance(raw, dict):
        raise ApiError(400, "Invalid input for field/attribute extra_specs: not an object")
    out = {}
    for key, value in raw.items():
        if not _SPEC_KEY.match(key):
            raise ApiError(
                400,
                f"Invalid input for field/attribute extra_specs: key {key!r} may hold 1 to 255 "
                "letters, digits and '-_:. '",
            )
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise ApiError(
                400, f"Invalid input for field/attribute {key}: {value!r} is not a string"
            )
        text = str(value)
        if len(text) > 255:
            raise ApiError(400, f"Invalid input for field/attribute {key}: longer than 255")
        out[key] = text
    return out


def _merge_specs(request: Request, doc: Document, new: Mapping[str, str]) -> None:
    def change(body: dict[str, Any]) -> dict[str, Any]:
        merged = {**body.get("extra_specs", {}), **new}
        try:
            catalog.check_flavor_specs(body, merged)
        except InvalidSpec as exc:
            raise ApiError(400, f"Validation failed; {exc.message}") from None
        return dict(body, extra_specs=merged)

    flavors.change_flavor(cloud_of(request), doc.id, change)


@router.get("/flavors/{flavor_id}/os-extra_specs")
async def list_specs(flavor_id: str, request: Request) -> JSONResponse:
    ctx = require_context(request)
    doc = _get(request, ctx, flavor_id)
    return JSONResponse({"extra_specs": dict(doc.body.get("extra_specs", {}))})


@router.post("/flavors/{flavor_id}/os-extra_specs")
async def create_specs(flavor_id: str, request: Request) -> JSONResponse:
    ctx = require_admin(request)
    body = await json_body(request)
    if not isinstance(body, dict) or "extra_specs" not in body:
        raise ApiError(
            400, "Invalid input for field/attribute extra_specs: 'extra_specs' is required"
        )
    specs = _specs(body["extra_specs"])
    _merge_specs(request, _get(request, ctx, flavor_id), specs)
    return JSONResponse({"extra_specs": specs})


@router.get("/flavors/{flavor_id}/os-extra_specs/{key}")
async def show_spec(flavor_id: str, key: str, request: Request) -> JSONResponse:
    ctx = require_context(request)
    specs = _get(request, ctx, flavor_id).body.get("extra_specs", {})
    if key not in specs:
        raise ApiError(404, f"Flavor {flavor_id} has no extra specs with key {key}.")
    return JSONResponse({key: specs[key]})


@router.put("/flavors/{flavor_id}/os-extra_specs/{key}")
async def update_spec(flavor_id: str, key: str, request: Request) -> JSONResponse:
    ctx = require_admin(request)
    body = await json_body(request)
    if not isinstance(body, dict) or not body:
        raise ApiError(400, "Malformed request body: an object with one key expected")
    if len(body) > 1:
        raise ApiError(400, "Request body contains too many items")
    if key not in body:
        raise ApiError(400, "Request body and URI mismatch")
    specs = _specs(body)
    _merge_specs(request, _get(request, ctx, flavor_id), specs)
    return JSONResponse(specs)


@router.delete("/flavors/{flavor_id}/os-extra_specs/{key}")
async def delete_spec(flavor_id: str, key: str, request: Request) -> Response:
    ctx = require_admin(request)
    _get(request, ctx, flavor_id)

    def change(body: dict[str, Any]) -> dict[str, Any]:
        specs = dict(body.get("extra_specs", {}))
        if key not in specs:
            raise ApiError(404, f"Flavor {flavor_id} has no extra specs with key {key}.")
        del specs[key]
        return dict(body, extra_specs=specs)

    flavors.change_flavor(cloud_of(request), flavor_id, change)
    return Response(status_code=202)
