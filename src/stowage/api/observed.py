"""Every request's request id bound to its log lines, an access log line, and its rate and
latency per route template."""

from __future__ import annotations

import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stowage.domain.ids import new_request_id
from stowage.telemetry import bind, logger
from stowage.telemetry.metrics import HTTP_REQUESTS, HTTP_SECONDS

__all__ = ["Observed"]

access = logger("stowage.access")
_HEADER = b"x-openstack-request-id"


class Observed:
    """ASGI middleware, outermost: the request id is the client's `X-OpenStack-Request-Id`
    or a new one, put in the headers so every service's own middleware answers with the
    same, and bound (structlog contextvars) to all the work the request does."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = list(scope.get("headers") or [])
        rid = next((v.decode("latin-1") for k, v in headers if k == _HEADER), "")
        if not rid:
            rid = new_request_id()
            scope = dict(scope, headers=[*headers, (_HEADER, rid.encode())])
        status = 500
        started = time.perf_counter()

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        with bind(request_id=rid):
            try:
                await self.app(scope, receive, send_status)
            finally:
                elapsed_s = time.perf_counter() - started
                route = _route_of(scope)
                method = str(scope.get("method", ""))
                HTTP_REQUESTS.labels(route, method, str(status)).inc()
                HTTP_SECONDS.labels(route, method).observe(elapsed_s)
                access.info(
                    "request",
                    method=method,
                    path=scope.get("path", ""),
                    route=route,
                    status=status,
                    duration_ms=round(elapsed_s * 1000, 1),
                    client=(scope.get("client") or ("", 0))[0],
                )


def _route_of(scope: Scope) -> str:
    """The matched route's template under its mounts (bounded cardinality), or the first
    path segment when no route matched."""
    route: Any = scope.get("route")
    template = getattr(route, "path", None)
    path = str(scope.get("path", "/"))
    if isinstance(template, str) and ":path}" not in template:
        # The template matched the path's last segments; what is before them is the mounts'
        # and routers' prefixes (static), whichever way they were included.
        parts = [p for p in path.split("/") if p]
        tail = [p for p in template.split("/") if p]
        head = parts[: max(0, len(parts) - len(tail))]
        return "/" + "/".join([*head, *tail]) + ("/" if template.endswith("/") and tail else "")
    if isinstance(template, str):
        return str(scope.get("root_path", "")) + template
    first = path.strip("/").split("/", 1)[0]
    return f"/{first}/*" if first else "/"
