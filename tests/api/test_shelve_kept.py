"""Shelve with `--shelved-offload-time` (Nova's shelved_offload_time): a shelved server stays
SHELVED where it is, holding its claims, until shelveOffload or the conductor, past the time,
offloads it; unshelving a SHELVED server starts it where it is.

Before: every shelve offloaded at once and shelveOffload answered 409 (no SHELVED server
could exist), whatever an operator configured.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from tests.api.cloudproc import IMAGE, RunningCloud, start_cloud, stop_cloud
from tests.api.test_server_volumes import allocations
from tests.api.test_volumes import SDK_WARNINGS, audit_clean, unique

pytestmark = pytest.mark.filterwarnings(SDK_WARNINGS)

OFFLOAD_S = 30


@pytest.fixture(scope="module")
def shelf(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCloud]:
    running = start_cloud(
        tmp_path_factory.mktemp("shelf") / "state",
        "--hosts",
        "1",
        "--shelved-offload-time",
        str(OFFLOAD_S),
    )
    try:
        yield running
    finally:
        stop_cloud(running)


def _server(cloud: RunningCloud, server_id: str) -> dict[str, Any]:
    found: dict[str, Any] = cloud.compute("GET", f"/servers/{server_id}").json()["server"]
    return found


def _until(check: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


def _settled(cloud: RunningCloud, server_id: str, status: str) -> dict[str, Any]:
    def done() -> bool:
        shown = _server(cloud, server_id)
        return shown["status"] == status and shown["OS-EXT-STS:task_state"] is None

    _until(done, f"{server_id} to be {status}")
    return _server(cloud, server_id)


def test_a_shelved_server_keeps_its_claims_until_offloaded(shelf: RunningCloud) -> None:
    # One waits for the conductor to offload it (OFFLOAD_S after its shelve) ...
    waiting = shelf.boot(unique("wait"))
    shelf.osc("server", "shelve", waiting["id"])
    shelved_at = time.monotonic()
    held = _settled(shelf, waiting["id"], "SHELVED")
    assert held["OS-EXT-SRV-ATTR:host"] == waiting["OS-EXT-SRV-ATTR:host"]
    assert held["OS-EXT-STS:power_state"] == 4  # its guest stopped where it is
    assert allocations(shelf, waiting["id"])  # ... holding its claims meanwhile
    disk = shelf.state_dir / "sim" / waiting["OS-EXT-SRV-ATTR:host"] / f"{waiting['id']}.img"
    assert disk.exists()
    image = shelf.osc_json("image", "show", f"{waiting['name']}-shelved")
    assert image["status"] == "active"

    # ... another is unshelved where it is: not to a host (Nova's 409), its image gone.
    back = shelf.boot(unique("back"))
    shelf.osc("server", "shelve", back["id"])
    _settled(shelf, back["id"], "SHELVED")
    refused = shelf.compute(
        "POST",
        f"/servers/{back['id']}/action",
        version="2.91",
        json={"unshelve": {"host": back["OS-EXT-SRV-ATTR:host"]}},
    )
    assert refused.status_code == 409, refused.text
    shelf.osc("server", "unshelve", back["id"])
    running = _settled(shelf, back["id"], "ACTIVE")
    assert running["OS-EXT-SRV-ATTR:host"] == back["OS-EXT-SRV-ATTR:host"]
    assert allocations(shelf, back["id"])
    assert shelf.osc("image", "show", f"{back['name']}-shelved", check=False).returncode != 0
    events = shelf.compute("GET", f"/servers/{back['id']}/os-instance-actions").json()
    assert {"shelve", "unshelve"} <= {a["action"] for a in events["instanceActions"]}

    # A volume-backed one, offloaded by the CLI's `--offload` (shelve, then shelveOffload).
    name = unique("bfv")
    created = shelf.osc_json(
        "server", "create", "--flavor", "m1.tiny", "--image", IMAGE, "--boot-from-volume", "1",
        "--nic", "none", "--wait", name,
    )  # fmt: skip
    shelf.osc("server", "shelve", "--offload", name)
    offloaded = _settled(shelf, created["id"], "SHELVED_OFFLOADED")
    assert offloaded["OS-EXT-SRV-ATTR:host"] is None
    assert allocations(shelf, created["id"]) == {}
    again = shelf.compute("POST", f"/servers/{created['id']}/action", json={"shelveOffload": None})
    assert again.status_code == 409, again.text  # offloaded already
    shelf.osc("server", "delete", "--wait", name)

    # The first, past the offload time: offloaded by the conductor, holding nothing.
    gone = _settled(shelf, waiting["id"], "SHELVED_OFFLOADED")
    assert time.monotonic() - shelved_at >= OFFLOAD_S - 1
    assert gone["OS-EXT-SRV-ATTR:host"] is None
    assert allocations(shelf, waiting["id"]) == {}
    assert not disk.exists()
    audit_clean(shelf)
    shelf.osc("server", "unshelve", "--wait", waiting["id"])
    assert _settled(shelf, waiting["id"], "ACTIVE")["OS-EXT-SRV-ATTR:host"]
    shelf.osc("server", "delete", "--wait", waiting["id"], back["id"])
    audit_clean(shelf)
