"""Placement: views over the ledger (in progress)."""

from __future__ import annotations

from fastapi import FastAPI

from stowage.api.common import install_common, placement_error
from stowage.api.placement import routes
from stowage.services.cloud import Cloud

__all__ = ["create_placement_app"]


def create_placement_app(cloud: Cloud) -> FastAPI:
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    app.state.cloud = cloud
    install_common(app, placement_error)
    app.include_router(routes.router)
    return app
