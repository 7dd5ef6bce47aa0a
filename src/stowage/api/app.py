"""Every API on one port under devstack's prefixes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.types import ASGIApp, Receive, Scope, Send

from stowage.api.compute import create_compute_app
from stowage.api.identity import create_identity_app
from stowage.api.image import create_image_app
from stowage.api.network import create_network_app
from stowage.api.placement import create_placement_app
from stowage.services.cloud import Cloud

__all__ = ["create_app"]

PREFIXES = ("/identity", "/compute", "/image", "/networking", "/placement")


class _BarePrefix:
    """Serve `GET /identity` as `/identity/`: clients ask for the catalog URL without a slash."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in PREFIXES:
            scope = dict(scope, path=scope["path"] + "/", raw_path=scope["path"].encode() + b"/")
        await self.app(scope, receive, send)


@contextlib.asynccontextmanager
async def _lifespan(app: Starlette) -> AsyncIterator[None]:
    """Until compute agents run (their own issue), the simulated hosts heartbeat from here."""
    cloud: Cloud = app.state.cloud

    async def beat() -> None:
        while True:
            await asyncio.to_thread(cloud.ledger.heartbeat)
            await asyncio.to_thread(cloud.ledger.prune_changes)
            await asyncio.sleep(cloud.config.heartbeat_interval_s)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def create_app(cloud: Cloud) -> ASGIApp:
    app = Starlette(
        lifespan=_lifespan,
        routes=[
            Mount("/identity", app=create_identity_app(cloud)),
            Mount("/compute", app=create_compute_app(cloud)),
            Mount("/image", app=create_image_app(cloud)),
            Mount("/networking", app=create_network_app(cloud)),
            Mount("/placement", app=create_placement_app(cloud)),
        ],
    )
    app.state.cloud = cloud
    return _BarePrefix(app)
