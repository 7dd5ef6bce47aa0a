"""Seed: a compute agent must not go "dead" while snapshots read a busy disk
(compute-agent-stuck-on-busy-disk.txt).

Through the API: several `openstack server image create` of instances on one host whose
simulated disk blocks every read for seconds, while other requests hit that host. The agent
keeps heartbeating within its interval (its own records say so), the service never shows
down, the other operations complete, and every snapshot ends active with all its data.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.api.cloudproc import BIN, RunningCloud, boot_args, start_cloud, stop_cloud
from tests.e2e.test_seed_evacuation_anti_affinity import audit_is_clean
from tests.e2e.test_seed_stale_migration import sim

HEARTBEAT_S = 0.5
SLOW_READ_S = 3.0
SNAPSHOTS = 4


@pytest.fixture
def cloud(tmp_path: Path) -> Iterator[RunningCloud]:
    running = start_cloud(
        tmp_path / "state", "--hosts", "2", "--heartbeat-interval", str(HEARTBEAT_S)
    )
    yield running
    stop_cloud(running)


def popen(cloud: RunningCloud, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [str(BIN / "openstack"), *args],
        env=cloud.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def host1_agent(cloud: RunningCloud) -> dict[str, Any]:
    hosts = json.loads(sim(cloud, "show", "--json"))
    return next(h for h in hosts if h["host"] == "host1")


def test_snapshots_on_a_busy_disk_leave_the_agent_alive(cloud: RunningCloud) -> None:
    servers = [
        cloud.boot(f"bigfile-{i}", "--availability-zone", "nova:host1")["id"]
        for i in range(SNAPSHOTS + 1)
    ]
    sim(cloud, "slow-disk", "host1", "--seconds", str(SLOW_READ_S))
    started = time.monotonic()
    snapshots = [
        popen(cloud, "server", "image", "create", "--name", f"snap-{i}", servers[i])
        for i in range(SNAPSHOTS)
    ]
    # Meanwhile, other work on the same agent: a reboot and a new instance there.
    others = [
        popen(cloud, "server", "reboot", "--wait", servers[-1]),
        popen(cloud, *boot_args("during", "--availability-zone", "nova:host1")),
    ]
    states: list[str] = []
    while any(p.poll() is None for p in snapshots + others) or time.monotonic() - started < 6:
        rows = cloud.osc_json("compute", "service", "list", "--host", "host1")
        states.extend(r["State"] for r in rows)
        time.sleep(0.5)
    for proc in snapshots + others:
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stdout + stderr

    assert states and set(states) == {"up"}, states
    assert cloud.osc_json("server", "show", servers[-1])["status"] == "ACTIVE"
    assert cloud.osc_json("server", "show", "during")["status"] == "ACTIVE"

    deadline = time.monotonic() + 120
    images: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        images = [cloud.osc_json("image", "show", f"snap-{i}") for i in range(SNAPSHOTS)]
        if all(img["status"] == "active" for img in images):
            break
        time.sleep(1)
    assert [img["status"] for img in images] == ["active"] * SNAPSHOTS
    assert all(int(img["size"]) == 1024 * 1024 for img in images)  # the whole simulated disk

    agent = host1_agent(cloud)
    # The agent's own records: reads blocked SLOW_READ_S at a time, yet its heartbeat never
    # waited much beyond its interval and its event loop was never held.
    assert agent["heartbeat_gap_max_s"] < 4 * HEARTBEAT_S, agent
    assert agent["loop_lag_max_s"] < SLOW_READ_S / 2, agent
    # The same figures reach Prometheus (the observer copies them every few seconds).
    deadline = time.monotonic() + 30
    text = ""
    while time.monotonic() < deadline:
        admin = {"X-Auth-Token": cloud.token()}  # the metrics are an admin's
        text = httpx.get(f"{cloud.base_url}/metrics", headers=admin, timeout=10).text
        if 'stowage_agent_heartbeat_gap_seconds_count{host="host1"}' in text:
            break
        time.sleep(1)
    assert 'stowage_agent_heartbeat_gap_seconds_count{host="host1"}' in text
    assert 'stowage_agent_loop_lag_seconds_count{host="host1"}' in text
    audit_is_clean(cloud)
