"""The rest of the server life cycle: the console log through the CLI, and the life cycle
actions refused as Nova refuses in the server's state, never dropped."""

from __future__ import annotations

import uuid

import httpx
from tests.api.cloudproc import IMAGE, RunningCloud


def test_console_log_and_the_refused_life_cycle_actions(cloud: RunningCloud) -> None:
    name = f"lc-{uuid.uuid4().hex[:6]}"
    image = httpx.get(
        f"{cloud.base_url}/image/v2/images?name={IMAGE}", headers={"X-Auth-Token": cloud.token()}
    ).json()["images"][0]["id"]
    created = cloud.compute(
        "POST",
        "/servers",
        json={"server": {"name": name, "flavorRef": "1", "imageRef": image, "networks": "none"}},
    )
    server_id = created.json()["server"]["id"]
    assert cloud.compute("GET", f"/servers/{server_id}").json()["server"]["status"] == "ACTIVE"
    log = cloud.osc("console", "log", "show", "--lines", "1", name).stdout
    assert len(log.strip().splitlines()) == 1
    full = cloud.compute(
        "POST", f"/servers/{server_id}/action", json={"os-getConsoleOutput": {"length": None}}
    ).json()["output"]
    assert log.strip() == full.strip().splitlines()[-1]

    for action, args, status in (
        ("shelveOffload", None, 409),  # shelving offloads at once: never SHELVED
        ("unshelve", None, 409),  # not shelved
        ("forceDelete", None, 409),
        ("restore", None, 409),
    ):
        response = cloud.compute("POST", f"/servers/{server_id}/action", json={action: args})
        assert response.status_code == status, (action, response.text)
    assert cloud.compute("GET", f"/servers/{server_id}").json()["server"]["status"] == "ACTIVE"
    interfaces = cloud.compute("GET", f"/servers/{server_id}/os-interface").json()
    assert interfaces == {"interfaceAttachments": []}  # attach: tests/api/test_interfaces.py
    cloud.compute("DELETE", f"/servers/{server_id}")
