"""Network v2.0 (Neutron subset): discovery and the resource router."""

from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request

from stowage.api.auth import cloud_of
from stowage.api.common import api_app, include_routes, install_common, network_error
from stowage.api.network import quotas, resources, trunks
from stowage.api.responses import JSONResponse
from stowage.services.cloud import Cloud

__all__ = ["create_network_app"]

# The resources (ports, networks: the busiest) first, the version document last; no two
# routers serve the same method and path (tests/api/test_compute_routes.py).
_ROUTERS = (resources, quotas, trunks)

discovery = APIRouter()


@discovery.get("/")
async def versions(request: Request) -> JSONResponse:
    base = cloud_of(request).config.base_url
    return JSONResponse(
        {
            "versions": [
                {
                    "id": "v2.0",
                    "status": "CURRENT",
                    "links": [{"rel": "self", "href": f"{base}/networking/v2.0/"}],
                }
            ]
        }
    )


def create_network_app(cloud: Cloud) -> FastAPI:
    app = api_app()
    app.state.cloud = cloud
    install_common(app, network_error)
    for module in _ROUTERS:
        include_routes(app, module.router, prefix="/v2.0")
    include_routes(app, discovery)
    return app
