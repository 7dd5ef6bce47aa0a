"""Every API on one port under devstack's prefixes."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from stowage.api.auth import context_from_token
from stowage.api.common import (
    ApiError,
    ErrorStyle,
    compute_error,
    identity_error,
    image_error,
    network_error,
    placement_error,
    run_off_loop,
    size_thread_pool,
    www_authenticate,
)
from stowage.api.compute import create_compute_app
from stowage.api.compute.consoles import SERIAL_PATH, serial_console_websocket
from stowage.api.dashboard import create_dashboard_app
from stowage.api.identity import create_identity_app
from stowage.api.image import create_image_app
from stowage.api.limits import DEFAULT_MAX_BODY, BodyLimit
from stowage.api.metadata import (
    create_ec2_metadata_app,
    create_openstack_metadata_app,
    start_metadata_service,
)
from stowage.api.network import create_network_app
from stowage.api.observed import Observed
from stowage.api.placement import create_placement_app
from stowage.api.responses import JSONResponse
from stowage.api.volume import create_volume_app, start_volume_service
from stowage.domain.ids import new_request_id
from stowage.services.cloud import Cloud
from stowage.services.dashboard import heartbeat_ages
from stowage.telemetry import REGISTRY
from stowage.telemetry.metrics import watch_heartbeats

__all__ = ["create_app"]

PREFIXES = (
    "/identity",
    "/compute",
    "/image",
    "/networking",
    "/placement",
    "/volume",
    "/openstack",
    "/latest",
)


class _BarePrefix:
    """Serve `GET /identity` as `/identity/`: clients ask for the catalog URL without a slash."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in PREFIXES:
            scope = dict(scope, path=scope["path"] + "/", raw_path=scope["path"].encode() + b"/")
        await self.app(scope, receive, send)


Runtime = Callable[[Cloud], contextlib.AbstractAsyncContextManager[Any]]
"""What runs beside the APIs for the app's lifetime (the composition root, `stowage.wiring`,
chooses it): entered at start-up, it yields what has metrics to serve (an object whose
`async exposition()` gives them in the text format) or None."""


@contextlib.asynccontextmanager
async def _lifespan(app: Starlette) -> AsyncIterator[None]:
    """The ledger's change-log pruning and the loop-lag watchdog, and the runtime if any."""
    cloud: Cloud = app.state.cloud
    runtime: Runtime | None = app.state.runtime
    size_thread_pool(cloud)
    stack = contextlib.AsyncExitStack()
    await asyncio.to_thread(start_volume_service, cloud)
    await asyncio.to_thread(start_metadata_service, cloud)
    if runtime is not None:
        app.state.metrics = await stack.enter_async_context(runtime(cloud))

    async def prune() -> None:
        while True:
            await asyncio.to_thread(cloud.ledger.prune_changes)
            await asyncio.sleep(60.0)

    watch_heartbeats(functools.partial(heartbeat_ages, cloud))
    task = asyncio.create_task(prune())
    watchdog = _api_watchdog(app)
    lag_task = asyncio.create_task(watchdog.run())
    try:
        yield
    finally:
        for running in (task, lag_task):
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running
        await stack.aclose()


def _api_watchdog(app: Starlette) -> Any:
    """The API's own event-loop lag, exported like the agents' (a late wake-up means a
    handler held the loop, and every other request waited with it)."""
    from prometheus_client import CollectorRegistry, Counter, Gauge

    from stowage.agent.runtime import LagWatchdog

    watchdog = LagWatchdog(interval_s=0.05, stall_s=0.25, samples_max=2_000)
    registry = CollectorRegistry()
    Gauge(
        "stowage_api_loop_lag_max_seconds",
        "Largest event-loop lag of the API process over its recent samples",
        registry=registry,
    ).set_function(lambda: watchdog.lag_max_s)
    Gauge(
        "stowage_api_loop_lag_p99_seconds",
        "99th percentile event-loop lag of the API process over its recent samples",
        registry=registry,
    ).set_function(lambda: watchdog.lag_p99_s)
    stalls = Counter(
        "stowage_api_loop_stalls", "Event-loop wake-ups late by 0.25 s or more", registry=registry
    )
    stalls.inc(0)
    watchdog.on_stall = stalls.inc
    app.state.api_registry = registry
    return watchdog


async def _metrics(request: Request) -> Response:
    """Prometheus metrics of the API process and of the agents it runs: for an admin or
    service token only (X-Auth-Token, or `Authorization: Bearer`), not for whoever reaches
    the API port."""
    from stowage.agent.metrics import CONTENT_TYPE_LATEST, render

    bearer = request.headers.get("authorization", "")
    token = request.headers.get("x-auth-token") or bearer.removeprefix("Bearer ").strip()
    refusal = await asyncio.to_thread(_metrics_refusal, request, token)
    if refusal is not None:
        status, message = refusal
        headers = www_authenticate(request) if status == 401 else {}
        rid = new_request_id()
        headers["x-openstack-request-id"] = rid
        return JSONResponse(identity_error(status, message, None, rid), status, headers=headers)
    parts = [render(REGISTRY)]
    registry = getattr(request.app.state, "api_registry", None)
    if registry is not None:
        parts.append(render(registry))
    metrics = getattr(request.app.state, "metrics", None)
    if metrics is not None:
        parts.append(await metrics.exposition())
    return Response(b"".join(parts), media_type=CONTENT_TYPE_LATEST)


def _metrics_refusal(request: Request, token: str) -> tuple[int, str] | None:
    """Why this caller may not read the metrics (status, message), or None."""
    if not token:
        return 401, "The request you have made requires authentication."
    try:
        ctx = context_from_token(request.app.state.cloud, token)
    except ApiError as exc:
        return 401, exc.message
    if not ctx.roles & {"admin", "service"}:
        return 403, "Only an admin or a service may read the metrics."
    return None


_STYLES: dict[str, ErrorStyle] = {
    "identity": identity_error,
    "compute": compute_error,
    "image": image_error,
    "networking": network_error,
    "placement": placement_error,
    "volume": compute_error,
}


async def _unrouted(request: Request, exc: Exception) -> Response:
    """A path no service took (an unknown prefix, a newline in an id): JSON with a request id,
    in the shape of the service its first segment names."""
    status = exc.status_code if isinstance(exc, HTTPException) else 404
    message = "The resource could not be found." if status == 404 else str(exc)
    rid = request.headers.get("x-openstack-request-id") or new_request_id()
    style = _STYLES.get(request.url.path.strip("/").split("/", 1)[0], identity_error)
    return JSONResponse(
        style(status, message, None, rid),
        status_code=status,
        headers={"x-openstack-request-id": rid},
    )


def create_app(cloud: Cloud, *, runtime: Runtime | None = None) -> ASGIApp:
    """Every API on one port; `runtime` runs beside them (see `stowage.wiring`)."""
    services = {
        "/identity": create_identity_app(cloud),
        "/compute": create_compute_app(cloud),
        "/image": create_image_app(cloud),
        "/networking": create_network_app(cloud),
        "/placement": create_placement_app(cloud),
        "/volume": create_volume_app(cloud),
        # The metadata service, for the instance a metadata proxy names (api/metadata).
        "/openstack": create_openstack_metadata_app(cloud),
        "/latest": create_ec2_metadata_app(cloud),
    }
    for service in services.values():
        run_off_loop(service)
    app = Starlette(
        lifespan=_lifespan,
        exception_handlers={HTTPException: _unrouted},
        middleware=[
            Middleware(Observed),
            Middleware(BodyLimit, limit=functools.partial(_body_limit, cloud), render=_limit_error),
        ],
        routes=[
            Route("/metrics", _metrics),
            # The serial console's websocket proxy (compute's remote-consoles hand out its URL).
            WebSocketRoute(SERIAL_PATH + "/{server_id}", serial_console_websocket),
            *(Mount(prefix, app=service) for prefix, service in services.items()),
            Route("/dashboard", _to_dashboard),
            Mount("/dashboard", app=create_dashboard_app(cloud, services["/identity"])),
        ],
    )
    app.state.cloud = cloud
    app.state.runtime = runtime
    return _BarePrefix(app)


async def _to_dashboard(request: Request) -> Response:
    return RedirectResponse("/dashboard/", status_code=307)


def _body_limit(cloud: Cloud | None) -> int:
    return cloud.config.max_request_body_size if cloud is not None else DEFAULT_MAX_BODY


def _limit_error(path: str, status: int, message: str, request_id: str) -> dict[str, Any]:
    """A 413 of the body limit, in the shape of the service the path names."""
    style = _STYLES.get(path.strip("/").split("/", 1)[0], identity_error)
    return style(status, message, None, request_id)
