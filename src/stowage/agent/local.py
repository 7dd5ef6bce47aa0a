"""The all-in-one cloud's compute side: one simulated agent per host, the in-process bus,
the conductor, and each agent's reconciler, all on the server's event loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from stowage.agent.metrics import AgentMetrics, AgentObserver, observe_agent
from stowage.agent.reconciler import Reconciler
from stowage.agent.runtime import AgentConfig
from stowage.agent.server import AgentServer, ConsoleSettings, ImageUpload
from stowage.bus.base import LoopBridge, Transport
from stowage.bus.inproc import InProcTransport
from stowage.domain.errors import NotFound
from stowage.services.caller import SystemCaller
from stowage.services.cloud import Cloud
from stowage.services.conductor import Conductor, conductor_config
from stowage.services.reconcile import Divergence, expected_on_host, record_divergence
from stowage.virt.driver import Driver
from stowage.virt.sim import SimConfig, SimDriver

__all__ = [
    "LocalCompute",
    "agent_server",
    "make_reconciler",
    "make_upload_sink",
    "restore_guests",
    "resume_guests",
]

log = logging.getLogger(__name__)

SIM_DISK_BYTES = 1024 * 1024
RECONCILE_INTERVAL_S = 60.0
POWER_SYNC_INTERVAL_S = 10.0


class _LocalUpload:
    """A snapshot's data into the image store: every write and the commit off the loop."""

    def __init__(self, upload: Any) -> None:
        self._upload = upload

    async def write(self, chunk: bytes) -> None:
        await asyncio.to_thread(self._upload.write, chunk)

    async def commit(self) -> None:
        await asyncio.to_thread(self._upload.commit)

    async def abort(self) -> None:
        await asyncio.to_thread(self._upload.abort)


class LocalCompute:
    """Starts and stops everything `stowage up` runs besides the APIs.

    It all runs on an event loop of its own, in its own thread, as the agents and the
    conductor would in their own processes: nothing the API does on its loop can hold an
    agent's heartbeat or its work.
    """

    def __init__(self, cloud: Cloud) -> None:
        self.cloud = cloud
        self.bus = InProcTransport()
        self.metrics = AgentMetrics.create()
        self.conductor = Conductor(cloud, self.bus, conductor_config(cloud))
        self.agents: dict[str, AgentServer] = {}
        self.reconcilers: dict[str, Reconciler] = {}
        self._observers: list[AgentObserver] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._power_wakes: dict[str, asyncio.Event] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start_thread(self) -> LoopBridge:
        """Run `start()` on a new loop in a daemon thread; returns the bus bridge."""
        started = threading.Event()
        failure: list[BaseException] = []

        def main() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self.start())
            except BaseException as exc:
                failure.append(exc)
                started.set()
                return
            started.set()
            loop.run_forever()
            loop.run_until_complete(self.close())
            loop.close()

        self._thread = threading.Thread(target=main, name="stowage-compute", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            raise failure[0]
        assert self._loop is not None
        return LoopBridge(self._loop, self.bus)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop everything here runs on (once `start_thread` has returned)."""
        assert self._loop is not None
        return self._loop

    def stop_thread(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)

    async def start(self) -> None:
        cloud = self.cloud
        names = await asyncio.to_thread(_host_names, cloud)
        sim_dir = cloud.config.state_dir / "sim"
        for name in names:
            driver: Driver
            if cloud.config.driver == "libvirt":
                wake = asyncio.Event()
                self._power_wakes[name] = wake
                poke = _waker(asyncio.get_running_loop(), wake)
                driver = await asyncio.to_thread(libvirt_driver, cloud, name, poke)
            else:
                driver = SimDriver(
                    SimConfig(
                        disk_bytes=SIM_DISK_BYTES,
                        step_latency_s=(
                            {"start": cloud.config.sim_step_s} if cloud.config.sim_step_s else {}
                        ),
                    ),
                    disk_dir=sim_dir / name,
                )
            server = agent_server(cloud, name, driver, self.bus)
            await server.serve()
            self.agents[name] = server
            self._observers.append(observe_agent(self.metrics, name, server.agent))
            self.reconcilers[name] = make_reconciler(cloud, name, server, self.metrics)
        await asyncio.to_thread(_record_host_ips, cloud, names)
        # The ledger is the truth and the simulated hypervisors start empty: before any
        # operation resumes, each runs again what the ledger places on it.
        await self._restore_hypervisors()
        # Before the API serves (its lifespan waits for this start).
        await asyncio.to_thread(cloud.scheduler.warm)
        cloud.kick = self.conductor.kick
        self._tasks = [
            asyncio.create_task(self.conductor.run(), name="conductor"),
            asyncio.create_task(self._observe(), name="agent-metrics"),
            *(
                asyncio.create_task(r.run_forever(RECONCILE_INTERVAL_S), name=f"reconcile-{h}")
                for h, r in self.reconcilers.items()
            ),
            *(
                asyncio.create_task(self._power_sync(h, w), name=f"power-sync-{h}")
                for h, w in self._power_wakes.items()
            ),
        ]

    async def close(self) -> None:
        self.cloud.kick = lambda: None
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for server in self.agents.values():
            await server.close()
            if isinstance(server.driver, SimDriver):
                server.driver.clear_faults()
            close = getattr(server.driver, "close", None)
            if close is not None and not isinstance(server.driver, SimDriver):
                await asyncio.to_thread(close)
        await self.bus.close()

    async def _restore_hypervisors(self) -> None:
        for host, server in self.agents.items():
            await asyncio.to_thread(restore_guests, self.cloud, host, server.driver)
            if self.cloud.config.resume_guests_state_on_host_boot:
                resumed = await asyncio.to_thread(resume_guests, self.cloud, host, server.driver)
                if resumed:
                    log.info("%s: started %d guest(s) that ran before", host, len(resumed))

    async def _power_sync(self, host: str, wake: asyncio.Event) -> None:
        """Lifecycle events (a guest stopped, crashed, vanished) and a periodic check bring
        the hypervisor's power state into the servers' (Nova's _sync_power_states)."""
        from stowage.services.power_sync import sync_power_states

        server = self.agents[host]
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POWER_SYNC_INTERVAL_S):
                    await wake.wait()
            wake.clear()
            await asyncio.sleep(0.5)  # let the operation that caused the event record itself
            try:
                running = await server.agent.running()
                await asyncio.to_thread(sync_power_states, self.cloud, host, running)
            except Exception:
                log.exception("power sync of %s failed", host)

    async def _observe(self) -> None:
        while True:
            for observer in self._observers:
                observer.observe()
            await asyncio.sleep(5.0)


def _record_host_ips(cloud: Cloud, names: list[str]) -> None:
    """Every all-in-one host runs on this machine: its address is this machine's."""
    from stowage.agent.processes import my_ip
    from stowage.services.compute_catalog import record_host_ip

    address = cloud.config.host_ip or my_ip()
    for name in names:
        record_host_ip(cloud, name, address)


def _waker(loop: asyncio.AbstractEventLoop, wake: asyncio.Event) -> Callable[[str, str], None]:
    """A lifecycle callback (libvirt's event thread) that sets `wake` on `loop`."""

    def poke(_instance_id: str, _event: str) -> None:
        loop.call_soon_threadsafe(wake.set)

    return poke


def libvirt_driver(
    cloud: Cloud, host: str, on_lifecycle: Callable[[str, str], None] | None = None
) -> Driver:
    """A host's libvirt driver: its URI, its topology as registered, images over HTTP."""
    from stowage.virt.images import HttpImageFetcher
    from stowage.virt.libvirt_driver import LibvirtDriver

    config = cloud.config
    uri = config.libvirt_uris.get(host, "qemu:///system")
    spec = next((h for h in config.topology if h.name == host), None)
    fetcher = HttpImageFetcher(f"{config.base_url}/image", lambda: service_token(cloud))
    return LibvirtDriver(
        uri,
        None if spec is None else spec.topology,
        config.state_dir / "libvirt" / host / "disks",
        virt_type=config.virt_type,
        image_fetcher=fetcher,
        migration_uri="tcp://127.0.0.1" if uri.startswith("qemu+unix") else None,
        on_lifecycle=on_lifecycle,
    )


GUEST_IMAGE_NAME = "stowage-guest"


def register_guest_image(cloud: Cloud) -> str:
    """The bootable guest built from Debian packages (`stowage.virt.guest_image`) as a public
    raw image, once; its id."""
    from pathlib import Path

    from stowage.services import images
    from stowage.virt import guest_image

    for doc in cloud.objects.list("image"):
        if doc.body.get("name") == GUEST_IMAGE_NAME and doc.body.get("status") == "active":
            return doc.id
    owner = next(d.id for d in cloud.objects.list("project") if d.body.get("name") == "admin")
    path = cloud.config.state_dir / "libvirt" / "guest.raw"
    guest_image.build(path, kernel=guest_image.default_kernel(), busybox=Path("/bin/busybox"))
    admin = SystemCaller(owner)
    body = images.create_image(
        cloud,
        admin,
        {
            "name": GUEST_IMAGE_NAME,
            "visibility": "public",
            "disk_format": "raw",
            "container_format": "bare",
        },
    )

    def chunks() -> Any:
        with path.open("rb") as f:
            while chunk := f.read(1 << 20):
                yield chunk

    images.store_image_bytes(cloud, admin, body["id"], chunks())
    return str(body["id"])


def service_token(cloud: Cloud) -> str:
    """A token for the cloud's own admin (the agents' image downloads)."""
    users = [d for d in cloud.objects.list("user") if d.body.get("name") == "admin"]
    projects = [d for d in cloud.objects.list("project") if d.body.get("name") == "admin"]
    if not users or not projects:
        raise RuntimeError("the cloud has no admin user or project")
    user_id, project_id = users[0].id, projects[0].id
    roles = cloud.roles_of(user_id, project_id)
    token, _payload = cloud.tokens.issue(user_id, project_id, roles, methods=("password",))
    return token


def make_reconciler(
    cloud: Cloud, host: str, server: AgentServer, metrics: AgentMetrics
) -> Reconciler:
    """The host's reconciler: the hypervisor through its agent, the ledger directly."""

    async def running() -> Any:
        return await server.agent.running()

    def record(divergence: Divergence) -> None:
        record_divergence(cloud, host, divergence)

    def busy() -> set[str]:
        return {op.instance_id for op in cloud.operations.active(host=host)}

    reconciler = Reconciler(
        host, running, lambda: expected_on_host(cloud.ledger, host), record, metrics, busy=busy
    )

    async def on_demand() -> dict[str, Any]:
        report = await reconciler.run_once()
        return {
            "host": host,
            "audited": len(report.audited),
            "skipped": len(report.skipped),
            "error": report.error,
            "divergences": [d.as_dict() for d in report.divergences],
        }

    server.reconcile = on_demand
    return reconciler


def make_upload_sink(cloud: Cloud) -> Any:
    """Snapshot data straight into the image store (this process shares its directory)."""

    async def sink(image_id: str, payload: dict[str, Any]) -> ImageUpload:
        from stowage.services import images

        caller = SystemCaller(str(payload.get("project_id") or ""))
        upload = await asyncio.to_thread(images.begin_upload, cloud, caller, image_id)
        return _LocalUpload(upload)

    return sink


def _host_names(cloud: Cloud) -> list[str]:
    from stowage.services.compute import instance_hosts

    return sorted(instance_hosts(cloud).values())


def agent_server(
    cloud: Cloud,
    host: str,
    driver: Driver,
    bus: Transport,
    image_sink: Any = None,
    *,
    console: ConsoleSettings | None = None,
) -> AgentServer:
    """A host's agent on the bus, heartbeating into the ledger, snapshots into the images
    (this process's image store, unless `image_sink` sends them elsewhere), its serial
    console proxy where `console` says (default: on 127.0.0.1, the API being on this
    machine)."""

    def beat() -> None:
        cloud.ledger.heartbeat([host])

    return AgentServer(
        host,
        driver,
        bus,
        beat,
        config=AgentConfig(
            heartbeat_interval_s=cloud.config.heartbeat_interval_s,
            max_concurrent_disk_ops=cloud.config.max_concurrent_disk_ops,
        ),
        image_sink=image_sink or make_upload_sink(cloud),
        console=console or ConsoleSettings(),
    )


def resume_guests(cloud: Cloud, host: str, driver: Driver) -> list[str]:
    """Nova's `resume_guests_state_on_host_boot`: the host's hypervisor came back with its
    guests defined but shut off (it stopped with the host); start those whose server was
    running (vm_state active), so the server's state and the guest's agree again. Returns
    the instances started; one that cannot start is logged and left (the power sync then
    shows it SHUTOFF)."""
    from stowage.virt.driver import InstanceState

    resumed = []
    for instance_id, seen in driver.running().items():
        doc = cloud.objects.find("instance", instance_id)
        if seen["state"] is not InstanceState.SHUTOFF or doc is None:
            continue
        body = doc.body
        if body.get("host") != host or body.get("vm_state") != "active":
            continue
        try:
            driver.power_on(instance_id)
        except Exception as exc:  # one guest that cannot start never stops the others
            log.warning("could not resume %s on %s: %s", instance_id, host, exc)
            continue
        resumed.append(instance_id)
    return resumed


def restore_guests(cloud: Cloud, host: str, driver: Driver) -> list[str]:
    """A simulated hypervisor starts empty: run again what the ledger places on `host`
    (instances and the destination ends of moves in flight), powered off where the server is
    stopped. Call it before the agent serves, so no operation meets a half-restored host.
    Returns the instances restored; one that cannot be restored is logged and skipped (the
    reconciler then reports it missing).
    """
    from stowage.services.conductor import claim_of
    from stowage.services.guest_spec import guest_payload
    from stowage.virt.driver import Guest

    present = driver.running()
    restored = []
    for consumer_id, instance_id, _host in _placed(cloud, host):
        if instance_id in present:
            continue
        claim = claim_of(cloud, consumer_id)
        if claim is None:
            continue
        pins = {int(k): int(v) for k, v in claim["pins"].items()}
        # The whole guest, as the conductor sends it (a shared-CPU flavor's vCPUs are not in
        # the claim); a move's destination end has the migration's flavor.
        record = (
            cloud.objects.find("migration", consumer_id) if consumer_id != instance_id else None
        )
        flavor = record.body.get("new_flavor") if record is not None else None
        guest = Guest.from_payload({**guest_payload(cloud, instance_id, flavor=flavor), **claim})
        try:
            driver.spawn(instance_id, pins, claim["cells"], claim["memory_mb"], guest)
            doc = cloud.objects.find("instance", instance_id)
            if doc is not None:
                _restore_state(cloud, driver, instance_id, doc.body)
        except Exception as exc:  # one guest that cannot come back never stops the others
            log.warning("could not restore %s on %s: %s", instance_id, host, exc)
            continue
        present = {**present, instance_id: driver.running()[instance_id]}
        restored.append(instance_id)
    return restored


def _restore_state(cloud: Cloud, driver: Driver, instance_id: str, body: dict[str, Any]) -> None:
    """The restored guest as its record says it is: powered off when stopped, booted from
    its rescue image (its own disk second) when rescued. The rescue password is not kept
    (secrets leave the operation's record), so the rescue system comes back without one."""
    from stowage.services.guest_spec import image_spec
    from stowage.virt.driver import ImageSpec

    state = body.get("vm_state")
    if state == "stopped":
        driver.power_off(instance_id)
    elif state == "rescued":
        image_id = str(body.get("rescue_image_id") or body.get("image_id") or "")
        spec = image_spec(cloud, image_id)
        if spec is None:
            raise NotFound(f"rescue image {image_id} of {instance_id} is not an active image")
        driver.rescue(instance_id, ImageSpec(**spec), "")
    elif state == "paused":
        driver.pause(instance_id)
    elif state == "suspended":
        driver.suspend(instance_id)


def _placed(cloud: Cloud, host: str | None = None) -> list[tuple[str, str, str]]:
    """(consumer, instance, host) for every consumer holding a host (or `host`): instances
    and the destination ends of moves in flight."""
    from sqlalchemy import select

    from stowage.ledger.db import READONLY
    from stowage.ledger.schema import consumers, hosts

    query = select(consumers.c.id, consumers.c.instance_id, hosts.c.name).select_from(
        consumers.join(hosts, hosts.c.id == consumers.c.host_id)
    )
    if host is not None:
        query = query.where(hosts.c.name == host)
    with cloud.ledger.engine.connect().execution_options(**READONLY) as conn:
        rows = conn.execute(query.order_by(consumers.c.id)).all()
    return [(str(c), str(i), str(h)) for c, i, h in rows]
