"""`stowage up --driver libvirt` stopped and started again on its state directory: the servers
that ran are ACTIVE again and their guests run (Nova's `resume_guests_state_on_host_boot`: the
cloud's libvirt daemons stop with it, and their guests with them); a stopped server stays
stopped.

Never skipped in CI (CI=true): a missing QEMU, libvirt or guest package is a failure.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable

import pytest
from tests.api.cloudproc import RunningCloud, start_cloud, stop_cloud
from tests.virt.test_libvirt_cloud import _require_real_qemu

from stowage.virt import guest_image

TIMEOUT_S = 120.0
UP = ("--driver", "libvirt", "--hosts", "1", "--virt-type", "qemu", "--api-wait-seconds", "0")


def _wait_for(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {TIMEOUT_S} s waiting for {what}")
        time.sleep(0.5)


def _status(cloud: RunningCloud, name: str) -> str:
    return str(cloud.osc_json("server", "show", name)["status"])


def _domstate(cloud: RunningCloud, server_id: str) -> str:
    sock = cloud.state_dir / "libvirt" / "host1" / "daemon" / "sock" / "libvirt-sock"
    done = subprocess.run(
        ["virsh", "-c", f"qemu+unix:///system?socket={sock}", "domstate", f"instance-{server_id}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _boot_ids(cloud: RunningCloud, name: str) -> list[str]:
    text = cloud.osc("console", "log", "show", name).stdout
    return guest_image.boot_ids(text)


def test_a_restarted_libvirt_cloud_runs_its_guests_again(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    _require_real_qemu()
    # A short directory: libvirt's sockets live under it, and a unix socket's path has at
    # most 107 bytes (the test's own name in the path made it too long).
    state = tmp_path_factory.mktemp("lvr") / "state"
    cloud = start_cloud(state, *UP, timeout_s=180)
    try:
        for name in ("runs", "rests"):
            cloud.osc(
                "server", "create", "--flavor", "m1.micro", "--image", "stowage-guest",
                "--nic", "none", "--wait", name,
            )  # fmt: skip
        ids = {n: str(cloud.osc_json("server", "show", n)["id"]) for n in ("runs", "rests")}
        _wait_for(lambda: len(_boot_ids(cloud, "runs")) == 1, "the first boot")
        cloud.osc("server", "stop", "rests")
        _wait_for(lambda: _status(cloud, "rests") == "SHUTOFF", "rests to stop")
    finally:
        stop_cloud(cloud)

    cloud = start_cloud(state, *UP, timeout_s=180)
    try:
        assert _status(cloud, "runs") == "ACTIVE"
        assert _domstate(cloud, ids["runs"]) == "running"
        _wait_for(lambda: len(_boot_ids(cloud, "runs")) == 2, "the guest to boot again")
        assert _status(cloud, "rests") == "SHUTOFF"
        assert _domstate(cloud, ids["rests"]) == "shut off"
        # The power sync (lifecycle events and its periodic pass) agrees: nothing flips.
        cloud.osc("server", "start", "rests")
        _wait_for(lambda: _status(cloud, "rests") == "ACTIVE", "rests to start")
        assert _status(cloud, "runs") == "ACTIVE"
        cloud.osc("server", "delete", "--wait", "runs", "rests")
    finally:
        stop_cloud(cloud)
