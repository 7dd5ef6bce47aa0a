"""Seed: concurrent live migrations must not pin two guests to one pCPU
(numa-pinning-conflict-breaks-resource-tracker.txt)."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.api.cloudproc import BIN, RunningCloud, start_cloud, stop_cloud
from tests.e2e.test_seed_evacuation_anti_affinity import audit_is_clean


@pytest.fixture
def cloud(tmp_path: Path) -> Iterator[RunningCloud]:
    running = start_cloud(tmp_path / "state", "--hosts", "3")
    yield running
    stop_cloud(running)


def boot_pinned(cloud: RunningCloud, flavor: str, host: str) -> str:
    name = f"pinned-{uuid.uuid4().hex[:6]}"
    return str(cloud.boot(name, "--availability-zone", f"nova:{host}", flavor=flavor)["id"])


def pcpus(cloud: RunningCloud, server_id: str) -> tuple[str, set[int]]:
    token = cloud.token()
    server = cloud.compute("GET", f"/servers/{server_id}", token=token).json()["server"]
    topology = cloud.compute("GET", f"/servers/{server_id}/topology", token=token).json()
    cpus = {cpu for node in topology["nodes"] for cpu in node["cpu_pinning"].values()}
    return server["OS-EXT-SRV-ATTR:host"], cpus


def test_two_pinned_live_migrations_to_room_for_one(cloud: RunningCloud) -> None:
    # 8 dedicated vCPUs: one guest per NUMA cell, so a host (2 cells) has room for two.
    flavor = f"pinned8-{uuid.uuid4().hex[:4]}"
    cloud.osc("quota", "set", "--cores", "100", "admin")
    cloud.osc(
        "flavor",
        "create",
        flavor,
        "--public",
        "--vcpus",
        "8",
        "--ram",
        "1024",
        "--disk",
        "1",
        "--property",
        "hw:cpu_policy=dedicated",
    )
    a = boot_pinned(cloud, flavor, "host1")
    b = boot_pinned(cloud, flavor, "host2")
    filler = boot_pinned(cloud, flavor, "host3")  # host3 now has room for exactly one more
    procs = [
        subprocess.Popen(
            [
                str(BIN / "openstack"),
                "server",
                "migrate",
                "--live-migration",
                "--host",
                "host3",
                server_id,
            ],
            env=cloud.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for server_id in (a, b)
    ]
    for proc in procs:
        proc.communicate(timeout=180)
    placed = {sid: pcpus(cloud, sid) for sid in (a, b, filler)}
    on_host3 = [sid for sid, (host, _) in placed.items() if host == "host3"]
    assert len(on_host3) == 2, placed  # the filler and exactly one of the two
    first, second = (placed[sid][1] for sid in on_host3)
    assert not first & second, f"pCPUs pinned twice on host3: {first & second}"
    loser = next(sid for sid in (a, b) if placed[sid][0] != "host3")
    assert cloud.osc_json("server", "show", loser)["status"] == "ACTIVE"
    migrations = cloud.osc_json("server", "migration", "list")
    assert sorted(m["Status"] for m in migrations) == ["completed", "failed"]
    usage = cloud.osc_json("hypervisor", "list", "--long")
    assert usage, "hypervisors must list"
    audit_is_clean(cloud)
