"""Placement microversions: `OpenStack-API-Version: placement X.Y`, echoed on every response."""

from __future__ import annotations

import contextvars
from email.utils import formatdate

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.datastructures import MutableHeaders

from stowage.api.asgi import OnResponse, ResponseHeaders
from stowage.api.common import ApiError, placement_error
from stowage.api.responses import JSONResponse

__all__ = [
    "MAX_VERSION",
    "MIN_VERSION",
    "Version",
    "current",
    "install_microversions",
    "pv",
    "require_version",
]

# The canonical list, as placement/microversion.py keeps it; every version is served.
VERSIONS = (
    "1.0",
    "1.1",  # GET/PUT /resource_providers/{uuid}/aggregates
    "1.2",  # /resource_classes
    "1.3",  # member_of on GET /resource_providers
    "1.4",  # resources on GET /resource_providers
    "1.5",  # DELETE /resource_providers/{uuid}/inventories
    "1.6",  # /traits and /resource_providers/{uuid}/traits
    "1.7",  # PUT /resource_classes/{name} creates or verifies, bodiless
    "1.8",  # project_id and user_id required in PUT /allocations
    "1.9",  # GET /usages
    "1.10",  # GET /allocation_candidates
    "1.11",  # 'allocations' link on providers
    "1.12",  # dict-shaped allocations, project_id/user_id on GET /allocations/{consumer}
    "1.13",  # POST /allocations
    "1.14",  # parent_provider_uuid, root_provider_uuid, in_tree
    "1.15",  # last-modified and cache-control headers
    "1.16",  # limit on GET /allocation_candidates
    "1.17",  # required traits on allocation candidates; traits in provider summaries
    "1.18",  # required traits on GET /resource_providers
    "1.19",  # generation in provider aggregates
    "1.20",  # POST /resource_providers answers 200 with the provider
    "1.21",  # member_of on allocation candidates
    "1.22",  # forbidden traits (!TRAIT)
    "1.23",  # 'code' in error bodies
    "1.24",  # repeated member_of
    "1.25",  # granular request groups
    "1.26",  # reserved may equal total
    "1.27",  # every inventory class in provider summaries
    "1.28",  # consumer generations
    "1.29",  # nested providers in allocation candidates (parent/root in summaries)
    "1.30",  # POST /reshaper
    "1.31",  # in_tree on allocation candidates
    "1.32",  # forbidden aggregates (!member_of)
    "1.33",  # string suffixes on request groups
    "1.34",  # mappings in allocation requests
    "1.35",  # root_required
    "1.36",  # same_subtree
    "1.37",  # re-parenting providers
    "1.38",  # consumer types
    "1.39",  # any-of traits (in:A,B) in required
)


class Version(tuple[int, int]):
    """A placement microversion; compare with tuples, e.g. `pv(request) >= (1, 14)`."""

    def __str__(self) -> str:
        return f"{self[0]}.{self[1]}"


def _v(text: str) -> Version:
    major, minor = text.split(".")
    return Version((int(major), int(minor)))


MIN_VERSION = _v(VERSIONS[0])
MAX_VERSION = _v(VERSIONS[-1])
_SUPPORTED = frozenset(_v(v) for v in VERSIONS)

# The version of the request being served, for error bodies rendered without the request.
current: contextvars.ContextVar[Version] = contextvars.ContextVar(
    "placement_version", default=MIN_VERSION
)


def _requested(request: Request) -> str | None:
    for header in request.headers.getlist("openstack-api-version"):
        for part in header.split(","):
            service, _, value = part.strip().partition(" ")
            if service.lower() == "placement" and value.strip():
                return value.strip()
    return None


def _parse(raw: str) -> Version:
    """The version asked for; TypeError for a malformed one, as microversion_parse does."""
    if raw.lower() == "latest":
        return MAX_VERSION
    major, dot, minor = raw.partition(".")
    if not dot or not major.isdigit() or not minor.isdigit():
        raise TypeError(f"invalid version string: {raw}")
    return Version((int(major), int(minor)))


def pv(request: Request) -> Version:
    version: Version = request.state.placement_version
    return version


def require_version(request: Request, minimum: tuple[int, int], *, status: int = 404) -> None:
    """Routes added by a later microversion do not exist below it."""
    if pv(request) < minimum:
        if status == 405:
            raise ApiError(405, "The method specified is not allowed for this resource.")
        raise ApiError(404, "The resource could not be found.")


def _refuse(request: Request, status: int, message: str) -> JSONResponse:
    body = placement_error(status, message, None, getattr(request.state, "request_id", ""))
    error = body["errors"][0]
    # A 406 tells the client what it may ask for (osc-placement reads max_version).
    error.pop("code", None)
    if status == 406:
        error["max_version"] = str(MAX_VERSION)
        error["min_version"] = str(MIN_VERSION)
    return JSONResponse(body, status_code=status, headers={"Vary": "openstack-api-version"})


def install_microversions(app: FastAPI) -> None:
    app.add_middleware(ResponseHeaders, enter=_negotiate, exit=_done)


def _negotiate(request: Request) -> Response | OnResponse:
    raw = _requested(request)
    try:
        version = MIN_VERSION if raw is None else _parse(raw)
    except TypeError as exc:
        return _refuse(request, 400, f"Invalid microversion: {exc}")
    if version not in _SUPPORTED:
        return _refuse(request, 406, f"Invalid microversion: Unacceptable version header: {raw}")
    request.state.placement_version = version
    request.state.placement_token = current.set(version)

    def echo(status: int, headers: MutableHeaders) -> None:
        headers["OpenStack-API-Version"] = f"placement {version}"
        headers["Vary"] = "openstack-api-version"
        if (
            version >= (1, 15)
            and request.method in ("GET", "PUT", "POST")
            and status in (200, 201)
            and request.url.path.rstrip("/") != request.scope.get("root_path", "").rstrip("/")
        ):
            headers["Cache-Control"] = "no-cache"
            if "last-modified" not in headers:
                headers["Last-Modified"] = formatdate(usegmt=True)

    return echo


def _done(request: Request) -> None:
    token = getattr(request.state, "placement_token", None)
    if token is not None:
        current.reset(token)
