"""The dashboard's routes: each parses, authorizes with the API's own checks, calls a
services read (or use case) and renders; nothing here writes to the ledger."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import jinja2
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp

from stowage.api.common import Context
from stowage.api.dashboard import session
from stowage.api.responses import JSONResponse
from stowage.domain.errors import ConflictError, NotFound, StowageError
from stowage.domain.keystone import password_login
from stowage.services import dashboard as reads
from stowage.services.capacity import capacity_if_domain_fails, capacity_if_host_fails
from stowage.services.cloud import Cloud
from stowage.services.migrations import evacuate_host, move

__all__ = ["create_dashboard_app"]

ROOT = "/dashboard"
_HERE = Path(__file__).parent
_STATUSES = ("ACTIVE", "BUILD", "SHUTOFF", "PAUSED", "SUSPENDED", "MIGRATING", "ERROR")
_ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(_HERE / "templates"),
    autoescape=True,
)


def _hue(instance_id: str | None) -> int:
    """A stable colour per guest, so the same guest has the same colour on every page."""
    if not instance_id:
        return 0
    return int(hashlib.sha256(instance_id.encode()).hexdigest()[:6], 16) % 360


def _when(ts: float | None) -> str:
    if not ts:
        return ""
    return datetime.fromtimestamp(float(ts), UTC).strftime("%Y-%m-%d %H:%M:%S")


def _age(seconds: float | None) -> str:
    return "never" if seconds is None else f"{round(seconds)} s ago"


def _cpuset(cpus: Any) -> str:
    """CPU ids as a Linux cpuset (0-3,8)."""
    ids = sorted(int(c) for c in cpus)
    parts: list[str] = []
    start = prev = None
    for cpu in [*ids, None]:
        if cpu is not None and prev is not None and cpu == prev + 1:
            prev = cpu
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = cpu
    return ",".join(parts)


def _progress(body: Mapping[str, Any]) -> str:
    pct = reads.progress_percent(body)
    return "" if pct is None else f"{pct}%"


_ENV.globals.update(
    hue=_hue,
    when=_when,
    age=_age,
    cpuset=_cpuset,
    progress=_progress,
    percent=reads.progress_percent,
    root=ROOT,
)


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _render(
    request: Request,
    template: str,
    ctx: Context | None,
    *,
    status: int = 200,
    live: bool = False,
    **values: Any,
) -> HTMLResponse:
    partial = request.headers.get("x-dashboard-partial") == "1"
    html = _ENV.get_template(template).render(
        ctx=ctx,
        csrf=session.csrf_for(ctx.token) if ctx is not None else values.pop("csrf", ""),
        partial=partial,
        live=live,
        **values,
    )
    return HTMLResponse(
        html,
        status_code=status,
        headers={
            "Cache-Control": "no-store",
            "X-Frame-Options": "DENY",
            "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; "
            "frame-ancestors 'none'; form-action 'self'",
            "Referrer-Policy": "same-origin",
        },
    )


Page = Callable[[Request, Cloud, Context], Response]


def _page(handler: Page, *, admin: bool = False) -> Callable[[Request], Response]:
    """A page for a logged-in caller (admin pages: an admin's only, 403 otherwise); run in
    the thread pool, as every handler's database work runs off the event loop."""

    def endpoint(request: Request) -> Response:
        cloud: Cloud = request.app.state.cloud
        ctx = session.current_context(cloud, request)
        if ctx is None:
            target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
            return RedirectResponse(f"{ROOT}/login?next={quote(target)}", status_code=303)
        try:
            if admin and not ctx.is_admin:
                raise _Refused(403, "Policy doesn't allow this operation to be performed.")
            if request.method == "POST":
                _check_csrf(request, ctx)
            return handler(request, cloud, ctx)
        except _Refused as exc:
            return _render(
                request,
                "error.html",
                ctx,
                status=exc.status,
                title=str(exc.status),
                page="",
                status_code=exc.status,
                message=exc.message,
            )

    return endpoint


def _check_csrf(request: Request, ctx: Context) -> None:
    fields = request.state.form
    if not session.csrf_ok(session.csrf_for(ctx.token), fields.get("csrf", "")):
        raise _Refused(403, "The form's CSRF token is missing or wrong: reload the page.")


async def _with_form(request: Request, endpoint: Callable[[Request], Response]) -> Response:
    """Read an urlencoded body on the loop, then run the page in the thread pool."""
    request.state.form = session.form_fields(await request.body())
    return await asyncio.to_thread(endpoint, request)


def _post(handler: Page, *, admin: bool = False) -> Callable[[Request], Any]:
    endpoint = _page(handler, admin=admin)

    async def post(request: Request) -> Response:
        return await _with_form(request, endpoint)

    return post


# -- login ---------------------------------------------------------------------------------


def _safe_next(value: str) -> str:
    """Only a dashboard path: a login never sends the browser elsewhere."""
    if value.startswith(ROOT + "/") and not value.startswith("//") and "\\" not in value:
        return value
    return f"{ROOT}/servers"


async def login_form(request: Request) -> Response:
    csrf = session.login_csrf(request)
    response = _render(
        request,
        "login.html",
        None,
        title="Log in",
        page="login",
        csrf=csrf,
        error="",
        next=_safe_next(request.query_params.get("next", "")),
        username="",
        project="",
        domain="Default",
    )
    session.set_login_csrf(response, request, csrf)
    return response


async def login(request: Request) -> Response:
    """Keystone's password authentication, through the identity API of this process (the
    same checks as `openstack token issue`: lockout, disabled users, roles on the project)."""
    fields = session.form_fields(await request.body())
    cookie = request.cookies.get(session.LOGIN_CSRF_COOKIE, "")
    username, project = fields.get("username", ""), fields.get("project", "")
    domain = fields.get("domain") or "Default"
    error = ""
    if not session.csrf_ok(cookie, fields.get("csrf", "")):
        error = "The login form expired: try again."
    else:
        token, expires_at, error = await _keystone_login(
            request, username, fields.get("password", ""), project, domain
        )
        if token:
            done = RedirectResponse(_safe_next(fields.get("next", "")), status_code=303)
            session.set_session(done, request, token, expires_at)
            done.delete_cookie(session.LOGIN_CSRF_COOKIE, path=session.PATH)
            return done
    csrf = session.login_csrf(request)
    response = _render(
        request,
        "login.html",
        None,
        status=401,
        title="Log in",
        page="login",
        csrf=csrf,
        error=error,
        next=_safe_next(fields.get("next", "")),
        username=username,
        project=project,
        domain=domain,
    )
    session.set_login_csrf(response, request, csrf)
    return response


async def _keystone_login(
    request: Request, username: str, password: str, project: str, domain: str
) -> tuple[str, float, str]:
    identity: ASGIApp = request.app.state.identity_app
    body = password_login(username, password, project, domain)
    transport = httpx.ASGITransport(app=identity)
    async with httpx.AsyncClient(transport=transport, base_url="http://dashboard") as client:
        answer = await client.post("/v3/auth/tokens", json=body)
    if answer.status_code != 201:
        try:
            message = str(answer.json()["error"]["message"])
        except (ValueError, KeyError, TypeError):
            message = "Login failed."
        return "", 0.0, message
    expires = answer.json()["token"]["expires_at"]
    expires_at = datetime.fromisoformat(expires.replace("Z", "+00:00")).timestamp()
    return answer.headers["x-subject-token"], expires_at, ""


def logout(request: Request, cloud: Cloud, ctx: Context) -> Response:
    response = RedirectResponse(f"{ROOT}/login", status_code=303)
    response.delete_cookie(session.SESSION_COOKIE, path=session.PATH)
    return response


# -- pages ---------------------------------------------------------------------------------


def home(request: Request, cloud: Cloud, ctx: Context) -> Response:
    return RedirectResponse(f"{ROOT}/hosts" if ctx.is_admin else f"{ROOT}/servers", 303)


def feed(request: Request, cloud: Cloud, ctx: Context) -> Response:
    return JSONResponse(
        {"marker": reads.change_marker(cloud), "now": cloud.clock()},
        headers={"Cache-Control": "no-store"},
    )


def hosts_page(request: Request, cloud: Cloud, ctx: Context) -> Response:
    cards = reads.host_cards(cloud)
    names = {d.id: d.body.get("name", d.id) for d in reads.servers(cloud, None)}
    pinned: dict[str, list[tuple[str, int]]] = {}
    for card in cards:
        for cell in card.cells:
            for core in cell.cores:
                for cpu in core:
                    if cpu.instance_id is not None and not cpu.withheld:
                        pinned.setdefault(cpu.instance_id, []).append((card.host.name, cpu.id))
    legend = [
        {
            "id": instance_id,
            "name": names.get(instance_id, instance_id),
            "host": ", ".join(sorted({h for h, _ in where})),
            "cpus": _cpuset(c for _, c in where),
        }
        for instance_id, where in sorted(pinned.items(), key=lambda kv: str(names.get(kv[0])))
    ]

    def guest(instance_id: str | None) -> str:
        return str(names.get(instance_id, instance_id)) if instance_id else ""

    return _render(
        request,
        "hosts.html",
        ctx,
        live=True,
        title="Hosts",
        page="hosts",
        cards=cards,
        legend=legend,
        guest=guest,
    )


def servers_page(request: Request, cloud: Cloud, ctx: Context) -> Response:
    query = request.query_params
    all_projects = ctx.is_admin and query.get("all_projects") == "1"
    filters = {
        "name": query.get("name", ""),
        "status": query.get("status", ""),
        "host": query.get("host", "") if ctx.is_admin else "",
        "all_projects": all_projects,
    }
    docs = reads.servers(
        cloud,
        None if all_projects else ctx.project_id,
        name=str(filters["name"]),
        status=str(filters["status"]),
        host=str(filters["host"]),
    )
    return _render(
        request,
        "servers.html",
        ctx,
        live=True,
        title="Servers",
        page="servers",
        docs=docs,
        filters=filters,
        statuses=_STATUSES,
    )


def _visible_server(cloud: Cloud, ctx: Context, server_id: str) -> Any:
    """The server, or a 404 (another project's server too: as the compute API answers)."""
    doc = cloud.objects.find("instance", server_id)
    if doc is None or not (doc.project_id == ctx.project_id or ctx.is_admin):
        raise _Refused(404, f"Instance {server_id} could not be found.")
    return doc


def server_page(request: Request, cloud: Cloud, ctx: Context, message: str = "") -> Response:
    server_id = request.path_params["server_id"]
    doc = _visible_server(cloud, ctx, server_id)
    claim = reads.server_claim(cloud, server_id)
    hosts = [card.host.name for card in reads.host_cards(cloud)] if ctx.is_admin else []
    return _render(
        request,
        "server.html",
        ctx,
        live=True,
        title=f"Server {doc.body.get('name', server_id)}",
        page="servers",
        doc=doc,
        claim=claim,
        hosts=hosts,
        message=message,
    )


def live_migrate(request: Request, cloud: Cloud, ctx: Context) -> Response:
    """Start a live migration (the compute API's os-migrateLive, admin only), then show the
    server again: its page follows the move live."""
    server_id = request.path_params["server_id"]
    _visible_server(cloud, ctx, server_id)
    dest = request.state.form.get("host") or None
    try:
        move(
            cloud,
            server_id,
            "live-migration",
            user_id=ctx.user_id,
            project_id=ctx.project_id,
            dest=dest,
            request_id=request.state.request_id,
        )
    except (ConflictError, NotFound) as exc:
        raise _Refused(409 if isinstance(exc, ConflictError) else 400, exc.message) from None
    except StowageError as exc:
        raise _Refused(400, exc.message) from None
    return RedirectResponse(f"{ROOT}/servers/{quote(server_id)}", status_code=303)


def groups_page(request: Request, cloud: Cloud, ctx: Context) -> Response:
    project = None if ctx.is_admin else ctx.project_id
    groups = reads.server_groups(cloud, project)
    names = {d.id: str(d.body.get("name", d.id)) for d in reads.servers(cloud, project)}
    return _render(
        request,
        "groups.html",
        ctx,
        live=True,
        title="Server groups",
        page="groups",
        groups=groups,
        names=names,
    )


def migrations_page(request: Request, cloud: Cloud, ctx: Context) -> Response:
    migrations = reads.migrations_in_flight(cloud, None)
    names = {d.id: str(d.body.get("name", d.id)) for d in reads.servers(cloud, None)}
    return _render(
        request,
        "migrations.html",
        ctx,
        live=True,
        title="Migrations",
        page="migrations",
        migrations=migrations,
        names=names,
        cards=reads.host_cards(cloud),
    )


def _host_state(cloud: Cloud, host: str) -> str:
    card = next((c for c in reads.host_cards(cloud) if c.host.name == host), None)
    if card is None:
        raise _Refused(404, f"Compute host {host} could not be found.")
    return card.state


def evacuate_page(
    request: Request,
    cloud: Cloud,
    ctx: Context,
    *,
    results: list[tuple[str, Any]] | None = None,
    error: str = "",
) -> Response:
    """The plan first: where each instance of the host would go, as the evacuation plans it
    (all of them together), before anything is started."""
    host = request.path_params["host"]
    state = _host_state(cloud, host)
    report = capacity_if_host_fails(cloud, host)
    return _render(
        request,
        "evacuate.html",
        ctx,
        live=results is None,
        title=f"Evacuate {host}",
        page="migrations",
        host=host,
        state=state,
        report=report,
        results=results or [],
        error=error,
    )


def evacuate(request: Request, cloud: Cloud, ctx: Context) -> Response:
    host = request.path_params["host"]
    try:
        started = evacuate_host(
            cloud,
            host,
            user_id=ctx.user_id,
            project_id=ctx.project_id,
            request_id=request.state.request_id,
        )
    except NotFound as exc:
        raise _Refused(404, exc.message) from None
    except ConflictError as exc:
        return evacuate_page(request, cloud, ctx, error=exc.message)
    return evacuate_page(request, cloud, ctx, results=sorted(started.items()))


def capacity_page(request: Request, cloud: Cloud, ctx: Context) -> Response:
    """`?fail=HOST`, or `?fail=LABEL=VALUE` for a whole failure domain (a rack)."""
    hosts = [card.host.name for card in reads.host_cards(cloud)]
    domains = sorted(
        {f"{k}={v}" for labels in reads.host_labels(cloud).values() for k, v in labels.items()}
    )
    target = request.query_params.get("fail", "")
    report = None
    try:
        if target in hosts:
            report = capacity_if_host_fails(cloud, target)
        elif "=" in target:
            label, value = target.split("=", 1)
            report = capacity_if_domain_fails(cloud, label, value)
        elif target:
            raise NotFound(f"Compute host {target} could not be found.")
    except NotFound as exc:
        raise _Refused(404, exc.message) from None
    return _render(
        request,
        "capacity.html",
        ctx,
        title="Capacity what-if",
        page="capacity",
        hosts=hosts,
        domains=domains,
        target=target,
        report=report,
    )


# -- the app -------------------------------------------------------------------------------


class _RequestId:
    """A request id on every dashboard response, as the APIs give one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        import uuid

        headers = dict(scope.get("headers") or [])
        rid = headers.get(b"x-openstack-request-id", b"").decode() or f"req-{uuid.uuid4()}"
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message: Any) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", []).append((b"x-openstack-request-id", rid.encode()))
            await send(message)

        await self.app(scope, receive, send_with_id)


def create_dashboard_app(cloud: Cloud, identity_app: ASGIApp) -> ASGIApp:
    """The dashboard, to mount at `/dashboard`; `identity_app` answers its logins."""
    app = Starlette(
        routes=[
            Route("/", _page(home)),
            Route("/login", login_form, methods=["GET"]),
            Route("/login", login, methods=["POST"]),
            Route("/logout", _post(logout), methods=["POST"]),
            Route("/feed", _page(feed)),
            Route("/hosts", _page(hosts_page, admin=True)),
            Route("/hosts/{host}/evacuate", _page(evacuate_page, admin=True), methods=["GET"]),
            Route("/hosts/{host}/evacuate", _post(evacuate, admin=True), methods=["POST"]),
            Route("/servers", _page(servers_page)),
            Route("/servers/{server_id}", _page(server_page)),
            Route(
                "/servers/{server_id}/live-migrate",
                _post(live_migrate, admin=True),
                methods=["POST"],
            ),
            Route("/groups", _page(groups_page)),
            Route("/migrations", _page(migrations_page, admin=True)),
            Route("/capacity", _page(capacity_page, admin=True)),
            Mount("/static", app=StaticFiles(directory=_HERE / "static"), name="static"),
        ]
    )
    app.state.cloud = cloud
    app.state.identity_app = identity_app
    return _RequestId(app)
