"""The conductor on a real ledger (SQLite and PostgreSQL) with agents on the in-process bus:
several conductors share the operations table and every step runs once; a dead
conductor's operations are resumed by another; an agent that is stopped leaves a move in
`error` with both ends held, and its return settles it."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import traceback
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event

from stowage.agent.server import AgentServer
from stowage.bus.inproc import InProcTransport
from stowage.domain.topology import HostSpec, HostTopology
from stowage.ledger import Ledger, audit
from stowage.services import migrations
from stowage.services.cloud import Cloud, CloudConfig
from stowage.services.compute import BuildRequest, build_servers
from stowage.services.conductor import Conductor, ConductorConfig
from stowage.virt.sim import SimConfig, SimDriver

TOPOLOGY = HostTopology.uniform(cells=2, cores_per_cell=8, threads_per_core=2)
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
FAST = ConductorConfig(call_timeout_s=1.0, poll_s=0.05, retry_s=0.1, retry_max_s=0.3)


@pytest.fixture
def cloud(db_url: str, tmp_path: Path) -> Iterator[Cloud]:
    ledger = Ledger.open(db_url)
    for name in HOSTS:
        ledger.register_host(HostSpec(name, TOPOLOGY, disk_gb=100))
    ledger.heartbeat()
    cloud = Cloud(CloudConfig(state_dir=tmp_path / "state"), ledger)
    # Quotas are taken with the instances; these tests are about the conductor, not quotas.
    cloud.objects.create("quota", "p", {"instances": -1, "cores": -1, "ram": -1})
    yield cloud
    ledger.close()


@contextlib.asynccontextmanager
async def agents(cloud: Cloud, tmp_path: Path) -> AsyncIterator[tuple[Any, dict[str, Any]]]:
    bus = InProcTransport()
    servers = {}
    for name in HOSTS:
        driver = SimDriver(SimConfig(disk_bytes=4096), disk_dir=tmp_path / name)
        server = AgentServer(name, driver, bus, lambda n=name: cloud.ledger.heartbeat([n]))
        await server.serve()
        servers[name] = server
    try:
        yield bus, servers
    finally:
        for server in servers.values():
            await server.close()
        await bus.close()


def build(cloud: Cloud, count: int, host: str) -> list[str]:
    docs = build_servers(
        cloud,
        BuildRequest(
            name="vm",
            flavor=PINNED,
            image_id="img",
            project_id="p",
            user_id="u",
            min_count=count,
            max_count=count,
            force_host=host,
            networks="none",
        ),
        request_id="req-conductor",
    )
    return [str(d["id"]) for d in docs]


async def until(cloud: Cloud, check: Any, timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await asyncio.to_thread(check):
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


def statuses(cloud: Cloud, ids: list[str]) -> list[str]:
    return [str(cloud.objects.get("instance", i).body["status"]) for i in ids]


def test_two_conductors_share_the_work_and_each_spawn_runs_once(
    cloud: Cloud, tmp_path: Path
) -> None:
    async def scenario() -> None:
        async with agents(cloud, tmp_path) as (bus, servers):
            conductors = [Conductor(cloud, bus, FAST, owner=f"c{i}") for i in range(2)]
            tasks = [asyncio.create_task(c.run(take_over=False)) for c in conductors]
            ids = await asyncio.to_thread(build, cloud, 12, "host1")
            await until(cloud, lambda: statuses(cloud, ids) == ["ACTIVE"] * 12)
            await until(cloud, lambda: not cloud.operations.active())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            driver = servers["host1"].driver
            spawned = [iid for op, iid in driver.calls if op == "spawn"]
            assert sorted(spawned) == sorted(ids)  # once each, whichever conductor drove it
            assert sorted(driver.running()) == sorted(ids)
            for iid in ids:  # each create's action records its spawn, once
                events = cloud.objects.get("instance_action", f"req-conductor:{iid}").body
                spawns = [e for e in events["events"] if e["event"] == "compute_build_spawn"]
                assert [(e["result"], e["host"]) for e in spawns] == [("Success", "host1")]

    asyncio.run(scenario())
    assert audit(cloud.ledger) == []


def test_a_dead_conductors_operations_are_resumed(cloud: Cloud, tmp_path: Path) -> None:
    async def scenario() -> None:
        async with agents(cloud, tmp_path) as (bus, servers):
            ids = await asyncio.to_thread(build, cloud, 3, "host2")
            # A conductor leased the request's operation and died: its lease is still valid for
            # a while. The three instances are scheduled, and then spawned, by the survivor.
            dead = await asyncio.to_thread(cloud.operations.lease, "dead", lease_s=0.5, limit=10)
            assert [(op.kind, op.step) for op in dead] == [("build", "schedule")]
            survivor = Conductor(cloud, bus, FAST, owner="survivor")
            task = asyncio.create_task(survivor.run(take_over=False))
            await until(cloud, lambda: statuses(cloud, ids) == ["ACTIVE"] * 3)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            assert sorted(servers["host2"].driver.running()) == sorted(ids)

    asyncio.run(scenario())


def test_a_stopped_destination_leaves_error_then_failed_holding_nothing(
    cloud: Cloud, tmp_path: Path
) -> None:
    async def scenario() -> None:
        async with agents(cloud, tmp_path) as (bus, servers):
            conductor = Conductor(cloud, bus, FAST)
            task = asyncio.create_task(conductor.run())
            (vm,) = await asyncio.to_thread(build, cloud, 1, "host1")
            await until(cloud, lambda: statuses(cloud, [vm]) == ["ACTIVE"])
            servers["host2"].stop()
            result = await asyncio.to_thread(
                migrations.move, cloud, vm, "live-migration", user_id="u", project_id="p",
                dest="host2",
            )  # fmt: skip

            def status() -> str:
                return str(cloud.objects.get("migration", result.migration_id).body["status"])

            await until(cloud, lambda: status() == "error")
            assert cloud.ledger.consumer_host(result.migration_id) is not None  # held
            servers["host2"].start()
            await until(cloud, lambda: status() == "failed")
            assert cloud.ledger.consumer_host(result.migration_id) is None  # gone with it
            assert statuses(cloud, [vm]) == ["ACTIVE"]
            assert servers["host2"].driver.running() == {}
            assert sorted(servers["host1"].driver.running()) == [vm]
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
    assert audit(cloud.ledger) == []


async def _cold_move(cloud: Cloud, vm: str, kind: str) -> Any:
    """A cold migration (or a resize to a flavor with a bigger disk) of `vm` to host2."""
    bigger = {**PINNED, "id": "p2", "name": "pinned.2", "disk": 2}
    return await asyncio.to_thread(
        migrations.move, cloud, vm, kind, user_id="u", project_id="p", dest="host2",
        new_flavor=bigger if kind == "resize" else None,
    )  # fmt: skip


@pytest.mark.parametrize("kind", ["migration", "resize"])
def test_a_cold_move_stops_the_source_guest_and_a_revert_starts_it_again(
    cloud: Cloud, tmp_path: Path, kind: str
) -> None:
    """Before the fix the source guest kept running while its disk was copied (a copy that
    is not consistent) and through VERIFY_RESIZE, beside its copy on the destination. Now,
    as Nova's migrate_disk_and_power_off: stopped before the copy, and a revert runs it
    again on the source."""
    from stowage.virt.driver import InstanceState

    async def scenario() -> None:
        async with agents(cloud, tmp_path) as (bus, servers):
            conductor = Conductor(cloud, bus, FAST)
            task = asyncio.create_task(conductor.run())
            (vm,) = await asyncio.to_thread(build, cloud, 1, "host1")
            await until(cloud, lambda: statuses(cloud, [vm]) == ["ACTIVE"])
            await _cold_move(cloud, vm, kind)
            await until(cloud, lambda: statuses(cloud, [vm]) == ["VERIFY_RESIZE"])
            source, dest = servers["host1"].driver, servers["host2"].driver
            assert source.running()[vm]["state"] == InstanceState.SHUTOFF
            assert dest.running()[vm]["state"] == InstanceState.RUNNING
            calls = [op for op, iid in source.calls if iid == vm]
            assert calls.index("power_off") < calls.index("export_disk")
            await asyncio.to_thread(migrations.revert_resize, cloud, vm)
            await until(cloud, lambda: statuses(cloud, [vm]) == ["ACTIVE"])
            await until(cloud, lambda: not cloud.operations.active())
            assert cloud.objects.get("instance", vm).body["host"] == "host1"
            assert source.running()[vm]["state"] == InstanceState.RUNNING
            assert vm not in dest.running()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
    assert audit(cloud.ledger) == []


@pytest.mark.parametrize("kind", ["migration", "resize"])
def test_a_cold_move_takes_the_instances_disk_to_the_destination(
    cloud: Cloud, tmp_path: Path, kind: str
) -> None:
    """Cold migration and resize move the disk (the guest's data), not a new one from the
    image: what only this instance's disk holds is on the destination after the confirm."""

    async def scenario() -> None:
        async with agents(cloud, tmp_path) as (bus, servers):
            conductor = Conductor(cloud, bus, FAST)
            task = asyncio.create_task(conductor.run())
            (vm,) = await asyncio.to_thread(build, cloud, 1, "host1")
            await until(cloud, lambda: statuses(cloud, [vm]) == ["ACTIVE"])
            source_disk = tmp_path / "host1" / f"{vm}.img"
            # What this instance wrote: bytes no other disk holds.
            data = f"written by {vm}".encode() + source_disk.read_bytes()
            source_disk.write_bytes(data)
            result = await _cold_move(cloud, vm, kind)
            await until(cloud, lambda: statuses(cloud, [vm]) == ["VERIFY_RESIZE"])
            await asyncio.to_thread(migrations.confirm_resize, cloud, vm)
            await until(cloud, lambda: statuses(cloud, [vm]) == ["ACTIVE"])
            await until(cloud, lambda: not cloud.operations.active())
            assert cloud.objects.get("instance", vm).body["host"] == "host2"
            assert result.migration_id is not None
            assert (tmp_path / "host2" / f"{vm}.img").read_bytes() == data
            assert not list((tmp_path / "host1").glob(f"{vm}*"))  # the source's copy is gone
            calls = [op for op, iid in servers["host1"].driver.calls if iid == vm]
            assert "export_disk" in calls
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
    assert audit(cloud.ledger) == []


def test_the_conductor_never_uses_the_ledger_on_its_event_loop(
    cloud: Cloud, tmp_path: Path
) -> None:
    """Before the fix, an interface detach read its port and a live migration's memory
    copy wrote its record on the loop: every other operation waited for that round trip."""
    on_loop: list[str] = []

    def checkout(*_: Any) -> None:
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop()
            frames = traceback.extract_stack()
            ours = [f for f in frames if f.filename.endswith("services/conductor.py")]
            if ours:
                on_loop.append(f"{ours[-1].name}:{ours[-1].lineno}")

    event.listen(cloud.ledger.engine, "checkout", checkout)

    async def scenario() -> None:
        async with agents(cloud, tmp_path) as (bus, _servers):
            conductor = Conductor(cloud, bus, FAST)
            task = asyncio.create_task(conductor.run())
            (vm,) = await asyncio.to_thread(build, cloud, 1, "host1")
            await until(cloud, lambda: statuses(cloud, [vm]) == ["ACTIVE"])
            payload = {"mac": "fa:16:3e:00:00:01", "port_id": "no-such-port"}
            await asyncio.to_thread(
                cloud.operations.enqueue, "interface-detach", vm, "host1",
                step="detach_interface", payload=payload,
            )  # fmt: skip
            conductor.kick()
            await until(cloud, lambda: not cloud.operations.active())
            result = await asyncio.to_thread(
                migrations.move, cloud, vm, "live-migration", user_id="u", project_id="p",
                dest="host2",
            )  # fmt: skip

            def status() -> str:
                return str(cloud.objects.get("migration", result.migration_id).body["status"])

            await until(cloud, lambda: status() == "completed")
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
    event.remove(cloud.ledger.engine, "checkout", checkout)
    assert on_loop == []


# --- a process that schedules for its life reads its view before it serves -----------------


def _freezing(cloud: Cloud) -> Cloud:
    frozen = Cloud(
        CloudConfig(state_dir=cloud.config.state_dir, scheduler_freeze_view=True), cloud.ledger
    )
    assert frozen.scheduler.freeze_view and frozen.scheduler.view is None
    return frozen


def test_a_freezing_conductor_reads_the_view_and_freezes_before_its_first_lease(
    cloud: Cloud, tmp_path: Path, thawed: None
) -> None:
    """The freeze's first full collection stalled every request in flight when it ran
    under the first creates; it belongs before the conductor takes work."""
    frozen = _freezing(cloud)
    leased_with: list[object] = []

    async def scenario() -> None:
        async with agents(frozen, tmp_path) as (bus, _servers):
            conductor = Conductor(frozen, bus, FAST, owner="c1")
            lease = conductor.ops.lease

            def noting(*args: Any, **kwargs: Any) -> Any:
                leased_with.append(frozen.scheduler.view)
                return lease(*args, **kwargs)

            conductor.ops.lease = noting  # type: ignore[method-assign]
            task = asyncio.create_task(conductor.run())
            while not leased_with:
                await asyncio.sleep(0.01)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    asyncio.run(scenario())
    assert leased_with[0] is not None
    assert gc.get_freeze_count() > 0


def test_stowage_up_reads_the_view_and_freezes_before_the_api_serves(
    cloud: Cloud, thawed: None
) -> None:
    from stowage.agent.local import LocalCompute

    frozen = _freezing(cloud)
    local = LocalCompute(frozen)
    local.start_thread()  # what the API's lifespan waits for before it serves
    try:
        assert frozen.scheduler.view is not None
        assert gc.get_freeze_count() > 0
    finally:
        local.stop_thread()


def test_a_scheduler_that_does_not_freeze_is_not_warmed(cloud: Cloud) -> None:
    cloud.scheduler.warm()
    assert cloud.scheduler.view is None


def test_a_poll_that_leases_nothing_reads_nothing_more(cloud: Cloud, tmp_path: Path) -> None:
    """The conductor polls every `poll_s` and at every kick: with nothing due, the due read is
    the poll's one statement (it read the clean-ups for no operation before)."""
    statements: list[str] = []

    def note(_c: Any, _cur: Any, statement: str, *_rest: Any) -> None:
        if "hosts" not in statement:  # not the agents' heartbeats
            statements.append(statement)

    async def scenario() -> None:
        async with agents(cloud, tmp_path) as (bus, _servers):
            conductor = Conductor(cloud, bus, FAST, owner="c1")
            event.listen(cloud.ledger.engine, "before_cursor_execute", note)
            try:
                await conductor._lease_and_start()
            finally:
                event.remove(cloud.ledger.engine, "before_cursor_execute", note)

    asyncio.run(scenario())
    assert len(statements) == 1 and "FROM operations" in statements[0], statements
