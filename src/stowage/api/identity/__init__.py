"""Identity v3 (Keystone): discovery, tokens, domains, projects, users, roles and grants."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, FastAPI, Request

from stowage.api.auth import cloud_of
from stowage.api.common import (
    api_app,
    identity_error,
    include_routes,
    install_common,
    www_authenticate,
)
from stowage.api.identity import (
    app_credentials,
    catalog,
    credentials,
    grants,
    groups,
    inherit,
    limits,
    policy_blobs,
    resources,
    system,
    tokens,
    unimplemented,
)
from stowage.api.identity.views import iso
from stowage.api.responses import JSONResponse
from stowage.services.cloud import Cloud
from stowage.services.identity import Forbidden, Unauthorized

__all__ = ["create_identity_app", "iso"]

API_VERSION = "v3.14"


def _version_doc(base: str) -> dict[str, Any]:
    return {
        "id": API_VERSION,
        "status": "stable",
        "updated": "2020-04-07T00:00:00Z",
        "links": [{"rel": "self", "href": f"{base}/identity/v3/"}],
        "media-types": [
            {"base": "application/json", "type": "application/vnd.openstack.identity-v3+json"}
        ],
    }


# As compute's (api/compute/__init__.py): a router's place is a cost of every request it
# serves, so tokens first (every validation), the version documents last; no two routers
# serve the same method and path (tests/api/test_compute_routes.py).
_ROUTERS = (
    tokens,
    resources,
    grants,
    catalog,
    app_credentials,
    groups,
    system,
    inherit,
    credentials,
    policy_blobs,
    limits,
    unimplemented,
)

discovery = APIRouter()


@discovery.api_route("/", methods=["GET", "HEAD"])
async def versions(request: Request) -> JSONResponse:
    base = cloud_of(request).config.base_url
    return JSONResponse({"versions": {"values": [_version_doc(base)]}}, status_code=300)


@discovery.api_route("/v3", methods=["GET", "HEAD"])
@discovery.api_route("/v3/", methods=["GET", "HEAD"])
async def version(request: Request) -> JSONResponse:
    return JSONResponse({"version": _version_doc(cloud_of(request).config.base_url)})


def create_identity_app(cloud: Cloud) -> FastAPI:
    app = api_app()
    app.state.cloud = cloud
    install_common(app, identity_error)

    # More specific than install_common's StowageError handler: Keystone's 403 and 401.
    @app.exception_handler(Forbidden)
    async def _forbidden(request: Request, exc: Forbidden) -> JSONResponse:
        return JSONResponse(identity_error(403, exc.message, exc.code, ""), status_code=403)

    @app.exception_handler(Unauthorized)
    async def _unauthorized(request: Request, exc: Unauthorized) -> JSONResponse:
        return JSONResponse(
            identity_error(401, exc.message, exc.code, ""),
            status_code=401,
            headers=www_authenticate(request),
        )

    for module in _ROUTERS:
        include_routes(app, module.router)
    include_routes(app, discovery)
    return app
