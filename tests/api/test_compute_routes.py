"""The compute, identity and network APIs' routers may be included in any order (the busiest
first and the version documents last, for speed: api/compute/__init__.py): no two of them serve
the same method and path."""

from __future__ import annotations

import re
from types import ModuleType

import pytest
from fastapi import APIRouter
from starlette.routing import compile_path

from stowage.api import compute, identity, network


@pytest.mark.parametrize(
    ("api", "prefix", "least"),
    [(compute, "/v2.1", 100), (identity, "", 100), (network, "/v2.0", 80)],
)
def test_no_two_routers_serve_the_same_request(api: ModuleType, prefix: str, least: int) -> None:
    routers: list[tuple[str, APIRouter, str]] = [
        (module.__name__, module.router, prefix) for module in api._ROUTERS
    ]
    routers.append(("discovery", api.discovery, ""))
    routes = [
        (name, prefix + route.path, compile_path(prefix + route.path)[0], set(route.methods or ()))
        for name, router, prefix in routers
        for route in router.routes
    ]
    assert len(routes) > least
    shared = []
    for module, path, _, methods in routes:
        sample = re.sub(r"\{[^}]+\}", "x0", path)  # a request this route serves
        for method in methods:
            serving = {
                other
                for other, _, regex, other_methods in routes
                if method in other_methods and regex.match(sample)
            }
            if serving != {module}:
                shared.append((method, path, sorted(serving)))
    assert shared == []
