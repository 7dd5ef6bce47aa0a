"""Recovery on a real ledger (SQLite and PostgreSQL) with agents on the in-process bus and a
real conductor: a guest that vanished puts its server into Nova's state for it (SHUTOFF,
power state NOSTATE, a fault and an instance action) and `start` brings it back; a guest
whose instance is deleted or lives elsewhere is reaped as `running_deleted_instance_action`
says; a fresh simulated hypervisor is refilled from the ledger."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from stowage.agent.local import make_reconciler, restore_guests
from stowage.agent.metrics import AgentMetrics
from stowage.agent.server import AgentServer
from stowage.bus.inproc import InProcTransport
from stowage.domain.topology import HostSpec, HostTopology
from stowage.ledger import Ledger, audit
from stowage.services import compute
from stowage.services.caller import SystemCaller
from stowage.services.cloud import Cloud, CloudConfig
from stowage.services.compute import BuildRequest, build_servers, schedule_builds
from stowage.services.conductor import Conductor, ConductorConfig
from stowage.services.reconcile import DivergenceKind
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


def _cloud(db_url: str, tmp_path: Path, **config: Any) -> Cloud:
    ledger = Ledger.open(db_url)
    for name in HOSTS:
        ledger.register_host(HostSpec(name, TOPOLOGY, disk_gb=100))
    ledger.heartbeat()
    return Cloud(CloudConfig(state_dir=tmp_path / "state", **config), ledger)


@pytest.fixture
def cloud(db_url: str, tmp_path: Path) -> Iterator[Cloud]:
    cloud = _cloud(db_url, tmp_path)
    yield cloud
    cloud.ledger.close()


@contextlib.asynccontextmanager
async def running_cloud(cloud: Cloud, tmp_path: Path) -> AsyncIterator[dict[str, AgentServer]]:
    """Agents on both hosts and one conductor, until the block ends."""
    bus = InProcTransport()
    servers = {}
    for name in HOSTS:
        driver = SimDriver(SimConfig(disk_bytes=4096), disk_dir=tmp_path / name)
        server = AgentServer(name, driver, bus, lambda n=name: cloud.ledger.heartbeat([n]))
        await server.serve()
        servers[name] = server
    config = dataclasses.replace(FAST, live_migration_transfer_s=cloud.config.live_migration_s)
    conductor = Conductor(cloud, bus, config, owner="recovery")
    cloud.kick = conductor.kick
    task = asyncio.create_task(conductor.run())
    try:
        yield servers
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
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
        request_id="req-recovery",
    )
    # The conductor's scheduling step: claimed on `host`, the spawn still pending.
    schedule_builds(cloud, [op for op in cloud.operations.active() if op.step == "schedule"])
    return [str(d["id"]) for d in docs]


async def until(check: Any, timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await asyncio.to_thread(check):
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


def state(cloud: Cloud, instance_id: str) -> tuple[Any, ...]:
    body = cloud.objects.get("instance", instance_id).body
    return body["status"], body["vm_state"], body["power_state"], body["task_state"]


def faults(cloud: Cloud, instance_id: str) -> list[str]:
    return [
        str(d.body["error_code"])
        for d in cloud.objects.list("instance_fault", project_id=instance_id)
    ]


def reconcile_actions(cloud: Cloud, instance_id: str) -> list[dict[str, Any]]:
    return [
        d.body
        for d in cloud.objects.list("instance_action", project_id=instance_id)
        if d.body["action"] == "reconcile"
    ]


def test_a_vanished_guest_stops_its_server_once_and_start_spawns_it_again(
    cloud: Cloud, tmp_path: Path
) -> None:
    async def scenario() -> None:
        async with running_cloud(cloud, tmp_path) as servers:
            gone, kept = await asyncio.to_thread(build, cloud, 2, "host1")
            await until(lambda: [state(cloud, i)[0] for i in (gone, kept)] == ["ACTIVE"] * 2)
            driver = servers["host1"].driver
            assert isinstance(driver, SimDriver)
            await asyncio.to_thread(driver.destroy, gone)  # behind the ledger's back
            reconciler = make_reconciler(cloud, "host1", servers["host1"], AgentMetrics.create())
            report = await reconciler.run_once()
            assert [(d.instance_id, d.kind) for d in report.divergences] == [
                (gone, DivergenceKind.MISSING_INSTANCE)
            ]
            # Nova's state for a guest that is gone, never "ACTIVE, Running" forever.
            assert state(cloud, gone) == ("SHUTOFF", "stopped", 0, None)
            assert state(cloud, kept) == ("ACTIVE", "active", 1, None)
            body = cloud.objects.get("instance", gone).body
            assert body["fault"]["code"] == 500 and "vanished" in body["fault"]["message"]
            assert faults(cloud, gone) == ["reconcile.missing_instance"]
            [action] = reconcile_actions(cloud, gone)
            assert action["events"][0]["result"] == "Error"
            # The next pass sees the same thing and records nothing new.
            again = await reconciler.run_once()
            assert [d.instance_id for d in again.divergences] == [gone]
            assert faults(cloud, gone) == ["reconcile.missing_instance"]
            assert len(reconcile_actions(cloud, gone)) == 1
            # `openstack server start` defines the guest again with its claim.
            await asyncio.to_thread(compute.power_action, cloud, gone, "os-start", is_admin=True)
            await until(lambda: state(cloud, gone) == ("ACTIVE", "active", 1, None))
            assert cloud.objects.get("instance", gone).body["fault"] is None
            assert sorted(driver.running()) == sorted([gone, kept])
            assert (await reconciler.run_once()).divergences == []

    asyncio.run(scenario())
    assert audit(cloud.ledger) == []


def test_a_vanished_guest_of_a_busy_server_is_left_to_its_operation(
    cloud: Cloud, tmp_path: Path
) -> None:
    [instance_id] = build(cloud, 1, "host1")  # its build operation is still pending
    from stowage.services.reconcile import Divergence, settle_vanished

    divergence = Divergence(DivergenceKind.MISSING_INSTANCE, instance_id, "gone")
    assert not settle_vanished(cloud, "host1", divergence)
    assert state(cloud, instance_id)[0] == "BUILD"


def _orphan_record(cloud: Cloud, elsewhere: bool) -> str:
    """What the ledger says of a guest left on host1: its instance deleted, or now on host2.
    Made before a conductor runs: one running meanwhile would drive the build itself (a
    race a loaded CI machine lost: the guest was there already when the test spawned it)."""
    [instance_id] = build(cloud, 1, "host2" if elsewhere else "host1")
    for op in cloud.operations.active(instance_id=instance_id):
        cloud.operations.update(op.id, state="done")
    if not elsewhere:

        def gone(conn: Any) -> None:
            cloud.objects.delete_in(conn, "instance", instance_id)

        cloud.ledger.release(instance_id, also=gone)
    return instance_id


def _orphan(driver: SimDriver, instance_id: str) -> str:
    """The guest itself, left running on host1."""
    driver.spawn(instance_id, {0: 2}, [0], 256)
    return instance_id


@pytest.mark.parametrize("elsewhere", [False, True], ids=["deleted", "elsewhere"])
def test_a_guest_whose_instance_is_deleted_or_elsewhere_is_reaped(
    cloud: Cloud, tmp_path: Path, elsewhere: bool
) -> None:
    record = _orphan_record(cloud, elsewhere)

    async def scenario() -> None:
        async with running_cloud(cloud, tmp_path) as servers:
            driver = servers["host1"].driver
            assert isinstance(driver, SimDriver)
            orphan = await asyncio.to_thread(_orphan, driver, record)
            reconciler = make_reconciler(cloud, "host1", servers["host1"], AgentMetrics.create())
            report = await reconciler.run_once()
            assert [(d.instance_id, d.kind) for d in report.divergences] == [
                (orphan, DivergenceKind.UNKNOWN_INSTANCE)
            ]
            assert faults(cloud, orphan) == ["reconcile.unknown_instance"]
            await until(lambda: orphan not in driver.running())
            await until(lambda: not cloud.operations.active(host="host1"))
            assert (await reconciler.run_once()).divergences == []
            if elsewhere:  # the instance itself is untouched
                assert cloud.objects.get("instance", orphan).body["host"] == "host2"

    asyncio.run(scenario())
    assert audit(cloud.ledger) == []


@pytest.mark.parametrize("action", ["log", "noop"])
def test_running_deleted_instance_action_log_and_noop_leave_the_guest(
    db_url: str, tmp_path: Path, action: str
) -> None:
    cloud = _cloud(db_url, tmp_path, running_deleted_instance_action=action)

    record = _orphan_record(cloud, False)

    async def scenario() -> None:
        async with running_cloud(cloud, tmp_path) as servers:
            driver = servers["host1"].driver
            assert isinstance(driver, SimDriver)
            orphan = await asyncio.to_thread(_orphan, driver, record)
            reconciler = make_reconciler(cloud, "host1", servers["host1"], AgentMetrics.create())
            report = await reconciler.run_once()
            assert [d.kind for d in report.divergences] == [DivergenceKind.UNKNOWN_INSTANCE]
            await asyncio.sleep(0.5)  # a conductor runs: it would have reaped by now
            assert orphan in driver.running()
            assert not cloud.operations.active(host="host1")
            recorded = faults(cloud, orphan)
            assert recorded == (["reconcile.unknown_instance"] if action == "log" else [])

    try:
        asyncio.run(scenario())
    finally:
        cloud.ledger.close()


def test_a_guest_built_after_the_ledger_was_read_is_not_reaped(cloud: Cloud) -> None:
    """The pass read the ledger before the claim and the hypervisor after the spawn: the
    reap checks the ledger again in its own transaction and leaves the guest alone."""
    from stowage.services.reconcile import reap_unknown

    [instance_id] = build(cloud, 1, "host1")
    for op in cloud.operations.active(instance_id=instance_id):
        cloud.operations.update(op.id, state="done")
    assert reap_unknown(cloud, "host1", instance_id) is None
    # Placed on host2 and still running on host1 during its clean-up there: not reaped either.
    [other] = build(cloud, 1, "host2")
    for op in cloud.operations.active(instance_id=other):
        cloud.operations.update(op.id, state="done")
    cloud.operations.enqueue("cleanup", other, "host1", step="destroy")
    assert reap_unknown(cloud, "host1", other) is None
    assert [op.kind for op in cloud.operations.active(host="host1")] == ["cleanup"]


def test_restore_guests_refills_a_fresh_simulated_hypervisor(cloud: Cloud, tmp_path: Path) -> None:
    async def scenario() -> list[str]:
        async with running_cloud(cloud, tmp_path) as servers:
            ids = await asyncio.to_thread(build, cloud, 3, "host1")
            await until(lambda: [state(cloud, i)[0] for i in ids] == ["ACTIVE"] * 3)
            await asyncio.to_thread(compute.power_action, cloud, ids[0], "os-stop", is_admin=True)
            await until(lambda: state(cloud, ids[0])[0] == "SHUTOFF")
            driver = servers["host1"].driver
            assert isinstance(driver, SimDriver)
            return ids

    ids = asyncio.run(scenario())
    # The agent's process is gone; a new one starts with an empty simulated hypervisor.
    fresh = SimDriver(SimConfig(disk_bytes=4096), disk_dir=tmp_path / "host1-again")
    assert sorted(restore_guests(cloud, "host1", fresh)) == sorted(ids)
    running = fresh.running()
    assert sorted(running) == sorted(ids)
    assert [str(running[i]["state"]) for i in ids] == ["shutoff", "running", "running"]
    from stowage.services.conductor import claim_of

    for i in ids:
        claim = claim_of(cloud, i)
        assert claim is not None
        assert {str(v): c for v, c in running[i]["pins"].items()} == claim["pins"]
    assert restore_guests(cloud, "host1", fresh) == []  # already there: nothing twice
    fresh.close()


class _Admin(SystemCaller):
    @property
    def user_id(self) -> str:
        return "u"


def test_a_rescued_guest_comes_back_rescued_after_its_agent_restarts(
    cloud: Cloud, tmp_path: Path
) -> None:
    """A simulated hypervisor forgets its guests with its process: the rescued one must run
    again from its rescue image and the paused one be paused, as their records say (before:
    both restored as normal running guests while the servers still showed RESCUE, PAUSED)."""
    from stowage.services import guest_actions, images

    admin = _Admin("p", True)
    image = images.create_image(
        cloud, admin, {"name": "rescue", "disk_format": "raw", "container_format": "bare"}
    )
    images.store_image_bytes(cloud, admin, image["id"], [b"\0" * 512])
    rescue_image = str(image["id"])

    async def scenario() -> tuple[str, str, str]:
        async with running_cloud(cloud, tmp_path) as servers:
            rescued, plain, paused = await asyncio.to_thread(build, cloud, 3, "host1")
            ids = (rescued, plain, paused)
            await until(lambda: [state(cloud, i)[0] for i in ids] == ["ACTIVE"] * 3)
            await asyncio.to_thread(compute.power_action, cloud, paused, "pause", is_admin=True)
            await until(lambda: state(cloud, paused)[0] == "PAUSED")
            await asyncio.to_thread(
                guest_actions.rescue_server,
                cloud,
                admin,
                rescued,
                image_id=rescue_image,
                password="pw",
                request_id="req-rescue",
            )
            await until(lambda: state(cloud, rescued) == ("RESCUE", "rescued", 1, None))
            driver = servers["host1"].driver
            assert isinstance(driver, SimDriver)
            assert driver.guest_details()[rescued]["rescue_image"] == rescue_image
            return rescued, plain, paused

    rescued, plain, paused = asyncio.run(scenario())
    fresh = SimDriver(SimConfig(disk_bytes=4096), disk_dir=tmp_path / "host1-again")
    assert sorted(restore_guests(cloud, "host1", fresh)) == sorted([rescued, plain, paused])
    details = fresh.guest_details()
    assert details[rescued]["rescue_image"] == rescue_image  # rescued, as the record says
    assert details[plain]["rescue_image"] is None
    running = fresh.running()
    assert [str(running[i]["state"]) for i in (rescued, plain, paused)] == [
        "running",
        "running",
        "paused",
    ]
    assert state(cloud, rescued) == ("RESCUE", "rescued", 1, None)
    fresh.close()


# --- deleting a server whose move is not over -------------------------------------------


def holdings(cloud: Cloud) -> dict[str, list[str]]:
    """host -> the consumers holding claims there."""
    from sqlalchemy import select

    from stowage.ledger.db import READONLY
    from stowage.ledger.schema import allocations, consumers, hosts

    with cloud.ledger.engine.connect().execution_options(**READONLY) as conn:
        rows = conn.execute(
            select(hosts.c.name, consumers.c.id)
            .select_from(
                allocations.join(hosts, hosts.c.id == allocations.c.host_id).join(
                    consumers, consumers.c.seq == allocations.c.consumer_seq
                )
            )
            .distinct()
        ).all()
    out: dict[str, list[str]] = {}
    for host, consumer in rows:
        out.setdefault(str(host), []).append(str(consumer))
    return {h: sorted(c) for h, c in sorted(out.items())}


def guests(servers: dict[str, AgentServer]) -> dict[str, list[str]]:
    return {h: sorted(s.driver.running()) for h, s in servers.items()}


def _move(cloud: Cloud, instance_id: str, kind: str) -> str:
    from stowage.services import migrations

    result = migrations.move(cloud, instance_id, kind, user_id="u", project_id="p", dest="host2")
    assert result.dest == "host2", result
    return result.migration_id


def test_deleting_a_server_in_verify_resize_destroys_it_at_both_ends(
    cloud: Cloud, tmp_path: Path
) -> None:
    async def scenario() -> None:
        async with running_cloud(cloud, tmp_path) as servers:
            [vm] = await asyncio.to_thread(build, cloud, 1, "host1")
            await until(lambda: state(cloud, vm)[0] == "ACTIVE")
            mid = await asyncio.to_thread(_move, cloud, vm, "migration")
            await until(lambda: state(cloud, vm)[0] == "VERIFY_RESIZE")
            assert guests(servers) == {"host1": [vm], "host2": [vm]}
            assert holdings(cloud) == {"host1": [vm], "host2": [mid]}
            await asyncio.to_thread(compute.delete_server, cloud, vm)
            await until(lambda: cloud.objects.find("instance", vm) is None)
            await until(lambda: not cloud.operations.active())
            # Nothing runs anywhere, nothing is held anywhere.
            assert guests(servers) == {"host1": [], "host2": []}
            assert holdings(cloud) == {}
            record = cloud.objects.get("migration", mid).body
            assert (record["status"], record["reason"]) == ("failed", "the instance was deleted")

    asyncio.run(scenario())
    assert audit(cloud.ledger) == []


def test_deleting_a_server_during_its_live_migration_destroys_it_at_both_ends(
    db_url: str, tmp_path: Path
) -> None:
    cloud = _cloud(db_url, tmp_path, live_migration_s=60.0)  # the copy lasts: still in flight

    async def scenario() -> None:
        async with running_cloud(cloud, tmp_path) as servers:
            [vm] = await asyncio.to_thread(build, cloud, 1, "host1")
            await until(lambda: state(cloud, vm)[0] == "ACTIVE")
            mid = await asyncio.to_thread(_move, cloud, vm, "live-migration")
            await until(lambda: cloud.objects.get("migration", mid).body["status"] == "running")
            assert guests(servers) == {"host1": [vm], "host2": [vm]}
            await asyncio.to_thread(compute.delete_server, cloud, vm)
            await until(lambda: cloud.objects.find("instance", vm) is None)
            await until(lambda: not cloud.operations.active())
            assert guests(servers) == {"host1": [], "host2": []}
            assert holdings(cloud) == {}
            assert cloud.objects.get("migration", mid).body["status"] == "failed"

    try:
        asyncio.run(scenario())
        assert audit(cloud.ledger) == []
    finally:
        cloud.ledger.close()


def test_a_deleted_servers_destination_stays_held_until_it_is_known_clean(
    cloud: Cloud, tmp_path: Path
) -> None:
    async def scenario() -> None:
        async with running_cloud(cloud, tmp_path) as servers:
            [vm] = await asyncio.to_thread(build, cloud, 1, "host1")
            await until(lambda: state(cloud, vm)[0] == "ACTIVE")
            mid = await asyncio.to_thread(_move, cloud, vm, "resize")
            await until(lambda: state(cloud, vm)[0] == "VERIFY_RESIZE")
            servers["host2"].stop()  # the destination's agent stops answering
            await asyncio.to_thread(compute.delete_server, cloud, vm)
            await until(lambda: cloud.objects.find("instance", vm) is None)
            await asyncio.sleep(1.5)  # several tries of the destination's clean-up
            # Unknown there: its claims stay with the migration, and the record says so.
            assert holdings(cloud) == {"host2": [mid]}
            assert cloud.objects.get("migration", mid).body["status"] == "error"
            assert [op.kind for op in cloud.operations.active(host="host2")] == ["cleanup"]
            assert audit(cloud.ledger) == []
            servers["host2"].start()
            await until(lambda: not cloud.operations.active(), 30)
            assert guests(servers) == {"host1": [], "host2": []}
            assert holdings(cloud) == {}
            assert cloud.objects.get("migration", mid).body["status"] == "failed"

    asyncio.run(scenario())
    assert audit(cloud.ledger) == []


def test_a_move_step_that_ends_after_the_delete_commits_nothing(
    db_url: str, tmp_path: Path
) -> None:
    """The conductor is still copying memory when the server is deleted: the copy's end
    must not write its migration back to `post-migrating` (nor bring its operation back)."""
    cloud = _cloud(db_url, tmp_path, live_migration_s=1.5)

    async def scenario() -> None:
        async with running_cloud(cloud, tmp_path) as servers:
            [vm] = await asyncio.to_thread(build, cloud, 1, "host1")
            await until(lambda: state(cloud, vm)[0] == "ACTIVE")
            mid = await asyncio.to_thread(_move, cloud, vm, "live-migration")
            await until(lambda: cloud.objects.get("migration", mid).body["status"] == "running")
            await asyncio.to_thread(compute.delete_server, cloud, vm)
            await until(lambda: cloud.objects.find("instance", vm) is None)
            await asyncio.sleep(2.5)  # past the end of the copy
            await until(lambda: not cloud.operations.active())
            assert cloud.objects.get("migration", mid).body["status"] == "failed"
            assert guests(servers) == {"host1": [], "host2": []}
            assert holdings(cloud) == {}

    try:
        asyncio.run(scenario())
        assert audit(cloud.ledger) == []
    finally:
        cloud.ledger.close()
