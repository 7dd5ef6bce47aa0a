"""Seed: a failed live migration must not haunt its destination
(stale-error-migration-context.txt).

The reporter's steps with the `openstack` CLI, the destination's compute service stopped in
the middle through `stowage sim stop`: the migration goes to `error` while nobody knows what
the destination did, both ends held; once the destination answers again it is undone there
and the record ends `failed`, holding nothing. The repeated migration then completes, the
destination holds exactly one instance, and the audit is clean, also after a restart.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.api.cloudproc import BIN, RunningCloud, start_cloud, stop_cloud
from tests.e2e.test_seed_evacuation_anti_affinity import audit_is_clean

CLOUD_ARGS = ("--hosts", "2", "--op-timeout", "2")


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture
def cloud(state: Path) -> Iterator[RunningCloud]:
    running = start_cloud(state, *CLOUD_ARGS)
    yield running
    stop_cloud(running)


def sim(cloud: RunningCloud, *args: str) -> str:
    result = subprocess.run(
        [str(BIN / "stowage"), "sim", *args, "--state-dir", str(cloud.state_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def poll(what: Callable[[], Any], until: Callable[[Any], bool], timeout_s: float = 60) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = what()
        if until(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.5)


def migrations_of(cloud: RunningCloud, server: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = cloud.osc_json(
        "server", "migration", "list", "--server", server, "--sort-column", "Created At"
    )
    return sorted(rows, key=lambda r: int(r["Id"]))


def usage(cloud: RunningCloud, host: str) -> dict[str, int]:
    for hv in cloud.compute("GET", "/os-hypervisors/detail", version="2.87").json()["hypervisors"]:
        if hv["hypervisor_hostname"] == host:
            rp = cloud.osc_json("resource", "provider", "list", "--name", host)[0]
            usages = cloud.osc_json("resource", "provider", "usage", "show", rp["uuid"])
            return {u["resource_class"]: int(u["usage"]) for u in usages}
    raise AssertionError(f"no hypervisor {host}")


def test_failed_live_migration_in_preparing_then_repeated(cloud: RunningCloud, state: Path) -> None:
    cloud.osc(
        "flavor", "create", "cirros256-pinned", "--public", "--vcpus", "1", "--ram", "256",
        "--disk", "1", "--property", "hw_rng:allowed=True", "--property", "hw:cpu_policy=dedicated",
    )  # fmt: skip
    # The reporter's command, exactly: a 1 GB boot volume made from the image.
    server = cloud.osc_json(
        "server", "create", "--flavor", "cirros256-pinned", "--image", "cirros-0.6.2-x86_64-disk",
        "--boot-from-volume", "1", "--nic", "net-id=private", "--availability-zone", ":host1",
        "vm0", "--wait",
    )  # fmt: skip
    assert server["OS-EXT-SRV-ATTR:host"] == "host1"
    (root,) = server["volumes_attached"]
    volume = cloud.osc_json("volume", "show", root["id"])
    assert (volume["status"], volume["size"], str(volume["bootable"]).lower()) == (
        "in-use",
        1,
        "true",
    )

    # The destination's compute service stops while the migration prepares there.
    sim(cloud, "stop", "host2")
    cloud.osc("server", "migrate", "--live-migration", "vm0")
    rows = poll(lambda: migrations_of(cloud, "vm0"), lambda r: r[-1]["Status"] == "error")
    assert rows[-1]["Status"] == "error", rows  # unknown outcome: both ends held, said so
    assert cloud.osc_json("server", "show", "vm0")["status"] == "MIGRATING"
    assert usage(cloud, "host2").get("PCPU") == 1  # held while nobody knows

    sim(cloud, "start", "host2")
    rows = poll(lambda: migrations_of(cloud, "vm0"), lambda r: r[-1]["Status"] == "failed")
    assert [r["Status"] for r in rows] == ["failed"], rows  # settled, never stuck in error
    assert usage(cloud, "host2").get("PCPU", 0) == 0  # nothing of the failed attempt

    cloud.osc("server", "set", "--state", "active", "vm0", stdin="y\n")  # it asks to be sure
    cloud.osc("server", "migrate", "--live-migration", "vm0", "--wait")
    rows = poll(lambda: migrations_of(cloud, "vm0"), lambda r: r[-1]["Status"] == "completed")
    assert [r["Status"] for r in rows] == ["failed", "completed"], rows
    shown = cloud.osc_json("server", "show", "vm0")
    assert (shown["status"], shown["OS-EXT-SRV-ATTR:host"]) == ("ACTIVE", "host2")
    assert usage(cloud, "host2").get("PCPU") == 1
    assert usage(cloud, "host1").get("PCPU", 0) == 0
    hypervisors = {h["host"]: h for h in _sim_show(cloud)}
    assert list(hypervisors["host2"]["instances"]) == [server["id"]]
    assert hypervisors["host1"]["instances"] == {}
    # The boot volume moved with the server, attached to it on its new host.
    volume = cloud.osc_json("volume", "show", root["id"])
    assert volume["status"] == "in-use"
    assert [(a["server_id"], a.get("host_name")) for a in volume["attachments"]] in (
        [(server["id"], "host2")],
        [(server["id"], None)],
    )
    audit_is_clean(cloud)

    # Every process restarted: the same answer.
    stop_cloud(cloud)
    again = start_cloud(state, *CLOUD_ARGS)
    try:
        audit_is_clean(again)
        assert usage(again, "host2").get("PCPU") == 1
        assert usage(again, "host1").get("PCPU", 0) == 0
        rows = migrations_of(again, "vm0")
        assert [r["Status"] for r in rows] == ["failed", "completed"]
        hypervisors = poll(
            lambda: {h["host"]: h for h in _sim_show(again)},
            lambda h: bool(h["host2"]["instances"]),
        )
        assert list(hypervisors["host2"]["instances"]) == [server["id"]]
    finally:
        stop_cloud(again)


def _sim_show(cloud: RunningCloud) -> list[dict[str, Any]]:
    import json

    return list(json.loads(sim(cloud, "show", "--json")))
