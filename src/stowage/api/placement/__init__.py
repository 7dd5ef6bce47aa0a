"""Placement: the ledger's hosts as resource providers, with their inventories and claims."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from stowage.api.common import api_app, include_routes, install_common, placement_error
from stowage.api.placement import routes
from stowage.api.placement.microversion import current, install_microversions
from stowage.services.cloud import Cloud

__all__ = ["create_placement_app"]


def _error(status: int, message: str, code: str | None, request_id: str) -> dict[str, Any]:
    """Placement's error body; `code` appears from microversion 1.23, as placement adds it."""
    body = placement_error(status, message, code, request_id)
    if current.get() < (1, 23):
        for error in body["errors"]:
            error.pop("code", None)
    return body


def create_placement_app(cloud: Cloud) -> FastAPI:
    app = api_app()
    app.state.cloud = cloud
    install_microversions(app)
    install_common(app, _error)
    include_routes(app, routes.router)
    return app
