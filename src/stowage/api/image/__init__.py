"""Image v2 (Glance): discovery and the images router."""

from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request

from stowage.api.auth import cloud_of
from stowage.api.common import api_app, image_error, include_routes, install_common
from stowage.api.image import images, metadefs
from stowage.api.responses import JSONResponse
from stowage.services.cloud import Cloud

__all__ = ["create_image_app"]

discovery = APIRouter()


@discovery.get("/")
async def versions(request: Request) -> JSONResponse:
    base = cloud_of(request).config.base_url
    values = [
        {
            "id": f"v2.{minor}",
            "status": "CURRENT" if minor == 16 else "SUPPORTED",
            "links": [{"rel": "self", "href": f"{base}/image/v2/"}],
        }
        for minor in (16, 15, 9, 0)
    ]
    return JSONResponse({"versions": values}, status_code=300)


def create_image_app(cloud: Cloud) -> FastAPI:
    app = api_app()
    app.state.cloud = cloud
    install_common(app, image_error)
    include_routes(app, discovery)
    include_routes(app, images.router, prefix="/v2")
    include_routes(app, metadefs.router, prefix="/v2")
    return app
