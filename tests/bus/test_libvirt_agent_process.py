"""Production mode on a real hypervisor: `stowage api`, `stowage conductor` and `stowage agent
--driver libvirt` as processes of their own (PostgreSQL, RabbitMQ), the agent on a private
libvirt daemon running real QEMU (TCG); the guest built from Debian packages boots to ACTIVE
and prints its marker on the console the API shows.

Never skipped in CI (CI=true): a missing QEMU, libvirt or guest package is a failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tests.api.cloudproc import BIN, RunningCloud, free_port
from tests.conftest import pg_schema_url

pytestmark = pytest.mark.postgres

BOOT_TIMEOUT_S = 120.0
START_TIMEOUT_S = 180.0  # the processes start slowly on a loaded machine (alembic, QEMU)
HOST_IP = "198.51.100.7"  # TEST-NET-2: the address the agent is told it has


def _require_real_qemu() -> None:
    tools = ("qemu-system-x86_64", "qemu-img", "libvirtd", "virsh", "mformat", "syslinux")
    missing = [t for t in tools if not shutil.which(t)]
    why = f"missing {missing}" if missing else ("needs root" if os.geteuid() != 0 else "")
    try:
        import libvirt  # noqa: F401
    except ImportError:
        why = why or "libvirt-python is not installed"
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"CI runs the production libvirt agent test: {why}", pytrace=False)
        pytest.skip(why)


def _spawn(log: Path, *args: str) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen([str(BIN / "stowage"), *args], stdout=out, stderr=subprocess.STDOUT)


@pytest.fixture
def libvirt_production(tmp_path: Path) -> Iterator[tuple[RunningCloud, str, str]]:
    """The cloud, the libvirt agent's host name and its daemon's URI."""
    _require_real_qemu()
    from stowage.virt.daemon import LibvirtDaemon

    pg = pg_schema_url()
    pg_url = next(pg)
    daemon = LibvirtDaemon(tmp_path / "libvirtd", migration_port_min=49600)
    daemon.start()
    state = tmp_path / "state"
    port = free_port()
    common = ("--state-dir", str(state), "--db", pg_url)
    procs = [_spawn(tmp_path / "api.log", "api", *common, "--port", str(port))]
    base = f"http://127.0.0.1:{port}"
    host = f"prod-lv-{uuid.uuid4().hex[:6]}"
    cloud = RunningCloud(base, state, procs[0], tmp_path / "api.log")
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert procs[0].poll() is None, (tmp_path / "api.log").read_text()
            assert time.monotonic() < deadline, "the API did not come up"
            try:
                if httpx.get(f"{base}/identity/v3", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        # Each agent call gets 1 s: a real guest's snapshot (qemu-img convert, then the upload
        # over HTTP) takes longer, and must still finish: the conductor's retries of the same
        # call join the running snapshot (as Nova's snapshot is not bound by an RPC timeout).
        procs.append(_spawn(tmp_path / "conductor.log", "conductor", *common, "--op-timeout", "1"))
        # The agent's host shares nothing with the API's but the ledger and the bus: a state
        # directory of its own (no token key, no image store in common).
        agent_state = ("--state-dir", str(tmp_path / "agent-state"), "--db", pg_url)
        agent = ("agent", "--host", host, *agent_state, "--heartbeat-interval", "1")
        agent += ("--driver", "libvirt", "--libvirt-uri", daemon.uri, "--virt-type", "qemu")
        agent += ("--image-api", f"{base}/image", "--host-ip", HOST_IP)
        procs.append(_spawn(tmp_path / "agent.log", *agent))
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert procs[-1].poll() is None, (tmp_path / "agent.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "agent.log").read_text()
            rows = cloud.osc_json("compute", "service", "list", "--service", "nova-compute")
            if [r["Host"] for r in rows if r["State"] == "up"] == [host]:
                break
            time.sleep(0.5)
        yield cloud, host, daemon.uri
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in reversed(procs):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        daemon.stop()
        for name in ("api", "conductor", "agent"):
            log = tmp_path / f"{name}.log"
            if log.exists() and "Traceback" in log.read_text():
                print(f"--- {name}.log ---\n{log.read_text()}")
        next(pg, None)


def test_the_libvirt_agent_process_boots_a_real_guest(
    libvirt_production: tuple[RunningCloud, str, str], tmp_path: Path
) -> None:
    from stowage.virt import guest_image

    cloud, host, uri = libvirt_production
    assert cloud.osc_json("hypervisor", "show", host)["host_ip"] == HOST_IP
    disk = guest_image.build(
        tmp_path / "guest.raw", kernel=guest_image.default_kernel(), busybox=Path("/bin/busybox")
    )
    cloud.osc(
        "image", "create", "--disk-format", "raw", "--container-format", "bare",
        "--file", str(disk), "--public", "guest",
    )  # fmt: skip
    server = cloud.osc_json(
        "server", "create", "--flavor", "m1.micro", "--image", "guest", "--nic", "none",
        "--wait", "prod-guest",
    )  # fmt: skip
    shown = cloud.osc_json("server", "show", "prod-guest")
    assert (shown["status"], shown["OS-EXT-SRV-ATTR:host"]) == ("ACTIVE", host), shown.get("fault")
    domains = subprocess.run(
        ["virsh", "-c", uri, "list", "--name"], capture_output=True, text=True, check=True
    ).stdout
    assert f"instance-{server['id']}" in domains.split()

    deadline = time.monotonic() + BOOT_TIMEOUT_S
    console = ""
    while guest_image.MARKER not in console:
        if time.monotonic() > deadline:
            pytest.fail(f"no console marker after {BOOT_TIMEOUT_S} s:\n{console[-2000:]}")
        time.sleep(1.0)
        console = cloud.osc("console", "log", "show", "prod-guest").stdout

    # A snapshot streams to the image API over HTTP, in the base's format.
    cloud.osc("server", "image", "create", "--name", "prod-guest-snap", "--wait", "prod-guest")
    steps = (tmp_path / "conductor.log").read_text()
    assert "step='snapshot' outcome='wait'" in steps, "the snapshot outlived no call timeout"
    snap = cloud.osc_json("image", "show", "prod-guest-snap")
    assert (snap["status"], snap["disk_format"]) == ("active", "raw")
    saved = tmp_path / "snap.raw"
    cloud.osc("image", "save", "--file", str(saved), "prod-guest-snap")
    assert saved.stat().st_size == 1024**3  # the flavor's root disk, flattened
    with saved.open("rb") as f:  # the image's data at its head
        assert f.read(disk.stat().st_size) == disk.read_bytes()

    cloud.osc("server", "delete", "--wait", "prod-guest")
    domains = subprocess.run(
        ["virsh", "-c", uri, "list", "--all", "--name"], capture_output=True, text=True, check=True
    ).stdout
    assert not [d for d in domains.split() if d.startswith("instance-")]
