"""The compute API's routers may be included in any order (the busiest first and the version
documents last, for speed: api/compute/__init__.py): no two of them serve the same method and
path."""

from __future__ import annotations

import re

from starlette.routing import compile_path

from stowage.api.compute import _ROUTERS, discovery


def test_no_two_compute_routers_serve_the_same_request() -> None:
    routers = [(module.__name__, module.router, "/v2.1") for module in _ROUTERS]
    routers.append(("discovery", discovery, ""))
    routes = [
        (name, prefix + route.path, compile_path(prefix + route.path)[0], set(route.methods or ()))
        for name, router, prefix in routers
        for route in router.routes
    ]
    assert len(routes) > 100
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
