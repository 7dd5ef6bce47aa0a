"""Snapshots as units of work (issue 9): the image, the server's task state and the operation
that fills the image commit together; an upload cut off by an agent crash ends its image."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.agent.test_conductor import FAST, until
from tests.agent.test_use_cases import (
    HOSTS,
    Crash,
    crash_at_commit,
    drive,
    open_cloud,
    open_work,
    request,
    statuses,
)

from stowage.agent.local import make_upload_sink
from stowage.agent.server import AgentServer
from stowage.bus.base import BusClosed
from stowage.bus.inproc import InProcTransport
from stowage.services.caller import SystemCaller
from stowage.services.cloud import Cloud
from stowage.services.compute import build_servers, delete_server, snapshot_server
from stowage.services.conductor import Conductor
from stowage.virt.sim import FaultKind, SimConfig, SimDriver


@pytest.fixture
def cloud(db_url: str, tmp_path: Path) -> Iterator[Cloud]:
    made = open_cloud(db_url, tmp_path / "state")
    yield made
    made.ledger.close()


def images(cloud: Cloud) -> dict[str, str]:
    return {d.id: str(d.body["status"]) for d in cloud.objects.list("image")}


def active_server(cloud: Cloud, tmp_path: Path) -> str:
    (vm,) = (d["id"] for d in build_servers(cloud, request(1), "req-build"))
    drive(cloud, tmp_path, lambda: statuses(cloud) == ["ACTIVE"])
    return vm


def test_a_snapshot_crashed_at_any_commit_leaves_no_image_nothing_fills(
    cloud: Cloud, tmp_path: Path
) -> None:
    """Before the fix the queued image committed first and the server's task state and the
    operation after it: a crash (or a concurrent request winning the server) in between left
    an image queued for good (found by the simulation: image.stuck)."""
    vm = active_server(cloud, tmp_path)
    nth = 1
    while True:
        with crash_at_commit(cloud.ledger.engine, nth):
            try:
                image_id = snapshot_server(cloud, SystemCaller("p"), vm, "snap", {})
                crashed = False
            except Crash:
                crashed = True
        if not crashed:
            break
        assert images(cloud) == {}, f"a crash at commit {nth} left an image"
        assert cloud.objects.get("instance", vm).body["task_state"] is None
        assert open_work(cloud) == []
        nth += 1
    assert nth == 2, "a snapshot's request commits exactly once"
    assert images(cloud) == {image_id: "queued"}
    assert open_work(cloud) == [("snapshot", "snapshot", "pending")]


class _Routes:
    """The conductor's bus to agents that each serve on a transport of their own, so that an
    agent process that dies takes its consumers and the replies it owed with it."""

    def __init__(self) -> None:
        self.hosts: dict[str, InProcTransport] = {}

    async def call(
        self, topic: str, method: str, payload: dict[str, Any], *, op_id: str, timeout_s: float
    ) -> dict[str, Any]:
        host = topic.rsplit(".", 1)[-1]
        transport = self.hosts.get(host)
        if transport is None:
            raise BusClosed(f"nobody serves {topic}")
        return await transport.call(topic, method, payload, op_id=op_id, timeout_s=timeout_s)

    async def close(self) -> None:
        for transport in self.hosts.values():
            await transport.close()


@pytest.mark.parametrize("then", ["retried", "deleted"])
def test_a_snapshot_cut_off_by_an_agent_crash_ends_its_image(
    cloud: Cloud, tmp_path: Path, then: str
) -> None:
    """The agent dies in the middle of the upload (the image is `saving`). Retried, the
    snapshot meets an image no upload will finish and ends it; and before the fix, a delete
    of the server meanwhile failed the operation and left the image behind for good."""
    vm = active_server(cloud, tmp_path)
    host = str(cloud.objects.get("instance", vm).body["host"])
    drivers = {h: SimDriver(SimConfig(disk_bytes=4096), disk_dir=tmp_path / "d" / h) for h in HOSTS}
    image_id = snapshot_server(cloud, SystemCaller("p"), vm, "snap", {})
    drivers[host].adopt(vm, {})  # the guest, on this scenario's own hypervisor
    drivers[host].inject("read_disk", "read", FaultKind.HANG)

    uploads: list[Any] = []
    sink = make_upload_sink(cloud)

    async def recorded(image: str, payload: dict[str, Any]) -> Any:
        upload = await sink(image, payload)
        uploads.append(upload)
        return upload

    def close_files() -> None:
        """What a dead process had open, the OS closes: the upload it never finished."""
        for upload in uploads:
            file = getattr(getattr(upload, "_upload", None), "_file", None)
            if file is not None:
                file.close()

    async def agent(routes: _Routes, name: str) -> AgentServer:
        transport = InProcTransport()
        server = AgentServer(
            name,
            drivers[name],
            transport,
            lambda: cloud.ledger.heartbeat([name]),
            image_sink=recorded,
        )
        await server.serve()
        routes.hosts[name] = transport
        return server

    async def scenario() -> None:
        routes = _Routes()
        servers = {h: await agent(routes, h) for h in HOSTS}
        conductor = Conductor(cloud, routes, FAST)  # type: ignore[arg-type]
        task = asyncio.create_task(conductor.run())
        try:
            # (and its upload handed over: `saving` commits inside begin_upload's thread, so
            # a stop before it returns would drop an open file no test could close)
            await until(cloud, lambda: images(cloud).get(image_id) == "saving" and bool(uploads))
            # The agent process dies in the middle of the upload...
            await routes.hosts.pop(host).close()
            await servers[host].agent.stop(grace_s=0.0)
            close_files()
            drivers[host].clear_faults()
            if then == "deleted":
                await asyncio.to_thread(delete_server, cloud, vm)
            # ... and comes back.
            servers[host] = await agent(routes, host)
            await until(cloud, lambda: not open_work(cloud))
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            for server in servers.values():
                await server.close()
            await routes.close()

    asyncio.run(scenario())
    assert image_id not in images(cloud), images(cloud)  # killed with its upload: deleted
    doc = cloud.objects.find("instance", vm)
    assert (then, doc is None) in (("deleted", True), ("retried", False))
    assert doc is None or doc.body["task_state"] is None


def test_a_shelve_stops_the_guest_before_it_copies_the_disk(cloud: Cloud, tmp_path: Path) -> None:
    """Nova powers a guest off before the shelve snapshot, so the image is of a disk nothing
    writes to. Before the fix the running guest's disk was copied as it changed, and the guest
    destroyed only after: an image of a disk caught mid-write."""
    from stowage.services.shelve import shelve_server

    vm = active_server(cloud, tmp_path)
    host = str(cloud.objects.get("instance", vm).body["host"])
    drivers = {h: SimDriver(SimConfig(disk_bytes=4096), disk_dir=tmp_path / "d" / h) for h in HOSTS}
    drivers[host].adopt(vm, {})  # the guest, running, on this scenario's own hypervisor
    states: list[str] = []
    read_disk = drivers[host].read_disk

    def observed_read(instance_id: str, chunk_bytes: int, disk_format: str | None = None) -> Any:
        states.append(str(drivers[host].running()[instance_id]["state"]))
        return read_disk(instance_id, chunk_bytes, disk_format)

    drivers[host].read_disk = observed_read  # type: ignore[method-assign]
    shelve_server(cloud, SystemCaller("p"), vm, "req-shelve")

    async def scenario() -> None:
        routes = _Routes()
        servers = []
        for name in HOSTS:
            transport = InProcTransport()
            server = AgentServer(
                name,
                drivers[name],
                transport,
                lambda n=name: cloud.ledger.heartbeat([n]),
                image_sink=make_upload_sink(cloud),
            )
            await server.serve()
            routes.hosts[name] = transport
            servers.append(server)
        conductor = Conductor(cloud, routes, FAST)  # type: ignore[arg-type]
        task = asyncio.create_task(conductor.run())
        try:
            await until(cloud, lambda: not open_work(cloud))
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            for server in servers:
                await server.close()
            await routes.close()

    asyncio.run(scenario())
    body = cloud.objects.get("instance", vm).body
    with cloud.ledger.engine.connect() as conn:
        results = conn.exec_driver_sql("SELECT kind, state, result FROM operations").all()
    assert body["vm_state"] == "shelved_offloaded", results
    assert states == ["shutoff"], states  # the disk was read once, from a stopped guest
    ops = [op for op, iid in drivers[host].calls if iid == vm]
    assert ops.index("power_off") < ops.index("read_disk") < ops.index("destroy"), ops
    assert images(cloud)[str(body["shelved_image_id"])] == "active"
