"""Moves as durable state machines, driven through the agents of `stowage up`:
abort (2.24) and force-complete (2.22) of a live migration, an agent that fails or crashes
in the middle of a step, and a cloud killed mid-migration that resumes on restart."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.api.cloudproc import BIN, RunningCloud, start_cloud, stop_cloud
from tests.e2e.test_seed_evacuation_anti_affinity import audit_is_clean
from tests.e2e.test_seed_stale_migration import migrations_of, poll, sim, usage

SLOW_MIGRATION = ("--hosts", "2", "--live-migration-seconds", "60", "--op-timeout", "3")


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture(scope="module")
def slow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCloud]:
    """One cloud for the abort and force-complete tests (each moves its own server)."""
    running = start_cloud(tmp_path_factory.mktemp("slow") / "state", *SLOW_MIGRATION)
    yield running
    stop_cloud(running)


def running_migration(cloud: RunningCloud, server: str) -> dict[str, Any]:
    cloud.osc("server", "migrate", "--live-migration", "--host", "host2", server)
    rows = poll(lambda: migrations_of(cloud, server), lambda r: r[-1]["Status"] == "running")
    assert rows[-1]["Status"] == "running", rows
    return rows[-1]


def hypervisor_instances(cloud: RunningCloud) -> dict[str, list[str]]:
    hosts = json.loads(sim(cloud, "show", "--json"))
    return {h["host"]: sorted(h["instances"]) for h in hosts}


def test_a_running_live_migration_is_aborted(slow: RunningCloud) -> None:
    server = slow.boot("moving", "--availability-zone", "nova:host1", flavor="m1.pinned")
    before = usage(slow, "host2").get("PCPU", 0)
    migration = running_migration(slow, "moving")
    assert usage(slow, "host2").get("PCPU") == before + 1  # both ends held while it runs

    slow.osc("--os-compute-api-version", "2.24", "server", "migration", "abort", "moving",
             str(migration["Id"]))  # fmt: skip
    rows = poll(lambda: migrations_of(slow, "moving"), lambda r: r[-1]["Status"] == "cancelled")
    assert rows[-1]["Status"] == "cancelled", rows
    shown = slow.osc_json("server", "show", "moving")
    assert (shown["status"], shown["OS-EXT-SRV-ATTR:host"]) == ("ACTIVE", "host1")
    assert usage(slow, "host2").get("PCPU", 0) == before
    instances = hypervisor_instances(slow)
    assert server["id"] in instances["host1"] and server["id"] not in instances["host2"]
    audit_is_clean(slow)


def test_a_running_live_migration_is_forced_to_complete(slow: RunningCloud) -> None:
    server = slow.boot("forced", "--availability-zone", "nova:host1", flavor="m1.pinned")
    before = usage(slow, "host1").get("PCPU", 0)
    migration = running_migration(slow, "forced")

    slow.osc("--os-compute-api-version", "2.22", "server", "migration", "force", "complete",
             "forced", str(migration["Id"]))  # fmt: skip
    rows = poll(lambda: migrations_of(slow, "forced"), lambda r: r[-1]["Status"] == "completed")
    assert rows[-1]["Status"] == "completed", rows  # long before the 60 s copy would end
    shown = slow.osc_json("server", "show", "forced")
    assert (shown["status"], shown["OS-EXT-SRV-ATTR:host"]) == ("ACTIVE", "host2")
    assert usage(slow, "host1").get("PCPU", 0) == before - 1
    instances = hypervisor_instances(slow)
    assert server["id"] in instances["host2"] and server["id"] not in instances["host1"]
    audit_is_clean(slow)


def test_aborting_a_finished_migration_is_refused(slow: RunningCloud) -> None:
    slow.boot("settled", "--availability-zone", "nova:host1")
    migration = running_migration(slow, "settled")
    slow.osc("--os-compute-api-version", "2.22", "server", "migration", "force", "complete",
             "settled", str(migration["Id"]))  # fmt: skip
    poll(lambda: migrations_of(slow, "settled"), lambda r: r[-1]["Status"] == "completed")
    result = slow.osc(
        "--os-compute-api-version", "2.24", "server", "migration", "abort", "settled",
        str(migration["Id"]), check=False,
    )  # fmt: skip
    assert result.returncode != 0
    assert "Cannot abort" in result.stderr or "404" in result.stderr, result.stderr


def test_a_cloud_killed_mid_migration_resumes_it(state: Path) -> None:
    first = start_cloud(state, *SLOW_MIGRATION)
    try:
        server = first.boot("resumed", "--availability-zone", "nova:host1", flavor="m1.pinned")
        running_migration(first, "resumed")
    finally:
        first.process.send_signal(signal.SIGKILL)  # no clean shutdown: a crash
        first.process.wait(timeout=30)

    again = start_cloud(state, "--hosts", "2", "--op-timeout", "3")
    try:
        rows = poll(
            lambda: migrations_of(again, "resumed"), lambda r: r[-1]["Status"] == "completed"
        )
        assert rows[-1]["Status"] == "completed", rows
        shown = again.osc_json("server", "show", "resumed")
        assert (shown["status"], shown["OS-EXT-SRV-ATTR:host"]) == ("ACTIVE", "host2")
        instances = poll(
            lambda: hypervisor_instances(again), lambda h: h["host2"] == [server["id"]]
        )
        assert instances == {"host1": [], "host2": [server["id"]]}
        assert usage(again, "host1").get("PCPU", 0) == 0
        audit_is_clean(again)
    finally:
        stop_cloud(again)


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCloud]:
    """One cloud for the fault tests; each clears what it injected."""
    running = start_cloud(tmp_path_factory.mktemp("quick") / "state", "--hosts", "2",
                          "--op-timeout", "3", "--resize-confirm-window", "2")  # fmt: skip
    yield running
    stop_cloud(running)


def test_a_failed_spawn_leaves_an_error_and_no_claim(quick: RunningCloud) -> None:
    sim(quick, "fault", "host2", "spawn", "define", "--action", "fail")
    result = quick.osc(
        "server", "create", "--flavor", "m1.pinned", "--image", "cirros-0.6.2-x86_64-disk",
        "--nic", "none", "--availability-zone", "nova:host2", "--wait", "doomed", check=False,
    )  # fmt: skip
    assert result.returncode != 0
    shown = quick.osc_json("server", "show", "doomed")
    assert shown["status"] == "ERROR"
    assert "injected failure at spawn.define" in str(shown["fault"])
    assert shown["OS-EXT-SRV-ATTR:host"] is None  # it holds nothing anywhere
    assert all(shown["id"] not in ids for ids in hypervisor_instances(quick).values())
    audit_is_clean(quick)
    # The next build there is clean.
    fine = quick.boot("fine", "--availability-zone", "nova:host2", flavor="m1.pinned")
    assert fine["status"] == "ACTIVE"


def test_an_agent_crash_mid_spawn_is_survived(quick: RunningCloud) -> None:
    sim(quick, "fault", "host2", "spawn", "start", "--action", "crash")
    server = quick.boot("survivor", "--availability-zone", "nova:host2", flavor="m1.pinned")
    assert server["status"] == "ACTIVE"
    agent = next(h for h in json.loads(sim(quick, "show", "--json")) if h["host"] == "host2")
    assert agent["crashes"] == 1 and agent["running"]
    assert server["id"] in hypervisor_instances(quick)["host2"]
    audit_is_clean(quick)


def test_a_hung_step_holds_until_cleared(quick: RunningCloud) -> None:
    sim(quick, "fault", "host1", "reboot", "stop", "--action", "hang")
    server = quick.boot("stuck", "--availability-zone", "nova:host1")
    quick.osc("server", "reboot", "stuck")
    time.sleep(1)
    assert quick.osc_json("server", "show", "stuck")["OS-EXT-STS:task_state"] == "rebooting"
    sim(quick, "clear", "host1")  # the hung step returns with an error: the reboot failed
    shown = poll(
        lambda: quick.osc_json("server", "show", "stuck"),
        lambda s: s["OS-EXT-STS:task_state"] is None,
    )
    assert shown["OS-EXT-STS:task_state"] is None
    assert server["id"] in hypervisor_instances(quick)["host1"]
    quick.osc("server", "reboot", "--wait", "stuck")  # and the next one works
    assert quick.osc_json("server", "show", "stuck")["status"] == "ACTIVE"


def test_a_failed_snapshot_upload_leaves_no_image(quick: RunningCloud) -> None:
    quick.boot("snapped", "--availability-zone", "nova:host1")
    sim(quick, "fault", "host1", "read_disk", "read", "--action", "fail")
    result = quick.osc("server", "image", "create", "--name", "half", "--wait", "snapped",
                       check=False)  # fmt: skip
    assert result.returncode != 0
    images = quick.osc_json("image", "list", "--private")
    assert "half" not in {i["Name"] for i in images}  # never left half-written
    shown = quick.osc_json("server", "show", "snapped")
    assert (shown["status"], shown["OS-EXT-STS:task_state"]) == ("ACTIVE", None)
    quick.osc("server", "image", "create", "--name", "whole", "--wait", "snapped")
    assert quick.osc_json("image", "show", "whole")["status"] == "active"


def test_a_resize_is_confirmed_after_the_window(quick: RunningCloud) -> None:
    quick.boot("growing", "--availability-zone", "nova:host1")
    quick.osc("server", "resize", "--flavor", "m1.small", "growing")
    shown = poll(
        lambda: quick.osc_json("server", "show", "growing"),
        lambda s: s["status"] == "ACTIVE" and "m1.small" in str(s["flavor"]),
    )
    assert shown["status"] == "ACTIVE" and "m1.small" in str(shown["flavor"])
    assert shown["OS-EXT-SRV-ATTR:host"] == "host2"
    rows = migrations_of(quick, "growing")
    assert rows[-1]["Status"] == "confirmed"
    assert hypervisor_instances(quick)["host1"].count(shown["id"]) == 0
    audit_is_clean(quick)


def test_the_reconciler_finds_pins_changed_behind_the_ledgers_back(quick: RunningCloud) -> None:
    a = quick.boot("pinned-a", "--availability-zone", "nova:host2", flavor="m1.pinned")
    b = quick.boot("pinned-b", "--availability-zone", "nova:host2", flavor="m1.pinned")
    shown = {h["host"]: h["instances"] for h in json.loads(sim(quick, "show", "--json"))}
    pcpu_of_b = shown["host2"][b["id"]]["pins"]["0"]
    sim(quick, "repin", "host2", a["id"], f"0:{pcpu_of_b}")  # a now shares b's pCPU
    result = subprocess.run(
        [str(BIN / "stowage"), "host", "reconcile", "host2", "--state-dir",
         str(quick.state_dir)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert a["id"] in result.stdout and "pins_differ" in result.stdout
    assert "1 divergence(s)" in result.stdout  # b still runs as claimed; the rest audited
    audit_is_clean(quick)  # the ledger was not rewritten from what the hypervisor showed


def test_a_stopped_server_stays_stopped_through_resize_and_rebuild(quick: RunningCloud) -> None:
    """As in Nova: a resize (confirmed here by the window) and a rebuild keep SHUTOFF."""
    server = quick.boot("resting", "--availability-zone", "nova:host1")
    quick.osc("server", "stop", "resting")
    quick.osc("server", "resize", "--flavor", "m1.small", "resting")
    shown = poll(
        lambda: quick.osc_json("server", "show", "resting"),
        lambda s: "m1.small" in str(s["flavor"]) and s["OS-EXT-STS:task_state"] is None,
    )
    assert (shown["status"], shown["OS-EXT-SRV-ATTR:host"]) == ("SHUTOFF", "host2")
    running = json.loads(sim(quick, "show", "--json"))
    on_host2 = next(h for h in running if h["host"] == "host2")["instances"]
    assert on_host2[server["id"]]["state"] == "shutoff"
    quick.osc("server", "rebuild", "--image", "cirros-0.6.2-x86_64-disk", "--wait", "resting")
    shown = poll(
        lambda: quick.osc_json("server", "show", "resting"),
        lambda s: s["OS-EXT-STS:task_state"] is None and s["status"] != "REBUILD",
    )
    assert shown["status"] == "SHUTOFF"
    audit_is_clean(quick)
