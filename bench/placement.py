"""Placement benchmark: simulated hosts, a realistic flavor mix, SQLite and PostgreSQL.

Builds N simulated hosts (2 NUMA cells x 16 cores x 2 threads each) and places instances
through `stowage.services.scheduler.Scheduler.schedule` in batches, with 30% of requests on
dedicated (pinned) flavors and 20% members of anti-affinity groups, using 1 or more
scheduler processes against one database. In the same run, on the same database server
and schema, it measures a bare SQL claim loop (one transaction and one commit per claim)
as the baseline. After every run it audits the ledger.

Run `.venv/bin/python bench/placement.py --help`; bench/README.md explains each figure.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.util
import inspect
import json
import math
import multiprocessing as mp
import os
import platform
import queue as queue_mod
import random
import resource
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from alembic import command
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, make_url, text

from stowage.domain.flavor import Flavor, InstanceShape, ThreadPolicy, shape_of
from stowage.domain.groups import parse_group
from stowage.domain.topology import HostSpec, HostTopology, ResourceClass
from stowage.ledger.audit import audit
from stowage.ledger.db import alembic_config
from stowage.ledger.ledger import Ledger
from stowage.scheduling.filters import default_filters
from stowage.scheduling.framework import Request
from stowage.scheduling.pipeline import Pipeline
from stowage.services.scheduler import Scheduler

# -- the simulated cloud -----------------------------------------------------------------

CELLS = 2
CORES_PER_CELL = 16
THREADS_PER_CORE = 2
MEMORY_MB_PER_CELL = 262_144  # 512 GiB a host: memory never binds before CPUs do
HOST_DISK_GB = 4_000
RACKS = 20  # hosts carry a rack label; some groups spread over racks
REGISTER_CHUNK = 500  # hosts per register_hosts call (one transaction each)
GROUP_SIZE = 10
DEDICATED_SHARE = 0.30
MEMBER_SHARE = 0.20
RACK_GROUP_SHARE = 0.25  # of the anti-affinity groups, this share spreads over racks
# Simulated hosts send no heartbeats; the compute filter must not call them down mid-run.
SERVICE_DOWN_TIME_S = 7 * 86_400.0
BARRIER_TIMEOUT_S = 900.0
PROGRESS_S = 30.0  # a scheduler process reports how far it got this often
TEMPLATE = "stowage_bench_tpl"

# (name, vCPUs, RAM MB, disk GB, extra specs, weight within its kind)
SHARED_FLAVORS: list[tuple[str, int, int, int, dict[str, str], int]] = [
    ("m1.tiny", 1, 1024, 10, {}, 2),
    ("m1.small", 1, 2048, 20, {}, 4),
    ("m1.medium", 2, 4096, 40, {}, 4),
    ("m1.large", 4, 8192, 40, {}, 2),
    ("r1.medium", 2, 8192, 40, {}, 1),
]
DEDICATED_FLAVORS: list[tuple[str, int, int, int, dict[str, str], int]] = [
    ("p1.small", 1, 2048, 20, {"hw:cpu_policy": "dedicated"}, 3),
    ("p1.medium", 2, 4096, 40, {"hw:cpu_policy": "dedicated"}, 4),
    ("p1.large", 4, 8192, 40, {"hw:cpu_policy": "dedicated"}, 2),
    (
        "p1.isolated",
        2,
        4096,
        40,
        {"hw:cpu_policy": "dedicated", "hw:cpu_thread_policy": "isolate"},
        1,
    ),
]


def flavors() -> list[Flavor]:
    """Shared flavors first, then dedicated ones; indices are stable."""
    return [
        Flavor(name=n, vcpus=v, memory_mb=m, disk_gb=d, extra_specs=s, id=n)
        for n, v, m, d, s, _ in SHARED_FLAVORS + DEDICATED_FLAVORS
    ]


def host_specs(count: int) -> list[HostSpec]:
    topology = HostTopology.uniform(
        cells=CELLS,
        cores_per_cell=CORES_PER_CELL,
        threads_per_core=THREADS_PER_CORE,
        memory_mb_per_cell=MEMORY_MB_PER_CELL,
    )
    per_rack = max(1, math.ceil(count / RACKS))
    return [
        HostSpec(
            name=f"cn{i:05d}",
            topology=topology,
            disk_gb=HOST_DISK_GB,
            labels={"rack": f"r{i // per_rack:02d}"},
        )
        for i in range(count)
    ]


@dataclass(slots=True)
class Workload:
    """The request stream: (instance id, flavor index, group index or -1), in arrival order."""

    items: list[tuple[str, int, int]]
    groups: list[str]
    rack_groups: frozenset[int]


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


IDS = ("api", "uuid4")
"""How the instances' ids are made: `api` as the compute API makes a server's
(`stowage.domain.ids`: time-ordered, the bench's clock one millisecond per
`_IDS_PER_MS` requests from 2026-01-01), or `uuid4`, random as the API made them before
(and as the bench did until session 15)."""
_IDS_PER_MS = 4
_IDS_FROM_MS = 1_767_225_600_000


def _this_checkouts_ids() -> Any:
    """`stowage.domain.ids` of this checkout, also in a process importing stowage from
    --before-src (whose tree may not have it): both sides get the same stream."""
    path = Path(__file__).resolve().parents[1] / "src" / "stowage" / "domain" / "ids.py"
    spec = importlib.util.spec_from_file_location("_bench_stowage_ids", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


time_ordered = _this_checkouts_ids().time_ordered


def _instance_id(rng: random.Random, ids: str, n: int) -> str:
    if ids == "uuid4":
        return _uuid(rng)
    return str(time_ordered(_IDS_FROM_MS + n // _IDS_PER_MS, rng.getrandbits(128)))


def make_workload(seed: int, instances: int, ids: str = "api") -> Workload:
    """Deterministic from the seed, so every process rebuilds the same stream.

    Exactly 30% of requests use a dedicated flavor and 20% are anti-affinity members, in
    groups of ten arriving together (a multi-create), at random places in the stream. The
    random draws are the same whatever `ids` is: only the instances' ids differ.
    """
    rng = random.Random(seed)
    members = round(instances * MEMBER_SHARE)
    n_groups = math.ceil(members / GROUP_SIZE)
    blocks: list[tuple[int, int]] = []
    left = members
    for g in range(n_groups):
        size = min(GROUP_SIZE, left)
        left -= size
        blocks.append((g, size))
    blocks += [(-1, 1)] * (instances - members)
    rng.shuffle(blocks)
    dedicated = [True] * round(instances * DEDICATED_SHARE)
    dedicated += [False] * (instances - len(dedicated))
    rng.shuffle(dedicated)
    shared_idx = list(range(len(SHARED_FLAVORS)))
    shared_w = [f[5] for f in SHARED_FLAVORS]
    ded_idx = [len(SHARED_FLAVORS) + i for i in range(len(DEDICATED_FLAVORS))]
    ded_w = [f[5] for f in DEDICATED_FLAVORS]
    items: list[tuple[str, int, int]] = []
    for group, size in blocks:
        for _ in range(size):
            if dedicated[len(items)]:
                flavor = rng.choices(ded_idx, ded_w)[0]
            else:
                flavor = rng.choices(shared_idx, shared_w)[0]
            items.append((_instance_id(rng, ids, len(items)), flavor, group))
    groups = [_uuid(rng) for _ in range(n_groups)]
    rack_groups = frozenset(rng.sample(range(n_groups), round(n_groups * RACK_GROUP_SHARE)))
    return Workload(items, groups, rack_groups)


def share(total: int, procs: int, index: int) -> tuple[int, int]:
    """Process `index`'s contiguous slice of the request stream."""
    return total * index // procs, total * (index + 1) // procs


def demand_per_host(instances: int, hosts: int) -> dict[str, float]:
    """Rough average demand per host against capacity, to warn before a run cannot fit."""
    fl = flavors()
    shapes = [shape_of(f) for f in fl]
    shared_w = sum(f[5] for f in SHARED_FLAVORS)
    ded_w = sum(f[5] for f in DEDICATED_FLAVORS)
    per = instances / max(hosts, 1)
    vcpu = pcpu = 0.0
    for i, (_, _, _, _, _, w) in enumerate(SHARED_FLAVORS):
        vcpu += (1 - DEDICATED_SHARE) * w / shared_w * shapes[i].vcpus
    for j, (_, _, _, _, specs, w) in enumerate(DEDICATED_FLAVORS):
        s = shapes[len(SHARED_FLAVORS) + j]
        factor = 2 if specs.get("hw:cpu_thread_policy") == "isolate" else 1
        pcpu += DEDICATED_SHARE * w / ded_w * s.vcpus * factor
    spec = host_specs(1)[0]
    return {
        "VCPU": per * vcpu / spec.capacity(ResourceClass.VCPU),
        "PCPU": per * pcpu / spec.capacity(ResourceClass.PCPU),
    }


# -- databases ---------------------------------------------------------------------------


class Databases:
    """Fresh databases for one backend: a template with hosts and groups, copied per run."""

    def __init__(
        self, backend: str, pg_admin_url: str, workdir: Path, template_dir: Path | None = None
    ) -> None:
        self.backend = backend
        self.pg_admin_url = pg_admin_url
        self.workdir = workdir
        # With --template, templates live (SQLite files) or stay (PostgreSQL) between runs.
        self.template_dir = template_dir
        self._made: set[str] = set()

    def _file(self, name: str) -> Path:
        if self.template_dir is not None and name.startswith(TEMPLATE):
            return self.template_dir / name
        return self.workdir / name

    def url(self, name: str) -> str:
        if self.backend == "sqlite":
            return f"sqlite:///{self._file(name + '.db')}"
        return make_url(self.pg_admin_url).set(database=name).render_as_string(hide_password=False)

    def exists(self, name: str) -> bool:
        if self.backend == "sqlite":
            return self._file(name + ".db").exists()
        engine = self._admin()
        with engine.connect() as conn:
            found = conn.execute(
                text("SELECT 1 FROM pg_database WHERE datname = :name"), {"name": name}
            ).scalar()
        engine.dispose()
        return found is not None

    def _admin(self) -> Any:
        url = self.pg_admin_url
        if url.startswith("postgresql://"):
            url = "postgresql+psycopg://" + url[len("postgresql://") :]
        return create_engine(url, isolation_level="AUTOCOMMIT")

    def drop(self, name: str) -> None:
        if self.backend == "sqlite":
            for suffix in (".db", ".db-wal", ".db-shm"):
                self._file(name + suffix).unlink(missing_ok=True)
        else:
            engine = self._admin()
            with engine.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            engine.dispose()
        self._made.discard(name)

    def create(self, name: str, template: str | None = None) -> str:
        """Drop and recreate `name`, empty or as a copy of `template`; returns its URL."""
        self.drop(name)
        if self.backend == "sqlite":
            if template is not None:
                src = sqlite3.connect(self._file(template + ".db"))
                dst = sqlite3.connect(self._file(name + ".db"))
                with dst:
                    src.backup(dst)
                src.close()
                dst.close()
        else:
            engine = self._admin()
            with engine.connect() as conn:
                clause = f' TEMPLATE "{template}"' if template else ""
                conn.execute(text(f'CREATE DATABASE "{name}"{clause}'))
            engine.dispose()
        self._made.add(name)
        return self.url(name)

    def drop_all(self) -> None:
        for name in list(self._made):
            self.drop(name)

    def template(self, hosts: int, workload: Workload, say: Any) -> tuple[str, dict[str, float]]:
        """The template database for `hosts` and the workload's groups, and its build timings.

        With --template, a template built earlier for the same cloud is reused (its timings
        are then empty) and a new one is kept for the next run.
        """
        if self.template_dir is None:
            url = self.create(TEMPLATE)
            return TEMPLATE, build_template(url, hosts, workload, say)
        # The name says what the template holds: a different cloud gets a different one.
        shape = [CELLS, CORES_PER_CELL, THREADS_PER_CORE, MEMORY_MB_PER_CELL, HOST_DISK_GB, RACKS]
        cloud = json.dumps([*shape, hosts, workload.groups, sorted(workload.rack_groups)])
        name = f"{TEMPLATE}_{hosts}h_{hashlib.sha256(cloud.encode()).hexdigest()[:12]}"
        if self.exists(name):
            say(f"  reusing the template {name} in {self.template_dir or self.pg_admin_url}")
            Ledger.open(self.url(name)).close()  # brings its schema up to date
            return name, {}
        url = self.create(name)
        self._made.discard(name)  # kept, even when the build fails half way
        try:
            return name, build_template(url, hosts, workload, say)
        except BaseException:
            self.drop(name)
            raise

    def settings(self) -> dict[str, str]:
        if self.backend == "sqlite":
            return {
                "sqlite_version": sqlite3.sqlite_version,
                "journal_mode": "wal",
                "synchronous": "normal",
            }
        engine = self._admin()
        out = {}
        with engine.connect() as conn:
            out["server_version"] = str(conn.execute(text("SHOW server_version")).scalar())
            for name in ("fsync", "synchronous_commit", "commit_delay", "shared_buffers"):
                out[name] = str(conn.execute(text(f"SHOW {name}")).scalar())
        engine.dispose()
        return out


def build_template(url: str, hosts: int, workload: Workload, say: Any) -> dict[str, float]:
    """Hosts and groups through the ledger's own API; returns timings."""
    t0 = time.monotonic()
    ledger = Ledger.open(url)
    specs = host_specs(hosts)
    t_specs = time.monotonic()
    reported = t_specs
    for start in range(0, len(specs), REGISTER_CHUNK):
        ledger.register_hosts(specs[start : start + REGISTER_CHUNK])
        if time.monotonic() - reported >= PROGRESS_S:
            reported = time.monotonic()
            say(f"  registered {start + REGISTER_CHUNK:,} of {hosts:,} hosts")
    t1 = time.monotonic()
    for i, group_id in enumerate(workload.groups):
        rules: dict[str, object] = {}
        if i in workload.rack_groups:
            rules = {"failure_domain": "rack", "max_server_per_host": 1}
        ledger.create_group(
            parse_group(group_id, f"aa-{i}", "anti-affinity", rules, project_id="bench")
        )
    t2 = time.monotonic()
    ledger.close()
    return {
        "open_and_specs_s": t_specs - t0,
        "register_hosts_s": t1 - t_specs,
        "create_groups_s": t2 - t1,
    }


# -- the stowage run ---------------------------------------------------------------------


@functools.cache
def _flavor_shapes() -> tuple[list[Flavor], list[InstanceShape]]:
    fl = flavors()
    return fl, [shape_of(f) for f in fl]


def _requests(workload: Workload, lo: int, hi: int) -> list[Request]:
    fl, shapes = _flavor_shapes()
    out = []
    for instance_id, flavor, group in workload.items[lo:hi]:
        out.append(
            Request(
                consumer_id=instance_id,
                instance_id=instance_id,
                shape=shapes[flavor],
                project_id="bench",
                user_id="bench",
                group_id=workload.groups[group] if group >= 0 else None,
                extra_specs=fl[flavor].extra_specs,
            )
        )
    return out


def _rss_mib() -> float:
    """The resident set now, from /proc (Linux)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 1048576.0


def _peak_rss_mib() -> float:
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _stowage_worker(
    index: int,
    procs: int,
    url: str,
    seed: int,
    ids: str,
    instances: int,
    batch: int,
    shard: bool,
    freeze_view: bool,
    barrier: Any,
    results: Any,
) -> None:
    try:
        ledger = Ledger.open(url, upgrade=False)
        workload = make_workload(seed, instances, ids)
        lo, hi = share(instances, procs, index)
        rng = random.Random(seed * 1000 + index)
        pipeline = Pipeline(
            filters=default_filters(SERVICE_DOWN_TIME_S),
            rng=rng,
            shard=(index, procs) if shard and procs > 1 else None,
        )
        options: dict[str, Any] = {}
        if freeze_view and "freeze_view" in inspect.signature(Scheduler).parameters:
            # The view out of the cyclic collector's reach; an older --before-src lacks it.
            options["freeze_view"] = True
        scheduler = Scheduler(ledger, pipeline=pipeline, batch_max=batch, **options)
        rss_before_view = _rss_mib()
        t_view = time.monotonic()
        scheduler.current_view()
        view_s = time.monotonic() - t_view
        view_mib = _rss_mib() - rss_before_view
        barrier.wait(BARRIER_TIMEOUT_S)
        start = time.monotonic()
        cpu_start = time.process_time()
        latencies: list[tuple[float, int]] = []
        placed = 0
        refused: Counter[str] = Counter()
        retried = 0
        reported = start
        for b in range(lo, hi, batch):
            # Built per batch, so the measured memory is the scheduler's, not the input's.
            chunk = _requests(workload, b, min(b + batch, hi))
            t0 = time.monotonic()
            placements = scheduler.schedule(chunk)
            latencies.append((time.monotonic() - t0, len(chunk)))
            for p in placements:
                if p.ok:
                    placed += 1
                else:
                    refused[str(p.code)] += 1
                retried += p.attempts > 1
            if time.monotonic() - reported >= PROGRESS_S:
                reported = time.monotonic()
                done = b + len(chunk) - lo
                print(
                    f"  [process {index}] {done:,} of {hi - lo:,} requests, {placed:,} placed, "
                    f"{done / (reported - start):,.0f}/s, "
                    f"{(time.process_time() - cpu_start) / done * 1e6:.0f} us CPU each, "
                    f"RSS {_rss_mib():,.0f} MiB, load {os.getloadavg()[0]:.1f}",
                    file=sys.stderr,
                    flush=True,
                )
        end = time.monotonic()
        cpu_s = time.process_time() - cpu_start
        results.put(
            {
                "index": index,
                "requested": hi - lo,
                "cpu_s": cpu_s,
                "stowage": str(Path(sys.modules[Scheduler.__module__].__file__ or "").parents[2]),
                "view_mib": view_mib,
                "placed": placed,
                "refused": dict(refused),
                "conflicts": scheduler.conflicts,
                "retried": retried,
                "start": start,
                "end": end,
                "view_load_s": view_s,
                "latencies": latencies,
                "peak_rss_mib": _peak_rss_mib(),
            }
        )
        ledger.close()
    except BaseException:
        barrier.abort()
        results.put({"index": index, "error": traceback.format_exc()})


def _run_processes(target: Any, procs: int, args: tuple[Any, ...]) -> list[dict[str, Any]]:
    """Start `procs` spawned workers together and collect one result dict from each."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(procs)
    results = ctx.Queue()
    workers = [
        ctx.Process(target=target, args=(i, procs, *args, barrier, results), daemon=True)
        for i in range(procs)
    ]
    for w in workers:
        w.start()
    out: list[dict[str, Any]] = []
    try:
        while len(out) < procs:
            try:
                out.append(results.get(timeout=5.0))
            except queue_mod.Empty:
                dead = [w for w in workers if not w.is_alive() and w.exitcode not in (0, None)]
                if dead:
                    raise RuntimeError(f"a worker died with exit code {dead[0].exitcode}") from None
        for w in workers:
            w.join(60)
    finally:
        for w in workers:
            if w.is_alive():
                w.terminate()
                w.join(10)
    errors = [r["error"] for r in out if "error" in r]
    if errors:
        raise RuntimeError("a worker failed:\n" + errors[0])
    return sorted(out, key=lambda r: r["index"])


def weighted_percentile(pairs: Sequence[tuple[float, int]], q: float) -> float:
    """The value below which a share `q` of the weight lies (each pair is value, weight)."""
    items = sorted(pairs)
    total = sum(w for _, w in items)
    if not total:
        return float("nan")
    target = q * total
    acc = 0
    for value, weight in items:
        acc += weight
        if acc >= target:
            return value
    return items[-1][0]


# -- the bare SQL baseline ---------------------------------------------------------------


def _baseline_amounts(shape: InstanceShape) -> dict[str, int]:
    amounts = {rc.value: n for rc, n in shape.amounts().items()}
    if shape.dedicated_vcpus and shape.thread_policy is ThreadPolicy.ISOLATE:
        amounts[ResourceClass.PCPU.value] = 2 * len(shape.dedicated_vcpus)
    return amounts


def _baseline_worker(
    index: int,
    procs: int,
    backend: str,
    url: str,
    seed: int,
    ids: str,
    claims: int,
    barrier: Any,
    results: Any,
) -> None:
    """One transaction and one commit per claim, with plain SQL on the ledger's own tables.

    Hosts are split between processes and taken round robin; pCPUs are taken in order from
    a per-host list, so no claim collides. Only the writes a claim needs at the least: the
    consumer, a guarded usage update per resource class, the allocations, the pins.
    """
    try:
        workload = make_workload(seed, claims, ids)
        lo, hi = share(claims, procs, index)
        shapes = [shape_of(f) for f in flavors()]
        items = workload.items[lo:hi]
        del workload
        if backend == "sqlite":
            conn: Any = sqlite3.connect(make_url(url).database or "", timeout=60.0)
            conn.isolation_level = None
            for pragma in (
                "PRAGMA journal_mode=WAL",
                "PRAGMA synchronous=NORMAL",
                "PRAGMA foreign_keys=ON",
                "PRAGMA busy_timeout=60000",
            ):
                conn.execute(pragma)
            ph, begin = "?", "BEGIN IMMEDIATE"
        else:
            import psycopg

            dsn = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
            conn = psycopg.connect(dsn, autocommit=True)
            ph, begin = "%s", "BEGIN"
        cur = conn.cursor()
        cur.execute("SELECT host_id, cpu_id FROM pcpus WHERE dedicated ORDER BY host_id, cpu_id")
        free: dict[int, list[int]] = {}
        for host_id, cpu in cur.fetchall():
            free.setdefault(host_id, []).append(cpu)
        mine = sorted(free)[index::procs]
        for host_id in mine:
            free[host_id].reverse()  # pop() from the end takes the lowest id first
        ins_consumer = (
            "INSERT INTO consumers (id, kind, instance_id, project_id, user_id, host_id, "
            f"generation, created_at) VALUES ({ph}, 'instance', {ph}, 'bench', 'bench', "
            f"{ph}, 0, {ph}) RETURNING seq"
        )
        use = (
            f"UPDATE inventories SET used = used + {ph} WHERE host_id = {ph} "
            f"AND resource_class = {ph} AND used + {ph} <= (total - reserved) * allocation_ratio"
        )
        ins_alloc = (
            "INSERT INTO allocations (consumer_seq, host_id, resource_class, amount) "
            f"VALUES ({ph}, {ph}, {ph}, {ph})"
        )
        ins_pin = (
            "INSERT INTO pins (host_id, cpu_id, consumer_seq, guest_vcpu, dedicated) "
            f"VALUES ({ph}, {ph}, {ph}, {ph}, {'1' if backend == 'sqlite' else 'true'})"
        )
        barrier.wait(BARRIER_TIMEOUT_S)
        start = time.monotonic()
        done = refused = 0
        for n, (instance_id, flavor, _group) in enumerate(items):
            host_id = mine[n % len(mine)]
            amounts = _baseline_amounts(shapes[flavor])
            pcpu = amounts.get(ResourceClass.PCPU.value, 0)
            if pcpu > len(free[host_id]):
                refused += 1
                continue
            cur.execute(begin)
            ok = True
            cur.execute(ins_consumer, (instance_id, instance_id, host_id, time.time()))
            (seq,) = cur.fetchone()
            for rc, amount in sorted(amounts.items()):
                cur.execute(use, (amount, host_id, rc, amount))
                if cur.rowcount != 1:
                    ok = False
                    break
            if ok:
                cur.executemany(ins_alloc, [(seq, host_id, rc, a) for rc, a in amounts.items()])
                if pcpu:
                    taken = [free[host_id].pop() for _ in range(pcpu)]
                    vcpus = len(shapes[flavor].dedicated_vcpus)
                    cur.executemany(
                        ins_pin,
                        [
                            (host_id, cpu, seq, i if i < vcpus else None)
                            for i, cpu in enumerate(taken)
                        ],
                    )
                cur.execute("COMMIT")
                done += 1
            else:
                cur.execute("ROLLBACK")
                refused += 1
        end = time.monotonic()
        conn.close()
        results.put(
            {
                "index": index,
                "claims": done,
                "refused": refused,
                "start": start,
                "end": end,
                "peak_rss_mib": _peak_rss_mib(),
            }
        )
    except BaseException:
        barrier.abort()
        results.put({"index": index, "error": traceback.format_exc()})


# -- one configuration -------------------------------------------------------------------


@dataclass(slots=True)
class RunResult:
    backend: str
    hosts: int
    procs: int
    instances: int
    batch: int
    code: str = "this"  # "before" (--before-src) or "after"; "this" without --before-src
    load_start: float = 0.0  # the machine's 1-minute load average around the placement phase
    load_end: float = 0.0
    cpu_us_per_claim: float = 0.0  # CPU time of the scheduler processes per placed instance
    view_mib: float = 0.0  # resident memory the initial view added (largest process)
    placed: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    conflicts: int = 0
    retried: int = 0
    wall_s: float = 0.0
    placements_per_s: float = 0.0
    latency_p50_ms: float = 0.0
    latency_p99_ms: float = 0.0
    latency_max_ms: float = 0.0
    amortized_us_per_claim: float = 0.0
    peak_rss_mib_per_proc: list[float] = field(default_factory=list)
    peak_rss_mib: float = 0.0
    view_load_s: float = 0.0
    setup: dict[str, float] = field(default_factory=dict)
    ledger_placed: int = 0
    audit_violations: int = 0
    audit_sample: list[str] = field(default_factory=list)
    audit_s: float = 0.0
    baseline_claims: int = 0
    baseline_refused: int = 0
    baseline_wall_s: float = 0.0
    baseline_per_s: float = 0.0
    baseline_audit_violations: int = 0
    ratio: float = 0.0

    @property
    def clean(self) -> bool:
        return self.audit_violations == 0 and self.ledger_placed == self.placed


def _audit(url: str) -> tuple[list[str], int, float]:
    t0 = time.monotonic()
    ledger = Ledger.open(url, upgrade=False)
    try:
        violations = [str(v) for v in audit(ledger)]
        with ledger.engine.connect() as conn:
            placed = conn.execute(
                text("SELECT count(*) FROM consumers WHERE host_id IS NOT NULL")
            ).scalar_one()
    finally:
        ledger.close()
    return violations, int(placed), time.monotonic() - t0


def _head_of(src: Path) -> str:
    """The newest schema revision the code in `src` (another checkout's `src/`) knows."""
    head = ScriptDirectory(str(src / "stowage" / "ledger" / "migrations")).get_current_head()
    assert head is not None
    return head


def run_config(
    dbs: Databases,
    template: str,
    setup: dict[str, float],
    hosts: int,
    procs: int,
    args: argparse.Namespace,
    say: Any,
    *,
    code: str = "this",
    src: Path | None = None,
    baseline: bool = True,
) -> RunResult:
    """One configuration: place, audit, then (unless `baseline` is false) the bare SQL loop.

    With `src` (another checkout's `src/`), the scheduler processes import stowage from it:
    spawned processes take the parent's `sys.path` when they start.
    """
    res = RunResult(
        dbs.backend, hosts, procs, args.instances, args.batch, code=code, setup=dict(setup)
    )
    t0 = time.monotonic()
    url = dbs.create("stowage_bench_run", template)
    res.setup["copy_template_s"] = time.monotonic() - t0
    if src is not None:
        # The template has this checkout's schema: the copy goes back to what `src` knows.
        command.downgrade(alembic_config(url), _head_of(src))
    say(f"  [{code}] placing {args.instances} instances with {procs} scheduler process(es)...")
    res.load_start = os.getloadavg()[0]
    if src is not None:
        sys.path.insert(0, str(src))
    try:
        out = _run_processes(
            _stowage_worker,
            procs,
            (url, args.seed, args.ids, args.instances, args.batch, args.shard, args.freeze_view),
        )
    finally:
        if src is not None:
            sys.path.remove(str(src))
    res.load_end = os.getloadavg()[0]
    say(f"  [{code}] stowage imported from {out[0]['stowage']}")
    res.placed = sum(r["placed"] for r in out)
    refused: Counter[str] = Counter()
    for r in out:
        refused.update(r["refused"])
    res.refused = dict(refused)
    res.conflicts = sum(r["conflicts"] for r in out)
    res.retried = sum(r["retried"] for r in out)
    res.wall_s = max(r["end"] for r in out) - min(r["start"] for r in out)
    res.placements_per_s = res.placed / res.wall_s if res.wall_s > 0 else 0.0
    pairs = [tuple(p) for r in out for p in r["latencies"]]
    res.latency_p50_ms = weighted_percentile(pairs, 0.50) * 1000
    res.latency_p99_ms = weighted_percentile(pairs, 0.99) * 1000
    res.latency_max_ms = max((p[0] for p in pairs), default=0.0) * 1000
    busy = sum(p[0] for p in pairs)
    res.amortized_us_per_claim = busy / max(1, sum(p[1] for p in pairs)) * 1e6
    res.peak_rss_mib_per_proc = [round(r["peak_rss_mib"], 1) for r in out]
    res.peak_rss_mib = max(res.peak_rss_mib_per_proc)
    res.view_load_s = max(r["view_load_s"] for r in out)
    res.view_mib = max(r["view_mib"] for r in out)
    res.cpu_us_per_claim = sum(r["cpu_s"] for r in out) / max(1, res.placed) * 1e6
    if src is not None:
        say(f"  [{code}] upgrading the ledger to this checkout's schema for the audit...")
        command.upgrade(alembic_config(url), "head")
    say(f"  {res.placed} placed, {res.placements_per_s:,.0f}/s; auditing...")
    violations, res.ledger_placed, res.audit_s = _audit(url)
    say(f"  audit: {len(violations)} violations ({res.audit_s:.1f}s)")
    res.audit_violations = len(violations)
    res.audit_sample = violations[:5]
    dbs.drop("stowage_bench_run")
    if not baseline:
        return res
    t0 = time.monotonic()
    base_url = dbs.create("stowage_bench_base", template)
    res.setup["drop_and_copy_s"] = time.monotonic() - t0
    claims = min(args.instances, args.baseline_claims)
    say(f"  baseline: {claims} bare SQL claims, one commit each, {procs} process(es)...")
    base = _run_processes(
        _baseline_worker, procs, (dbs.backend, base_url, args.seed, args.ids, claims)
    )
    res.baseline_claims = sum(r["claims"] for r in base)
    res.baseline_refused = sum(r["refused"] for r in base)
    res.baseline_wall_s = max(r["end"] for r in base) - min(r["start"] for r in base)
    res.baseline_per_s = res.baseline_claims / res.baseline_wall_s if res.baseline_wall_s else 0
    base_violations, _, _ = _audit(base_url)
    res.baseline_audit_violations = len(base_violations)
    dbs.drop("stowage_bench_base")
    res.ratio = res.placements_per_s / res.baseline_per_s if res.baseline_per_s else 0.0
    return res


def _share_baseline(measured: RunResult, other: RunResult) -> None:
    """`other` (the before run of the same configuration) takes `measured`'s baseline."""
    for name in (
        "baseline_claims",
        "baseline_refused",
        "baseline_wall_s",
        "baseline_per_s",
        "baseline_audit_violations",
    ):
        setattr(other, name, getattr(measured, name))
    other.ratio = other.placements_per_s / other.baseline_per_s if other.baseline_per_s else 0.0


def run_backend(
    backend: str, args: argparse.Namespace, workdir: Path, say: Any
) -> tuple[list[RunResult], dict[str, str]]:
    dbs = Databases(backend, args.pg_url, workdir, args.template)
    procs_list = args.procs or ([1, 4] if backend == "postgres" else [1])
    out: list[RunResult] = []
    try:
        settings = dbs.settings()
        workload = make_workload(args.seed, args.instances, args.ids)
        for hosts in args.hosts:
            demand = demand_per_host(args.instances, hosts)
            if max(demand.values()) > 0.9:
                say(
                    f"[yellow]warning: {args.instances} instances on {hosts} hosts use about "
                    f"{demand['VCPU']:.0%} of VCPU and {demand['PCPU']:.0%} of PCPU capacity; "
                    "expect refusals[/yellow]"
                )
            say(f"[bold]{backend}, {hosts} hosts[/bold]: the template (hosts and groups)...")
            template, setup = dbs.template(hosts, workload, say)
            if setup:
                say(
                    f"  {hosts:,} hosts registered in {setup['register_hosts_s']:.1f}s "
                    f"({hosts / max(setup['register_hosts_s'], 1e-9):,.0f}/s), "
                    f"{len(workload.groups)} groups in {setup['create_groups_s']:.1f}s"
                )
            for procs in procs_list:
                before = None
                if args.before_src is not None:
                    before = run_config(
                        dbs,
                        template,
                        setup,
                        hosts,
                        procs,
                        args,
                        say,
                        code="before",
                        src=args.before_src,
                        baseline=False,
                    )
                after = run_config(
                    dbs,
                    template,
                    setup,
                    hosts,
                    procs,
                    args,
                    say,
                    code="after" if before else "this",
                )
                if before is not None:
                    _share_baseline(after, before)
                    out.append(before)
                out.append(after)
            if args.template is None:
                dbs.drop(template)
    finally:
        if not args.keep:
            dbs.drop_all()
    return out, settings


# -- output ------------------------------------------------------------------------------


def _targets(results: list[RunResult], instances: int) -> list[tuple[str, str, str]]:
    """(target, measured, verdict) for every target this run's configurations cover."""
    rows = []

    def row(name: str, r: RunResult, measured: str, ok: bool) -> None:
        who = f" ({r.code})" if r.code != "this" else ""
        rows.append((name + who, measured, "met" if ok else "NOT met"))

    for r in results:
        single = r.procs == 1 and r.backend == "sqlite"
        if r.hosts == 10_000 and single:
            row(
                ">= 10,000 placements/s, 10,000 hosts, SQLite",
                r,
                f"{r.placements_per_s:,.0f}/s",
                r.placements_per_s >= 10_000,
            )
            row(
                "p99 batch <= 50 ms, 10,000 hosts, SQLite",
                r,
                f"{r.latency_p99_ms:.1f} ms",
                r.latency_p99_ms <= 50,
            )
        if r.backend == "postgres" and r.procs == 4 and r.hosts == 10_000:
            row(
                ">= 10,000 placements/s, 10,000 hosts, PostgreSQL, 4 processes",
                r,
                f"{r.placements_per_s:,.0f}/s (baseline {r.baseline_per_s:,.0f}/s)",
                r.placements_per_s >= 10_000,
            )
        if r.hosts == 10_000 and instances >= 100_000:
            row(
                f"<= 500 MB peak, 10,000 hosts, 100,000 instances ({r.backend}, {r.procs}p)",
                r,
                f"{r.peak_rss_mib:,.0f} MiB",
                r.peak_rss_mib * 1.048576 <= 500,
            )
        if r.hosts >= 100_000 and instances >= 1_000_000:
            row(
                f">= 5,000 placements/s, 100,000 hosts, 1,000,000 instances ({r.backend})",
                r,
                f"{r.placements_per_s:,.0f}/s",
                r.placements_per_s >= 5000,
            )
            row(
                f"<= 2 GB per scheduler process, 100,000 hosts, 1,000,000 instances ({r.backend})",
                r,
                f"{r.peak_rss_mib:,.0f} MiB",
                r.peak_rss_mib * 1.048576 <= 2000,
            )
    return rows


def render(results: list[RunResult], args: argparse.Namespace, env: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(160, shutil.get_terminal_size((160, 40)).columns))
    table = Table(
        title=(
            f"stowage placement benchmark: {args.instances:,} instances, batch {args.batch}, "
            f"seed {args.seed}, instance ids {args.ids}"
        ),
        caption=(
            "placements/s = placed / wall time of the placement phase. Claim latency: a "
            "request's claim is committed when its schedule() batch returns, so each request "
            "counts its batch's call-to-return time. Peak = max ru_maxrss over the scheduler "
            "processes. Baseline = bare SQL loop, one transaction and one commit per claim, "
            "same server and schema, same process count; ratio = stowage / baseline."
        ),
    )
    for name, justify in (
        ("backend", "left"),
        ("code", "left"),
        ("hosts", "right"),
        ("procs", "right"),
        ("placed", "right"),
        ("wall s", "right"),
        ("placements/s", "right"),
        ("p50 ms", "right"),
        ("p99 ms", "right"),
        ("peak MiB", "right"),
        ("baseline/s", "right"),
        ("ratio", "right"),
        ("audit", "left"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for r in results:
        audit_text = (
            "clean"
            if r.clean
            else f"[red]{r.audit_violations} violations, ledger {r.ledger_placed}[/red]"
        )
        table.add_row(
            r.backend,
            r.code,
            f"{r.hosts:,}",
            str(r.procs),
            f"{r.placed:,}/{r.instances:,}",
            f"{r.wall_s:.2f}",
            f"{r.placements_per_s:,.0f}",
            f"{r.latency_p50_ms:.1f}",
            f"{r.latency_p99_ms:.1f}",
            f"{r.peak_rss_mib:.0f}",
            f"{r.baseline_per_s:,.0f}",
            f"{r.ratio:.2f}",
            audit_text,
        )
    console.print(table)

    detail = Table(title="details")
    for name in (
        "backend",
        "code",
        "hosts",
        "procs",
        "load",
        "setup s",
        "view s",
        "view MiB (KiB/host)",
        "us/claim",
        "CPU us/claim",
        "max ms",
        "conflicts",
        "retried",
        "refused",
        "MiB per proc",
        "baseline",
        "base audit",
    ):
        detail.add_column(name)
    for r in results:
        # Codes without their namespace, to fit; --json has them in full.
        refused = (
            ", ".join(f"{k.split('.', 1)[-1]}: {v}" for k, v in sorted(r.refused.items())) or "0"
        )
        detail.add_row(
            r.backend,
            r.code,
            f"{r.hosts:,}",
            str(r.procs),
            f"{r.load_start:.1f}-{r.load_end:.1f}",
            (
                f"{r.setup['register_hosts_s']:.1f}+{r.setup['create_groups_s']:.1f}"
                if "register_hosts_s" in r.setup
                else "reused"
            ),
            f"{r.view_load_s:.2f}",
            f"{r.view_mib:.0f} ({r.view_mib * 1024 / max(1, r.hosts):.1f})",
            f"{r.amortized_us_per_claim:.0f}",
            f"{r.cpu_us_per_claim:.0f}",
            f"{r.latency_max_ms:.0f}",
            str(r.conflicts),
            str(r.retried),
            refused,
            ", ".join(f"{m:.0f}" for m in r.peak_rss_mib_per_proc),
            f"{r.baseline_claims:,} in {r.baseline_wall_s:.2f}s"
            + (f" ({r.baseline_refused} refused)" if r.baseline_refused else ""),
            "clean" if r.baseline_audit_violations == 0 else f"{r.baseline_audit_violations}",
        )
    console.print(detail)

    build = Table(
        title="template build (before placing)",
        caption="Ledger.open and the host specs, register_hosts in chunks of "
        f"{REGISTER_CHUNK}, the anti-affinity groups, the copy of the template per run, and "
        "the scheduler's first view; --template reuses a template built earlier",
    )
    for name in ("backend", "hosts", "open+specs s", "register s", "hosts/s", "groups s"):
        build.add_column(name, justify="right")
    for name in ("copy s", "view s", "view MiB"):
        build.add_column(name, justify="right")
    seen: set[tuple[str, int]] = set()
    for r in results:
        if (r.backend, r.hosts) in seen:
            continue
        seen.add((r.backend, r.hosts))
        got = r.setup
        reg = got.get("register_hosts_s")
        build.add_row(
            r.backend,
            f"{r.hosts:,}",
            f"{got['open_and_specs_s']:.1f}" if reg is not None else "reused",
            f"{reg:.1f}" if reg is not None else "reused",
            f"{r.hosts / max(reg, 1e-9):,.0f}" if reg is not None else "",
            f"{got['create_groups_s']:.1f}" if reg is not None else "reused",
            f"{got.get('copy_template_s', 0.0):.1f}",
            f"{r.view_load_s:.1f}",
            f"{r.view_mib:.0f}",
        )
    console.print(build)

    targets = _targets(results, args.instances)
    if targets:
        t = Table(title="targets")
        t.add_column("target")
        t.add_column("measured", justify="right")
        t.add_column("verdict")
        for name, measured, verdict in targets:
            colour = "green" if verdict == "met" else "red"
            t.add_row(name, measured, f"[{colour}]{verdict}[/{colour}]")
        console.print(t)
    for r in results:
        for line in r.audit_sample:
            console.print(f"[red]audit ({r.backend}, {r.hosts}, {r.procs}p): {line}[/red]")
    settings = "; ".join(
        f"{backend}: " + ", ".join(f"{k}={v}" for k, v in s.items())
        for backend, s in env["settings"].items()
    )
    console.print(
        f"machine: {env['cpus']} CPUs, Python {env['python']}, commit {env['commit']}; {settings}; "
        f"load average {env['load_start']:.1f} at the start, {env['load_end']:.1f} at the end"
    )


# -- main --------------------------------------------------------------------------------


def _int_list(text_value: str) -> list[int]:
    try:
        return [int(x.replace("_", "")) for x in text_value.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text_value!r} is not a comma-separated list") from None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Placement throughput, claim latency and memory of the stowage scheduler "
        "against a bare SQL claim loop, on SQLite and PostgreSQL."
    )
    p.add_argument("--backend", choices=["sqlite", "postgres", "both"], default="both")
    p.add_argument("--hosts", type=_int_list, default=None, help="default 1000,10000")
    p.add_argument(
        "--procs",
        type=_int_list,
        default=None,
        help="scheduler processes per run (default: 1,4 on postgres, 1 on sqlite)",
    )
    p.add_argument("--instances", type=int, default=None, help="default 20000")
    p.add_argument("--batch", type=int, default=256, help="requests per schedule() call")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--ids",
        choices=IDS,
        default="api",
        help="instance ids: api (time-ordered, as the compute API makes them; default) or "
        "uuid4 (random, as before session 15)",
    )
    p.add_argument(
        "--no-shard",
        dest="shard",
        action="store_false",
        help="let every scheduler process start anywhere (default: each prefers its shard)",
    )
    p.add_argument(
        "--no-freeze-view",
        dest="freeze_view",
        action="store_false",
        help="leave the view to the cyclic collector (default: Scheduler(freeze_view=True))",
    )
    p.add_argument(
        "--baseline-claims",
        type=int,
        default=None,
        help="claims the bare SQL loop commits (at most --instances); default 5000, 300 quick",
    )
    p.add_argument(
        "--pg-url",
        default=os.environ.get("STOWAGE_BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/test"),
        help="an existing database to connect to for CREATE/DROP DATABASE stowage_bench_*",
    )
    p.add_argument(
        "--before-src",
        type=Path,
        default=None,
        help="another checkout's src/ directory: each configuration is placed with it first, "
        "then with this checkout, on the same template (one baseline for both)",
    )
    p.add_argument("--workdir", type=Path, default=None, help="where SQLite files go")
    p.add_argument("--keep", action="store_true", help="keep the last databases")
    p.add_argument(
        "--template",
        type=Path,
        default=None,
        metavar="DIR",
        help="keep each template (its SQLite file in DIR; on PostgreSQL the database) and reuse "
        "it in later runs with the same hosts, seed and instances",
    )
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="write all figures")
    p.add_argument(
        "--quick", action="store_true", help="smoke run: 200 hosts, 1000 instances, < 30 s"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.hosts = args.hosts or [200]
        args.instances = args.instances or 1000
    if args.baseline_claims is None:
        args.baseline_claims = 300 if args.quick else 5000
    args.hosts = args.hosts or [1000, 10000]
    args.instances = args.instances or 20000
    if min(args.batch, args.instances, args.baseline_claims, *args.hosts) < 1:
        p.error("--batch, --instances, --baseline-claims and --hosts must be positive")
    if args.procs and any(n < 1 for n in args.procs):
        p.error("--procs must be positive")
    return args


def _commit() -> str:
    """The commit measured, marked when src/ has uncommitted changes."""

    def git(*argv: str) -> str:
        return subprocess.run(
            ["git", *argv],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parent.parent,
        ).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--", "src")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head} + uncommitted changes in src/" if dirty else head


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from rich.console import Console

    console = Console(stderr=True)

    started = time.monotonic()

    def say(msg: str) -> None:
        console.print(f"[dim]{time.monotonic() - started:6.1f}s[/dim] {msg}")

    backends = ["sqlite", "postgres"] if args.backend == "both" else [args.backend]
    own_workdir = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="stowage-bench-")) if own_workdir else args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    if args.template is not None:
        args.template.mkdir(parents=True, exist_ok=True)
    results: list[RunResult] = []
    env: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "commit": _commit(),
        "settings": {},
        "load_start": os.getloadavg()[0],
    }
    t0 = time.monotonic()
    try:
        for backend in backends:
            got, settings = run_backend(backend, args, workdir, say)
            results.extend(got)
            env["settings"][backend] = settings
    finally:
        if own_workdir and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    env["total_s"] = time.monotonic() - t0
    env["load_end"] = os.getloadavg()[0]
    render(results, args, env)
    if args.json:
        payload = {
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "env": env,
            "results": [asdict(r) | {"audit_clean": r.clean} for r in results],
            "targets": [
                {"target": t, "measured": m, "verdict": v}
                for t, m, v in _targets(results, args.instances)
            ],
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    return 0 if all(r.clean and r.baseline_audit_violations == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
