"""Soft delete with `--reclaim-instance-interval`: a deleted server rests SOFT_DELETED with its
claims, is restored, force-deleted, or reclaimed by the conductor past the interval."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import httpx
import pytest
from tests.api.cloudproc import IMAGE, RunningCloud, start_cloud, stop_cloud


@pytest.fixture(scope="module")
def soft(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCloud]:
    running = start_cloud(
        tmp_path_factory.mktemp("soft") / "state",
        "--hosts",
        "1",
        "--reclaim-instance-interval",
        "6",
    )
    try:
        yield running
    finally:
        stop_cloud(running)


def boot(cloud: RunningCloud) -> str:
    image = httpx.get(
        f"{cloud.base_url}/image/v2/images?name={IMAGE}", headers={"X-Auth-Token": cloud.token()}
    ).json()["images"][0]["id"]
    body = {"name": f"sd-{uuid.uuid4().hex[:6]}", "flavorRef": "1", "imageRef": image,
            "networks": "none"}  # fmt: skip
    server_id: str = cloud.compute("POST", "/servers", json={"server": body}).json()["server"]["id"]
    return server_id


def status(cloud: RunningCloud, server_id: str) -> str | None:
    response = cloud.compute("GET", f"/servers/{server_id}")
    return None if response.status_code == 404 else str(response.json()["server"]["status"])


def action(cloud: RunningCloud, server_id: str, name: str) -> tuple[int, str]:
    response = cloud.compute("POST", f"/servers/{server_id}/action", json={name: None})
    return response.status_code, response.text


def test_soft_delete_restore_force_delete_and_reclaim(soft: RunningCloud) -> None:
    kept = boot(soft)
    assert status(soft, kept) == "ACTIVE"
    assert action(soft, kept, "forceDelete")[0] == 409  # not soft-deleted
    assert soft.compute("DELETE", f"/servers/{kept}").status_code == 204
    assert status(soft, kept) == "SOFT_DELETED"
    answer = action(soft, kept, "restore")
    assert answer[0] == 202, answer
    assert status(soft, kept) == "ACTIVE"
    assert action(soft, kept, "restore")[0] == 409  # not soft-deleted any more

    forced = boot(soft)
    soft.compute("DELETE", f"/servers/{forced}")
    assert status(soft, forced) == "SOFT_DELETED"
    assert action(soft, forced, "forceDelete")[0] == 202
    assert status(soft, forced) is None

    # Past the interval (6 s) the conductor deletes it for good; the restored one stays.
    soft.compute("DELETE", f"/servers/{kept}")
    deadline = time.monotonic() + 60
    while status(soft, kept) is not None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert status(soft, kept) is None
