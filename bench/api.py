"""Boots through the real HTTP API, against the limits the API sits under, in one run.

    .venv/bin/python bench/api.py [--servers 1000] [--hosts 20] [--procs 4] [--clients 8]
                                  [--before-src /tmp/before/src]

Starts `stowage up` (SQLite, simulated hosts sized to the load, no quota, the API answering
as soon as a request is committed), issues one token, and then, with `--procs` load processes
of `--clients` threads each sending plain HTTP:

- creates `--servers` m1.tiny servers with no NIC (with `--nics`, one port each on a /16
  network made for the run) and waits until every one is ACTIVE or
  ERROR (read from the ledger's file, so the poll does not load the API); prints boots/s to a
  settled state, the ERROR count (a throughput figure must count them), and create latency
  percentiles (the wait counts instances and unended builds, and reads the statuses only
  once none is left, so the poll does not load the database);
- measures the same load generator against a trivial authenticated GET (`GET /flavors/1`):
  the rate of the HTTP stack itself, the first limit;
- measures the scheduler-and-ledger claim rate on a fresh ledger of the same hosts on the
  same disk (in-process, batches of 256): the second limit;
- times `GET /servers/detail` of everything created;
- fires `--migrations` live migrations and prints migrations/s until all completed.

With `--compute-process on` it starts `stowage up --compute-process` (the conductor and the
agents in a second process); `--compute-process both` runs this checkout both ways in one run
and prints them side by side.

Beside each rate it prints the CPU the `stowage up` process used (in cores, and per request
or boot: the figure a loaded machine moves least; with `--compute-process`, the APIs' process
and the compute process apart) and the load generator's own CPU, so a rate
is not read as the API's when the generator was the limit. With `--before-src OTHER/src` it
measures another checkout first in the same run (same machine, same load) and prints the
two side by side.

With `--production` the cloud is the production processes instead (issue 12's second
target): `stowage api --workers W`, `--conductors C` conductors and one `stowage agent
--driver sim` per host, sharing a fresh PostgreSQL schema (`--pg-url`) and RabbitMQ (`--bus`).
CPU is then printed per process kind (the API's workers summed), with PostgreSQL's and
RabbitMQ's where they run on this machine (each a tree from its root process, the backends it
has reaped included) and the machine's busy cores, so a run shows when the machine, not one
process, is the limit; `--profile DIR` records
a py-spy profile (`py-spy record --gil`, raw collapsed stacks) of one process of each kind
while the creates run and prints each one's heaviest functions by inclusive share:

    .venv/bin/python bench/api.py --production --hosts 6 --api-workers 2 --conductors 2 \
        --servers 2000 --profile /tmp/profiles

With `--holds` it prints, for each process of the cloud, how long it held SQLite's write
lock while booting, how much of that time the holding thread was on a core (the rest it waited
for the GIL or for a core, with the lock held), and the places that held it longest
(`STOWAGE_WRITER_TALLY`, stowage.ledger.db).

With `--threads` it also prints where `stowage up`'s CPU goes by kind of thread, user and
system time read from /proc per thread (names from `py-spy dump`): a sampling profile with
`--gil` credits the thread that holds the GIL when sampled, which under-counts threads that
release it often (the API's handlers, in SQLite), so this is the split to believe.

The figures are the ones printed; nothing is asserted. The machine is shared: compare
figures of one run with each other, not with another run's.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import multiprocessing
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml
from sqlalchemy import bindparam, create_engine, text

from stowage.domain.keystone import password_login
from stowage.ledger.db import TALLY_ENV
from stowage.ledger.operations import ACTIVE_STATES

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


class Cloud:
    """The cloud under load: `stowage up` (one process) or the production processes, with
    the ledger's URL and the pid of each process kind's root processes."""

    def __init__(self, base: str, db_url: str, procs: dict[str, list[subprocess.Popen[bytes]]]):
        self.base = base
        self.db_url = db_url
        self.procs = procs
        self.engine = create_engine(db_url)
        self.services: dict[str, int] = {}

    def pids(self) -> dict[str, list[int]]:
        return {kind: [p.pid for p in procs] for kind, procs in self.procs.items()}

    def cpu(self) -> dict[str, float]:
        """CPU seconds used so far per process kind, children included (API workers); `stowage
        up`'s split into its own process (the APIs) and its children (`--compute-process`)."""
        out: dict[str, float] = {}
        for kind, pids in self.pids().items():
            if kind == "stowage up":
                out["stowage up: APIs"] = sum(cpu_s(pid) for pid in pids)
                kids = sum(cpu_s(child) for pid in pids for child in children(pid))
                if kids:
                    out["stowage up: compute"] = kids
            else:
                out[kind] = sum(tree_cpu_s(pid) for pid in pids)
        return out

    def services_cpu(self) -> dict[str, float]:
        """CPU seconds used so far by the services this machine runs for the cloud (production:
        PostgreSQL and RabbitMQ), each a tree from its root process, with the children the
        root has reaped (a PostgreSQL backend's CPU stays counted after its connection ends)."""
        return {name: service_cpu_s(pid) for name, pid in self.services.items()}

    def stop(self) -> None:
        everything = [p for procs in self.procs.values() for p in procs]
        for proc in everything:
            proc.terminate()
        for proc in everything:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.engine.dispose()


def wait_answering(base: str, procs: list[subprocess.Popen[bytes]], what: str) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            break
        try:
            if httpx.get(f"{base}/identity/v3", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    for p in procs:
        p.kill()
    raise SystemExit(f"{what} did not answer")


def start(
    state: Path, hosts: int, src: Path | None = None, *, compute_process: bool = False
) -> Cloud:
    """`stowage up` of this checkout, or of the source tree `src` (another commit's `src/`,
    run by this interpreter: the "before" of a before/after run); with `compute_process`,
    `stowage up --compute-process` (its CPU is the process tree's: the APIs' process, and its
    children, the compute process)."""
    port = free_port()
    topo = topology_file(state.parent / "topology.yaml", hosts)
    proc = subprocess.Popen(
        [
            *command_of(src),
            "up",
            "--state-dir",
            str(state),
            "--port",
            str(port),
            "--topology",
            str(topo),
            "--max-instances-per-request",
            "100000",
            # Said either way (the default follows the cores); a "before" checkout older
            # than the option runs one process and is told nothing.
            *(
                ["--compute-process"]
                if compute_process
                else ([] if src is not None else ["--no-compute-process"])
            ),
        ],
        stdout=(state.parent / "cloud.log").open("wb"),
        stderr=subprocess.STDOUT,
        env=env_of(src),
    )
    base = f"http://127.0.0.1:{port}"
    wait_answering(base, [proc], "stowage up")
    return Cloud(base, f"sqlite:///{state / 'ledger.db'}", {"stowage up": [proc]})


def command_of(src: Path | None) -> list[str]:
    if src is None:
        return [str(BIN / "stowage")]
    return [sys.executable, "-c", "from stowage.cli import app; app()"]


def env_of(src: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = str(src)
    return env


def start_production(
    state: Path, args: argparse.Namespace, src: Path | None = None
) -> tuple[Cloud, str]:
    """The production processes on a new PostgreSQL schema; returns the cloud and the
    schema (dropped by the caller)."""
    schema, db_url = new_schema(args.pg_url, "bench")
    port = free_port()
    topo = topology_file(state.parent / "topology.yaml", args.hosts)
    common = ["--state-dir", str(state), "--db", db_url]
    logs = state.parent

    def spawn(name: str, *argv: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [*command_of(src), *argv],
            stdout=(logs / f"{name}.log").open("wb"),
            stderr=subprocess.STDOUT,
            env=env_of(src),
        )

    api = spawn(
        "api",
        "api",
        *common,
        "--port",
        str(port),
        "--workers",
        str(args.api_workers),
        "--max-instances-per-request",
        "100000",
    )
    base = f"http://127.0.0.1:{port}"
    wait_answering(base, [api], "stowage api")
    conductors = [
        spawn(f"conductor{i}", "conductor", *common, "--bus", args.bus, "--name", f"bench-c{i}")
        for i in range(args.conductors)
    ]
    hosts = [f"h{i:05d}" for i in range(args.hosts)]
    agents = [
        spawn(
            host,
            "agent",
            "--host",
            host,
            *common,
            "--bus",
            args.bus,
            "--topology",
            str(topo),
            "--image-api",
            f"{base}/image",
        )
        for host in hosts
    ]
    cloud = Cloud(base, db_url, {"api": [api], "conductor": conductors, "agent": agents})
    kinds = {"postgres": "postgres", "beam.smp": "rabbitmq"}  # command name: what it is
    cloud.services = {kinds[name]: pid for name, pid in service_roots(tuple(kinds)).items()}
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        with cloud.engine.connect() as conn:
            up = conn.execute(text("SELECT count(*) FROM hosts")).scalar_one()
        if up >= args.hosts:
            break
        time.sleep(0.5)
    else:
        cloud.stop()
        raise SystemExit(f"only {up} of {args.hosts} agents registered their hosts")
    return cloud, schema


def new_schema(pg_url: str, prefix: str) -> tuple[str, str]:
    """A new, empty PostgreSQL schema, and the URL whose connections live in it."""
    schema = f"{prefix}_{os.getpid()}_{time.time_ns()}"
    admin = create_engine(pg_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    admin.dispose()
    return schema, f"{pg_url}?options=-csearch_path%3D{schema}"


def drop_schema(pg_url: str, schema: str) -> None:
    admin = create_engine(pg_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
    admin.dispose()


def token(base: str) -> tuple[str, str]:
    body = password_login("admin", "stowage-admin", "admin")
    response = httpx.post(f"{base}/identity/v3/auth/tokens", json=body, timeout=30)
    response.raise_for_status()
    return response.headers["x-subject-token"], response.json()["token"]["project"]["id"]


def _load(args: tuple[str, str, str, str, int, int, Any, str]) -> tuple[list[float], float]:
    """One load process: `clients` threads sharing `count` requests; latencies in seconds,
    and the CPU seconds this process used (the load generator must not be the limit)."""
    import concurrent.futures
    import resource

    base, tok, kind, image, count, clients, network, client = args
    headers = {
        "X-Auth-Token": tok,
        "OpenStack-API-Version": "compute 2.96",
        "Content-Type": "application/json",
    }
    url = "/compute/v2.1"
    send = _plain_sender if client == "plain" else _httpx_sender

    def worker(n: int) -> list[float]:
        out = []
        with send(base, headers) as request:
            for i in range(n):
                start = time.perf_counter()
                if kind == "create":
                    body = {
                        "server": {
                            "name": f"b{os.getpid()}-{i}",
                            "flavorRef": "1",
                            "imageRef": image,
                            "networks": [{"uuid": network}] if network else "none",
                        }
                    }
                    ok = request("POST", f"{url}/servers", json.dumps(body).encode()) == 202
                else:
                    ok = request("GET", f"{url}/flavors/1", None) == 200
                out.append(time.perf_counter() - start if ok else -1.0)
        return out

    shares = [count // clients + (1 if i < count % clients else 0) for i in range(clients)]
    before = resource.getrusage(resource.RUSAGE_SELF)
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        latencies = [x for part in pool.map(worker, shares) for x in part]
    after = resource.getrusage(resource.RUSAGE_SELF)
    used = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return latencies, used


Sender = Callable[[str, str, bytes | None], int]


@contextlib.contextmanager
def _plain_sender(base: str, headers: dict[str, str]) -> Iterator[Sender]:
    """Requests on one kept-alive connection of the standard library's `http.client`: 0.4-0.5
    ms of CPU a request against httpx's 1.3-4.0 ms (session 24), CPU the load generator takes
    from the machine it shares with the cloud. A request that fails counts as refused (status
    0) and the next one opens a new connection."""
    import http.client
    import urllib.parse

    where = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(where.hostname or "127.0.0.1", where.port, timeout=120)

    def request(method: str, path: str, body: bytes | None) -> int:
        try:
            conn.request(method, path, body, headers)
            response = conn.getresponse()
            response.read()
            return response.status
        except (OSError, http.client.HTTPException):
            conn.close()
            return 0

    try:
        yield request
    finally:
        conn.close()


@contextlib.contextmanager
def _httpx_sender(base: str, headers: dict[str, str]) -> Iterator[Sender]:
    """Requests from an httpx client (what the benchmark sent up to session 23)."""
    with httpx.Client(base_url=base, headers=headers, timeout=120) as http:

        def request(method: str, path: str, body: bytes | None) -> int:
            return http.request(method, path, content=body).status_code

        yield request


class Load:
    """The load generator's processes, started once (their start-up is not measured)."""

    def __init__(self, procs: int) -> None:
        self.procs = procs
        self.pool = multiprocessing.get_context("spawn").Pool(procs)
        self.pool.map(abs, range(procs))  # every process up before the first phase

    def close(self) -> None:
        self.pool.terminate()
        self.pool.join()


def drive(
    load: Load,
    base: str,
    tok: str,
    kind: str,
    image: str,
    total: int,
    clients: int,
    network: str | None = None,
    client: str = "plain",
) -> tuple[float, list[float], float]:
    """Wall seconds, latencies and the load generator's CPU seconds of one phase."""
    procs = load.procs
    shares = [total // procs + (1 if i < total % procs else 0) for i in range(procs)]
    start = time.perf_counter()
    parts = load.pool.map(
        _load, [(base, tok, kind, image, n, clients, network, client) for n in shares]
    )
    elapsed = time.perf_counter() - start
    return elapsed, [x for part, _ in parts for x in part], sum(cpu for _, cpu in parts)


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process has used so far, from /proc (0 once gone)."""
    return sum(times_s(Path(f"/proc/{pid}/stat")))


def stat_fields(stat: Path) -> tuple[str, list[str]] | None:
    """A /proc `stat` file's command name and the fields after it (`state` is the first);
    None once the process or thread is gone."""
    try:
        head, tail = stat.read_text().rsplit(")", 1)
    except (OSError, ValueError):
        return None
    return head.split("(", 1)[1], tail.split()


def times_s(stat: Path) -> tuple[float, float]:
    """User and system CPU seconds of a /proc `stat` file (a process's or a thread's); zero
    once it is gone."""
    read = stat_fields(stat)
    if read is None:
        return (0.0, 0.0)
    fields, tick = read[1], os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) / tick, int(fields[12]) / tick)


def thread_cpu_s(pid: int) -> dict[int, tuple[float, float]]:
    """Each live thread's CPU seconds so far, (user, system), by thread id, from /proc."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return {}
    return {int(task.name): times_s(task / "stat") for task in tasks}


# A thread's name as `py-spy dump` prints it, to what it is in `stowage up` (an executor's
# threads are named by their prefix and a number).
_THREAD_KINDS = (
    ("MainThread", "API event loop"),
    ("AnyIO worker thread", "API handlers"),
    ("stowage-compute", "compute loop (conductor, agents)"),
    ("asyncio", "loops' executors (conductor's database steps)"),
    ("agent-driver", "agents' driver calls"),
)


class Threads:
    """Where one process's CPU goes by kind of thread, between `start` and `report`: each
    thread's user and system time from /proc, named by `py-spy dump` (`--threads`)."""

    def __init__(self, on: bool, cloud: Cloud) -> None:
        self.pid = next(iter(cloud.pids().values()))[0] if on else None
        self.before: dict[int, tuple[float, float]] = {}

    def start(self) -> None:
        if self.pid is not None:
            self.before = thread_cpu_s(self.pid)

    def report(self, seconds: float) -> str:
        if self.pid is None:
            return ""
        now = thread_cpu_s(self.pid)
        spy = BIN / "py-spy"
        if not spy.exists():
            raise SystemExit("--threads needs py-spy: .venv/bin/pip install py-spy")
        dump = subprocess.run(
            [str(spy), "dump", "--pid", str(self.pid)], capture_output=True, text=True, check=False
        ).stdout
        names = {
            int(m.group(1)): m.group(2)
            for m in re.finditer(r'^Thread (\d+) \(\w+\): "([^"]*)"', dump, re.MULTILINE)
        }
        kinds: dict[str, list[float]] = {}
        for tid, (user, system) in now.items():
            user0, system0 = self.before.get(tid, (0.0, 0.0))
            name = names.get(tid, "")
            kind = next((k for prefix, k in _THREAD_KINDS if name.startswith(prefix)), "other")
            used = kinds.setdefault(kind, [0.0, 0.0])
            used[0] += user - user0
            used[1] += system - system0
        ordered = sorted(kinds.items(), key=lambda kv: -sum(kv[1]))
        return "; ".join(
            f"{kind} {(u + y) / seconds:4.2f} cores (system {y / seconds:4.2f})"
            for kind, (u, y) in ordered
            if u + y > 0
        )


def processes() -> dict[int, tuple[str, int]]:
    """Every live process's command name and parent, by pid, from /proc."""
    out: dict[int, tuple[str, int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (read := stat_fields(entry / "stat")) is not None:
            out[int(entry.name)] = (read[0], int(read[1][1]))
    return out


def children(pid: int) -> list[int]:
    """Every live descendant of `pid`."""
    parents: dict[int, list[int]] = {}
    for child, (_, ppid) in processes().items():
        parents.setdefault(ppid, []).append(child)
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def tree_cpu_s(pid: int) -> float:
    return cpu_s(pid) + sum(cpu_s(child) for child in children(pid))


def service_cpu_s(pid: int) -> float:
    """A service's CPU seconds so far: its root, its live descendants, and the children the
    root has reaped (`cutime` and `cstime`)."""
    read = stat_fields(Path(f"/proc/{pid}/stat"))
    if read is None:
        return 0.0
    reaped = (int(read[1][13]) + int(read[1][14])) / os.sysconf("SC_CLK_TCK")
    return tree_cpu_s(pid) + reaped


def service_roots(names: tuple[str, ...]) -> dict[str, int]:
    """The root process of each service named (its command name), if it runs on this
    machine: the oldest process of that name whose parent has another name."""
    comm = processes()
    roots: dict[str, int] = {}
    for pid in sorted(comm):
        name, ppid = comm[pid]
        if name in names and name not in roots and comm.get(ppid, ("", 0))[0] != name:
            roots[name] = pid
    return roots


def machine_busy_s() -> float:
    """CPU seconds the whole machine has spent busy (all but idle and I/O wait), from
    /proc/stat: with it, a rate shows whether the machine, not one process, was the limit."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(v for v in values if v >= 0)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def statuses(cloud: Cloud) -> dict[str, int]:
    with cloud.engine.connect() as conn:
        rows = conn.execute(text("SELECT body FROM objects WHERE kind = 'instance'")).all()
    out: dict[str, int] = {}
    for (body,) in rows:
        status = json.loads(body)["status"]
        out[status] = out.get(status, 0) + 1
    return out


def builds_under_way(cloud: Cloud, servers: int) -> bool:
    """True while fewer than `servers` instances exist or a build operation has not ended:
    two counts from indexes, where `statuses` reads and decodes every instance."""
    with cloud.engine.connect() as conn:
        made = conn.execute(text("SELECT count(*) FROM objects WHERE kind = 'instance'"))
        if made.scalar_one() < servers:
            return True
        building = conn.execute(
            text(
                "SELECT count(*) FROM operations WHERE kind = 'build' AND state IN :states"
            ).bindparams(bindparam("states", expanding=True)),
            {"states": list(ACTIVE_STATES)},
        )
        return building.scalar_one() > 0


def until(check: Callable[[], bool], timeout_s: float) -> float:
    start = time.perf_counter()
    while not check():
        if time.perf_counter() - start > timeout_s:
            break
        time.sleep(0.1)
    return time.perf_counter() - start


def claim_rate(hosts: int, instances: int, db_url: str) -> float:
    """The scheduler and the ledger alone on the same database: placements/s of m1.tiny."""
    from stowage.domain.flavor import Flavor, shape_of
    from stowage.domain.topology import HostSpec, HostTopology
    from stowage.ledger import Ledger
    from stowage.scheduling.framework import Request
    from stowage.services.scheduler import Scheduler

    ledger = Ledger.open(db_url)
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


def make_network(base: str, tok: str, project: str) -> str:
    """A network whose /16 subnet holds every server's port, and no network quota: each
    server boots with a NIC on it (`--nics`)."""
    headers = {"X-Auth-Token": tok}
    net = f"{base}/networking/v2.0"
    unlimited = {"quota": {"network": -1, "subnet": -1, "port": -1}}
    httpx.put(f"{net}/quotas/{project}", json=unlimited, headers=headers).raise_for_status()
    made = httpx.post(f"{net}/networks", json={"network": {"name": "bench"}}, headers=headers)
    made.raise_for_status()
    network_id = str(made.json()["network"]["id"])
    subnet = {"network_id": network_id, "ip_version": 4, "cidr": "10.64.0.0/16"}
    httpx.post(
        f"{net}/subnets", json={"subnet": subnet}, headers=headers, timeout=60
    ).raise_for_status()
    return network_id


class Holds:
    """The write lock's holds (`--holds`), from the files the cloud's processes write
    (stowage.ledger.db's `_HoldTally`): what each process held it for from `start` to
    `report`, and how much of that its holding thread spent on a core."""

    settle_s = 3 * 0.2  # each process writes its tally every 0.2 s while it changes

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder
        self.before: dict[str, dict[str, dict[str, float]]] = {}

    def read(self) -> dict[str, dict[str, dict[str, float]]]:
        if self.folder is None or not self.folder.exists():
            return {}
        return {
            path.stem.removeprefix("writer-holds-"): json.loads(path.read_text())
            for path in sorted(self.folder.glob("writer-holds-*.json"))
        }

    def start(self) -> None:
        if self.folder is not None:
            time.sleep(self.settle_s)  # what the processes tallied last, written
        self.before = self.read()

    def report(self, seconds: float, boots: int) -> list[str]:
        """A line for each process: the lock held (seconds, share of `seconds`, ms a boot),
        the holder's CPU in it and its wait for a core, and its heaviest places, each with
        its holds' count and the boots a hold (a batch's size, for a claim or a group)."""
        if self.folder is None:
            return []
        time.sleep(self.settle_s)
        lines = []
        for pid, sites in self.read().items():
            was = self.before.get(pid, {})
            now = {
                site: {k: v - was.get(site, {}).get(k, 0.0) for k, v in tally.items()}
                for site, tally in sites.items()
            }
            held = sum(t["held_s"] for t in now.values())
            if held <= 0:
                continue
            cpu = sum(t["cpu_s"] for t in now.values())
            delay = sum(t.get("run_delay_s", 0.0) for t in now.values())
            top = sorted(now.items(), key=lambda kv: -kv[1]["held_s"])[:4]
            lines.append(
                f"write lock held by process {pid}: {held:.2f} s ({held / seconds:.0%} of the "
                f"run, {held / boots * 1e3:.2f} ms a boot), on a core {cpu / held:.0%} of it, "
                f"waiting for a core {delay / held:.0%}; "
                + "; ".join(
                    f"{site}: {int(t['holds'])} holds ({boots / t['holds']:.1f} boots each), "
                    f"{t['held_s'] / t['holds'] * 1e3:.2f} ms each, "
                    f"{t['cpu_s'] / t['held_s']:.0%} on a core, "
                    f"{t.get('run_delay_s', 0.0) / t['held_s']:.0%} waiting for one, waited "
                    f"{t['waited_s']:.2f} s"
                    for site, t in top
                    if t["holds"] > 0 and t["held_s"] > 0
                )
            )
        return lines


class Profiles:
    """py-spy recordings (GIL-holding samples, raw collapsed stacks) of one process of each
    kind, from `start` to `stop`; `report` prints each kind's heaviest functions."""

    def __init__(self, directory: Path | None, cloud: Cloud) -> None:
        self.directory = directory
        self.cloud = cloud
        self.running: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, label: str) -> None:
        if self.directory is None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        spy = BIN / "py-spy"
        if not spy.exists():
            raise SystemExit("--profile needs py-spy: .venv/bin/pip install py-spy")
        for kind, pids in self.cloud.pids().items():
            out = self.directory / f"{label}-{kind.replace(' ', '-')}.txt"
            self.running[kind] = subprocess.Popen(
                [
                    *(str(spy), "record", "--gil", "--subprocesses", "-r", "50", "-f", "raw"),
                    *("-o", str(out), "-p", str(pids[0])),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )

    def stop(self, say: Callable[[str], None], label: str) -> None:
        if self.directory is None:
            return
        for proc in self.running.values():
            proc.send_signal(2)  # py-spy writes its output on SIGINT
        for kind, proc in self.running.items():
            proc.wait(timeout=60)
            out = self.directory / f"{label}-{kind.replace(' ', '-')}.txt"
            say(f"profile of {kind} ({out}): " + top_functions(out))
        self.running.clear()


def top_functions(path: Path, n: int = 10) -> str:
    """From a raw py-spy file: Stowage's functions in most of the samples (inclusive, those
    under 95%: below the entry points), and the packages the samples end in (self time)."""
    inclusive: dict[str, int] = {}
    leaves: dict[str, int] = {}
    samples = 0
    if not path.exists():
        return "no samples"
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not count_text.isdigit():
            continue
        count = int(count_text)
        samples += count
        frames = [frame.partition(" (") for frame in stack.split(";")[1:]]
        seen = set()
        for name, _, where in frames:
            if where.startswith("stowage/") and name not in seen:
                seen.add(name)
                key = f"{name} ({where.rsplit(':', 1)[0].removeprefix('stowage/')})"
                inclusive[key] = inclusive.get(key, 0) + count
        if frames:
            package = frames[-1][2].split("/", 1)[0].split(".", 1)[0].split(":", 1)[0]
            leaves[package] = leaves.get(package, 0) + count
    if not samples:
        return "no samples"
    ours = [
        (k, v) for k, v in sorted(inclusive.items(), key=lambda kv: -kv[1]) if v < 0.95 * samples
    ]
    ends = sorted(leaves.items(), key=lambda kv: -kv[1])[:6]
    return (
        f"{samples} samples holding the GIL; inclusive: "
        + ", ".join(f"{k} {v / samples:.0%}" for k, v in ours[:n])
        + "; ending in: "
        + ", ".join(f"{k} {v / samples:.0%}" for k, v in ends)
    )


def run(
    args: argparse.Namespace,
    load: Load,
    label: str,
    src: Path | None,
    *,
    compute_process: bool = False,
    client: str = "plain",
) -> dict[str, float]:
    """One cloud, every phase; prints each figure as it is measured and returns them."""
    work = Path(tempfile.mkdtemp(prefix="stowage-bench-api-"))
    state = work / "state"
    schema = None
    holds = Holds(work / "holds" if args.holds else None)
    if holds.folder is not None:  # the cloud's processes tally their holds of the write lock
        os.environ[TALLY_ENV] = str(holds.folder)
    try:
        if args.production:
            cloud, schema = start_production(state, args, src)
        else:
            cloud = start(state, args.hosts, src, compute_process=compute_process)
    finally:
        os.environ.pop(TALLY_ENV, None)
    base = cloud.base
    profiles = Profiles(args.profile, cloud)
    threads = Threads(args.threads, cloud)
    figures: dict[str, float] = {}
    clients = load.procs * args.clients

    def say(text: str) -> None:
        print(f"[{label}] {text}", flush=True)

    def snapshot() -> tuple[dict[str, float], dict[str, float], float]:
        return cloud.cpu(), cloud.services_cpu(), machine_busy_s()

    def cpu_since(
        before: tuple[dict[str, float], dict[str, float], float], seconds: float, per: int
    ) -> tuple[float, float, float, str]:
        """Since `before`: Stowage's CPU seconds, the services' (PostgreSQL, RabbitMQ), the
        whole machine's busy seconds, and a line with each process kind's share."""
        own, services, busy = snapshot()
        used = {kind: own[kind] - before[0].get(kind, 0.0) for kind in own}
        served = {kind: services[kind] - before[1].get(kind, 0.0) for kind in services}
        parts = [
            f"{kind} {cpu / seconds:4.2f} cores ({cpu / per * 1e3:.2f} ms each)"
            for kind, cpu in (*used.items(), *served.items())
        ]
        machine = busy - before[2]
        parts.append(f"machine busy {machine / seconds:4.2f} of {os.cpu_count()} cores")
        return sum(used.values()), sum(served.values()), machine, "; ".join(parts)

    try:
        tok, project = token(base)
        headers = {"X-Auth-Token": tok, "OpenStack-API-Version": "compute 2.96"}
        quota = {"quota_set": {"instances": -1, "cores": -1, "ram": -1}}
        httpx.put(f"{base}/compute/v2.1/os-quota-sets/{project}", json=quota, headers=headers)
        image = httpx.get(f"{base}/image/v2/images", headers=headers).json()["images"][0]["id"]
        network = make_network(base, tok, project) if args.nics else None

        cpu0 = snapshot()
        get_s, get_lat, get_gen = drive(
            load, base, tok, "get", image, args.gets, args.clients, client=client
        )
        get_cpu, _, _, get_kinds = cpu_since(cpu0, get_s, args.gets)
        figures.update(
            get_rate=args.gets / get_s,
            get_p50_ms=pct(get_lat, 0.5) * 1e3,
            get_p99_ms=pct(get_lat, 0.99) * 1e3,
            get_server_cpu_ms=get_cpu / args.gets * 1e3,
        )
        say(
            f"trivial authenticated GET (GET /flavors/1), {clients} clients: "
            f"{figures['get_rate']:8.1f} req/s, p50 {figures['get_p50_ms']:6.1f} ms, "
            f"p99 {figures['get_p99_ms']:6.1f} ms; CPU {get_kinds}; load generator CPU "
            f"{get_gen / get_s:4.2f} cores"
        )

        def settled() -> bool:
            # The cheap look first: while a build is under way, reading and decoding every
            # instance ten times a second would load the database and this machine (6 ms of
            # PostgreSQL and 9 ms of this process a look at 2,000 servers), not the cloud's.
            if builds_under_way(cloud, args.servers):
                return False
            counts = statuses(cloud)
            return counts.get("ACTIVE", 0) + counts.get("ERROR", 0) >= args.servers

        holds.start()
        cpu0 = snapshot()
        profiles.start(label)
        threads.start()
        start_t = time.perf_counter()
        create_s, lat, create_gen = drive(
            load, base, tok, "create", image, args.servers, args.clients, network, client
        )
        create_cpu, _, _, create_kinds = cpu_since(cpu0, create_s, args.servers)
        create_threads = threads.report(create_s)
        threads.start()
        until(settled, 900)
        total_s = time.perf_counter() - start_t
        boot_cpu, boot_services, boot_machine, boot_kinds = cpu_since(cpu0, total_s, args.servers)
        rest_threads = threads.report(total_s - create_s)
        held = holds.report(total_s, args.servers)
        profiles.stop(say, label)
        counts = statuses(cloud)
        refused = sum(1 for x in lat if x < 0)
        figures.update(
            create_rate=args.servers / create_s,
            create_p50_ms=pct(lat, 0.5) * 1e3,
            create_p99_ms=pct(lat, 0.99) * 1e3,
            create_server_cpu_ms=create_cpu / args.servers * 1e3,
            boots_per_s=args.servers / total_s,
            boot_server_cpu_ms=boot_cpu / args.servers * 1e3,
            boot_cores=boot_cpu / total_s,
            boot_machine_cores=boot_machine / total_s,
            errors=float(counts.get("ERROR", 0)),
        )
        if cloud.services:  # production: PostgreSQL and RabbitMQ on this machine
            figures["boot_services_cpu_ms"] = boot_services / args.servers * 1e3
        say(
            f"creates answered, {clients} clients: {figures['create_rate']:8.1f} req/s, "
            f"p50 {figures['create_p50_ms']:6.1f} ms, p99 {figures['create_p99_ms']:6.1f} ms, "
            f"{refused} refused; CPU {create_kinds}; "
            f"load generator CPU {create_gen / create_s:4.2f} cores"
        )
        if create_threads:
            say(f"stowage up's threads while creating: {create_threads}")
            say(f"stowage up's threads after the creates, until settled: {rest_threads}")
        say(
            f"boots to a settled state: {figures['boots_per_s']:8.1f} boots/s "
            f"({total_s:.1f} s; {counts}); CPU {boot_kinds}; all of it "
            f"{figures['boot_cores']:4.2f} cores, {figures['boot_server_cpu_ms']:.1f} ms per boot"
        )
        for line in held:
            say(line)

        best = float("inf")
        for _ in range(3):  # the best of three: the machine is shared
            start_t = time.perf_counter()
            listed = httpx.get(f"{base}/compute/v2.1/servers/detail", headers=headers, timeout=300)
            best = min(best, time.perf_counter() - start_t)
        figures["detail_ms"] = best * 1e3
        say(
            f"GET /servers/detail of {len(listed.json()['servers'])} servers: "
            f"{figures['detail_ms']:8.1f} ms (best of 3)"
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

        def migration_statuses() -> collections.Counter[str]:
            with cloud.engine.connect() as conn:
                rows = conn.execute(text("SELECT body FROM objects WHERE kind = 'migration'"))
                return collections.Counter(json.loads(b)["status"] for (b,) in rows)

        def migrated() -> bool:
            done = migration_statuses()
            return sum(done.values()) >= len(moving) and all(s in _ENDED for s in done)

        until(migrated, 600)
        migrate_s = time.perf_counter() - start_t
        ended = migration_statuses()
        # A migration that has not ended when the wait gives up counts, and shows, as such.
        figures["migrations_unended"] = len(moving) - sum(
            n for s, n in ended.items() if s in _ENDED
        )
        figures["migrations_per_s"] = (len(moving) - figures["migrations_unended"]) / migrate_s
        say(
            f"live migrations to completed: {figures['migrations_per_s']:8.1f} /s "
            f"({len(moving)} in {migrate_s:.1f} s; {dict(ended)}; "
            f"{figures['migrations_unended']} not ended)"
        )
    finally:
        cloud.stop()
        if schema is not None:
            drop_schema(args.pg_url, schema)
    if args.production:
        claims_schema, claims_url = new_schema(args.pg_url, "bench_claims")
        try:
            rate = claim_rate(args.hosts, min(args.servers, 5000), claims_url)
        finally:
            drop_schema(args.pg_url, claims_schema)
    else:
        rate = claim_rate(args.hosts, min(args.servers, 5000), f"sqlite:///{work / 'claims.db'}")
    figures["claim_rate"] = rate
    say(f"scheduler + ledger alone, same hosts and database: {rate:8.1f} placements/s")
    say(
        f"the API keeps {figures['boots_per_s'] / rate * 100:5.1f}% of the claim rate and "
        f"{figures['boots_per_s'] / figures['get_rate'] * 100:5.1f}% of the trivial GET's; "
        f"{statistics.mean(x for x in lat if x >= 0) * 1e3:.1f} ms mean create latency"
    )
    return figures


_ENDED = frozenset({"completed", "failed", "error", "cancelled"})
"""The statuses of a migration that has ended."""

_ROWS = (
    ("trivial GET req/s", "get_rate", "{:.1f}"),
    ("trivial GET p99 ms", "get_p99_ms", "{:.1f}"),
    ("stowage CPU ms per trivial GET", "get_server_cpu_ms", "{:.2f}"),
    ("creates answered /s", "create_rate", "{:.1f}"),
    ("create p50 ms", "create_p50_ms", "{:.1f}"),
    ("create p99 ms", "create_p99_ms", "{:.1f}"),
    ("stowage CPU ms per create request", "create_server_cpu_ms", "{:.2f}"),
    ("boots/s to ACTIVE or ERROR", "boots_per_s", "{:.1f}"),
    ("stowage CPU ms per boot (all of it)", "boot_server_cpu_ms", "{:.1f}"),
    ("stowage CPU cores busy while booting", "boot_cores", "{:.2f}"),
    ("services' CPU ms per boot (PostgreSQL, RabbitMQ)", "boot_services_cpu_ms", "{:.1f}"),
    ("machine cores busy while booting", "boot_machine_cores", "{:.2f}"),
    ("servers in ERROR", "errors", "{:.0f}"),
    ("GET /servers/detail ms", "detail_ms", "{:.1f}"),
    ("live migrations/s", "migrations_per_s", "{:.1f}"),
    ("live migrations not ended", "migrations_unended", "{:.0f}"),
    ("scheduler + ledger placements/s", "claim_rate", "{:.0f}"),
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--servers", type=int, default=1000)
    parser.add_argument("--hosts", type=int, default=20)
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--migrations", type=int, default=100)
    parser.add_argument("--gets", type=int, default=2000)
    parser.add_argument(
        "--before-src",
        type=Path,
        help="another checkout's src/ directory: measure it first, then this one, and "
        "print both side by side",
    )
    parser.add_argument(
        "--nics",
        action="store_true",
        help="every server with a port on one network (a /16), instead of none",
    )
    parser.add_argument(
        "--production",
        action="store_true",
        help="the production processes on PostgreSQL and RabbitMQ instead of stowage up",
    )
    parser.add_argument("--api-workers", type=int, default=1)
    parser.add_argument("--conductors", type=int, default=1)
    parser.add_argument(
        "--pg-url", default="postgresql+psycopg://postgres@127.0.0.1/test", help="--production"
    )
    parser.add_argument("--bus", default="amqp://guest:guest@127.0.0.1:5672/", help="--production")
    parser.add_argument(
        "--threads",
        action="store_true",
        help="print stowage up's CPU by kind of thread (API loop, API handlers, compute loop, "
        "executors) while creating and after, until settled (needs py-spy for the names)",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        help="record a py-spy profile of each process kind during the creates into this folder",
    )
    parser.add_argument(
        "--holds",
        action="store_true",
        help="print, for each process, how long it held SQLite's write lock while booting, "
        "how much of that its holding thread was on a core, and where (stowage up)",
    )
    parser.add_argument(
        "--compute-process",
        choices=("off", "on", "both"),
        default="off",
        help="stowage up --compute-process (on) or --no-compute-process (off, the default "
        "here, as the figures before 2026-12-06 were taken); or both: this checkout in one "
        "process, then with --compute-process, side by side",
    )
    parser.add_argument(
        "--load-client",
        choices=("plain", "httpx", "both"),
        default="plain",
        help="the load generator's HTTP client: the standard library's http.client (plain, "
        "the default since session 24), httpx (before), or both: this checkout driven by "
        "httpx, then by http.client, side by side",
    )
    args = parser.parse_args()
    alone = args.before_src is None and args.compute_process != "both"
    if args.load_client == "both" and not alone:
        parser.error("--load-client both compares two runs of this checkout: nothing else")
    if args.threads and args.compute_process != "off":
        parser.error("--threads reads one process's threads: not with --compute-process")
    if args.compute_process == "both" and args.before_src is not None:
        parser.error("--compute-process both compares two runs of this checkout: no --before-src")
    if args.threads and args.production:
        parser.error("--threads reads stowage up's threads; with --production use --profile")
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the start", flush=True)
    load = Load(args.procs)
    try:
        # Each side: its label, its source tree (None: this checkout), whether split, and
        # the load generator's client.
        sides: list[tuple[str, Path | None, bool, str]]
        split = args.compute_process == "on"
        client = "plain" if args.load_client == "both" else args.load_client
        if args.compute_process == "both":
            sides = [("one process", None, False, client), ("compute process", None, True, client)]
        elif args.load_client == "both":
            sides = [("httpx", None, split, "httpx"), ("http.client", None, split, "plain")]
        else:
            sides = []
            if args.before_src:
                sides.append(("before", args.before_src.resolve(), split, client))
            sides.append(("after" if sides else "this", None, split, client))
        runs = [
            (label, run(args, load, label, src, compute_process=split, client=client))
            for label, src, split, client in sides
        ]
    finally:
        load.close()
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    print("| figure | " + " | ".join(label for label, _ in runs) + " |")
    print("|---|" + "---:|" * len(runs))
    for name, key, fmt in _ROWS:
        cells = [fmt.format(figures[key]) if key in figures else "-" for _, figures in runs]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
