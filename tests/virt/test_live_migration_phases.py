"""Live migration through the driver port's phases, driven by the conductor on a real ledger
with simulated hypervisors: prepare on the destination, migrate from the source with progress
into the record, finish on the destination; and a repeated migrate after the guest left."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from stowage.agent.server import AgentServer
from stowage.api.compute.microversion import Microversion
from stowage.api.compute.migrations import _server_migration_view
from stowage.bus.inproc import InProcTransport
from stowage.domain.topology import HostSpec, HostTopology
from stowage.ledger import Ledger, audit
from stowage.services import migrations
from stowage.services.cloud import Cloud, CloudConfig
from stowage.services.compute import BuildRequest, build_servers
from stowage.services.conductor import Conductor, ConductorConfig
from stowage.virt.driver import InstanceState
from stowage.virt.sim import FaultKind, SimConfig, SimDriver

TOPOLOGY = HostTopology.uniform(cells=2, cores_per_cell=4, threads_per_core=2)
PINNED = {
    "id": "p1",
    "name": "pinned.1",
    "vcpus": 1,
    "ram": 256,
    "disk": 1,
    "ephemeral": 0,
    "extra_specs": {"hw:cpu_policy": "dedicated"},
}
HOSTS = ("host1", "host2")
FAST = ConductorConfig(call_timeout_s=5.0, poll_s=0.05, retry_s=0.1, retry_max_s=0.3)


@pytest.fixture
def cloud(tmp_path: Path) -> Iterator[Cloud]:
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'ledger.db'}")
    for name in HOSTS:
        ledger.register_host(HostSpec(name, TOPOLOGY, disk_gb=100))
    ledger.heartbeat()
    yield Cloud(CloudConfig(state_dir=tmp_path / "state"), ledger)
    ledger.close()


@contextlib.asynccontextmanager
async def agents(
    cloud: Cloud, tmp_path: Path, latency: dict[str, float]
) -> AsyncIterator[dict[str, AgentServer]]:
    bus = InProcTransport()
    servers = {}
    for name in HOSTS:
        driver = SimDriver(
            SimConfig(disk_bytes=4096, step_latency_s=latency), disk_dir=tmp_path / name
        )
        server = AgentServer(name, driver, bus, lambda n=name: cloud.ledger.heartbeat([n]))
        await server.serve()
        servers[name] = server
    conductor = Conductor(cloud, bus, FAST)
    task = asyncio.create_task(conductor.run())
    try:
        yield servers
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for server in servers.values():
            await server.close()
        await bus.close()


async def until(check: Any, timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await asyncio.to_thread(check):
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


def _build(cloud: Cloud) -> str:
    (doc,) = build_servers(
        cloud,
        BuildRequest(
            name="vm",
            flavor=PINNED,
            image_id="img",
            project_id="p",
            user_id="u",
            min_count=1,
            max_count=1,
            force_host="host1",
            networks="none",
        ),
        request_id="req-phases",
    )
    return str(doc["id"])


def _status(cloud: Cloud, kind: str, doc_id: str) -> str:
    return str(cloud.objects.get(kind, doc_id).body["status"])


def _sim(server: AgentServer) -> SimDriver:
    assert isinstance(server.driver, SimDriver)
    return server.driver


def test_live_migration_runs_the_port_phases_with_progress(cloud: Cloud, tmp_path: Path) -> None:
    async def scenario() -> None:
        # The memory copy takes 2.5 s, so the conductor sees the job and records progress.
        async with agents(cloud, tmp_path, {"migrate.transfer": 2.5}) as servers:
            vm = await asyncio.to_thread(_build, cloud)
            await until(lambda: _status(cloud, "instance", vm) == "ACTIVE")
            result = await asyncio.to_thread(
                migrations.move, cloud, vm, "live-migration", user_id="u", project_id="p",
                dest="host2",
            )  # fmt: skip
            mid = result.migration_id
            await until(lambda: _status(cloud, "migration", mid) == "completed")
            src, dst = _sim(servers["host1"]), _sim(servers["host2"])
            assert [op for op, iid in dst.calls if iid == vm] == [
                "prepare_migration",
                "finish_migration",
            ]
            assert [op for op, iid in src.calls if iid == vm] == ["spawn", "migrate", "destroy"]
            assert "spawn" not in [op for op, iid in dst.calls if iid == vm]  # not rebuilt
            doc = cloud.objects.get("migration", mid)
            assert doc.body["memory_total_bytes"] == 256 * 1024 * 1024
            # GET /servers/{id}/migrations/{id} shows it (Nova's fields).
            view = _server_migration_view(doc, Microversion((2, 80)))
            assert view["server_uuid"] == vm
            assert view["memory_total_bytes"] == 256 * 1024 * 1024
            assert view["disk_total_bytes"] == 0
            assert dst.running()[vm]["state"] is InstanceState.RUNNING
            assert vm not in src.running()

    asyncio.run(scenario())
    assert audit(cloud.ledger) == []


def test_a_repeated_migrate_after_the_guest_left_does_not_undo_it(
    cloud: Cloud, tmp_path: Path
) -> None:
    """The destination fails to finish once: the step runs again and asks the source to
    migrate a guest it no longer has. The guest runs on the destination, so the migration
    completes there; undoing the destination would have destroyed the only copy."""

    async def scenario() -> None:
        async with agents(cloud, tmp_path, {}) as servers:
            vm = await asyncio.to_thread(_build, cloud)
            await until(lambda: _status(cloud, "instance", vm) == "ACTIVE")
            dst = _sim(servers["host2"])
            dst.inject("finish_migration", "start", FaultKind.FAIL)
            result = await asyncio.to_thread(
                migrations.move, cloud, vm, "live-migration", user_id="u", project_id="p",
                dest="host2",
            )  # fmt: skip
            mid = result.migration_id
            await until(lambda: _status(cloud, "migration", mid) in ("completed", "failed"))
            assert _status(cloud, "migration", mid) == "completed"
            assert dst.running()[vm]["state"] is InstanceState.RUNNING
            assert cloud.objects.get("instance", vm).body["host"] == "host2"

    asyncio.run(scenario())
    assert audit(cloud.ledger) == []


def test_pause_and_suspend_reach_the_hypervisor(cloud: Cloud, tmp_path: Path) -> None:
    """Pause, unpause, suspend and resume are carried out by the host's driver (they were
    document-only changes before: the guest kept running)."""
    from stowage.services.compute import power_action

    async def scenario() -> None:
        async with agents(cloud, tmp_path, {}) as servers:
            vm = await asyncio.to_thread(_build, cloud)
            await until(lambda: _status(cloud, "instance", vm) == "ACTIVE")
            sim = _sim(servers["host1"])
            for action, status, state in (
                ("pause", "PAUSED", InstanceState.PAUSED),
                ("unpause", "ACTIVE", InstanceState.RUNNING),
                ("suspend", "SUSPENDED", InstanceState.SUSPENDED),
                ("resume", "ACTIVE", InstanceState.RUNNING),
            ):
                await asyncio.to_thread(power_action, cloud, vm, action, is_admin=True)
                await until(lambda status=status: _status(cloud, "instance", vm) == status)
                assert sim.running()[vm]["state"] is state, action
            assert [op for op, iid in sim.calls if iid == vm][1:] == [
                "pause",
                "unpause",
                "suspend",
                "resume",
            ]

    asyncio.run(scenario())
