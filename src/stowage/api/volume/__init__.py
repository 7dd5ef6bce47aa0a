"""Block storage v3 (Cinder): discovery, microversions, and the resource routers under
`/volume/v3/{project_id}`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, FastAPI, Request

from stowage.api.auth import cloud_of
from stowage.api.common import api_app, compute_error, include_routes, install_common
from stowage.api.responses import JSONResponse
from stowage.api.volume import metadata, refusals, resources, volumes
from stowage.api.volume.microversion import MAX_VERSION, MIN_VERSION, install_microversions
from stowage.services.cloud import Cloud
from stowage.services.volumes import register_pool
from stowage.services.volumes import volumes as volume_service

__all__ = ["create_volume_app", "start_volume_service"]


def _version(base: str) -> dict[str, Any]:
    return {
        "id": "v3.0",
        "status": "CURRENT",
        "version": f"{MAX_VERSION[0]}.{MAX_VERSION[1]}",
        "min_version": f"{MIN_VERSION[0]}.{MIN_VERSION[1]}",
        "updated": "2023-08-31T00:00:00Z",
        "links": [
            {"rel": "describedby", "type": "text/html", "href": "https://docs.openstack.org/"},
            {"rel": "self", "href": f"{base}/volume/v3/"},
        ],
        "media-types": [
            {"base": "application/json", "type": "application/vnd.openstack.volume+json;version=3"}
        ],
    }


discovery = APIRouter()


@discovery.get("/")
async def versions(request: Request) -> JSONResponse:
    return JSONResponse({"versions": [_version(cloud_of(request).config.base_url)]}, 300)


@discovery.get("/v3")
@discovery.get("/v3/")
async def version(request: Request) -> JSONResponse:
    return JSONResponse({"versions": [_version(cloud_of(request).config.base_url)]})


def start_volume_service(cloud: Cloud) -> None:
    """At the API's start (not when its app is built): the local-file pool in the ledger, and
    the volumes and snapshots a dead process left creating, extending or deleting, driven to
    their end in the volume workers (each step is idempotent)."""
    register_pool(cloud)
    volume_service.submit_resume(cloud)


def create_volume_app(cloud: Cloud) -> FastAPI:
    app = api_app()
    app.state.cloud = cloud
    install_microversions(app)
    install_common(app, compute_error)
    include_routes(app, discovery)
    # The refusals last: their catch-all must never shadow an implemented route.
    for module in (volumes, metadata, resources, refusals):
        include_routes(app, module.router, prefix="/v3/{project_id}")
    return app
