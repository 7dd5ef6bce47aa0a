"""End to end on `stowage up --driver libvirt --hosts 3`: real QEMU guests through the real
openstack CLI, three libvirt daemons on this machine, live migrations between them.

Never skipped in CI (CI=true): a missing QEMU, libvirt or guest package is a failure.
"""

from __future__ import annotations

import os
import re
import shutil
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from tests.api.cloudproc import RunningCloud, start_cloud, stop_cloud

from stowage.virt import guest_image

BOOT_TIMEOUT_S = 120.0
HOSTS = ("host1", "host2", "host3")


def _require_real_qemu() -> None:
    tools = ("qemu-system-x86_64", "qemu-img", "libvirtd", "virsh", "mformat", "syslinux")
    missing = [t for t in tools if not shutil.which(t)]
    why = f"missing {missing}" if missing else ("needs root" if os.geteuid() != 0 else "")
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"CI runs the real-QEMU cloud test: {why}", pytrace=False)
        pytest.skip(why)


def _wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = BOOT_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(1.0)


@pytest.fixture(scope="module")
def cloud(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCloud]:
    _require_real_qemu()
    state = tmp_path_factory.mktemp("libvirt-cloud") / "state"
    running = start_cloud(state, "--driver", "libvirt", "--hosts", "3", "--virt-type", "qemu")
    try:
        yield running
    finally:
        stop_cloud(running)


def _uri(cloud: RunningCloud, host: str) -> str:
    sock = cloud.state_dir / "libvirt" / host / "daemon" / "sock" / "libvirt-sock"
    return f"qemu+unix:///system?socket={sock}"


def _virsh(cloud: RunningCloud, host: str, *args: str) -> str:
    done = subprocess.run(
        ["virsh", "-c", _uri(cloud, host), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _vcpupin(cloud: RunningCloud, host: str, server_id: str) -> dict[int, str]:
    out = _virsh(cloud, host, "vcpupin", f"instance-{server_id}")
    return {int(m[0]): m[1] for m in re.findall(r"^\s*(\d+)\s+(\S+)\s*$", out, re.M)}


def _ledger_pins(cloud: RunningCloud, consumer_id: str) -> dict[int, int]:
    db = sqlite3.connect(f"file:{cloud.state_dir / 'ledger.db'}?mode=ro", uri=True)
    try:
        rows = db.execute(
            "SELECT guest_vcpu, cpu_id FROM pins WHERE consumer_id = ?", (consumer_id,)
        ).fetchall()
    finally:
        db.close()
    return {int(v): int(c) for v, c in rows}


def _console(cloud: RunningCloud, name: str) -> str:
    return cloud.osc("console", "log", "show", name).stdout


def _boot_id(cloud: RunningCloud, name: str) -> str:
    _wait_for(lambda: guest_image.MARKER in _console(cloud, name), f"{name}'s console marker")
    found = re.findall(rf"{guest_image.MARKER} boot_id=(\S+)", _console(cloud, name))
    return str(found[-1])


def _uptime(text: str) -> int:
    counts = re.findall(rf"{guest_image.UPTIME_PREFIX} (\d+) ", text)
    return int(counts[-1]) if counts else 0


def _server(cloud: RunningCloud, name: str) -> dict[str, str]:
    shown = cloud.osc_json("server", "show", name)
    return {
        "id": shown["id"],
        "status": shown["status"],
        "host": shown["OS-EXT-SRV-ATTR:host"],
    }


def test_real_guests_through_the_openstack_cli(cloud: RunningCloud, tmp_path: Path) -> None:
    # The guest disk, built from Debian packages by the repo's script, uploaded as an image.
    script = Path(__file__).parents[2] / "scripts" / "make-guest-image.sh"
    disk = tmp_path / "guest.qcow2"
    made = subprocess.run(
        ["bash", str(script), str(disk), "--format", "qcow2"], capture_output=True, check=False
    )
    assert made.returncode == 0, made.stderr
    cloud.osc(
        "image", "create", "--disk-format", "qcow2", "--container-format", "bare",
        "--file", str(disk), "--public", "guest",
    )  # fmt: skip
    hypervisors = cloud.osc_json("hypervisor", "list", "--long")
    assert {h["Hypervisor Type"] for h in hypervisors} == {"QEMU"}

    def boot(name: str, flavor: str, image: str = "guest") -> dict[str, str]:
        cloud.osc(
            "server", "create", "--flavor", flavor, "--image", image, "--nic", "none",
            "--wait", name,
        )  # fmt: skip
        server = _server(cloud, name)
        assert server["status"] == "ACTIVE"
        return server

    pinned = boot("pinned", "m1.pinned")
    shared = boot("shared", "m1.micro")
    boot_id = _boot_id(cloud, "pinned")
    _boot_id(cloud, "shared")

    # What libvirt enforces is what the ledger claims.
    ledger = _ledger_pins(cloud, pinned["id"])
    assert len(ledger) == 1
    assert _vcpupin(cloud, pinned["host"], pinned["id"]) == {0: str(ledger[0])}
    assert not _ledger_pins(cloud, shared["id"])
    assert str(ledger[0]) not in _vcpupin(cloud, shared["host"], shared["id"]).values() or (
        pinned["host"] != shared["host"]
    )

    # Live migration of the running pinned guest: the same guest, on the other host's pins.
    before = _uptime(_console(cloud, "pinned"))
    cloud.osc("server", "migrate", "--live-migration", "--wait", "pinned")
    moved = _server(cloud, "pinned")
    assert moved["status"] == "ACTIVE"
    assert moved["host"] != pinned["host"]
    assert f"instance-{pinned['id']}" not in _virsh(cloud, pinned["host"], "list", "--all")
    new_pins = _ledger_pins(cloud, pinned["id"])
    assert _vcpupin(cloud, moved["host"], pinned["id"]) == {0: str(new_pins[0])}
    _wait_for(lambda: _uptime(_console(cloud, "pinned")) > before + 1, "the counter to go on")
    after = _console(cloud, "pinned")  # the destination's log: from the switch-over on
    assert f"boot_id={boot_id}" in after
    assert guest_image.MARKER not in after  # not booted again
    counts = [int(n) for n in re.findall(rf"{guest_image.UPTIME_PREFIX} (\d+) ", after)]
    assert min(counts) >= before  # it goes on from where it was
    migrations = cloud.osc_json("server", "migration", "list", "--server", "pinned")
    assert [m["Status"] for m in migrations] == ["completed"]

    # A snapshot is an image of the disk, flattened, in the base's format (qcow2 data
    # labelled qcow2), and it boots.
    cloud.osc("server", "image", "create", "--name", "snap", "--wait", "shared")
    snap = cloud.osc_json("image", "show", "snap")
    assert (snap["status"], snap["disk_format"]) == ("active", "qcow2")
    saved = tmp_path / "snap.qcow2"
    cloud.osc("image", "save", "--file", str(saved), "snap")
    assert saved.read_bytes()[:4] == b"QFI\xfb"
    info = subprocess.run(
        ["qemu-img", "info", "--output=json", str(saved)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert '"backing-filename"' not in info  # standalone, not an overlay
    boot("from-snap", "m1.micro", image="snap")
    _boot_id(cloud, "from-snap")
    cloud.osc("server", "delete", "--wait", "from-snap")

    # Stop, start, reboot: the guest really stops, and boots again.
    first = _boot_id(cloud, "shared")
    cloud.osc("server", "stop", "shared")
    _wait_for(lambda: _server(cloud, "shared")["status"] == "SHUTOFF", "shared to stop")
    assert "shut off" in _virsh(cloud, shared["host"], "domstate", f"instance-{shared['id']}")
    cloud.osc("server", "start", "shared")
    _wait_for(lambda: _server(cloud, "shared")["status"] == "ACTIVE", "shared to start")
    _wait_for(lambda: _boot_id(cloud, "shared") != first, "a new boot after start")
    second = _boot_id(cloud, "shared")
    cloud.osc("server", "reboot", "--hard", "--wait", "shared")
    _wait_for(lambda: _boot_id(cloud, "shared") != second, "a new boot after reboot")

    # `virsh destroy` behind Stowage's back shows in the server's state.
    _virsh(cloud, moved["host"], "destroy", f"instance-{pinned['id']}")
    _wait_for(lambda: _server(cloud, "pinned")["status"] == "SHUTOFF", "power sync of pinned", 40)

    # Delete leaves no domain and no disk anywhere.
    for name in ("pinned", "shared"):
        cloud.osc("server", "delete", "--wait", name)
    for host in HOSTS:
        assert "instance-" not in _virsh(cloud, host, "list", "--all")
        disks = cloud.state_dir / "libvirt" / host / "disks"
        assert not [p.name for p in disks.glob("*") if p.is_file()]
        assert not list((disks / "console").glob("*"))


def test_two_pinned_guests_migrated_at_once_to_room_for_one(cloud: RunningCloud) -> None:
    """Seed 002 on a real hypervisor: each host has one dedicated CPU; two pinned guests are
    live-migrated at the same moment while only one host has room. One moves, onto that
    host's CPU; the other stays where it runs; no pCPU is ever pinned twice."""
    names = ("seed-a", "seed-b")
    for name in names:
        cloud.osc(
            "server", "create", "--flavor", "m1.pinned", "--image", "stowage-guest",
            "--nic", "none", "--wait", name,
        )  # fmt: skip
    before = {name: _server(cloud, name) for name in names}
    assert before["seed-a"]["host"] != before["seed-b"]["host"]
    (free,) = set(HOSTS) - {s["host"] for s in before.values()}
    counts = {name: _uptime(_console(cloud, name)) for name in names}
    for name in names:
        _boot_id(cloud, name)

    moves = [
        subprocess.Popen(
            [
                str(Path(sys.executable).parent / "openstack"),
                "server",
                "migrate",
                "--live-migration",
                "--wait",
                name,
            ],
            env=cloud.env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for name in names
    ]
    for move in moves:
        move.wait(timeout=300)

    def settled() -> bool:
        shown = [cloud.osc_json("server", "show", n) for n in names]
        return all(s["status"] == "ACTIVE" and not s["OS-EXT-STS:task_state"] for s in shown)

    _wait_for(settled, "both servers to settle")
    after = {name: _server(cloud, name) for name in names}
    moved = [n for n in names if after[n]["host"] != before[n]["host"]]
    assert len(moved) == 1, after
    assert after[moved[0]]["host"] == free
    for host in HOSTS:
        pinned_here: list[str] = []
        for name in names:
            if after[name]["host"] == host:
                server_id = after[name]["id"]
                pins = _vcpupin(cloud, host, server_id)
                assert pins == {0: str(_ledger_pins(cloud, server_id)[0])}
                pinned_here += pins.values()
        assert len(pinned_here) == len(set(pinned_here)), (host, pinned_here)
    for name in names:  # both guests still run, the moved one and the one that stayed
        _wait_for(_counting(cloud, name, counts[name]), f"{name} running")
        cloud.osc("server", "delete", "--wait", name)


def _counting(cloud: RunningCloud, name: str, past: int) -> Callable[[], bool]:
    return lambda: _uptime(_console(cloud, name)) > past
