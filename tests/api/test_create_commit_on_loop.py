"""A create waits for its commit on the API's event loop, not in a handler thread, and the
handlers' thread pool is sized to the ledger (`size_thread_pool`).

With the commit waited for in a thread, the creates that could share a group commit were as
many as the pool's threads, and every create waiting held one from every other request; a
small pool (what a SQLite ledger wants: docs/performance.md 2026-12-07) then cut the groups
to a few creates each."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from anyio import to_thread

from stowage.api.app import create_app
from stowage.api.common import HANDLER_THREADS, size_thread_pool
from stowage.domain.keystone import password_login
from stowage.ledger import Ledger
from stowage.services.cloud import Cloud, CloudConfig, bootstrap


@pytest.fixture
def cloud(tmp_path: Path) -> Iterator[Cloud]:
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'ledger.db'}")
    try:
        made = Cloud(CloudConfig(state_dir=tmp_path / "state", hosts=1, group_writes=True), ledger)
        bootstrap(made)
        yield made
    finally:
        ledger.close()


async def _admin(client: httpx.AsyncClient) -> dict[str, str]:
    """The admin's headers for the compute API (a microversion that takes "networks": "none")."""
    login = await client.post(
        "/identity/v3/auth/tokens", json=password_login("admin", "stowage-admin", "admin")
    )
    return {
        "X-Auth-Token": login.headers["X-Subject-Token"],
        "OpenStack-API-Version": "compute 2.96",
    }


def test_creates_waiting_for_their_commit_hold_no_handler_thread(cloud: Cloud) -> None:
    creates = 6
    app = create_app(cloud)
    held = threading.Event()
    release = threading.Event()

    def hold(_conn: Any) -> None:  # the group writer, busy until released
        held.set()
        release.wait(30)

    waiting = cloud.objects._group._waiting  # type: ignore[union-attr]

    async def scenario() -> list[int]:
        to_thread.current_default_thread_limiter().total_tokens = 2
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            headers = await _admin(client)
            images = await client.get("/image/v2/images", headers=headers)
            image = images.json()["images"][0]["id"]
            blocker = cloud.objects.write_together_soon(hold)
            assert blocker is not None
            await asyncio.to_thread(held.wait, 10)

            async def create(n: int) -> int:
                server = {"name": f"s{n}", "flavorRef": "1", "imageRef": image, "networks": "none"}
                answer = await client.post(
                    "/compute/v2.1/servers", headers=headers, json={"server": server}
                )
                return answer.status_code

            sent = [asyncio.create_task(create(n)) for n in range(creates)]
            deadline = time.monotonic() + 20
            while waiting.qsize() < creates and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            queued = waiting.qsize()
            # Meanwhile a read still finds a thread: none is held by a waiting create.
            flavor = await client.get("/compute/v2.1/flavors/1", headers=headers)
            release.set()
            await asyncio.wrap_future(blocker)
            codes = await asyncio.gather(*sent)
            return [queued, flavor.status_code, *codes]

    try:
        queued, flavor, *codes = asyncio.run(scenario())
    finally:
        release.set()
    assert queued == creates
    assert flavor == 200
    assert codes == [202] * creates
    assert len(cloud.objects.ids("instance")) == creates


def test_a_create_refused_before_its_commit_answers_as_before(cloud: Cloud) -> None:
    """Its checks run in the pool: no token is a 401 before a bad body is read, a bad body
        a 400, a same_host hint that names no placed server a 400 from the build's own checks
    (`check_build`), and nothing is written."""
    app = create_app(cloud)

    async def answers() -> list[tuple[int, Any]]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            headers = await _admin(client)
            image = (await client.get("/image/v2/images", headers=headers)).json()["images"][0]
            server = {"name": "s", "flavorRef": "1", "imageRef": image["id"], "networks": "none"}
            hints = {"same_host": "00000000-0000-4000-8000-000000000000"}
            out = []
            for sent_headers, body in (
                ({}, b"{not json"),
                (headers, b"{not json"),
                (headers, json.dumps({"server": server, "os:scheduler_hints": hints}).encode()),
            ):
                answer = await client.post(
                    "/compute/v2.1/servers",
                    headers={**sent_headers, "Content-Type": "application/json"},
                    content=body,
                )
                out.append((answer.status_code, answer.json()))
            return out

    (anonymous, _), (malformed, body), (grouped, group_body) = asyncio.run(answers())
    assert anonymous == 401
    assert malformed == 400 and "not valid JSON" in body["badRequest"]["message"], body
    assert grouped == 400, group_body
    assert "same_host" in group_body["badRequest"]["message"], group_body
    assert cloud.objects.ids("instance") == []


def _fake(dialect: str, api_wait_s: float) -> Any:
    engine = SimpleNamespace(dialect=SimpleNamespace(name=dialect))
    return SimpleNamespace(
        ledger=SimpleNamespace(engine=engine), config=SimpleNamespace(api_wait_s=api_wait_s)
    )


@pytest.mark.parametrize(
    ("dialect", "api_wait_s", "threads"),
    [("sqlite", 0.0, HANDLER_THREADS), ("sqlite", 5.0, 40), ("postgresql", 0.0, 40)],
)
def test_the_handler_pool_is_sized_to_the_ledger(
    dialect: str, api_wait_s: float, threads: int
) -> None:
    async def sized() -> float:
        size_thread_pool(_fake(dialect, api_wait_s))
        return to_thread.current_default_thread_limiter().total_tokens

    assert asyncio.run(sized()) == threads
