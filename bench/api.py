"""Boots through the real HTTP API, against the limits the API sits under, in one run.

    .venv/bin/python bench/api.py [--servers 1000] [--hosts 20] [--procs 4] [--clients 8]

Starts `stowage up` (SQLite, simulated hosts sized to the load, no quota, the API answering
as soon as a request is committed), issues one token, and then, with `--procs` load processes
of `--clients` threads each sending plain HTTP:

- creates `--servers` m1.tiny servers with no NIC and waits until every one is ACTIVE or
  ERROR (read from the ledger's file, so the poll does not load the API); prints boots/s to a
  settled state, the ERROR count (a throughput figure must count them), and create latency
  percentiles;
- measures the same load generator against a trivial authenticated GET (`GET /flavors/1`):
  the rate of the HTTP stack itself, the first limit;
- measures the scheduler-and-ledger claim rate on a fresh ledger of the same hosts on the
  same disk (in-process, batches of 256): the second limit;
- times `GET /servers/detail` of everything created;
- fires `--migrations` live migrations and prints migrations/s until all completed.

The figures are the ones printed; nothing is asserted. The machine is shared: compare
figures of one run with each other, not with another run's.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def topology_file(path: Path, hosts: int) -> Path:
    """Hosts large enough for the load: 2 cells x 32 cores x 2 threads, 512 GiB, 10 TB."""
    spec = {
        "hosts": [
            {
                "name": f"h{i:05d}",
                "cells": 2,
                "cores_per_cell": 32,
                "threads_per_core": 2,
                "memory_mb_per_cell": 262144,
                "disk_gb": 10000,
            }
            for i in range(hosts)
        ]
    }
    path.write_text(yaml.safe_dump(spec))
    return path


def start(state: Path, hosts: int) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    topo = topology_file(state.parent / "topology.yaml", hosts)
    proc = subprocess.Popen(
        [
            str(BIN / "stowage"),
            "up",
            "--state-dir",
            str(state),
            "--port",
            str(port),
            "--topology",
            str(topo),
            "--max-instances-per-request",
            "100000",
        ],
        stdout=(state.parent / "cloud.log").open("wb"),
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/identity/v3", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("stowage up did not answer")


def token(base: str) -> tuple[str, str]:
    body = {
        "auth": {
            "identity": {
                "methods": ["password"],
                "password": {
                    "user": {
                        "name": "admin",
                        "domain": {"name": "Default"},
                        "password": "stowage-admin",
                    }
                },
            },
            "scope": {"project": {"name": "admin", "domain": {"name": "Default"}}},
        }
    }
    response = httpx.post(f"{base}/identity/v3/auth/tokens", json=body, timeout=30)
    response.raise_for_status()
    return response.headers["x-subject-token"], response.json()["token"]["project"]["id"]


def _load(args: tuple[str, str, str, str, int, int, Any]) -> list[float]:
    """One load process: `clients` threads sharing `count` requests; latencies in seconds."""
    import concurrent.futures

    base, tok, kind, image, count, clients, _ = args
    headers = {"X-Auth-Token": tok, "OpenStack-API-Version": "compute 2.96"}
    url = f"{base}/compute/v2.1"

    def worker(n: int) -> list[float]:
        out = []
        with httpx.Client(headers=headers, timeout=120) as http:
            for i in range(n):
                start = time.perf_counter()
                if kind == "create":
                    body = {
                        "server": {
                            "name": f"b{os.getpid()}-{i}",
                            "flavorRef": "1",
                            "imageRef": image,
                            "networks": "none",
                        }
                    }
                    response = http.post(f"{url}/servers", json=body)
                    ok = response.status_code == 202
                else:
                    response = http.get(f"{url}/flavors/1")
                    ok = response.status_code == 200
                out.append(time.perf_counter() - start if ok else -1.0)
        return out

    shares = [count // clients + (1 if i < count % clients else 0) for i in range(clients)]
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        return [x for part in pool.map(worker, shares) for x in part]


def drive(
    base: str, tok: str, kind: str, image: str, total: int, procs: int, clients: int
) -> tuple[float, list[float]]:
    shares = [total // procs + (1 if i < total % procs else 0) for i in range(procs)]
    ctx = multiprocessing.get_context("spawn")
    start = time.perf_counter()
    with ctx.Pool(procs) as pool:
        parts = pool.map(_load, [(base, tok, kind, image, n, clients, None) for n in shares])
    elapsed = time.perf_counter() - start
    return elapsed, [x for part in parts for x in part]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(v for v in values if v >= 0)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def statuses(db: Path) -> dict[str, int]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        rows = conn.execute("SELECT body FROM objects WHERE kind = 'instance'").fetchall()
    finally:
        conn.close()
    out: dict[str, int] = {}
    for (body,) in rows:
        status = json.loads(body)["status"]
        out[status] = out.get(status, 0) + 1
    return out


def until(check: Callable[[], bool], timeout_s: float) -> float:
    start = time.perf_counter()
    while not check():
        if time.perf_counter() - start > timeout_s:
            break
        time.sleep(0.1)
    return time.perf_counter() - start


def claim_rate(hosts: int, instances: int, workdir: Path) -> float:
    """The scheduler and the ledger alone on the same disk: placements/s of m1.tiny."""
    from stowage.domain.flavor import Flavor, shape_of
    from stowage.domain.topology import HostSpec, HostTopology
    from stowage.ledger import Ledger
    from stowage.scheduling.framework import Request
    from stowage.services.scheduler import Scheduler

    ledger = Ledger.open(f"sqlite:///{workdir / 'claims.db'}")
    topo = HostTopology.uniform(
        cells=2, cores_per_cell=32, threads_per_core=2, memory_mb_per_cell=262144
    )
    ledger.register_hosts([HostSpec(f"h{i:05d}", topo, disk_gb=10000) for i in range(hosts)])
    ledger.heartbeat()
    scheduler = Scheduler(ledger)
    shape = shape_of(Flavor("m1.tiny", 1, 512, 1, {}))
    requests = [
        Request(consumer_id=f"c{i}", instance_id=f"c{i}", shape=shape) for i in range(instances)
    ]
    start = time.perf_counter()
    for lo in range(0, instances, 256):
        scheduler.schedule(requests[lo : lo + 256])
    elapsed = time.perf_counter() - start
    ledger.close()
    return instances / elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--servers", type=int, default=1000)
    parser.add_argument("--hosts", type=int, default=20)
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--migrations", type=int, default=100)
    parser.add_argument("--gets", type=int, default=2000)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="stowage-bench-api-"))
    state = work / "state"
    proc, base = start(state, args.hosts)
    try:
        tok, project = token(base)
        headers = {"X-Auth-Token": tok, "OpenStack-API-Version": "compute 2.96"}
        quota = {"quota_set": {"instances": -1, "cores": -1, "ram": -1}}
        httpx.put(f"{base}/compute/v2.1/os-quota-sets/{project}", json=quota, headers=headers)
        image = httpx.get(f"{base}/image/v2/images", headers=headers).json()["images"][0]["id"]
        clients = args.procs * args.clients

        get_s, get_lat = drive(base, tok, "get", image, args.gets, args.procs, args.clients)
        print(
            f"trivial authenticated GET (GET /flavors/1), {clients} clients: "
            f"{args.gets / get_s:8.1f} req/s, p50 {pct(get_lat, 0.5) * 1e3:6.1f} ms, "
            f"p99 {pct(get_lat, 0.99) * 1e3:6.1f} ms"
        )

        start_t = time.perf_counter()
        create_s, lat = drive(base, tok, "create", image, args.servers, args.procs, args.clients)
        db = state / "ledger.db"

        def settled() -> bool:
            counts = statuses(db)
            return counts.get("ACTIVE", 0) + counts.get("ERROR", 0) >= args.servers

        until(settled, 600)
        total_s = time.perf_counter() - start_t
        counts = statuses(db)
        refused = sum(1 for x in lat if x < 0)
        print(
            f"creates answered, {clients} clients: {args.servers / create_s:8.1f} req/s, "
            f"p50 {pct(lat, 0.5) * 1e3:6.1f} ms, p99 {pct(lat, 0.99) * 1e3:6.1f} ms, "
            f"{refused} refused"
        )
        print(
            f"boots to a settled state: {args.servers / total_s:8.1f} boots/s "
            f"({total_s:.1f} s; {counts})"
        )

        start_t = time.perf_counter()
        listed = httpx.get(f"{base}/compute/v2.1/servers/detail", headers=headers, timeout=300)
        detail_s = time.perf_counter() - start_t
        print(
            f"GET /servers/detail of {len(listed.json()['servers'])} servers: "
            f"{detail_s * 1e3:8.1f} ms"
        )

        servers = [s["id"] for s in listed.json()["servers"] if s["status"] == "ACTIVE"]
        moving = servers[: args.migrations]
        start_t = time.perf_counter()
        with httpx.Client(headers=headers, timeout=120) as http:
            for server_id in moving:
                http.post(
                    f"{base}/compute/v2.1/servers/{server_id}/action",
                    json={"os-migrateLive": {"host": None, "block_migration": "auto"}},
                )

        def migrated() -> bool:
            conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
            try:
                rows = conn.execute("SELECT body FROM objects WHERE kind = 'migration'").fetchall()
            finally:
                conn.close()
            done = [json.loads(b)["status"] for (b,) in rows]
            return len(done) >= len(moving) and all(
                s in ("completed", "failed", "error", "cancelled") for s in done
            )

        until(migrated, 600)
        migrate_s = time.perf_counter() - start_t
        print(
            f"live migrations to completed: {len(moving) / migrate_s:8.1f} /s "
            f"({len(moving)} in {migrate_s:.1f} s)"
        )
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    rate = claim_rate(args.hosts, min(args.servers, 5000), work)
    print(f"scheduler + ledger alone, same hosts and disk: {rate:8.1f} placements/s")
    print(
        f"the API keeps {args.servers / total_s / rate * 100:5.1f}% of the claim rate; "
        f"the load generator ran {clients} clients in {args.procs} processes; "
        f"{statistics.mean(x for x in lat if x >= 0) * 1e3:.1f} ms mean create latency"
    )


if __name__ == "__main__":
    main()
