"""Time to ACTIVE, time to the guest's console marker, live-migration time (the API's
`--wait`, end to end) and the migration's downtime: libvirt/QEMU (TCG) against the simulated
driver, each in a fresh `stowage up --hosts 2`. The simulated driver has no guest, so it has
no console figure.

Downtime, libvirt: QEMU's own figure, `downtime` in the completed job's stats
(virDomainGetJobStats with VIR_DOMAIN_JOB_STATS_COMPLETED) on the destination: from the
source's vCPUs stopping to the destination's running. Simulated: the guest's pause as the
destination's console reports it, from the source pausing it for the switch-over to the
destination taking it (`finish_migration`): the conductor's round trip between the two.

    .venv/bin/python bench/virt.py [--runs 1] [--drivers sim,libvirt]   # libvirt needs root
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

BIN = Path(sys.executable).parent
MARKER = "STOWAGE-GUEST-UP"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def osc(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        [str(BIN / "openstack"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"openstack {' '.join(args)}: {done.stderr}")
    return done.stdout


def run_once(driver: str) -> dict[str, float | None]:
    state = Path(tempfile.mkdtemp(prefix=f"bench-virt-{driver}-"))
    port = free_port()
    extra = ["--driver", "libvirt", "--virt-type", "qemu"] if driver == "libvirt" else []
    log = (state / "up.log").open("wb")
    proc = subprocess.Popen(
        [
            str(BIN / "stowage"),
            "up",
            "--state-dir",
            str(state / "s"),
            "--port",
            str(port),
            "--hosts",
            "2",
            *extra,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{base}/identity/v3", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        env = {k: v for k, v in os.environ.items() if not k.startswith("OS_")}
        env.update(OS_CLIENT_CONFIG_FILE=str(state / "s" / "clouds.yaml"), OS_CLOUD="stowage-admin")
        image = "stowage-guest" if driver == "libvirt" else "cirros-0.6.2-x86_64-disk"
        start = time.perf_counter()
        osc(env, "server", "create", "--flavor", "m1.pinned", "--image", image, "--nic", "none",
            "--wait", "vm")  # fmt: skip
        active_s = time.perf_counter() - start
        marker_s: float | None = None
        if driver == "libvirt":
            while MARKER not in osc(env, "console", "log", "show", "vm"):
                time.sleep(0.5)
            marker_s = time.perf_counter() - start
        start = time.perf_counter()
        osc(env, "server", "migrate", "--live-migration", "--wait", "vm")
        migrate_s = time.perf_counter() - start
        if driver == "libvirt":
            downtime_ms = libvirt_downtime_ms(state / "s", env)
        else:
            downtime_ms = sim_downtime_ms(osc(env, "console", "log", "show", "vm"))
        return {
            "active_s": round(active_s, 2),
            "console_marker_s": None if marker_s is None else round(marker_s, 2),
            "live_migration_s": round(migrate_s, 2),
            "downtime_ms": None if downtime_ms is None else round(downtime_ms, 1),
        }
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        shutil.rmtree(state, ignore_errors=True)


def sim_downtime_ms(console: str) -> float | None:
    found = re.findall(r"arrived after a ([0-9.]+) ms pause", console)
    return float(found[-1]) if found else None


def libvirt_downtime_ms(state: Path, env: dict[str, str]) -> float | None:
    """`downtime` of the completed migration job, read from the destination's libvirt."""
    import libvirt

    shown = json.loads(osc(env, "server", "show", "vm", "-f", "json"))
    host, server_id = shown["OS-EXT-SRV-ATTR:host"], shown["id"]
    sock = state / "libvirt" / host / "daemon" / "sock" / "libvirt-sock"
    conn = libvirt.open(f"qemu+unix:///system?socket={sock}")
    try:
        dom = conn.lookupByName(f"instance-{server_id}")
        stats = dom.jobStats(libvirt.VIR_DOMAIN_JOB_STATS_COMPLETED)
    finally:
        conn.close()
    return float(stats["downtime"]) if "downtime" in stats else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--drivers", default="sim,libvirt")
    args = parser.parse_args()
    results = {
        driver: [run_once(driver) for _ in range(args.runs)] for driver in args.drivers.split(",")
    }
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
