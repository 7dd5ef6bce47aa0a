"""Placement's routes: the version document and every resource router."""

from __future__ import annotations

from fastapi import APIRouter

from stowage.api.common import include_routes
from stowage.api.placement import allocations, providers, traits
from stowage.api.placement.microversion import MAX_VERSION, MIN_VERSION
from stowage.api.responses import JSONResponse

__all__ = ["router"]

router = APIRouter()


@router.get("/")
async def versions() -> JSONResponse:
    """The version document; no token needed. The self link is relative, as placement's is."""
    return JSONResponse(
        {
            "versions": [
                {
                    "id": f"v{MIN_VERSION}",
                    "max_version": str(MAX_VERSION),
                    "min_version": str(MIN_VERSION),
                    "status": "CURRENT",
                    "links": [{"rel": "self", "href": ""}],
                }
            ]
        }
    )


include_routes(router, providers.router)
include_routes(router, traits.router)
include_routes(router, allocations.router)
