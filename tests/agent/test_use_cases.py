"""Use cases as units of work (issue 9): a server create and every move commit whole or leave
nothing, whatever commit a crash hits; what they commit the conductor drives to an end;
quotas are counted inside the create's transaction (processes racing on PostgreSQL); a
host's evacuation reports every instance and never stops half-way."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, event, func, select
from tests.agent.test_conductor import FAST, PINNED, TOPOLOGY, until

from stowage.agent.server import AgentServer
from stowage.bus.inproc import InProcTransport
from stowage.domain.errors import NotFound, QuotaExceeded
from stowage.domain.groups import parse_group
from stowage.domain.topology import HostSpec
from stowage.ledger import Ledger
from stowage.ledger.schema import objects, operations
from stowage.services import migrations
from stowage.services.audit import audit_cloud
from stowage.services.cloud import Cloud, CloudConfig
from stowage.services.compute import (
    BuildRequest,
    build_servers,
    delete_server,
    power_action,
    rebuild_server,
    schedule_builds,
)
from stowage.services.conductor import Conductor, ConductorConfig
from stowage.services.groups import create_server_group
from stowage.virt.sim import FaultKind, SimConfig, SimDriver

HOSTS = ("host1", "host2", "host3")
SHARED = {**PINNED, "id": "s1", "name": "shared.1", "extra_specs": {}}


class Crash(BaseException):
    """The process dies here: nothing after this point of the use case runs."""


@contextlib.contextmanager
def crash_at_commit(engine: Engine, nth: int) -> Iterator[list[int]]:
    """Let the first `nth - 1` commits through; the `nth` never lands (the process died)."""
    seen = [0]

    def on_commit(_conn: Any) -> None:
        seen[0] += 1
        if seen[0] == nth:
            raise Crash(f"crash at commit {nth}")

    event.listen(engine, "commit", on_commit)
    try:
        yield seen
    finally:
        event.remove(engine, "commit", on_commit)


def open_cloud(url: str, state: Path, **config: Any) -> Cloud:
    ledger = Ledger.open(url)
    for name in HOSTS:
        if name not in set(_host_names(ledger)):
            ledger.register_host(HostSpec(name, TOPOLOGY, disk_gb=100))
    ledger.heartbeat()
    cloud = Cloud(CloudConfig(state_dir=state, **config), ledger)
    if cloud.objects.find("domain", "default") is None:  # a cloud, not a bare ledger: audited
        cloud.objects.create("domain", "default", {"id": "default", "name": "Default"})
    return cloud


def _host_names(ledger: Ledger) -> list[str]:
    from stowage.ledger.schema import hosts

    with ledger.engine.connect() as conn:
        return list(conn.execute(select(hosts.c.name)).scalars())


@pytest.fixture
def cloud(db_url: str, tmp_path: Path) -> Iterator[Cloud]:
    made = open_cloud(db_url, tmp_path / "state")
    yield made
    made.ledger.close()


def request(
    count: int = 1,
    *,
    min_count: int = 1,
    flavor: dict[str, Any] = SHARED,
    project: str = "p",
    **kw: Any,
) -> BuildRequest:
    return BuildRequest(
        name="vm",
        flavor=flavor,
        image_id="img",
        project_id=project,
        user_id="u",
        min_count=min_count,
        max_count=count,
        networks="none",
        **kw,
    )


def instance_count(cloud: Cloud, project: str = "p") -> int:
    with cloud.ledger.engine.connect() as conn:
        return int(
            conn.execute(
                select(func.count())
                .select_from(objects)
                .where(objects.c.kind == "instance", objects.c.project_id == project)
            ).scalar_one()
        )


def open_work(cloud: Cloud) -> list[tuple[str, str, str]]:
    with cloud.ledger.engine.connect() as conn:
        rows = conn.execute(
            select(operations.c.kind, operations.c.step, operations.c.state).where(
                operations.c.state.in_(("pending", "unknown"))
            )
        ).all()
    return [tuple(r) for r in rows]  # type: ignore[misc]


def unended_migrations(cloud: Cloud) -> list[dict[str, Any]]:
    return [
        d.body for d in cloud.objects.list("migration") if d.body["status"] not in migrations.ENDED
    ]


_HYPERVISORS: dict[tuple[str, str], SimDriver] = {}


def drive(
    cloud: Cloud,
    tmp_path: Path,
    until_true: Any,
    timeout_s: float = 30.0,
    config: ConductorConfig = FAST,
) -> dict[str, Any]:
    """Run agents and a conductor (a new process's, as after a restart) until `until_true`,
    then until no operation is open; returns each host's running instances."""

    async def scenario() -> dict[str, Any]:
        bus = InProcTransport()
        servers = []
        for name in HOSTS:
            key = (str(tmp_path), name)  # the hypervisors outlive their agents' restarts
            if key not in _HYPERVISORS:
                disk = tmp_path / "disks" / name
                _HYPERVISORS[key] = SimDriver(SimConfig(disk_bytes=4096), disk_dir=disk)
            driver = _HYPERVISORS[key]
            server = AgentServer(name, driver, bus, lambda n=name: cloud.ledger.heartbeat([n]))
            await server.serve()
            servers.append(server)
        conductor = Conductor(cloud, bus, config)
        task = asyncio.create_task(conductor.run())
        try:
            await until(cloud, until_true, timeout_s)
            await until(cloud, lambda: not open_work(cloud), timeout_s)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            running = {s.host: sorted(s.driver.running()) for s in servers}
            for server in servers:
                await server.close()
            await bus.close()
        return running

    return asyncio.run(scenario())


def statuses(cloud: Cloud) -> list[str]:
    return sorted(str(d.body["status"]) for d in cloud.objects.list("instance"))


# -- creates ------------------------------------------------------------------------------


def test_a_create_crashed_at_any_commit_leaves_nothing_or_finishes(
    cloud: Cloud, tmp_path: Path
) -> None:
    """Before the fix a create was one commit per instance, then claims, then operations: a
    crash between them left instances in BUILD that nothing would ever schedule."""
    nth = 1
    while True:
        before = instance_count(cloud)
        with crash_at_commit(cloud.ledger.engine, nth) as seen:
            try:
                build_servers(cloud, request(3), "req-crash")
                crashed = False
            except Crash:
                crashed = True
        if not crashed:
            break
        # The crash hit the create's own commit: not one of its rows exists.
        assert instance_count(cloud) == before, f"crash at commit {nth} left instances"
        assert open_work(cloud) == []
        assert seen[0] == nth
        nth += 1
    assert nth == 2, "a create commits exactly once"
    drive(cloud, tmp_path, lambda: statuses(cloud) == ["ACTIVE"] * 3)
    assert audit_cloud(cloud.ledger, stale_after_s=0) == []


def test_a_create_is_finished_by_a_conductor_that_starts_after_the_api_died(
    cloud: Cloud, tmp_path: Path
) -> None:
    docs = build_servers(cloud, request(2, flavor=PINNED), "req-later")  # the API then dies
    assert [d["task_state"] for d in docs] == ["scheduling", "scheduling"]
    assert open_work(cloud) == [("build", "schedule", "pending")]  # owned, durable
    running = drive(cloud, tmp_path, lambda: statuses(cloud) == ["ACTIVE"] * 2)
    assert sorted(i for ids in running.values() for i in ids) == sorted(d["id"] for d in docs)
    assert audit_cloud(cloud.ledger, stale_after_s=0) == []


def test_max_count_stops_at_the_quota_and_min_count_past_it_is_refused(cloud: Cloud) -> None:
    """Before the fix the check counted min_count and the build looped max_count: 41 servers
    for a quota of 10."""
    created = build_servers(cloud, request(40), "req-40")
    assert len(created) == 10  # as many as the quota allows, as Nova
    with pytest.raises(QuotaExceeded, match="instances"):
        build_servers(cloud, request(5, min_count=1), "req-more")
    assert instance_count(cloud) == 10
    cloud.objects.create("quota", "q", {"instances": 3})
    with pytest.raises(QuotaExceeded, match="Requested 4"):
        build_servers(cloud, request(4, min_count=4, project="q"), "req-q")


def test_a_huge_max_count_is_cut_to_the_per_request_ceiling(db_url: str, tmp_path: Path) -> None:
    """Before the fix max_count 10**9 made ~159,000 rows in 2.5 minutes before anyone noticed."""
    cloud = open_cloud(db_url, tmp_path / "state", max_instances_per_request=5)
    try:
        cloud.objects.create("quota", "p", {"instances": -1, "cores": -1, "ram": -1})
        assert len(build_servers(cloud, request(10**9), "req-huge")) == 5
        with pytest.raises(QuotaExceeded, match="per request"):
            build_servers(cloud, request(10**9, min_count=6), "req-huge-min")
        assert instance_count(cloud) == 5
    finally:
        cloud.ledger.close()


def _create_one(url: str, state: str, barrier: Any, results: Any) -> None:
    cloud = Cloud(CloudConfig(state_dir=Path(state)), Ledger.open(url, upgrade=False))
    barrier.wait()
    try:
        build_servers(cloud, request(1), "req-race")
        results.put("created")
    except QuotaExceeded:
        results.put("refused")
    finally:
        cloud.ledger.close()


@pytest.mark.postgres
def test_concurrent_creates_in_processes_never_pass_the_quota(tmp_path: Path) -> None:
    """Before the fix 12 concurrent creates with 9 of 10 instances free gave 11 servers."""
    from tests.conftest import pg_schema_url

    for url in pg_schema_url():
        cloud = open_cloud(url, tmp_path / "state")
        try:
            build_servers(cloud, request(1), "req-first")  # 9 of 10 free
            ctx = multiprocessing.get_context("spawn")
            barrier = ctx.Barrier(12)
            results = ctx.Queue()
            racers = [
                ctx.Process(
                    target=_create_one, args=(url, str(tmp_path / "state"), barrier, results)
                )
                for _ in range(12)
            ]
            for racer in racers:
                racer.start()
            for racer in racers:
                racer.join(120)
                assert racer.exitcode == 0
            outcomes = sorted(results.get(timeout=5) for _ in racers)
            assert outcomes == ["created"] * 9 + ["refused"] * 3
            assert instance_count(cloud) == 10
        finally:
            cloud.ledger.close()


def test_a_stopped_servers_rebuild_whose_stop_fails_ends_active_not_rebuilding(
    cloud: Cloud, tmp_path: Path
) -> None:
    """A stopped server's rebuild spawns the new guest, then stops it (Nova keeps it
    stopped). When that stop fails the guest runs: the server is ACTIVE with no task, as
    Nova's stop leaves it. It stayed REBUILD for ever (the simulation's seed 6785)."""
    [doc] = build_servers(cloud, request(1), "req-rebuild")
    drive(cloud, tmp_path, lambda: statuses(cloud) == ["ACTIVE"])
    power_action(cloud, doc["id"], "os-stop", is_admin=False)
    drive(cloud, tmp_path, lambda: statuses(cloud) == ["SHUTOFF"])
    host = cloud.objects.get("instance", doc["id"]).body["host"]
    _HYPERVISORS[(str(tmp_path), host)].inject("power_off", "stop", FaultKind.FAIL)

    rebuild_server(cloud, doc["id"], "img", None)
    assert statuses(cloud) == ["REBUILD"]
    running = drive(cloud, tmp_path, lambda: not open_work(cloud))

    body = cloud.objects.get("instance", doc["id"]).body
    assert (body["status"], body["vm_state"], body["task_state"]) == ("ACTIVE", "active", None)
    assert body["power_state"] == 1 and running[host] == [doc["id"]]
    assert audit_cloud(cloud.ledger, stale_after_s=0) == []


# -- moves --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["live-migration", "migration"])
def test_a_move_crashed_at_any_commit_leaves_nothing_or_finishes(
    cloud: Cloud, tmp_path: Path, kind: str
) -> None:
    """Before the fix `move()` committed the instance, the migration record, the claim and
    the operation in four transactions: a crash between them left the server MIGRATING for
    good, its migration `pre-migrating` with no operation, every later move refused."""
    (vm,) = (d["id"] for d in build_servers(cloud, request(1, force_host="host1"), "req"))
    drive(cloud, tmp_path, lambda: statuses(cloud) == ["ACTIVE"])
    nth = 1
    while True:
        with crash_at_commit(cloud.ledger.engine, nth):
            try:
                migrations.move(cloud, vm, kind, user_id="u", project_id="p", dest="host2")
                crashed = False
            except Crash:
                crashed = True
        if not crashed:
            break
        doc = cloud.objects.get("instance", vm).body
        assert (doc["status"], doc["task_state"]) == ("ACTIVE", None), f"commit {nth}"
        assert unended_migrations(cloud) == [] and open_work(cloud) == []
        nth += 1
    # The numbering counter commits first (a gap at worst), then the move itself, once.
    assert nth == 3
    settled = "VERIFY_RESIZE" if kind == "migration" else "ACTIVE"
    drive(cloud, tmp_path, lambda: statuses(cloud) == [settled])
    doc = cloud.objects.get("instance", vm).body
    assert doc["host"] == "host2" or (kind == "migration" and doc["status"] == "VERIFY_RESIZE")
    assert audit_cloud(cloud.ledger, stale_after_s=0) == []


def test_a_move_whose_api_died_after_its_commit_is_driven_to_the_end(
    cloud: Cloud, tmp_path: Path
) -> None:
    (vm,) = (d["id"] for d in build_servers(cloud, request(1, force_host="host1"), "req"))
    drive(cloud, tmp_path, lambda: statuses(cloud) == ["ACTIVE"])
    started = migrations.move(cloud, vm, "live-migration", user_id="u", project_id="p")
    assert started.status == "accepted"
    assert open_work(cloud) == [("live-migration", "schedule", "pending")]
    drive(cloud, tmp_path, lambda: unended_migrations(cloud) == [])
    record = cloud.objects.get("migration", started.migration_id).body
    assert record["status"] == "completed"
    assert cloud.objects.get("instance", vm).body["host"] == record["dest_compute"] != "host1"
    assert audit_cloud(cloud.ledger, stale_after_s=0) == []


def test_a_move_its_delete_failed_before_a_destination_is_never_revived(
    cloud: Cloud, tmp_path: Path
) -> None:
    """A delete ends a move that holds no destination yet in a commit of its own, then fails
    the move's operation in its next. The API died between the two: the conductor scheduled
    the move anyway and wrote the `failed` migration back to `pre-migrating`, with claims on
    its destination (the simulation's seed 1581). A migration that ended stays ended."""
    (vm,) = (d["id"] for d in build_servers(cloud, request(1, force_host="host1"), "req"))
    drive(cloud, tmp_path, lambda: statuses(cloud) == ["ACTIVE"])
    started = migrations.move(cloud, vm, "migration", user_id="u", project_id="p")
    assert open_work(cloud) == [("migration", "schedule", "pending")]
    with crash_at_commit(cloud.ledger.engine, 2), pytest.raises(Crash):
        delete_server(cloud, vm)
    assert cloud.objects.get("migration", started.migration_id).body["status"] == "failed"

    drive(cloud, tmp_path, lambda: not open_work(cloud))
    record = cloud.objects.get("migration", started.migration_id).body
    assert (record["status"], record.get("dest_compute")) == ("failed", None)
    body = cloud.objects.get("instance", vm).body
    assert (body["status"], body["task_state"], body["host"]) == ("ACTIVE", None, "host1")
    assert audit_cloud(cloud.ledger, stale_after_s=0) == []

    delete_server(cloud, vm)  # the client asks again
    drive(cloud, tmp_path, lambda: statuses(cloud) == [])
    assert audit_cloud(cloud.ledger, stale_after_s=0) == []


def test_evacuating_a_host_reports_each_instance_and_never_stops_half_way(
    cloud: Cloud, tmp_path: Path
) -> None:
    """Before the fix one BUILD (or PAUSED) instance stopped `evacuate_host` at it, and the
    instances before it stayed REBUILD with `pre-migrating` migrations nothing ended."""
    ids = [d["id"] for d in build_servers(cloud, request(3, force_host="host1"), "req")]
    drive(cloud, tmp_path, lambda: statuses(cloud) == ["ACTIVE"] * 3)
    paused = cloud.objects.get("instance", ids[1])
    cloud.objects.update(
        "instance", ids[1], {**paused.body, "status": "PAUSED", "vm_state": "paused"}
    )
    building = build_servers(cloud, request(1, force_host="host1"), "req-b")[0]["id"]
    # Placed on host1 (the conductor's scheduling step) but not spawned yet: BUILD there.
    schedule_builds(cloud, cloud.operations.active(instance_id=building))
    assert cloud.objects.get("instance", building).body["host"] == "host1"
    cloud.ledger.set_host_state("host1", forced_down=True)

    results = migrations.evacuate_host(cloud, "host1", user_id="u", project_id="p")

    assert set(results) == {*ids, building}
    refused = {i for i, r in results.items() if r.status == "refused"}
    assert refused == {ids[1], building}
    assert "vm_state paused" in results[ids[1]].reason
    assert "vm_state building" in results[building].reason
    cloud.ledger.set_host_state("host1", forced_down=False)  # its agent serves the build
    drive(cloud, tmp_path, lambda: unended_migrations(cloud) == [])
    for instance_id in (ids[0], ids[2]):
        record = next(
            d.body
            for d in cloud.objects.list("migration")
            if d.body["instance_uuid"] == instance_id
        )
        assert record["status"] == "done"
        assert cloud.objects.get("instance", instance_id).body["host"] in ("host2", "host3")
    assert audit_cloud(cloud.ledger, stale_after_s=0) == []


def test_the_audit_sees_what_drifts_above_the_ledger(cloud: Cloud, tmp_path: Path) -> None:
    """`stowage audit` called the ledger clean while two servers were stuck MIGRATING."""
    (vm,) = (d["id"] for d in build_servers(cloud, request(1, force_host="host1"), "req"))
    drive(cloud, tmp_path, lambda: statuses(cloud) == ["ACTIVE"])
    assert audit_cloud(cloud.ledger, stale_after_s=0) == []
    # What a crash between the old move's commits left: a record no operation will end.
    cloud.objects.create(
        "migration", "m-stuck", {"instance_uuid": vm, "status": "pre-migrating"}, project_id="p"
    )
    # A document that says host2 while the ledger places the instance on host1.
    body = cloud.objects.get("instance", vm).body
    cloud.objects.update("instance", vm, {**body, "host": "host2"})
    # Instances past the project's quota (written behind the use case's back).
    cloud.objects.create("quota", "p", {"instances": 1})
    cloud.objects.create("instance", "extra", {**body, "id": "extra", "host": None}, project_id="p")
    # An operation nobody drives.
    cloud.operations.enqueue("power", vm, "host1", step="power", payload={"action": "reboot"})
    found = {v.check for v in audit_cloud(cloud.ledger, stale_after_s=0)}
    assert found == {"unowned_migration", "instance_claim", "quota", "undriven_operation"}


def test_server_groups_are_counted_against_their_quota(cloud: Cloud) -> None:
    """Before the fix a project could make server groups past its `server_groups` quota."""
    cloud.objects.create("quota", "p", {"server_groups": 2})
    for i in range(2):
        create_server_group(cloud, parse_group(f"g{i}", f"g{i}", "anti-affinity", project_id="p"))
    with pytest.raises(QuotaExceeded, match="server groups"):
        create_server_group(cloud, parse_group("g2", "g2", "anti-affinity", project_id="p"))
    with pytest.raises(NotFound):
        cloud.ledger.get_group("g2")


def test_group_members_are_counted_against_their_quota(cloud: Cloud) -> None:
    cloud.objects.create("quota", "p", {"server_group_members": 2})
    create_server_group(cloud, parse_group("g", "g", "soft-anti-affinity", project_id="p"))
    assert len(build_servers(cloud, request(5, group_id="g"), "req-g")) == 2
    with pytest.raises(QuotaExceeded, match="too many servers in group"):
        build_servers(cloud, request(1, group_id="g"), "req-g2")


def test_cores_and_ram_are_summed_by_the_database(cloud: Cloud) -> None:
    """Usage is summed in SQL now (it parsed every document in Python per create): the
    documents' vCPUs and RAM still count, per project, against each limit."""
    big = {**SHARED, "id": "s2", "name": "shared.2", "vcpus": 2, "ram": 1024}
    cloud.objects.create("quota", "p", {"instances": -1, "cores": 5, "ram": -1})
    assert len(build_servers(cloud, request(9, flavor=big), "req-cores")) == 2  # 4 of 5
    with pytest.raises(QuotaExceeded, match="cores"):
        build_servers(cloud, request(1, flavor=big), "req-cores-2")
    assert len(build_servers(cloud, request(3), "req-cores-3")) == 1  # the fifth core
    cloud.objects.create("quota", "q", {"instances": -1, "cores": -1, "ram": 2500})
    assert len(build_servers(cloud, request(9, flavor=big, project="q"), "req-ram")) == 2
    with pytest.raises(QuotaExceeded, match="ram"):
        build_servers(cloud, request(1, flavor=big, project="q"), "req-ram-2")


def test_group_members_are_counted_when_nothing_else_is_limited(cloud: Cloud) -> None:
    """With every other limit off, the create counts only the group's members."""
    cloud.objects.create(
        "quota", "p", {"instances": -1, "cores": -1, "ram": -1, "server_group_members": 2}
    )
    create_server_group(cloud, parse_group("g", "g", "soft-anti-affinity", project_id="p"))
    assert len(build_servers(cloud, request(1), "req-free")) == 1  # not a member
    assert len(build_servers(cloud, request(5, group_id="g"), "req-g")) == 2
    with pytest.raises(QuotaExceeded, match="too many servers in group"):
        build_servers(cloud, request(1, group_id="g"), "req-g2")
    assert len(build_servers(cloud, request(20), "req-many")) == 20  # no other limit


def test_deleting_one_instance_of_a_create_before_it_is_scheduled_spares_the_others(
    cloud: Cloud, tmp_path: Path
) -> None:
    """The create's scheduling operation is keyed by its first instance: deleting that one
    must not strand the others in BUILD (nothing would schedule them)."""
    from stowage.services.compute import delete_server

    ids = [d["id"] for d in build_servers(cloud, request(3), "req-del")]
    delete_server(cloud, ids[0])
    assert cloud.objects.find("instance", ids[0]) is None
    drive(cloud, tmp_path, lambda: statuses(cloud) == ["ACTIVE", "ACTIVE"])
    assert audit_cloud(cloud.ledger, stale_after_s=0) == []


def test_two_writers_of_one_instance_from_the_same_read_lose_nothing(cloud: Cloud) -> None:
    """Before the fix about twenty writers replaced the whole document with their copy: the
    second of two writers that read the same version erased the first one's change."""
    from stowage.services.instances import write_instance

    (vm,) = (d["id"] for d in build_servers(cloud, request(1), "req"))
    read = cloud.objects.get("instance", vm).body
    write_instance(cloud, vm, read, {**read, "metadata": {"owner": "ops"}})
    write_instance(cloud, vm, read, {**read, "locked": True})  # from the same, stale read
    body = cloud.objects.get("instance", vm).body
    assert (body["metadata"], body["locked"]) == ({"owner": "ops"}, True)


def test_a_writer_that_names_a_stale_current_body_reads_again_and_loses_nothing(
    cloud: Cloud,
) -> None:
    """`current` (the body as the writer's transaction read it) spares the swap a second
    read; when it is stale after all, the swap misses and the document is read again: the
    other writer's change stays, this one's lands, and a moved field is still a conflict."""
    from stowage.domain.errors import ConflictError
    from stowage.services.instances import write_instance

    (vm,) = (d["id"] for d in build_servers(cloud, request(1), "req"))
    read = cloud.objects.get("instance", vm).body
    write_instance(cloud, vm, read, {**read, "metadata": {"owner": "ops"}})
    with cloud.ledger.engine.begin() as conn:
        written = write_instance(cloud, vm, read, {**read, "locked": True}, conn=conn, current=read)
    body = cloud.objects.get("instance", vm).body
    assert (body["metadata"], body["locked"]) == ({"owner": "ops"}, True)
    assert written == body
    write_instance(cloud, vm, body, {**body, "task_state": "deleting"})
    with pytest.raises(ConflictError, match="task_state"), cloud.ledger.engine.begin() as conn:
        write_instance(cloud, vm, body, {**body, "task_state": "x"}, conn=conn, current=body)
    assert cloud.objects.get("instance", vm).body["task_state"] == "deleting"


def test_a_spawn_reads_the_instance_once_in_its_commit_and_not_its_operation_after(
    cloud: Cloud, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The commit that makes a spawned instance ACTIVE reads its document once, with its
    action's in the same statement (the swap, the volumes' attachments and the event reuse
    that read: before, three reads and a transaction of their own, then the action read
    alone), and the drive loop does not read the operation again to learn that the step
    ended it."""
    (vm,) = (d["id"] for d in build_servers(cloud, request(1), "req"))
    phase: list[str] = ["before"]
    op_ids: list[str] = []
    spawner: list[int] = []  # the thread that commits the spawn
    reads: list[tuple[str, str]] = []
    spawned = Conductor._spawned

    def watched(self: Conductor, op: Any, reply: Any) -> None:
        op_ids.append(op.id)
        spawner.append(threading.get_ident())
        phase[0] = "spawned"
        try:
            spawned(self, op, reply)
        finally:
            phase[0] = "after"

    def on_execute(_conn: Any, _cursor: Any, statement: str, params: Any, *_: Any) -> None:
        if not statement.lstrip().upper().startswith("SELECT"):
            return
        if phase[0] == "spawned" and threading.get_ident() not in spawner:
            return  # the test's own wait for ACTIVE, meanwhile
        values = set(params.values() if isinstance(params, dict) else params or ())
        if vm in values and "objects" in statement:
            reads.append((phase[0], "instance"))
        elif "objects" in statement:
            reads.append((phase[0], "another document"))
        if op_ids and op_ids[0] in values and "operations" in statement:
            reads.append((phase[0], "operation"))

    monkeypatch.setattr(Conductor, "_spawned", watched)
    event.listen(cloud.ledger.engine, "before_cursor_execute", on_execute)
    try:
        drive(cloud, tmp_path, lambda: statuses(cloud) == ["ACTIVE"])
    finally:
        event.remove(cloud.ledger.engine, "before_cursor_execute", on_execute)
    assert len(op_ids) == 1
    assert [r for r in reads if r[0] == "spawned"] == [("spawned", "instance")], reads
    assert ("after", "operation") not in reads, reads


def test_a_spawn_reads_its_instance_and_image_in_one_statement(cloud: Cloud) -> None:
    """A build's spawn names its instance's image, so the spawn's inputs read the two in one
    statement, and of its operation only the state (before: five reads, the operation's
    whole row decoded); an image gone since gives no image, as its read did."""
    image = {"id": "img", "status": "active", "disk_format": "qcow2", "size": 5}
    cloud.objects.create("image", "img", image)
    build_servers(cloud, request(1), "req")
    schedule_builds(cloud, [op for op in cloud.operations.active() if op.step == "schedule"])
    (op,) = [op for op in cloud.operations.active() if op.step == "spawn"]
    assert op.payload["image_id"] == "img"
    conductor = Conductor(cloud, InProcTransport(), FAST)
    made: list[str] = []

    def on_execute(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        made.append(" ".join(statement.replace('"', "").split()).upper())

    event.listen(cloud.ledger.engine, "before_cursor_execute", on_execute)
    try:
        _claim, _devices, why, guest = conductor._spawn_inputs(op)
    finally:
        event.remove(cloud.ledger.engine, "before_cursor_execute", on_execute)
    assert why is None and guest["image"]["id"] == "img", guest
    selects = [s for s in made if s.startswith("SELECT")]
    assert len(selects) == 4, selects  # the state, the claim, instance and image, the ports
    assert any(s.startswith("SELECT OPERATIONS.STATE FROM OPERATIONS") for s in selects), selects
    cloud.objects.delete("image", "img")
    assert conductor._spawn_inputs(op)[3]["image"] is None


def test_a_backlog_past_the_conductors_room_goes_on_without_waiting_for_a_poll(
    cloud: Cloud, tmp_path: Path
) -> None:
    """A conductor leases at most `concurrency_max` operations; before the fix, once it had
    leased all it had room for, the rest waited for its next poll even as its tasks ended
    (a backlog of creates waited out a poll every `concurrency_max` operations). Here the
    poll never comes: the backlog must be taken as room is made."""
    import dataclasses

    for n in range(10):
        build_servers(cloud, request(1), f"req-{n}")
    never = dataclasses.replace(FAST, poll_s=3600.0, concurrency_max=3)
    drive(cloud, tmp_path, lambda: statuses(cloud) == ["ACTIVE"] * 10, config=never)
    assert audit_cloud(cloud.ledger, stale_after_s=0) == []


def test_a_scheduled_builds_spawns_are_driven_without_a_lease_of_their_own(
    cloud: Cloud, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claim that places a build inserts its spawn leased to the conductor that planned
    it, which drives it at once. Before, each scheduled batch's spawns waited for the
    conductor's next poll and took a write transaction of their own to lease.

    A poll that runs while the claim commits may still read a spawn it owns as its own to
    take (the crossing `Conductor._start_each` leaves to whichever starts it first; on
    PostgreSQL this test saw it, once in CI): so the polls here never hand a spawn over,
    and every server still becomes ACTIVE, driven from its schedule step alone."""
    from stowage.ledger.operations import Operations

    leased_steps: list[str] = []
    lease = Operations.lease

    def watched(self: Operations, *args: Any, **kwargs: Any) -> Any:
        taken = [op for op in lease(self, *args, **kwargs) if op.step != "spawn"]
        leased_steps.extend(op.step for op in taken)
        return taken

    monkeypatch.setattr(Operations, "lease", watched)
    for n in range(6):
        build_servers(cloud, request(1), f"req-{n}")
    drive(cloud, tmp_path, lambda: statuses(cloud) == ["ACTIVE"] * 6)
    assert statuses(cloud) == ["ACTIVE"] * 6
    assert leased_steps.count("schedule") == 6, leased_steps
    assert audit_cloud(cloud.ledger, stale_after_s=0) == []


def test_a_spawn_started_with_its_schedule_waits_for_its_hosts_older_clean_up(
    cloud: Cloud, tmp_path: Path
) -> None:
    """A spawn driven straight from its schedule step still waits for an older clean-up of
    its host (a guest left there, still running on pCPUs the ledger has let go): the host's
    destroy of the old guest ends before the new guest is spawned."""
    driver = SimDriver(SimConfig(disk_bytes=4096), disk_dir=tmp_path / "disks" / "host1")
    _HYPERVISORS[(str(tmp_path), "host1")] = driver
    driver.spawn("left-behind", {0: 2}, [0], 256)
    driver.config.step_latency_s["destroy.stop"] = 0.5  # the clean-up still runs meanwhile
    cloud.operations.enqueue("cleanup", "left-behind", "host1", step="destroy")
    (vm,) = (d["id"] for d in build_servers(cloud, request(1, force_host="host1"), "req"))
    seen_at_spawn: list[set[str]] = []
    spawn = driver.spawn

    def watched(instance_id: str, *args: Any, **kwargs: Any) -> None:
        seen_at_spawn.append(set(driver.running()))
        spawn(instance_id, *args, **kwargs)

    driver.spawn = watched  # type: ignore[method-assign]
    drive(cloud, tmp_path, lambda: statuses(cloud) == ["ACTIVE"])
    assert seen_at_spawn == [set()], seen_at_spawn  # the old guest gone before the new one
    assert sorted(driver.running()) == [vm]


def test_a_spawns_group_commit_is_awaited_on_the_loop_with_no_thread_waiting_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a ledger whose writes go in groups on the store's writer thread (`stowage up`), the
    commit that makes a spawned instance ACTIVE is awaited by the conductor's loop itself:
    before, a thread of its executor handed the work to the writer thread and waited for
    it (two hand-offs more a boot)."""
    cloud = open_cloud(f"sqlite:///{tmp_path / 'ledger.db'}", tmp_path / "state", group_writes=True)
    try:
        cloud.objects.create("quota", "p", {"instances": -1, "cores": -1, "ram": -1})
        waited: list[str] = []
        committers: set[str] = set()
        spawned, active_in = Conductor._spawned, Conductor._active_in

        def in_a_thread(self: Conductor, op: Any, reply: Any) -> None:
            waited.append(op.instance_id)
            spawned(self, op, reply)

        def committed(self: Conductor, conn: Any, **kwargs: Any) -> Any:
            committers.add(threading.current_thread().name)
            return active_in(self, conn, **kwargs)

        monkeypatch.setattr(Conductor, "_spawned", in_a_thread)
        monkeypatch.setattr(Conductor, "_active_in", committed)
        for n in range(4):
            build_servers(cloud, request(1), f"req-{n}")
        drive(cloud, tmp_path, lambda: statuses(cloud) == ["ACTIVE"] * 4)
        assert waited == [] and committers == {"stowage-group-writer"}, (waited, committers)
        assert audit_cloud(cloud.ledger, stale_after_s=0) == []
    finally:
        cloud.ledger.close()


def test_spawns_due_together_read_their_inputs_in_one_thread_and_one_transaction(
    cloud: Cloud,
) -> None:
    """A scheduled batch's spawns start in one turn of the conductor's loop; each read its
    inputs in a thread and a transaction of its own (a hand-off there and back, a connection
    and four statements each). Read together: one thread, one transaction, the operations'
    states in one statement and the instances and image in another; each spawn gets what it
    would have read alone, and one whose operation ended hears of it alone."""
    image = {"id": "img", "status": "active", "disk_format": "qcow2", "size": 5}
    cloud.objects.create("image", "img", image)
    build_servers(cloud, request(5), "req")
    schedule_builds(cloud, [op for op in cloud.operations.active() if op.step == "schedule"])
    ops = sorted(
        (op for op in cloud.operations.active() if op.step == "spawn"), key=lambda op: op.id
    )
    assert len(ops) == 5
    conductor = Conductor(cloud, InProcTransport(), FAST)
    alone = [conductor._spawn_inputs(op) for op in ops]
    cloud.operations.update(ops[2].id, state="done")  # a delete ended this one meanwhile
    made: list[tuple[int, str]] = []
    checkouts: list[int] = []

    def on_execute(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        made.append((threading.get_ident(), " ".join(statement.replace('"', "").split()).upper()))

    def on_checkout(*_: Any) -> None:
        checkouts.append(threading.get_ident())

    async def together() -> list[Any]:
        return await asyncio.gather(
            *(conductor._spawn_inputs_together(op) for op in ops), return_exceptions=True
        )

    event.listen(cloud.ledger.engine, "before_cursor_execute", on_execute)
    event.listen(cloud.ledger.engine, "checkout", on_checkout)
    try:
        answers = asyncio.run(together())
    finally:
        event.remove(cloud.ledger.engine, "before_cursor_execute", on_execute)
        event.remove(cloud.ledger.engine, "checkout", on_checkout)
    assert isinstance(answers[2], NotFound), answers[2]
    assert [a for i, a in enumerate(answers) if i != 2] == [
        a for i, a in enumerate(alone) if i != 2
    ]
    assert len({thread for thread, _ in made}) == 1 and len(checkouts) == 1
    selects = [s for _, s in made if s.startswith("SELECT")]
    states = [s for s in selects if s.startswith("SELECT OPERATIONS.ID, OPERATIONS.STATE")]
    assert len(states) == 1, selects
    by_key = [s for s in selects if "FROM OBJECTS" in s and "OBJECTS.REF =" not in s]
    assert len(by_key) == 1, selects  # the instances and the image
    assert len(selects) == 2 + 2 * 4, selects  # and a claim and the ports of each of four


def test_a_schedule_batch_reads_its_instances_at_once_and_places_them_all(
    cloud: Cloud, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The conductor's schedule step of several creates reads their instances before it
    plans in one transaction, a statement per `_READ_AT_ONCE` of them (before: a transaction
    per create and a statement per instance), and still places every one that waits, and
    none that no longer does."""
    from stowage.services import compute

    monkeypatch.setattr(compute, "_READ_AT_ONCE", 4)  # so that 7 instances take two reads
    single = [build_servers(cloud, request(1), f"req-{n}")[0]["id"] for n in range(4)]
    several = [d["id"] for d in build_servers(cloud, request(3), "req-many")]
    gone = single.pop()  # deleted before its schedule step: no longer waits
    body = cloud.objects.get("instance", gone).body
    cloud.objects.update("instance", gone, {**body, "task_state": "deleting"})
    ops = [op for op in cloud.operations.active() if op.step == "schedule"]
    assert len(ops) == 5
    reads: list[str] = []  # before the plan: BEGINs and the instances' reads

    def on_begin(_conn: Any) -> None:
        reads.append("begin")

    def on_execute(_conn: Any, _cursor: Any, statement: str, params: Any, *_: Any) -> None:
        values = set(params.values() if isinstance(params, dict) else params or ())
        flat = {v for value in values for v in (value if isinstance(value, tuple) else (value,))}
        if statement.lstrip().upper().startswith("SELECT") and flat & {*single, *several}:
            reads.append("instances")

    planned = compute._place

    def place(*args: Any, **kwargs: Any) -> Any:
        event.remove(cloud.ledger.engine, "begin", on_begin)
        event.remove(cloud.ledger.engine, "before_cursor_execute", on_execute)
        return planned(*args, **kwargs)

    monkeypatch.setattr(compute, "_place", place)
    event.listen(cloud.ledger.engine, "begin", on_begin)
    event.listen(cloud.ledger.engine, "before_cursor_execute", on_execute)
    schedule_builds(cloud, ops)
    # The instances: two reads in one transaction (the hosts' names come from the scheduler's
    # view, no longer from a read of every host first).
    assert reads == ["begin", "instances", "instances"], reads
    for instance_id in [*single, *several]:
        placed = cloud.objects.get("instance", instance_id).body
        assert placed["host"] and placed["task_state"] == "spawning", placed
    assert cloud.objects.get("instance", gone).body.get("host") is None
    assert not [op for op in cloud.operations.active() if op.step == "schedule"]


def test_a_batch_of_claims_reads_its_instances_and_inserts_their_next_steps_at_once(
    cloud: Cloud, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The transaction that commits a schedule step's claims reads the instances it moves on
    in one statement and inserts their spawn operations in one (before: a read and an insert
    a claim, each a turn of the interpreter with the write lock held); on SQLite it swaps
    the instances in one statement too (before: one a claim; on PostgreSQL still one a
    claim, where the swap's guard is checked as it runs)."""
    from stowage.services import compute

    several = [d["id"] for d in build_servers(cloud, request(6), "req-many")]
    ops = [op for op in cloud.operations.active() if op.step == "schedule"]
    made: list[str] = []

    def on_execute(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        made.append(" ".join(statement.replace('"', "").split()).upper())

    planned = compute._place

    def place(*args: Any, **kwargs: Any) -> Any:
        event.listen(cloud.ledger.engine, "before_cursor_execute", on_execute)
        try:
            return planned(*args, **kwargs)
        finally:
            event.remove(cloud.ledger.engine, "before_cursor_execute", on_execute)

    monkeypatch.setattr(compute, "_place", place)
    schedule_builds(cloud, ops)
    reads = [s for s in made if s.startswith("SELECT") and "FROM OBJECTS" in s]
    inserts = [s for s in made if s.startswith("INSERT INTO OPERATIONS")]
    swaps = [s for s in made if s.startswith("UPDATE OBJECTS")]
    assert (len(reads), len(inserts)) == (1, 1), made
    assert len(swaps) == (1 if cloud.ledger.engine.dialect.name == "sqlite" else 6), made
    for instance_id in several:
        placed = cloud.objects.get("instance", instance_id).body
        assert placed["host"] and placed["task_state"] == "spawning", placed
    spawns = [op for op in cloud.operations.active() if op.step == "spawn"]
    assert sorted(op.instance_id for op in spawns) == sorted(several)


def test_a_create_of_one_server_ends_its_schedule_step_in_its_claims_commit(
    cloud: Cloud, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On SQLite a batch of creates of one server each is one commit: each create's schedule
    operation ends with its instance's claim, the batch's ends one held statement (before:
    the claims' commit, then another to end the operations). A create of several servers,
    one whose instance no longer waits, and one whose claim is refused end in a commit
    after, as before; so does every one on PostgreSQL, where nothing is held."""
    sqlite = cloud.ledger.engine.dialect.name == "sqlite"
    single = [build_servers(cloud, request(1), f"req-{n}")[0]["id"] for n in range(3)]
    ops = [op for op in cloud.operations.active() if op.step == "schedule"]
    cloud.scheduler.current_view()  # the view's first load is not the step's
    commits: list[str] = []
    ends: list[str] = []

    def on_commit(conn: Any) -> None:
        if not conn.get_execution_options().get("stowage_readonly"):  # a write's commit
            commits.append("commit")

    def on_execute(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        text = " ".join(statement.replace('"', "").split()).upper()
        if text.startswith("UPDATE OPERATIONS"):
            ends.append(text)

    def watching(run: Any) -> Any:
        commits.clear()
        ends.clear()
        event.listen(cloud.ledger.engine, "commit", on_commit)
        event.listen(cloud.ledger.engine, "before_cursor_execute", on_execute)
        try:
            return run()
        finally:
            event.remove(cloud.ledger.engine, "commit", on_commit)
            event.remove(cloud.ledger.engine, "before_cursor_execute", on_execute)

    watching(lambda: schedule_builds(cloud, ops))
    assert len(commits) == (1 if sqlite else 2), commits
    assert len(ends) == 1, ends  # one statement ends the three, in either commit
    for instance_id in single:
        assert cloud.objects.get("instance", instance_id).body["task_state"] == "spawning"
    assert {cloud.operations.find(op.id).state for op in ops} == {"done"}  # type: ignore[union-attr]

    # A create of two, one of one whose instance no longer waits, and one of one whose
    # claim is refused in its commit: their operations end after, in a commit of their own.
    several = [d["id"] for d in build_servers(cloud, request(2), "req-many")]
    gone = build_servers(cloud, request(1), "req-gone")[0]["id"]
    body = cloud.objects.get("instance", gone).body
    cloud.objects.update("instance", gone, {**body, "task_state": "deleting"})
    refused = build_servers(cloud, request(1), "req-refused")[0]["id"]
    kept = build_servers(cloud, request(1), "req-kept")[0]["id"]
    ops = [op for op in cloud.operations.active() if op.step == "schedule"]
    assert len(ops) == 4
    real_swap = cloud.objects.swap_in

    def swap_in(conn: Any, kind: str, key: str, *args: Any, **kwargs: Any) -> Any:
        if key == refused:  # changed while it was scheduled: its claim is refused
            return False
        return real_swap(conn, kind, key, *args, **kwargs)

    monkeypatch.setattr(cloud.objects, "swap_in", swap_in)
    watching(lambda: schedule_builds(cloud, ops))
    monkeypatch.setattr(cloud.objects, "swap_in", real_swap)
    assert len(commits) >= 2, commits
    for instance_id in [*several, kept]:
        assert cloud.objects.get("instance", instance_id).body["task_state"] == "spawning"
    for instance_id in (gone, refused):
        assert cloud.objects.get("instance", instance_id).body.get("host") is None
    assert {cloud.operations.find(op.id).state for op in ops} == {"done"}  # type: ignore[union-attr]


def test_a_schedule_steps_end_with_its_claim_is_undone_with_it(cloud: Cloud) -> None:
    """The end held in a claim's commit commits with it or not at all: a crash at that
    commit leaves the create's schedule operation active and its instance waiting, and
    the step run again places it and ends the operation."""
    (vm,) = (d["id"] for d in build_servers(cloud, request(1), "req"))
    ops = [op for op in cloud.operations.active() if op.step == "schedule"]
    with crash_at_commit(cloud.ledger.engine, 1), pytest.raises(Crash):
        schedule_builds(cloud, ops)
    assert [op.id for op in cloud.operations.active() if op.step == "schedule"] == [ops[0].id]
    assert cloud.objects.get("instance", vm).body["task_state"] == "scheduling"
    schedule_builds(cloud, ops)
    assert not [op for op in cloud.operations.active() if op.step == "schedule"]
    assert cloud.objects.get("instance", vm).body["task_state"] == "spawning"


def test_a_stale_writer_does_not_undo_another_writers_transition(cloud: Cloud) -> None:
    """A field another writer changed since this writer's read is a conflict, not overwritten
    (a conductor finishing a step must not undo a delete's task state)."""
    from stowage.domain.errors import ConflictError
    from stowage.services.instances import write_instance

    (vm,) = (d["id"] for d in build_servers(cloud, request(1), "req"))
    read = cloud.objects.get("instance", vm).body
    write_instance(cloud, vm, read, {**read, "task_state": "deleting"})
    with pytest.raises(ConflictError, match="task_state"):
        write_instance(cloud, vm, read, {**read, "task_state": "spawning"})
    assert cloud.objects.get("instance", vm).body["task_state"] == "deleting"


def test_user_data_reaches_the_hypervisor(cloud: Cloud) -> None:
    """Before the fix the API stored user_data and the driver port never got it."""
    from stowage.services.guest_spec import guest_payload

    (vm,) = (d["id"] for d in build_servers(cloud, request(1, user_data="aGVsbG8="), "req"))
    assert guest_payload(cloud, vm)["user_data"] == "aGVsbG8="


def test_a_config_drive_and_the_volumes_reach_the_hypervisor(cloud: Cloud, tmp_path: Path) -> None:
    """Before: a config drive was refused at the API and the driver port was told of no
    volume, so a libvirt guest could not boot from one or have one when (re)defined."""
    import json

    from stowage.services.guest_spec import guest_payload
    from stowage.services.instances import write_instance
    from stowage.virt.driver import Guest

    (plain,) = (d["id"] for d in build_servers(cloud, request(1), "r1"))
    assert "config_drive" not in guest_payload(cloud, plain)  # other guests: as they were
    assert "volumes" not in guest_payload(cloud, plain)
    (vm,) = (d["id"] for d in build_servers(cloud, request(1, config_drive=True), "r2"))
    doc = cloud.objects.get("instance", vm)
    devices = [
        {"volume_id": "v-root", "attachment_id": "a1", "device": "/dev/vda", "boot_index": 0},
        {"volume_id": "v-data", "attachment_id": "a2", "device": "/dev/vdb", "boot_index": None},
        {"volume_id": "v-new", "attachment_id": "a3", "device": "/dev/vdc", "attaching": True},
    ]
    write_instance(cloud, vm, doc.body, {**doc.body, "block_devices": devices})
    guest = Guest.from_payload(guest_payload(cloud, vm))
    assert [(v.device, v.boot_index, v.volume_id) for v in guest.volumes] == [
        ("/dev/vda", 0, "v-root"),
        ("/dev/vdb", None, "v-data"),  # the one still attaching is not the guest's yet
    ]
    assert guest.root_volume is not None
    root = guest.root_volume.connection
    assert root["driver_volume_type"] == "local"
    assert Path(root["data"]["device_path"]).name == "volume-v-root"
    assert guest.config_drive is not None
    meta = json.loads(guest.config_drive["openstack/latest/meta_data.json"])
    assert meta["uuid"] == vm
    assert "openstack/latest/network_data.json" in guest.config_drive
    # The simulated hypervisor writes the ISO beside its disk, and deletes it with it.
    driver = SimDriver(SimConfig(disk_bytes=4096), disk_dir=tmp_path / "sim")
    driver.spawn(vm, {}, [], 64, guest)
    iso = tmp_path / "sim" / f"{vm}.config.iso"
    assert iso.read_bytes()[0x8000:0x8006] == b"\x01CD001"
    driver.destroy(vm)
    assert not iso.exists()


def test_a_spawn_the_bus_delivers_after_its_undo_is_refused(tmp_path: Path) -> None:
    """Found by the simulation (bus-late): a move's spawn on the destination, delivered after
    the conductor had given up on it and undone the destination, ran anyway: a guest the
    ledger does not place, on pCPUs it gave another guest."""
    from stowage.bus.base import compute_topic

    async def scenario() -> tuple[dict[str, Any], dict[str, Any]]:
        bus = InProcTransport()
        driver = SimDriver(SimConfig(disk_bytes=4096), disk_dir=tmp_path / "d")
        server = AgentServer("h", driver, bus, lambda: None, clock=lambda: 0.0)
        await server.serve()
        try:
            early = {"instance_id": "vm", "issued_at": -1.0}  # before the agent started
            before_start = await bus.call(
                compute_topic("h"),
                "spawn",
                {**early, "pins": {"0": 2}, "cells": [0], "memory_mb": 256},
                op_id="op-0:spawn",
                timeout_s=5,
            )
            assert before_start["code"] == "agent.call.stale"
            undo = {"instance_id": "vm", "issued_at": 20.0}
            late = {"instance_id": "vm", "issued_at": 10.0, "pins": {"0": 2}, "cells": [0]}
            late["memory_mb"] = 256
            undone = await bus.call(
                compute_topic("h"), "destroy", undo, op_id="op-1:abort_dest", timeout_s=5
            )
            spawned = await bus.call(
                compute_topic("h"), "spawn", late, op_id="op-1:prepare", timeout_s=5
            )
            assert driver.running() == {}
            return undone, spawned
        finally:
            await server.close()
            await bus.close()

    undone, spawned = asyncio.run(scenario())
    assert undone["ok"] and (spawned["ok"], spawned["code"]) == (False, "agent.call.stale")


@pytest.mark.parametrize("found", ["nothing", "running", "stopped", "other pins"])
def test_a_spawn_is_one_trip_to_the_driver_pool_and_settles_a_repeated_one(
    tmp_path: Path, found: str
) -> None:
    """A spawn asked what the host runs, then spawned: two trips to the agent's driver pool
    (each a thread hand-off there and back) where one does. What the host may run already
    is still settled first: the guest as asked is left alone, one stopped with the same
    pins started again, one with other pins destroyed and spawned anew."""
    from stowage.bus.base import compute_topic
    from stowage.virt.driver import InstanceState

    driver = SimDriver(SimConfig(disk_bytes=4096), disk_dir=tmp_path / "d")
    if found != "nothing":
        driver.spawn("vm", {0: 3} if found == "other pins" else {0: 2}, [0], 256)
    if found == "stopped":
        driver.power_off("vm")
    driver.calls.clear()

    async def scenario() -> tuple[dict[str, Any], int]:
        bus = InProcTransport()
        server = AgentServer("h", driver, bus, lambda: None, clock=lambda: 0.0)
        await server.serve()
        trips = 0
        pool = server.agent._driver_pool
        assert pool is not None
        submit = pool.submit

        def counted(*args: Any, **kwargs: Any) -> Any:
            nonlocal trips
            trips += 1
            return submit(*args, **kwargs)

        pool.submit = counted  # type: ignore[method-assign]
        try:
            asked = {"instance_id": "vm", "issued_at": 1.0, "pins": {"0": 2}, "cells": [0]}
            reply = await bus.call(
                compute_topic("h"),
                "spawn",
                {**asked, "memory_mb": 256},
                op_id="op-1:spawn",
                timeout_s=5,
            )
            return reply, trips
        finally:
            await server.close()
            await bus.close()

    reply, trips = asyncio.run(scenario())
    assert reply["ok"], reply
    assert reply.get("already", False) == (found == "running")
    assert trips == 1
    assert driver.running()["vm"] == {"pins": {0: 2}, "state": InstanceState.RUNNING}
    assert (
        driver.calls
        == {
            "nothing": [("spawn", "vm")],
            "running": [],
            "stopped": [("power_on", "vm")],
            "other pins": [("destroy", "vm"), ("spawn", "vm")],
        }[found]
    )


def test_an_operation_started_twice_at_once_is_driven_once(cloud: Cloud) -> None:
    """A lease and a schedule step can hand the conductor the same operation at once: the
    schedule inserts a build's spawn leased to this conductor, and a lease that began before
    reads it as this conductor's own to take. Each side checked it was not driven before an
    await; both then drove it (seen in CI on PostgreSQL: the spawn committed twice, the
    second a ConflictError). An operation is driven by one task of a conductor, however it
    comes."""
    build_servers(cloud, request(1), "req")
    schedule_builds(cloud, [op for op in cloud.operations.active() if op.step == "schedule"])
    (op,) = [op for op in cloud.operations.active() if op.step == "spawn"]
    conductor = Conductor(cloud, InProcTransport(), FAST)
    driven: list[str] = []

    async def drive_once(self: Conductor, taken: Any) -> None:
        driven.append(taken.id)
        await asyncio.sleep(0.05)

    async def both() -> None:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(Conductor, "_drive", drive_once)
            await asyncio.gather(conductor._start_each([op]), conductor._start_each([op]))
            await asyncio.gather(*conductor._active.values())

    asyncio.run(both())
    assert driven == [op.id]


def test_two_conductors_driving_the_same_schedule_steps_at_once_place_each_server_once(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two conductors planning the same creates' schedule steps at once (a lease that ran
    out while its conductor was still planning, say) claim each instance once, with one
    spawn, and every step ends: a claim commits only while its instance waits to be
    scheduled, so the later plan's claims are refused, not doubled."""
    from stowage.services import compute

    first = open_cloud(db_url, tmp_path / "a")
    second = open_cloud(db_url, tmp_path / "b")
    try:
        vms = [build_servers(first, request(1), f"req-{n}")[0]["id"] for n in range(4)]
        vms += [d["id"] for d in build_servers(first, request(2), "req-two")]
        ops = [op for op in first.operations.active() if op.step == "schedule"]
        assert len(ops) == 5
        both_read = threading.Barrier(2, timeout=30)
        planned = compute._place

        def place(*args: Any, **kwargs: Any) -> Any:
            both_read.wait()  # each has read every instance as waiting before either claims
            return planned(*args, **kwargs)

        monkeypatch.setattr(compute, "_place", place)
        errors: list[BaseException] = []

        def conduct(cloud: Cloud) -> None:
            try:  # each as its conductor: the spawns it commits are leased to it
                schedule_builds(cloud, ops, owner=cloud.config.state_dir.name, lease_s=60)
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=conduct, args=(c,)) for c in (first, second)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        spawns = [op for op in first.operations.active() if op.step == "spawn"]
        assert sorted(op.instance_id for op in spawns) == sorted(vms)
        for vm in vms:
            body = first.objects.get("instance", vm).body
            assert body["task_state"] == "spawning" and body["host"], body
        assert {first.operations.find(op.id).state for op in ops} == {"done"}  # type: ignore[union-attr]
        assert audit_cloud(first.ledger, stale_after_s=0) == []
    finally:
        first.ledger.close()
        second.ledger.close()
