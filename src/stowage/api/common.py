"""What every API shares: request ids, the caller's context, errors in each service's shape."""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, TypeVarTuple

from anyio import to_thread
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import APIRoute, request_response
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException

from stowage.api.asgi import OnResponse, ResponseHeaders
from stowage.api.responses import JSONResponse
from stowage.domain.errors import (
    ConflictError,
    InvalidSpec,
    NotFound,
    QuotaExceeded,
    StowageError,
)
from stowage.domain.ids import new_request_id

if TYPE_CHECKING:
    from stowage.services.cloud import Cloud

__all__ = [
    "ApiError",
    "Context",
    "ErrorStyle",
    "api_routes",
    "include_routes",
    "install_common",
    "json_body",
    "json_of",
    "loads",
    "on_loop",
    "parse_limit",
    "run_off_loop",
    "size_thread_pool",
    "www_authenticate",
]


class ApiError(Exception):
    """An error with an HTTP status, rendered in the shape of the service that raised it."""

    def __init__(self, status: int, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


@dataclass(frozen=True, slots=True)
class Context:
    """Who is calling, from a validated token."""

    user_id: str
    user_name: str
    project_id: str
    project_name: str
    roles: frozenset[str]
    token: str = ""
    audit_id: str = ""
    expires_at: float = 0.0
    domain_id: str = "default"
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def is_admin(self) -> bool:
        return "admin" in self.roles

    @property
    def can_write(self) -> bool:
        """A reader may look; a member, manager or admin may also change things."""
        return bool(self.roles & {"admin", "member", "manager"})


# Compute's names for each status (nova/api/openstack/wsgi.py's fault names).
_COMPUTE_NAMES = {
    400: "badRequest",
    401: "unauthorized",
    403: "forbidden",
    404: "itemNotFound",
    405: "badMethod",
    406: "notAcceptable",
    409: "conflictingRequest",
    413: "overLimit",
    415: "badMediaType",
    429: "overLimit",
    500: "computeFault",
    501: "notImplemented",
    503: "serviceUnavailable",
}
_TITLES = {
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    406: "Not Acceptable",
    409: "Conflict",
    413: "Request Entity Too Large",
    415: "Unsupported Media Type",
    500: "Internal Server Error",
    501: "Not Implemented",
}
_NEUTRON_TYPES = {
    400: "BadRequest",
    401: "NotAuthorized",
    403: "Forbidden",
    404: "NotFound",
    409: "Conflict",
    500: "InternalServerError",
}


ErrorStyle = Callable[[int, str, str | None, str], dict[str, Any]]


def compute_error(status: int, message: str, code: str | None, request_id: str) -> dict[str, Any]:
    return {_COMPUTE_NAMES.get(status, "computeFault"): {"code": status, "message": message}}


def identity_error(status: int, message: str, code: str | None, request_id: str) -> dict[str, Any]:
    return {"error": {"code": status, "title": _TITLES.get(status, "Error"), "message": message}}


def image_error(status: int, message: str, code: str | None, request_id: str) -> dict[str, Any]:
    title = _TITLES.get(status, "Error")
    return {"code": f"{status} {title}", "title": title, "message": message}


def network_error(status: int, message: str, code: str | None, request_id: str) -> dict[str, Any]:
    kind = code or _NEUTRON_TYPES.get(status, "NeutronError")
    return {"NeutronError": {"type": kind, "message": message, "detail": ""}}


def placement_error(status: int, message: str, code: str | None, request_id: str) -> dict[str, Any]:
    return {
        "errors": [
            {
                "status": status,
                "title": _TITLES.get(status, "Error"),
                "detail": message,
                "request_id": request_id,
                "code": code or "placement.undefined_code",
            }
        ]
    }


_DOMAIN_STATUS: list[tuple[type[StowageError], int]] = [
    (NotFound, 404),
    (ConflictError, 409),
    (InvalidSpec, 400),
    (QuotaExceeded, 403),
]


def api_app() -> FastAPI:
    """One API's FastAPI application: no OpenAPI document or docs pages, and FastAPI's own
    OpenTelemetry instrumentation only where the process has an OpenTelemetry tracer
    provider when the app is built (run under `opentelemetry-instrument`, say). Left on with
    none, it read the environment for one on every request, to do nothing (3% of a trivial
    GET's CPU in process, docs/performance.md 2026-12-07). Stowage's own metrics are
    Prometheus's and its logs structlog's."""
    from opentelemetry import trace

    traced = not isinstance(
        trace.get_tracer_provider(), trace.ProxyTracerProvider | trace.NoOpTracerProvider
    )
    return FastAPI(
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
        telemetry={
            "tracing": traced,
            "operation_spans": traced,
            "metrics": False,
            "logs": False,
        },
    )


def include_routes(parent: FastAPI | APIRouter, router: APIRouter, *, prefix: str = "") -> None:
    """`parent.include_router(router, prefix=prefix)`, with `router`'s routes made routes of
    `parent` (of an app: of its router) itself, each of its own `route_class` and rebuilt on
    the whole path (so the prefix's path parameters are the handler's as well).

    FastAPI's `include_router` (0.143 and later) keeps an included router behind a wrapper
    that, on every request, walks the included router's routes to learn whether any changed
    since it last looked, then matches inside it: a compute request passed some twenty such
    wrappers, and FastAPI's routing was a tenth of the API process's CPU under load
    (docs/performance.md, 2026-12-07). Stowage's routers are whole before their app serves,
    so nothing is lost by taking their routes as they are then. Only `APIRoute`s (and routers
    of them) are taken, and a router's own settings must be defaults: anything else raises
    here, when the app is built, instead of serving differently."""
    if router.dependencies or router.callbacks or router.responses or router.tags:
        raise TypeError(f"include_routes: {router!r} has router-wide settings")
    target = parent.router if isinstance(parent, FastAPI) else parent
    for route in router.routes:
        included = getattr(route, "original_router", None)
        if included is not None:
            context = route.include_context  # type: ignore[attr-defined]
            include_routes(parent, included, prefix=prefix + (context.prefix or ""))
            continue
        if not isinstance(route, APIRoute):
            raise TypeError(f"include_routes: {route!r} is not an APIRoute")
        options = {name: getattr(route, name) for name in _ROUTE_OPTIONS}
        target.add_api_route(
            prefix + route.path, route.endpoint, route_class_override=type(route), **options
        )


_ROUTE_OPTIONS = tuple(
    name
    for name in inspect.signature(APIRoute.__init__).parameters
    if name not in ("self", "path", "endpoint", "dependency_overrides_provider")
)
"""What an `APIRoute` is built with, besides its path and endpoint, read back off a route
by the same names (`include_routes`)."""


def install_common(app: FastAPI, style: ErrorStyle, *, extra_headers: bool = False) -> None:
    """Request ids on every response and errors rendered in `style`."""

    def render(
        request: Request,
        status: int,
        message: str,
        code: str | None,
        headers: dict[str, str] | None = None,
    ) -> JSONResponse:
        request_id = getattr(request.state, "request_id", "")
        if status == 401:
            headers = {**(headers or {}), **www_authenticate(request)}
        return JSONResponse(
            style(status, message, code, request_id), status_code=status, headers=headers
        )

    def request_id(request: Request) -> OnResponse:
        rid = request.headers.get("x-openstack-request-id") or new_request_id()
        request.state.request_id = rid

        def stamp(status: int, headers: MutableHeaders) -> None:
            headers["x-openstack-request-id"] = rid
            if extra_headers:
                headers["x-compute-request-id"] = rid

        return stamp

    app.add_middleware(ResponseHeaders, enter=request_id)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return render(request, exc.status, exc.message, exc.code)

    @app.exception_handler(StowageError)
    async def _domain_error(request: Request, exc: StowageError) -> JSONResponse:
        status = next((s for kind, s in _DOMAIN_STATUS if isinstance(exc, kind)), 400)
        return render(request, status, exc.message, exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = "The resource could not be found."
        if exc.status_code == 405 and message == "Method Not Allowed":
            message = f"The method {request.method} is not allowed for this resource."
        return render(request, exc.status_code, message, None, dict(exc.headers or {}))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return render(
            request,
            400,
            f"Invalid input for field/attribute {where}: {first.get('msg', 'invalid')}",
            None,
        )


def www_authenticate(request: Request) -> dict[str, str]:
    """Where to authenticate, on every 401 (as keystonemiddleware and Keystone answer)."""
    cloud = getattr(request.app.state, "cloud", None)
    base = cloud.config.base_url if cloud is not None else str(request.base_url).rstrip("/")
    return {"WWW-Authenticate": f'Keystone uri="{base}/identity"'}


def parse_limit(raw: str | None, *, maximum: int) -> int | None:
    """A `limit` query parameter as nova and glance read it: None when absent, capped."""
    if raw is None:
        return None
    try:
        limit = int(raw)
    except ValueError:
        raise ApiError(400, "limit param must be an integer") from None
    if limit < 0:
        raise ApiError(400, "limit param must be positive")
    return min(limit, maximum)


def loads(raw: bytes) -> Any:
    """JSON as a client may send it, or ValueError: no NaN or Infinity (no answer could echo
    them), no lone surrogates (no answer could encode them), no nesting past Python's stack."""
    try:
        value = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise ValueError("a string is not valid Unicode") from None
    if _holds_nul(value):
        raise NulInString("a string holds a NUL character")
    return value


class NulInString(ValueError):
    """A JSON string with U+0000: no name, id or value may hold one (PostgreSQL cannot store it,
    and C strings end there)."""


def _holds_nul(value: Any) -> bool:
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            if "\x00" in item:
                return True
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return False


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


async def json_body(request: Request, *, required: bool = True) -> Any:
    """The request's JSON, or a 400 in the service's shape."""
    return json_of(await request.body(), required=required)


def json_of(raw: bytes, *, required: bool = True) -> Any:
    """`json_body` of a body already read."""
    if not raw:
        if required:
            raise ApiError(400, "The request body is missing or is not valid JSON.")
        return None
    try:
        return loads(raw)
    except NulInString:
        raise ApiError(400, "Invalid input: a string of the body holds a NUL character.") from None
    except ValueError:
        raise ApiError(400, "Malformed request body: not valid JSON.") from None


# -- handlers off the event loop ----------------------------------------------------------

_THREAD = threading.local()
_T = TypeVar("_T")
_Ts = TypeVarTuple("_Ts")
Endpoint = Callable[..., Any]


def on_loop(endpoint: Endpoint) -> Endpoint:
    """Keep an endpoint on the event loop: it streams a request body, or awaits the bus."""
    endpoint.__dict__["stowage_on_loop"] = True
    return endpoint


def run_off_loop(app: FastAPI) -> None:
    """Run every coroutine endpoint of `app` in the thread pool, never on the event loop.

    The handlers do synchronous database work (and password hashing); on the loop, one slow
    request stalls every other (the busy-disk seed's class of bug, in the API). The body is
    read on the loop first (it is I/O), then the handler runs in a worker thread on that
    thread's own event loop, so its `await`s keep working. Endpoints marked `on_loop` stay.
    Call it before the app serves its first request (FastAPI builds included routes lazily,
    from each route's endpoint).
    """
    for route in api_routes(app.router):
        endpoint = route.endpoint
        if not inspect.iscoroutinefunction(endpoint) or getattr(endpoint, "stowage_on_loop", False):
            continue
        threaded = _in_worker_thread(endpoint)
        route.endpoint = threaded
        route.dependant.call = threaded
        route.get_route_handler = _body_first(route)  # type: ignore[method-assign,assignment]
        route.app = request_response(route.get_route_handler())


def size_thread_pool(cloud: Cloud) -> None:
    """The handlers' thread pool (anyio's default limiter, of the running loop): on a SQLite
    ledger, `HANDLER_THREADS` threads; elsewhere it is left at anyio's default, 40.

    On SQLite a handler's database work is this process's own CPU, under its one
    interpreter lock: threads past a few make no more progress, they only pass the lock
    around (on `GET /flavors/1` under 32 connections, 64 context switches and 125 futex
    calls a request with 40 threads, 24 and 55 with 4; docs/performance.md 2026-12-07).
    On PostgreSQL a handler waits on the network, where more threads do overlap. A cloud
    whose answers wait for their operations (`api_wait_s`) keeps the 40: each waiting
    answer holds its thread for up to that long. The handlers that wait on the loop
    (`on_loop`: a create's commit, the bus) hold none meanwhile."""
    sqlite = cloud.ledger.engine.dialect.name == "sqlite"
    if sqlite and cloud.config.api_wait_s <= 0:
        to_thread.current_default_thread_limiter().total_tokens = HANDLER_THREADS


HANDLER_THREADS = 8
"""The handlers' threads on a SQLite ledger (`size_thread_pool`)."""


def api_routes(router: Any) -> Iterator[APIRoute]:
    for route in router.routes:
        if isinstance(route, APIRoute):
            yield route
        included = getattr(route, "original_router", None)
        if included is not None:
            yield from api_routes(included)


def _in_worker_thread(endpoint: Endpoint) -> Endpoint:
    def call(*args: Any, **kwargs: Any) -> Any:
        return _thread_loop().run_until_complete(endpoint(*args, **kwargs))

    # FastAPI reads the parameters from the signature (annotations resolved here, in the
    # endpoint's own module) and sees a plain function: it calls it in the thread pool.
    call.__signature__ = inspect.signature(endpoint, eval_str=True)  # type: ignore[attr-defined]
    call.__name__ = endpoint.__name__
    call.__qualname__ = endpoint.__qualname__
    call.__module__ = endpoint.__module__
    return call


class _WorkerLoop(asyncio.SelectorEventLoop):
    """A worker thread's own event loop, whose default executor is the thread itself:
    `asyncio.to_thread` in a handler that already runs off the event loop calls its function
    right here and hands back a finished future.

    A handler's `await asyncio.to_thread(...)` keeps the API's loop free when the handler
    runs on it; off it, the same call would hand the work to yet another thread (each worker
    thread's loop started a pool of its own) and wait for it: a thread start and two GIL
    hand-overs per call, a tenth of `POST /servers`'s samples, for no gain. A pool that runs
    the function in place still chained its future to the loop's through two
    `call_soon_threadsafe` (each a write to the loop's self-pipe) per call: none here. The
    thread is blocked either way, as it was while it waited. Closed when the thread ends (its
    thread-local storage goes, and this with it): nothing is left for the garbage collector to
    warn of."""

    def run_in_executor(
        self,
        executor: concurrent.futures.Executor | None,
        func: Callable[[*_Ts], _T],
        *args: *_Ts,
    ) -> asyncio.Future[_T]:
        if executor is not None:
            return super().run_in_executor(executor, func, *args)
        done: asyncio.Future[_T] = self.create_future()
        try:
            done.set_result(func(*args))
        except BaseException as exc:  # as a pool's work item hands on whatever it raised
            done.set_exception(exc)
        return done

    def __del__(self) -> None:
        if not self.is_closed():
            self.close()


def _thread_loop() -> asyncio.AbstractEventLoop:
    held: _WorkerLoop | None = getattr(_THREAD, "loop", None)
    if held is None:
        held = _WorkerLoop()
        _THREAD.loop = held
    return held


def _body_first(route: APIRoute) -> Callable[[], Callable[[Request], Awaitable[Response]]]:
    """`route.get_route_handler`, with the body read (and cached on the request the handler
    is given) on the event loop before the handler runs in its thread."""

    def get_route_handler() -> Callable[[Request], Awaitable[Response]]:
        # The route's own class (a router's route_class may translate errors), not the
        # instance attribute this replaces.
        handler = type(route).get_route_handler(route)

        async def read_then_handle(request: Request) -> Response:
            await request.body()
            return await handler(request)

        return read_then_handle

    return get_route_handler
