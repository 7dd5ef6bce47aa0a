"""The API never runs a handler on its event loop (issue 9): every endpoint but the ones that
stream a body or await the bus runs in the thread pool, so a slow request (a password hash,
a large query) cannot stall the others; the loop's lag is exported like the agents'."""

from __future__ import annotations

import inspect
import threading
from pathlib import Path

import httpx
from fastapi import FastAPI
from starlette.routing import Mount
from tests.api.cloudproc import start_cloud, stop_cloud

from stowage.api.app import create_app
from stowage.api.common import api_routes
from stowage.ledger import Ledger
from stowage.services.cloud import Cloud, CloudConfig, bootstrap

ON_LOOP = {"upload_data", "show", "act", "reconcile"}


def test_every_handler_runs_in_the_thread_pool(tmp_path: Path) -> None:
    """Before the fix every handler was `async` and did its database work on the loop."""
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'ledger.db'}")
    try:
        cloud = Cloud(CloudConfig(state_dir=tmp_path / "state", hosts=1), ledger)
        bootstrap(cloud)
        app = create_app(cloud).app  # type: ignore[attr-defined]
        on_loop, off_loop = set(), 0
        for mount in app.routes:
            if not isinstance(mount, Mount) or not isinstance(mount.app, FastAPI):
                continue
            for route in api_routes(mount.app.router):
                if inspect.iscoroutinefunction(route.endpoint):
                    on_loop.add(route.endpoint.__name__)
                else:
                    off_loop += 1
        assert on_loop <= ON_LOOP, on_loop - ON_LOOP
        assert off_loop > 200
    finally:
        ledger.close()


def test_a_request_is_handled_off_the_loop_and_the_lag_is_exported(tmp_path: Path) -> None:
    cloud = start_cloud(tmp_path / "state", "--hosts", "1")
    try:
        seen: list[int] = []

        def wrong_password() -> None:
            body = {
                "auth": {
                    "identity": {
                        "methods": ["password"],
                        "password": {
                            "user": {
                                "name": "admin",
                                "domain": {"name": "Default"},
                                "password": "x",
                            }
                        },
                    }
                }
            }
            seen.append(
                httpx.post(f"{cloud.base_url}/identity/v3/auth/tokens", json=body).status_code
            )

        threads = [threading.Thread(target=wrong_password) for _ in range(6)]
        for thread in threads:
            thread.start()
        flavors = cloud.compute("GET", "/flavors")
        for thread in threads:
            thread.join()
        assert flavors.status_code == 200 and seen == [401] * 6
        metrics = httpx.get(
            f"{cloud.base_url}/metrics", headers={"X-Auth-Token": cloud.token()}
        ).text
        assert "stowage_api_loop_lag_max_seconds" in metrics
        assert "stowage_api_loop_stalls_total" in metrics
    finally:
        stop_cloud(cloud)
