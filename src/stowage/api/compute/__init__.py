"""Compute v2.1 (Nova): discovery, microversions and the resource routers."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, FastAPI, Request

from stowage.api.auth import cloud_of
from stowage.api.common import api_app, compute_error, include_routes, install_common
from stowage.api.compute import (
    aggregates,
    availability_zones,
    capacity,
    cloud_status,
    consoles,
    flavors,
    floating_ips,
    host_evacuate,
    hypervisors,
    images,
    instance_actions,
    interfaces,
    keypairs,
    legacy,
    limits_quotas,
    migrations,
    os_services,
    security_groups,
    server_extras,
    server_groups,
    server_metadata,
    servers,
    sim,
    volume_attachments,
    volume_proxy,
)
from stowage.api.compute.microversion import MAX_VERSION, MIN_VERSION, install_microversions
from stowage.api.responses import JSONResponse
from stowage.services.cloud import Cloud

__all__ = ["create_compute_app"]

# FastAPI matches a request against the routes of each included router in turn (twice: once
# to pick the router, once inside it), so a router's place is a cost of every request it
# serves: flavors first (the bench's trivial GET, and every create reads one), then servers
# (creates and the clients' polls of a server), the version documents last. No two routers
# serve the same method and path (tests/api/test_compute_routes.py): the order changes no
# answer.
_ROUTERS = (
    flavors,
    servers,
    server_groups,
    keypairs,
    hypervisors,
    os_services,
    aggregates,
    availability_zones,
    limits_quotas,
    migrations,
    server_metadata,
    server_extras,
    security_groups,
    floating_ips,
    images,
    legacy,
    instance_actions,
    host_evacuate,
    capacity,
    cloud_status,
    sim,
    interfaces,
    consoles,
    volume_attachments,
    volume_proxy,
)


def _version(base: str) -> dict[str, Any]:
    return {
        "id": "v2.1",
        "status": "CURRENT",
        "version": f"{MAX_VERSION[0]}.{MAX_VERSION[1]}",
        "min_version": f"{MIN_VERSION[0]}.{MIN_VERSION[1]}",
        "updated": "2013-07-23T11:33:21Z",
        "links": [{"rel": "self", "href": f"{base}/compute/v2.1/"}],
        "media-types": [
            {
                "base": "application/json",
                "type": "application/vnd.openstack.compute+json;version=2.1",
            }
        ],
    }


def _legacy_version(base: str) -> dict[str, Any]:
    """v2.0, listed first as Nova lists it: the same API without microversions."""
    return {
        "id": "v2.0",
        "status": "SUPPORTED",
        "version": "",
        "min_version": "",
        "updated": "2011-01-21T11:33:21Z",
        "links": [{"rel": "self", "href": f"{base}/compute/v2/"}],
        "media-types": [
            {"base": "application/json", "type": "application/vnd.openstack.compute+json;version=2"}
        ],
    }


discovery = APIRouter()


@discovery.get("/")
async def versions(request: Request) -> JSONResponse:
    base = cloud_of(request).config.base_url
    return JSONResponse({"versions": [_legacy_version(base), _version(base)]})


@discovery.get("/v2")
@discovery.get("/v2/")
async def legacy_version(request: Request) -> JSONResponse:
    return JSONResponse({"version": _legacy_version(cloud_of(request).config.base_url)})


@discovery.get("/v2.1")
@discovery.get("/v2.1/")
async def version(request: Request) -> JSONResponse:
    return JSONResponse({"version": _version(cloud_of(request).config.base_url)})


def create_compute_app(cloud: Cloud) -> FastAPI:
    app = api_app()
    app.state.cloud = cloud
    install_microversions(app)
    install_common(app, compute_error, extra_headers=True)
    for module in _ROUTERS:
        include_routes(app, module.router, prefix="/v2.1")
    include_routes(app, discovery)
    return app
