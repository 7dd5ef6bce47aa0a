"""How fast the one-command cloud comes up, and how fast its first server is ACTIVE.

Prints, over several fresh state directories: seconds from `stowage up` to an answering
identity API, and the wall time of the first `openstack server create --wait` of m1.tiny,
next to the wall time of `openstack flavor list` in the same cloud (the CLI's own start-up
cost, measured in the same run as a baseline).

    .venv/bin/python bench/startup.py [--runs 3] [--compute-process on|off]

`stowage up` as it starts by default (the conductor and the agents in a second process, on a
machine of two cores or more), or told `--compute-process` (on) or `--no-compute-process`
(off, one process).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def timed(args: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(args, env=env, check=True, capture_output=True, timeout=120)
    return time.perf_counter() - start


def one_run(extra: list[str]) -> tuple[float, float, float]:
    state = Path(tempfile.mkdtemp(prefix="stowage-bench-"))
    port = free_port()
    start = time.perf_counter()
    proc = subprocess.Popen(
        [str(BIN / "stowage"), "up", "--state-dir", str(state / "s"), "--port", str(port), *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/identity/v3", timeout=1).is_success:
                    break
            except httpx.HTTPError:
                time.sleep(0.02)
        up_s = time.perf_counter() - start
        env = {k: v for k, v in os.environ.items() if not k.startswith("OS_")}
        env.update(OS_CLIENT_CONFIG_FILE=str(state / "s" / "clouds.yaml"), OS_CLOUD="stowage")
        osc = str(BIN / "openstack")
        create_s = timed(
            [osc, "server", "create", "--flavor", "m1.tiny", "--image",
             "cirros-0.6.2-x86_64-disk", "--nic", "none", "--wait", "first"],
            env,
        )  # fmt: skip
        baseline_s = timed([osc, "flavor", "list"], env)
        return up_s, create_s, baseline_s
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(state, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--compute-process", choices=("default", "on", "off"), default="default")
    args = parser.parse_args()
    extra = {"default": [], "on": ["--compute-process"], "off": ["--no-compute-process"]}[
        args.compute_process
    ]
    results = [one_run(extra) for _ in range(args.runs)]
    for name, index in (("stowage up -> identity answers", 0),
                        ("first server create --wait", 1),
                        ("openstack flavor list (CLI baseline)", 2)):  # fmt: skip
        values = [r[index] for r in results]
        print(
            f"{name:40s} median {statistics.median(values):6.2f} s   "
            f"min {min(values):6.2f} s   max {max(values):6.2f} s   (n={len(values)})"
        )
    create = statistics.median(r[1] for r in results)
    baseline = statistics.median(r[2] for r in results)
    print(f"server create --wait beyond the CLI's own start-up: {create - baseline:.2f} s")


if __name__ == "__main__":
    main()
