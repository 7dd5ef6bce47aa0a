"""The reconciler on a real ledger and a simulated hypervisor tampered with behind its back.

The seed "numa pinning conflict breaks the resource tracker": the upstream audit aborts on
the first conflicting instance and every later one goes unaudited. Here two instances made
to conflict are two recorded divergences, and every other instance is still audited.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from stowage.agent.metrics import AgentMetrics, observe_agent, record_op, render
from stowage.agent.reconciler import Reconciler, ReconcileReport
from stowage.agent.runtime import Agent, AgentConfig
from stowage.domain.errors import NotFound
from stowage.domain.topology import HostSpec, HostTopology
from stowage.ledger import Ledger
from stowage.ledger.db import READONLY
from stowage.ledger.schema import consumer_key, consumers, numa_claims, pins
from stowage.services import migrations
from stowage.services.cloud import Cloud, CloudConfig
from stowage.services.compute import BuildRequest, build_servers, schedule_builds
from stowage.services.reconcile import (
    Divergence,
    DivergenceKind,
    Role,
    expected_on_host,
    record_divergence,
)
from stowage.virt.driver import RunningInstance
from stowage.virt.sim import SimConfig, SimDriver

# 2 cells x 8 cores x 2 threads; dedicated: the first 4 cores of each cell, both threads.
TOPOLOGY = HostTopology.uniform(
    cells=2, cores_per_cell=8, threads_per_core=2, memory_mb_per_cell=16384
)
PINNED2 = {
    "id": "p2",
    "name": "pinned.2",
    "vcpus": 2,
    "ram": 512,
    "disk": 1,
    "ephemeral": 0,
    "extra_specs": {"hw:cpu_policy": "dedicated"},
}
PROJECT = "proj-reconcile"


@pytest.fixture
def cloud(db_url: str, tmp_path: Path) -> Iterator[Cloud]:
    ledger = Ledger.open(db_url)
    for name in ("host1", "host2"):
        ledger.register_host(HostSpec(name, TOPOLOGY, disk_gb=100))
    ledger.heartbeat()
    yield Cloud(CloudConfig(state_dir=tmp_path / "state"), ledger)
    ledger.close()


def _sim(tmp_path: Path, name: str) -> SimDriver:
    return SimDriver(SimConfig(disk_bytes=4096), disk_dir=tmp_path / f"disks-{name}")


@pytest.fixture
def host1(tmp_path: Path) -> Iterator[SimDriver]:
    sim = _sim(tmp_path, "host1")
    yield sim
    sim.close()


@pytest.fixture
def host2(tmp_path: Path) -> Iterator[SimDriver]:
    sim = _sim(tmp_path, "host2")
    yield sim
    sim.close()


# --- helpers ----------------------------------------------------------------------------


def build_on(cloud: Cloud, host: str, count: int) -> list[str]:
    """`count` pinned instances placed on `host` by the real scheduler and claim."""
    docs = build_servers(
        cloud,
        BuildRequest(
            name="vm",
            flavor=PINNED2,
            image_id="img",
            project_id=PROJECT,
            user_id="user",
            min_count=count,
            max_count=count,
            force_host=host,
            networks="none",
        ),
        request_id="req-build",
    )
    # The conductor's scheduling step, run here: claimed and waiting for the agent to spawn
    # them (no conductor runs here: the test spawns them on its own simulated hypervisor
    # with the claimed pins).
    schedule_builds(cloud, [op for op in cloud.operations.active() if op.step == "schedule"])
    docs = [cloud.objects.get("instance", d["id"]).body for d in docs]
    assert [(d["status"], d["host"]) for d in docs] == [("BUILD", host)] * count, [
        d.get("fault") for d in docs
    ]
    assert {d["host"] for d in docs} == {host}
    for doc in docs:
        # What the conductor would commit once the agent spawned it: the build is over.
        for op in cloud.operations.active(instance_id=doc["id"]):
            cloud.operations.update(op.id, state="done")
        body = dict(cloud.objects.get("instance", doc["id"]).body)
        body.update(status="ACTIVE", vm_state="active", task_state=None)
        cloud.objects.update("instance", doc["id"], body)
    return [str(d["id"]) for d in docs]


def claimed(cloud: Cloud, consumer_id: str) -> tuple[dict[int, int], list[int]]:
    """The consumer's pins (guest vCPU -> pCPU) and host NUMA cells, read from the tables."""
    with cloud.ledger.engine.connect().execution_options(**READONLY) as conn:
        pinned = conn.execute(
            select(pins.c.guest_vcpu, pins.c.cpu_id).where(
                pins.c.consumer_seq == consumer_key(consumer_id), pins.c.guest_vcpu.is_not(None)
            )
        ).all()
        cells = conn.execute(
            select(numa_claims.c.cell_id).where(
                numa_claims.c.consumer_seq == consumer_key(consumer_id)
            )
        ).scalars()
        return {int(v): int(c) for v, c in pinned}, sorted(int(c) for c in cells)


def spawn_as_claimed(cloud: Cloud, driver: SimDriver, instance_id: str, consumer_id: str) -> None:
    pinned, cells = claimed(cloud, consumer_id)
    assert len(pinned) == 2
    driver.spawn(instance_id, pinned, cells, 512)


def claim_tables(cloud: Cloud) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    with cloud.ledger.engine.connect().execution_options(**READONLY) as conn:
        return (
            sorted(tuple(r) for r in conn.execute(select(consumers))),
            sorted(tuple(r) for r in conn.execute(select(pins))),
        )


def free_dedicated_cpu(cloud: Cloud, host: str) -> int:
    with cloud.ledger.engine.connect().execution_options(**READONLY) as conn:
        taken = set(
            conn.execute(
                select(pins.c.cpu_id).where(pins.c.host_id == cloud.ledger.host_id(host))
            ).scalars()
        )
    return min(TOPOLOGY.cpu_dedicated_set - taken)


def reconciler_for(
    cloud: Cloud, host: str, driver: SimDriver, metrics: AgentMetrics, **kw: Any
) -> Reconciler:
    async def running() -> Mapping[str, RunningInstance]:
        return await asyncio.to_thread(driver.running)

    return Reconciler(
        host,
        kw.pop("running", running),
        kw.pop("expected", lambda: expected_on_host(cloud.ledger, host)),
        kw.pop("record", lambda d: record_divergence(cloud, host, d)),
        metrics,
        **kw,
    )


def kinds(report: ReconcileReport) -> dict[str, DivergenceKind]:
    by_id = {d.instance_id: d.kind for d in report.divergences}
    assert len(by_id) == len(report.divergences), "one divergence per instance"
    return by_id


def sample(metrics: AgentMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def faults_of(cloud: Cloud, instance_id: str) -> list[dict[str, Any]]:
    return [d.body for d in cloud.objects.list("instance_fault", project_id=instance_id)]


def reconcile_events(cloud: Cloud, instance_id: str) -> list[dict[str, Any]]:
    return [
        event
        for doc in cloud.objects.list("instance_action", project_id=instance_id)
        if doc.body["action"] == "reconcile"
        for event in doc.body["events"]
    ]


# --- the proof --------------------------------------------------------------------------


def test_two_conflicting_instances_are_two_divergences_and_the_rest_still_audited(
    cloud: Cloud, host1: SimDriver
) -> None:
    ids = build_on(cloud, "host1", 7)
    for iid in ids:
        spawn_as_claimed(cloud, host1, iid, iid)
    a, b, gone, *fine = ids
    # Behind the ledger's back: a and b repinned onto one pCPU the ledger gave nobody, one
    # instance destroyed, one the ledger never placed started.
    stray_cpu = free_dedicated_cpu(cloud, "host1")
    pins_a, _ = claimed(cloud, a)
    pins_b, _ = claimed(cloud, b)
    host1.tamper_pins(a, {0: stray_cpu, 1: pins_a[1]})
    host1.tamper_pins(b, {0: stray_cpu, 1: pins_b[1]})
    host1.destroy(gone)
    host1.adopt("vm-stray", {0: pins_a[0]})
    before = claim_tables(cloud)
    metrics = AgentMetrics.create()

    report = asyncio.run(reconciler_for(cloud, "host1", host1, metrics).run_once())

    assert report.error is None
    assert kinds(report) == {
        a: DivergenceKind.PINS_DIFFER,
        b: DivergenceKind.PINS_DIFFER,
        gone: DivergenceKind.MISSING_INSTANCE,
        "vm-stray": DivergenceKind.UNKNOWN_INSTANCE,
    }
    # Every instance on the host was audited in this one pass, the conflicting ones too.
    assert sorted(report.audited) == sorted([*ids, "vm-stray"])
    assert report.audited_count == 8
    assert report.unrecorded == []
    by_id = {d.instance_id: d for d in report.divergences}
    assert f"pCPU {stray_cpu} is also pinned by {b}" in by_id[a].detail
    assert f"pCPU {stray_cpu} is also pinned by {a}" in by_id[b].detail
    assert by_id[a].expected == {"home": pins_a}
    assert by_id[a].actual == {0: stray_cpu, 1: pins_a[1]}
    for iid in fine:
        assert faults_of(cloud, iid) == []
        assert reconcile_events(cloud, iid) == []

    # Recorded: a fault per divergence, an Error event for instances the cloud knows.
    for iid, kind in kinds(report).items():
        (fault,) = faults_of(cloud, iid)
        assert fault["error_code"] == f"reconcile.{kind.value}"
        assert fault["host"] == "host1"
        assert fault["message"] == by_id[iid].detail
    for iid in (a, b, gone):
        (event,) = reconcile_events(cloud, iid)
        assert event["event"] == "compute_reconcile"
        assert event["result"] == "Error"
        assert event["host"] == "host1"
        assert event["details"] == by_id[iid].detail
    assert reconcile_events(cloud, "vm-stray") == []

    # Counted.
    assert (
        sample(metrics, "stowage_reconcile_divergences_total", host="host1", kind="pins_differ")
        == 2
    )
    for kind in ("missing_instance", "unknown_instance"):
        assert sample(metrics, "stowage_reconcile_divergences_total", host="host1", kind=kind) == 1
    assert (
        sample(metrics, "stowage_reconcile_divergences_total", host="host1", kind="check_failed")
        == 0
    )
    assert sample(metrics, "stowage_reconcile_passes_total", host="host1") == 1
    assert sample(metrics, "stowage_reconcile_audited_instances", host="host1") == 8
    text = render(metrics.registry).decode()
    assert 'stowage_reconcile_divergences_total{host="host1",kind="pins_differ"} 2.0' in text

    # Never acted on: not one claim or consumer row changed.
    assert claim_tables(cloud) == before


def test_a_record_that_fails_for_one_instance_does_not_stop_the_others(
    cloud: Cloud, host1: SimDriver
) -> None:
    ids = build_on(cloud, "host1", 5)
    for iid in ids:
        spawn_as_claimed(cloud, host1, iid, iid)
    for iid in ids[:3]:
        host1.tamper_pins(
            iid, {0: free_dedicated_cpu(cloud, "host1"), 1: claimed(cloud, iid)[0][1]}
        )
    calls: list[str] = []

    def record(divergence: Divergence) -> None:
        calls.append(divergence.instance_id)
        if len(calls) == 1:  # the first write of the pass fails, as a lost connection would
            raise RuntimeError("the fault store is unreachable")
        record_divergence(cloud, "host1", divergence)

    metrics = AgentMetrics.create()
    report = asyncio.run(reconciler_for(cloud, "host1", host1, metrics, record=record).run_once())

    first, *rest = calls
    assert sorted(calls) == sorted(ids[:3])
    assert set(kinds(report)) == set(ids[:3])
    assert report.unrecorded == [first]
    assert sorted(report.audited) == sorted(ids)
    assert faults_of(cloud, first) == []
    for iid in rest:
        assert len(faults_of(cloud, iid)) == 1
        assert len(reconcile_events(cloud, iid)) == 1
    assert sample(metrics, "stowage_reconcile_record_failures_total", host="host1") == 1
    assert (
        sample(metrics, "stowage_reconcile_divergences_total", host="host1", kind="pins_differ")
        == 3
    )


def test_an_instance_that_cannot_be_compared_is_a_check_failure_and_the_pass_goes_on(
    cloud: Cloud, host1: SimDriver
) -> None:
    ids = build_on(cloud, "host1", 4)
    for iid in ids:
        spawn_as_claimed(cloud, host1, iid, iid)
    broken = ids[2]

    async def running() -> Mapping[str, RunningInstance]:
        rows = dict(await asyncio.to_thread(host1.running))
        # A domain whose definition the hypervisor cannot describe (no vCPU pins in it).
        rows[broken] = {"state": rows[broken]["state"]}  # type: ignore[typeddict-item]
        return rows

    metrics = AgentMetrics.create()
    report = asyncio.run(reconciler_for(cloud, "host1", host1, metrics, running=running).run_once())

    assert kinds(report) == {broken: DivergenceKind.CHECK_FAILED}
    assert "KeyError" in report.divergences[0].detail
    assert sorted(report.audited) == sorted(ids)
    (fault,) = faults_of(cloud, broken)
    assert fault["error_code"] == "reconcile.check_failed"
    assert (
        sample(metrics, "stowage_reconcile_divergences_total", host="host1", kind="check_failed")
        == 1
    )


def test_a_move_in_flight_is_expected_at_both_ends_and_runs_at_either(
    cloud: Cloud, host1: SimDriver, host2: SimDriver
) -> None:
    (moving,) = build_on(cloud, "host2", 1)
    (staying,) = build_on(cloud, "host1", 1)
    result = migrations.move(
        cloud, moving, "migration", user_id="user", project_id=PROJECT, dest="host1"
    )
    # The conductor's scheduling step, run here: the destination is claimed, both ends held.
    migrations.schedule_moves(cloud, cloud.operations.active(instance_id=moving))
    record = cloud.objects.get("migration", result.migration_id).body
    assert (record["status"], record["dest_compute"]) == ("pre-migrating", "host1")
    at_source = expected_on_host(cloud.ledger, "host2")[moving]
    at_dest = expected_on_host(cloud.ledger, "host1")[moving]
    assert [e.role for e in at_source.ends] == [Role.OUTGOING]
    assert [e.role for e in at_dest.ends] == [Role.INCOMING]
    assert at_dest.ends[0].consumer_id == result.migration_id
    source_pins = dict(at_source.ends[0].pins)
    dest_pins = dict(at_dest.ends[0].pins)
    assert source_pins == claimed(cloud, moving)[0]
    assert dest_pins == claimed(cloud, result.migration_id)[0]
    assert [e.role for e in expected_on_host(cloud.ledger, "host1")[staying].ends] == [Role.HOME]

    spawn_as_claimed(cloud, host1, staying, staying)
    spawn_as_claimed(cloud, host2, moving, moving)
    metrics = AgentMetrics.create()
    dest = reconciler_for(cloud, "host1", host1, metrics)
    source = reconciler_for(cloud, "host2", host2, metrics)

    # Still at the source only: the destination's claim is no missing instance.
    report = asyncio.run(dest.run_once())
    assert report.divergences == []
    assert sorted(report.audited) == sorted([moving, staying])
    assert asyncio.run(source.run_once()).divergences == []
    # Running at both ends, each with its own end's pins: still no divergence.
    spawn_as_claimed(cloud, host1, moving, result.migration_id)
    assert asyncio.run(dest.run_once()).divergences == []
    # The destination running it with the source's pins is a divergence.
    host1.tamper_pins(moving, source_pins)
    assert kinds(asyncio.run(dest.run_once())) == {moving: DivergenceKind.PINS_DIFFER}


def test_a_pass_that_cannot_read_the_ledger_audits_nothing_and_says_why(
    cloud: Cloud, host1: SimDriver
) -> None:
    metrics = AgentMetrics.create()
    reconciler = reconciler_for(
        cloud, "host9", host1, metrics, expected=lambda: expected_on_host(cloud.ledger, "host9")
    )
    report = asyncio.run(reconciler.run_once())
    assert report.audited == []
    assert report.error is not None and NotFound.__name__ in report.error
    assert sample(metrics, "stowage_reconcile_pass_failures_total", host="host9") == 1
    assert sample(metrics, "stowage_reconcile_passes_total", host="host9") == 0


def test_run_forever_passes_on_demand_and_keeps_going(cloud: Cloud, host1: SimDriver) -> None:
    ids = build_on(cloud, "host1", 2)
    for iid in ids:
        spawn_as_claimed(cloud, host1, iid, iid)
    metrics = AgentMetrics.create()
    reconciler = reconciler_for(cloud, "host1", host1, metrics)

    async def passes(count: int) -> None:
        deadline = time.monotonic() + 60
        while sample(metrics, "stowage_reconcile_passes_total", host="host1") < count:
            assert time.monotonic() < deadline, "no reconcile pass"
            await asyncio.sleep(0.01)

    async def scenario() -> ReconcileReport | None:
        task = asyncio.create_task(reconciler.run_forever(interval_s=3600))
        try:
            await passes(1)
            assert reconciler.last_report is not None
            assert reconciler.last_report.divergences == []
            host1.destroy(ids[0])
            reconciler.trigger()  # an hour early
            await passes(2)
            return reconciler.last_report
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    report = asyncio.run(scenario())
    assert report is not None
    assert kinds(report) == {ids[0]: DivergenceKind.MISSING_INSTANCE}


# --- agent metrics ----------------------------------------------------------------------


def test_agent_heartbeat_gaps_and_loop_lag_are_observed_once_each(host1: SimDriver) -> None:
    config = AgentConfig(heartbeat_interval_s=0.02, lag_interval_s=0.01)
    agent = Agent(host1, heartbeat=lambda: None, config=config)
    metrics = AgentMetrics.create()
    other = AgentMetrics.create()  # a registry per instance: two never clash

    async def scenario() -> tuple[int, int]:
        async with agent:
            observer = observe_agent(metrics, "host1", agent)
            deadline = time.monotonic() + 60
            while len(agent.heartbeat_gaps_s) < 3 or len(agent.watchdog.samples) < 3:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            observer.observe()
            await asyncio.sleep(0.05)
            observer.observe()  # only what is new since the first call is counted
            seen = len(agent.heartbeat_gaps_s), len(agent.watchdog.samples)
            observer.observe()  # nothing new since (no await in between): nothing counted
            result = await agent.spawn("op-1", "vm-1", {0: 2}, [0], 256)
            record_op(metrics, "host1", result)
            return seen

    gaps, lags = asyncio.run(scenario())
    count = "stowage_agent_heartbeat_gap_seconds_count"
    assert sample(metrics, count, host="host1") == gaps
    assert sample(metrics, "stowage_agent_loop_lag_seconds_count", host="host1") == lags
    assert sample(other, count, host="host1") == 0
    assert (
        sample(
            metrics, "stowage_agent_ops_total", host="host1", operation="spawn", result="success"
        )
        == 1
    )
    assert b"stowage_agent_heartbeat_gap_seconds_bucket" in render(metrics.registry)
