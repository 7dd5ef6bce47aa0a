"""Every API's routes are its app's own (`include_routes`): a request is matched against them
directly, not through FastAPI's included-router wrappers, which walked every route of every
router they passed on each request to learn whether one had changed (a tenth of the API
process's CPU under load, docs/performance.md 2026-12-07)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import APIRouter, Depends, FastAPI
from fastapi.routing import APIRoute
from starlette.routing import Mount, Route

from stowage.api.app import create_app
from stowage.api.common import api_app, include_routes
from stowage.domain.keystone import password_login
from stowage.ledger import Ledger
from stowage.services.cloud import Cloud, CloudConfig, bootstrap


@pytest.fixture
def cloud(tmp_path: Path) -> Iterator[Cloud]:
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'ledger.db'}")
    try:
        made = Cloud(CloudConfig(state_dir=tmp_path / "state", hosts=1), ledger)
        bootstrap(made)
        yield made
    finally:
        ledger.close()


def _apps(app: Any) -> list[FastAPI]:
    return [m.app for m in app.app.routes if isinstance(m, Mount) and isinstance(m.app, FastAPI)]


def test_every_api_route_is_its_apps_own(cloud: Cloud) -> None:
    apps = _apps(create_app(cloud))
    assert len(apps) >= 7
    for app in apps:
        kinds = {type(route).__name__ for route in app.router.routes}
        assert all(isinstance(route, APIRoute) for route in app.router.routes), kinds


def test_requests_do_not_walk_the_routes(cloud: Cloud, monkeypatch: pytest.MonkeyPatch) -> None:
    """FastAPI asks a router for its routes' version on each request that passes one of its
    included routers; with the routes the app's own, no request asks."""
    asked: list[int] = []
    real = APIRouter._get_routes_version

    def counted(self: APIRouter, seen: set[int] | None = None) -> int:
        asked.append(1)
        return real(self, seen)

    monkeypatch.setattr(APIRouter, "_get_routes_version", counted)
    app = create_app(cloud)

    async def requests() -> list[int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            login = await client.post(
                "/identity/v3/auth/tokens", json=password_login("admin", "stowage-admin", "admin")
            )
            headers = {"X-Auth-Token": login.headers["X-Subject-Token"]}
            project = login.json()["token"]["project"]["id"]
            codes = [login.status_code]
            for path in (
                "/compute/v2.1/flavors/1",
                "/compute/v2.1/servers",
                "/image/v2/images",
                "/networking/v2.0/networks",
                f"/volume/v3/{project}/volumes",
                "/placement/resource_providers",
            ):
                codes.append((await client.get(path, headers=headers)).status_code)
            return codes

    assert asyncio.run(requests()) == [201, 200, 200, 200, 200, 200, 200]
    assert asked == []


def _serve(app: FastAPI, method: str, path: str) -> tuple[int, Any]:
    async def request() -> tuple[int, Any]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            answer = await client.request(method, path)
            return answer.status_code, json.loads(answer.content or b"null")

    return asyncio.run(request())


class _Teapot(APIRoute):
    """A route class of a router's own (as the image and network APIs' error translators)."""

    def get_route_handler(self) -> Any:
        handler = super().get_route_handler()

        async def answer(request: Any) -> Any:
            response = await handler(request)
            response.headers["x-route-class"] = "teapot"
            return response

        return answer


def test_a_prefix_its_path_parameters_and_route_classes_are_kept() -> None:
    inner = APIRouter(route_class=_Teapot)

    @inner.get("/things/{thing_id}", status_code=203)
    def thing(project_id: str, thing_id: str) -> dict[str, str]:
        return {"project": project_id, "thing": thing_id}

    @inner.post("/things")
    def make() -> dict[str, str]:
        return {"made": "yes"}

    nested = APIRouter()
    include_routes(nested, inner)
    app = api_app()
    include_routes(app, nested, prefix="/v3/{project_id}")
    assert _serve(app, "GET", "/v3/p1/things/t1") == (203, {"project": "p1", "thing": "t1"})
    assert _serve(app, "POST", "/v3/p1/things") == (200, {"made": "yes"})
    assert _serve(app, "DELETE", "/v3/p1/things")[0] == 405
    assert _serve(app, "GET", "/v2/p1/things/t1")[0] == 404

    async def header() -> str:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            return (await client.get("/v3/p1/things/t1")).headers["x-route-class"]

    assert asyncio.run(header()) == "teapot"


def test_what_it_cannot_keep_is_refused_when_the_app_is_built() -> None:
    guarded = APIRouter(dependencies=[Depends(lambda: None)])

    @guarded.get("/x")
    def x() -> None:
        return None

    with pytest.raises(TypeError, match="router-wide"):
        include_routes(api_app(), guarded)
    plain = APIRouter()
    plain.routes.append(Route("/y", lambda request: None))
    with pytest.raises(TypeError, match="not an APIRoute"):
        include_routes(api_app(), plain)
