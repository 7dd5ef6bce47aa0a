"""Races with real concurrency: processes fighting over scarce pCPUs and group slots.

Each racer is a separate process (`race_worker.py`) with its own engine, its own view and
its own seed; they start together behind a file barrier so their claims truly overlap.
Afterwards the ledger must audit clean, and every attempt must either hold its claim or
have been refused with a code and a reason, holding nothing. Runs on SQLite and on
PostgreSQL (127.0.0.1).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from stowage.domain.claims import RefusalCode
from stowage.domain.flavor import Flavor, shape_of
from stowage.domain.groups import GroupPolicy, ServerGroup, domain_of, parse_group
from stowage.domain.topology import HostSpec, HostTopology, ResourceClass
from stowage.ledger import Ledger, audit
from stowage.ledger.schema import (
    allocations,
    consumers,
    group_members,
    group_slots,
    hosts,
    numa_claims,
    pins,
)
from stowage.scheduling.framework import Request
from stowage.services.scheduler import Scheduler

WORKER = Path(__file__).with_name("race_worker.py")

# Few, small hosts so pCPUs, NUMA memory and group slots run out: 8 dedicated pCPUs
# (2 cores x 2 threads per cell) and 2 x 4096 MB per host.
TOPOLOGY = HostTopology.uniform(
    cells=2, cores_per_cell=4, threads_per_core=2, memory_mb_per_cell=4096
)
HOSTS = 6
RACKS = 3

SCHEDULER_RACERS = 5
RAW_RACERS = 5
ATTEMPTS_PER_RACER = 210
ATTEMPTS_MIN = 2000
CONTENDERS = 8

NOTHING = {"allocations": 0, "numa_claims": 0, "pins": 0, "slots": 0, "host": None}
REFUSAL_CODES = {code.value for code in RefusalCode}


# -- running racers ---------------------------------------------------------------------


def _backend(url: str) -> str:
    return "sqlite" if url.startswith("sqlite") else "postgres"


def _open_cloud(url: str, names: list[str]) -> tuple[Ledger, dict[str, int]]:
    ledger = Ledger.open(url)
    ids = {}
    for i, name in enumerate(names):
        spec = HostSpec(name=name, topology=TOPOLOGY, disk_gb=200, labels={"rack": f"r{i % RACKS}"})
        ids[name] = ledger.register_host(spec)
        # Up for the whole run, however slow the machine: no heartbeat goes stale mid-race.
        ledger.set_host_state(name, last_seen=time.time() + 3600)
    return ledger, ids


def _group(name: str, policy: str, rules: dict[str, object] | None = None) -> ServerGroup:
    return parse_group(str(uuid.uuid4()), name, policy, rules)


class Racers:
    """Child processes started from configs, with a file barrier to release them at once."""

    def __init__(self, tmp_path: Path) -> None:
        self.dir = tmp_path / "racers"
        self.barrier = self.dir / "barrier"
        self.barrier.mkdir(parents=True)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.outs: dict[str, Path] = {}

    def start(self, name: str, cfg: dict[str, Any]) -> None:
        out = self.dir / f"{name}.json"
        cfg = {**cfg, "name": name, "barrier": str(self.barrier), "out": str(out)}
        path = self.dir / f"{name}.config.json"
        path.write_text(json.dumps(cfg))
        with (
            (self.dir / f"{name}.stdout").open("wb") as stdout,
            (self.dir / f"{name}.stderr").open("wb") as stderr,
        ):
            self.procs[name] = subprocess.Popen(
                [sys.executable, str(WORKER), str(path)], stdout=stdout, stderr=stderr
            )
        self.outs[name] = out

    def stderr(self, name: str) -> str:
        return (self.dir / f"{name}.stderr").read_text(errors="replace")[-4000:]

    def open_phase(self, phase: str, timeout_s: float = 180.0) -> None:
        """Wait until every racer is ready for `phase`, then let them all go at once."""
        deadline = time.monotonic() + timeout_s
        waiting = set(self.procs)
        while waiting:
            waiting = {n for n in waiting if not (self.barrier / f"ready-{phase}-{n}").exists()}
            for name in waiting:
                if self.procs[name].poll() is not None:
                    self.kill()
                    pytest.fail(f"racer {name} died before {phase}:\n{self.stderr(name)}")
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"racers {sorted(waiting)} never got ready for {phase}")
            time.sleep(0.005)
        (self.barrier / f"go-{phase}").touch()

    def finish(self, timeout_s: float = 300.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        for name, proc in self.procs.items():
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
                pytest.fail(f"racer {name} still running after {timeout_s:.0f} s")
        failed = {n: p.returncode for n, p in self.procs.items() if p.returncode != 0}
        assert not failed, "\n".join(
            f"{n} exited {rc}:\n{self.stderr(n)}" for n, rc in failed.items()
        )
        return [json.loads(self.outs[name].read_text()) for name in self.procs]

    def kill(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _cli_audit(url: str) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).with_name("stowage")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "stowage.cli"]
    return subprocess.run(
        [*command, "audit", "--db", url],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "COLUMNS": "200"},
    )


def _pg_deadlocks(ledger: Ledger) -> int | None:
    """Deadlocks PostgreSQL has detected in this database so far (any schema); None on SQLite."""
    if ledger.engine.dialect.name != "postgresql":
        return None
    with ledger.engine.connect() as conn:
        query = "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"
        return int(conn.exec_driver_sql(query).scalar_one())


def _assert_audits_clean(ledger: Ledger, url: str) -> None:
    violations = audit(ledger)
    assert violations == [], "\n".join(map(str, violations))
    cli = _cli_audit(url)
    assert cli.returncode == 0, f"stowage audit failed:\n{cli.stdout}\n{cli.stderr}"
    assert "ledger clean" in cli.stdout


# -- reading the ledger back ------------------------------------------------------------


class Snapshot:
    """The ledger's ownership tables, read once after every racer has exited."""

    def __init__(self, ledger: Ledger) -> None:
        with ledger.engine.connect() as conn:
            self.hosts = {
                row.id: (row.name, json.loads(row.labels))
                for row in conn.execute(select(hosts.c.id, hosts.c.name, hosts.c.labels))
            }
            self.consumers: dict[str, int | None] = dict(
                conn.execute(select(consumers.c.id, consumers.c.host_id)).all()
            )
            self.allocations: dict[str, dict[tuple[int, str], int]] = defaultdict(dict)
            for c, h, rc, amount in conn.execute(
                select(
                    consumers.c.id,
                    allocations.c.host_id,
                    allocations.c.resource_class,
                    allocations.c.amount,
                ).select_from(
                    allocations.join(consumers, consumers.c.seq == allocations.c.consumer_seq)
                )
            ):
                self.allocations[c][(h, rc)] = amount
            self.numa: dict[str, set[tuple[int, int]]] = defaultdict(set)
            for c, h, cell in conn.execute(
                select(consumers.c.id, numa_claims.c.host_id, numa_claims.c.cell_id).select_from(
                    numa_claims.join(consumers, consumers.c.seq == numa_claims.c.consumer_seq)
                )
            ):
                self.numa[c].add((h, cell))
            self.pins = conn.execute(
                select(
                    pins.c.host_id, pins.c.cpu_id, consumers.c.id, pins.c.guest_vcpu
                ).select_from(pins.join(consumers, consumers.c.seq == pins.c.consumer_seq))
            ).all()
            self.slots = conn.execute(
                select(
                    group_slots.c.group_id,
                    group_slots.c.domain,
                    group_slots.c.slot,
                    consumers.c.id,
                    group_slots.c.host_id,
                ).select_from(
                    group_slots.join(consumers, consumers.c.seq == group_slots.c.consumer_seq)
                )
            ).all()
            self.members: dict[str, set[str]] = defaultdict(set)
            for g, instance in conn.execute(select(group_members)):
                self.members[g].add(instance)

    def pins_of(self, consumer: str) -> list[tuple[int, int]]:
        return [(h, cpu) for h, cpu, c, _ in self.pins if c == consumer]

    def slots_of(self, consumer: str) -> list[tuple[str, str, int, int]]:
        return [(g, d, s, h) for g, d, s, c, h in self.slots if c == consumer]

    def domain(self, group: ServerGroup, host_id: int) -> str | None:
        name, labels = self.hosts[host_id]
        return domain_of(group, name, labels)


def _replay(logs: list[dict[str, Any]]) -> tuple[Counter[str], dict[str, dict[str, Any] | None]]:
    """Check each attempt as logged, and work out what each consumer should hold now."""
    outcomes: Counter[str] = Counter()
    holding: dict[str, dict[str, Any] | None] = {}  # consumer -> its last ok claim, or None
    for log in logs:
        for event in log["events"]:
            assert event["op"] != "error", f"{log['name']} raised:\n{event['error']}"
            consumer = event["consumer"]
            prior = holding.get(consumer)
            if event["op"] == "release":
                assert prior is not None, event
                assert event["released"], event
                holding[consumer] = None
                continue
            if event["ok"]:
                assert prior is None, f"{consumer} placed while it held a claim: {event}"
                assert not event["double"], event
                assert isinstance(event["host"], int), event
                holding[consumer] = event
                outcomes["ok"] += 1
                continue
            # Refused: with a stable code and words, and holding nothing it did not hold.
            assert event["code"] in REFUSAL_CODES, event
            assert event["reason"].strip(), event
            held = event["held_after"]
            if event["double"]:
                assert prior is not None, event
                assert event["code"] == RefusalCode.CONSUMER_PLACED.value, event
                assert held["host"] == prior["host"] and held["allocations"] > 0, event
            else:
                assert prior is None, event
                assert held == NOTHING, f"refused but holds {held}: {event}"
                holding.setdefault(consumer, None)
            outcomes[event["code"]] += 1
    return outcomes, holding


def _check_holdings(
    snap: Snapshot,
    holding: dict[str, dict[str, Any] | None],
    groups: dict[str, ServerGroup],
) -> None:
    """Every consumer holds exactly its last successful claim, or nothing at all."""
    unknown = set(snap.consumers) - set(holding)
    assert not unknown, f"consumers nobody claimed: {sorted(unknown)[:5]}"
    for consumer, event in holding.items():
        pinned = snap.pins_of(consumer)
        slotted = snap.slots_of(consumer)
        if event is None:
            assert snap.consumers.get(consumer) is None, consumer
            assert not snap.allocations.get(consumer), consumer
            assert not snap.numa.get(consumer), consumer
            assert not pinned and not slotted, consumer
            continue
        host = event["host"]
        assert snap.consumers.get(consumer) == host, (consumer, event)
        held = snap.allocations.get(consumer, {})
        assert {h for h, _ in held} == {host}, (consumer, held, event)
        assert held.get((host, ResourceClass.MEMORY_MB.value), 0) > 0, (consumer, held)
        assert {h for h, _ in pinned} <= {host}, (consumer, pinned)
        assert len(pinned) == event["pcpus"], (consumer, pinned, event)
        assert held.get((host, ResourceClass.PCPU.value), 0) == event["pcpus"], (consumer, held)
        # Each pinned pCPU sits in a NUMA cell the consumer claimed on that host.
        cells = snap.numa.get(consumer, set())
        for h, cpu in pinned:
            assert (h, TOPOLOGY.cell_of(cpu)) in cells, (consumer, cpu, cells)
        group = groups.get(event["group"] or "")
        if group is not None and group.policy is GroupPolicy.ANTI_AFFINITY:
            assert len(slotted) == 1, (consumer, slotted)
            [(g, domain, slot, h)] = slotted
            assert (g, h) == (group.id, host), (consumer, slotted)
            assert domain == snap.domain(group, host), (consumer, slotted)
            assert 0 <= slot < group.max_per_domain
        else:
            assert not slotted, (consumer, slotted)
        if group is not None:
            assert consumer in snap.members[group.id], (consumer, group.name)


def _check_invariants(snap: Snapshot, groups: dict[str, ServerGroup]) -> None:
    """The invariants again, by hand: no pCPU held twice, no group broken."""
    by_cpu = Counter((h, cpu) for h, cpu, _, _ in snap.pins)
    assert [key for key, n in by_cpu.items() if n > 1] == []
    assert {cpu for _, cpu, _, _ in snap.pins} <= TOPOLOGY.cpu_dedicated_set
    placed = {c: h for c, h in snap.consumers.items() if h is not None}
    for group in groups.values():
        members = [placed[c] for c in snap.members[group.id] if c in placed]
        if group.policy is GroupPolicy.AFFINITY:
            assert len(set(members)) <= 1, f"{group.name} spans hosts {set(members)}"
            continue
        per_domain = Counter(snap.domain(group, h) for h in members)
        over = {d: n for d, n in per_domain.items() if n > group.max_per_domain}
        assert not over, f"{group.name} over its limit in {over}"
        slots = Counter(d for g, d, _, _, _ in snap.slots if g == group.id)
        assert slots == per_domain, f"{group.name}: slots {slots} but members {per_domain}"


# -- the big race -------------------------------------------------------------------------


@pytest.mark.slow
def test_racers_fight_over_scarce_pcpus_and_slots(db_url: str, tmp_path: Path) -> None:
    backend = _backend(db_url)
    names = [f"race-{i}" for i in range(HOSTS)]
    ledger, _ = _open_cloud(db_url, names)
    groups = {
        g.id: g
        for g in (
            _group("anti", "anti-affinity"),
            _group("anti-2-per-host", "anti-affinity", {"max_server_per_host": 2}),
            _group("anti-rack", "anti-affinity", {"failure_domain": "rack"}),
            _group("together", "affinity"),
        )
    }
    for group in groups.values():
        ledger.create_group(group)
    common = {
        "url": db_url,
        "groups": [{"id": g.id, "name": g.name} for g in groups.values()],
        "attempts": ATTEMPTS_PER_RACER,
        "group_share": 0.3,
        "pinned_share": 0.6,
    }
    scheduler_cfg = {**common, "role": "scheduler", "batch_max": 4, "release_p": 0.6}
    raw_cfg = {**common, "role": "raw", "batch_max": 3, "release_p": 0.55, "double_p": 0.05}
    racers = Racers(tmp_path)
    deadlocks_before = _pg_deadlocks(ledger)
    try:
        for i in range(SCHEDULER_RACERS):
            racers.start(f"sched-{i}", {**scheduler_cfg, "seed": 100 + i})
        for i in range(RAW_RACERS):
            racers.start(f"raw-{i}", {**raw_cfg, "seed": 200 + i})
        racers.open_phase("main")
        started = time.perf_counter()
        logs = racers.finish()
        elapsed = time.perf_counter() - started
        deadlocks_after = _pg_deadlocks(ledger)

        _assert_audits_clean(ledger, db_url)
        outcomes, holding = _replay(logs)
        snap = Snapshot(ledger)
        _check_holdings(snap, holding, groups)
        _check_invariants(snap, groups)
    finally:
        racers.kill()
        ledger.close()

    attempts = sum(outcomes.values())
    refused = attempts - outcomes["ok"]
    by_role = Counter()
    for log in logs:
        by_role[log["role"]] += log["stats"]["attempts"]
    conflicts = sum(log["stats"].get("conflicts", 0) for log in logs)
    print(
        f"\n[{backend}] {len(logs)} racers, {attempts} claim attempts "
        f"({dict(by_role)}) in {elapsed:.1f} s: {outcomes['ok']} placed, {refused} refused, "
        f"{conflicts} scheduler commits lost and re-picked, "
        f"{len(holding)} consumers, {sum(1 for e in holding.values() if e)} holding at the end"
    )
    for role in ("scheduler", "raw"):
        refusals = Counter(
            event["code"]
            for log in logs
            if log["role"] == role
            for event in log["events"]
            if event["op"] == "claim" and not event["ok"]
        )
        print(f"[{backend}] {role} refusals by code: {dict(sorted(refusals.items()))}")
    go_at = [log["stats"]["go_at"] for log in logs]
    done_at = [log["stats"]["done_at"] for log in logs]
    print(
        f"[{backend}] racers started within {1000 * (max(go_at) - min(go_at)):.1f} ms of each "
        f"other and all ran at once for {max(0.0, min(done_at) - max(go_at)):.1f} s"
    )
    if deadlocks_before is not None and deadlocks_after is not None:
        print(
            f"[{backend}] deadlocks PostgreSQL detected (and the ledger retried) during the "
            f"race, database-wide: {deadlocks_after - deadlocks_before}"
        )

    assert len(logs) >= 8
    assert max(go_at) < min(done_at), "the racers never all ran at the same time"
    assert by_role["scheduler"] > 0 and by_role["raw"] > 0
    assert attempts == sum(by_role.values()) >= ATTEMPTS_MIN
    assert outcomes["ok"] > 0 and refused > 0
    # The database, not the racers' views, stopped the stale claims.
    assert outcomes[RefusalCode.PCPU_TAKEN.value] > 0
    assert outcomes[RefusalCode.ANTI_AFFINITY.value] > 0
    assert outcomes[RefusalCode.CONSUMER_PLACED.value] > 0


# -- the same pCPUs, the same last slot, at the same moment -----------------------------


def test_one_winner_for_the_last_slot_and_the_same_pcpus(db_url: str, tmp_path: Path) -> None:
    backend = _backend(db_url)
    names = ["contend-0", "contend-1", "contend-2"]
    ledger, ids = _open_cloud(db_url, names)
    group = _group("two-per-host", "anti-affinity", {"max_server_per_host": 2})
    ledger.create_group(group)
    # One member already on contend-1: its slot 1 is the group's last there.
    first = str(uuid.uuid4())
    small = {"name": "shared.1", "vcpus": 1, "memory_mb": 256, "disk_gb": 1}
    [placed] = Scheduler(ledger, seed=1).schedule(
        [
            Request(
                consumer_id=first,
                instance_id=first,
                shape=shape_of(Flavor("shared.1", 1, 256, 1)),
                group_id=group.id,
                force_host="contend-1",
            )
        ]
    )
    assert placed.ok, placed.reason
    phases = [
        {"name": "slot", "host": "contend-1", "group": group.id, "flavor": small},
        {
            "name": "pcpu",
            "host": "contend-2",
            "flavor": {
                "name": "pinned.2.require",
                "vcpus": 2,
                "memory_mb": 512,
                "disk_gb": 1,
                "extra_specs": {"hw:cpu_policy": "dedicated", "hw:cpu_thread_policy": "require"},
            },
        },
    ]
    racers = Racers(tmp_path)
    try:
        for i in range(CONTENDERS):
            cfg = {"url": db_url, "role": "contend", "seed": 300 + i, "phases": phases}
            racers.start(f"contend-{i}", cfg)
        for phase in phases:
            racers.open_phase(phase["name"])
        logs = racers.finish()
        _assert_audits_clean(ledger, db_url)
        snap = Snapshot(ledger)
    finally:
        racers.kill()
        ledger.close()

    expected = {"slot": RefusalCode.ANTI_AFFINITY.value, "pcpu": RefusalCode.PCPU_TAKEN.value}
    for phase in phases:
        events = [
            e for log in logs for e in log["events"] if e["via"] == f"contend:{phase['name']}"
        ]
        assert len(events) == CONTENDERS, events
        # Everyone aimed at the same thing.
        assert len({json.dumps([e["pins"], e["slots"]]) for e in events}) == 1, events
        winners = [e for e in events if e["ok"]]
        losers = [e for e in events if not e["ok"]]
        assert len(winners) == 1, events
        assert len(losers) == CONTENDERS - 1
        for loser in losers:
            assert loser["code"] == expected[phase["name"]], loser
            assert loser["reason"].strip()
            assert loser["held_after"] == NOTHING, loser
        [winner] = winners
        host = ids[phase["host"]]
        assert snap.consumers[winner["consumer"]] == host
        assert sorted(cpu for _, cpu in snap.pins_of(winner["consumer"])) == winner["pins"]
        assert [[g, d, s] for g, d, s, _ in snap.slots_of(winner["consumer"])] == winner["slots"]
        fired = [e["go_at"] for e in events]
        print(
            f"\n[{backend}] {phase['name']}: 1 of {CONTENDERS} won on {phase['host']}, "
            f"{len(losers)} refused with {expected[phase['name']]}; all fired within "
            f"{1000 * (max(fired) - min(fired)):.1f} ms, the first answer came "
            f"{1000 * (min(e['answered_at'] for e in events) - min(fired)):.1f} ms after the first"
        )
    assert snap.slots_of(first)[0][1:3] == ("host=contend-1", 0)
