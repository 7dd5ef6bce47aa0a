"""The API never runs a handler on its event loop (issue 9): every endpoint but the ones that
stream a body or await the bus runs in the thread pool, so a slow request (a password hash,
a large query) cannot stall the others; the loop's lag is exported like the agents'."""

from __future__ import annotations

import asyncio
import inspect
import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from starlette.routing import Mount
from tests.api.cloudproc import password_auth, start_cloud, stop_cloud

from stowage.api.app import create_app
from stowage.api.common import api_routes
from stowage.ledger import Ledger
from stowage.services.cloud import Cloud, CloudConfig, bootstrap

ON_LOOP = {"upload_data", "show", "act", "reconcile", "create_server"}


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


def test_image_data_is_written_and_committed_off_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before the fix the upload handler wrote, hashed and fsynced the data on the event
    loop: a 1 GiB snapshot stalled the API for seconds and a client's keep-alive connection
    was reset under it (CI, tests/bus/test_libvirt_agent_process.py)."""
    from stowage.services import images

    on_loop: list[str] = []

    def watched(name: str) -> None:
        real = getattr(images.Upload, name)

        def call(self: images.Upload, *args: object) -> object:
            try:
                asyncio.get_running_loop()
                on_loop.append(name)
            except RuntimeError:  # no loop in this thread: a worker of the thread pool
                pass
            return real(self, *args)

        monkeypatch.setattr(images.Upload, name, call)

    for name in ("write", "commit"):
        watched(name)
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'ledger.db'}")
    try:
        cloud = Cloud(CloudConfig(state_dir=tmp_path / "state", hosts=1), ledger)
        bootstrap(cloud)
        asyncio.run(_upload_and_read_back(create_app(cloud), cloud.config.admin_password))
    finally:
        ledger.close()
    assert on_loop == []


async def _upload_and_read_back(app: object, password: str) -> None:
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://stowage") as client:
        body = password_auth("admin", password, "admin")
        issued = await client.post("/identity/v3/auth/tokens", json=body)
        headers = {"X-Auth-Token": issued.headers["x-subject-token"]}
        created = await client.post(
            "/image/v2/images",
            headers=headers,
            json={"name": "big", "disk_format": "raw", "container_format": "bare"},
        )
        assert created.status_code == 201, created.text
        image_id = created.json()["id"]
        data = os.urandom(3 * 1024 * 1024 + 17)

        async def pieces() -> AsyncIterator[bytes]:
            for i in range(0, len(data), 65536):
                yield data[i : i + 65536]

        put = await client.put(
            f"/image/v2/images/{image_id}/file",
            headers={**headers, "Content-Type": "application/octet-stream"},
            content=pieces(),
        )
        assert put.status_code == 204, put.text
        shown = (await client.get(f"/image/v2/images/{image_id}", headers=headers)).json()
        assert (shown["status"], shown["size"]) == ("active", len(data))
        saved = await client.get(f"/image/v2/images/{image_id}/file", headers=headers)
        assert saved.content == data


def test_to_thread_in_an_off_loop_handler_runs_in_its_own_thread() -> None:
    """A handler in a worker thread that awaits `asyncio.to_thread` gets its function run in
    place, its value or its exception handed back, and no other thread started; an explicit
    executor is still used."""
    from concurrent.futures import ThreadPoolExecutor

    from stowage.api.common import _thread_loop

    def failing() -> None:
        raise KeyError("inside")

    async def handler() -> tuple[int, int, int]:
        here = await asyncio.to_thread(threading.get_ident)
        with pytest.raises(KeyError, match="inside"):
            await asyncio.to_thread(failing)
        with ThreadPoolExecutor(1) as pool:
            there = await asyncio.get_running_loop().run_in_executor(pool, threading.get_ident)
        return threading.get_ident(), here, there

    seen: list[tuple[int, int, int]] = []
    worker = threading.Thread(
        target=lambda: seen.append(_thread_loop().run_until_complete(handler()))
    )
    before = threading.active_count()
    worker.start()
    worker.join()
    ((mine, here, there),) = seen
    assert here == mine and there != mine
    assert threading.active_count() == before
