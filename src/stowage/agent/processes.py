"""Production mode: the conductor and each host's agent as processes of their own, talking
over RabbitMQ and sharing the ledger on PostgreSQL (the API runs as `stowage api`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from stowage.agent.metrics import AgentMetrics, AgentObserver, observe_agent
from stowage.agent.server import ConsoleSettings
from stowage.bus.base import Transport
from stowage.domain.topology import HostSpec
from stowage.ledger.db import NamedLock
from stowage.services.cloud import Cloud
from stowage.services.conductor import Conductor, conductor_config
from stowage.services.runtime import freeze_started_process
from stowage.virt.driver import Driver

__all__ = [
    "conductor_name",
    "http_image_sink",
    "my_ip",
    "run_agent",
    "run_conductor",
    "run_until_signal",
]

log = logging.getLogger(__name__)

DEFAULT_BUS_URL = "amqp://guest:guest@127.0.0.1:5672/"


async def run_until_signal(work: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run `work` until SIGINT or SIGTERM sets the event it is given."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await work(stop)


async def _connect(bus_url: str) -> Transport:
    from stowage.bus.rabbit import RabbitTransport

    transport: Transport = await RabbitTransport.connect(bus_url)
    return transport


def conductor_name(cloud: Cloud) -> str:
    """A conductor's stable identity: `--name`, else the machine's host name."""
    return cloud.config.conductor_name or socket.gethostname()


async def run_conductor(cloud: Cloud, bus_url: str, stop: asyncio.Event) -> None:
    """Lease and drive operations until `stop`; several conductors may run at once.

    A conductor leases operations under its name, so one that restarts (after a crash, a
    `kill -9`) takes back its own leases at once instead of waiting for them to run out;
    other conductors' leases run out (`lease_s`) and are taken over, never voided. Two
    conductors of one name would both take the name's leases: the second waits, leasing
    nothing, until the first is gone (its name is a lock in the ledger that the first
    holds while it lives), then takes over at once, as a hot standby.
    """
    name = conductor_name(cloud)
    lock = NamedLock(cloud.ledger.engine, f"conductor:{name}")
    warned = False
    while not await asyncio.to_thread(lock.acquire, wait=False):
        if not warned:
            log.warning("a conductor named %s is running: this one waits until it ends", name)
            warned = True
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1.0):
                await stop.wait()
        if stop.is_set():
            return
    try:
        bus = await _connect(bus_url)
        conductor = Conductor(cloud, bus, conductor_config(cloud), owner=name)
        task = asyncio.create_task(conductor.run(take_over=False))
        log.info("conductor %s running (leases of %.0f s)", name, conductor.config.lease_s)
        try:
            await stop.wait()
        finally:
            await _cancel(task)
            await bus.close()
    finally:
        await asyncio.to_thread(lock.release)


async def _observe(observer: AgentObserver, interval_s: float = 5.0) -> None:
    while True:
        observer.observe()
        await asyncio.sleep(interval_s)


async def _cancel(task: asyncio.Task[Any]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def my_ip() -> str:
    """This machine's address on its default route, as Nova's `my_ip` defaults: the source
    address the kernel picks for an outside destination (no packet is sent); 127.0.0.1
    when there is no route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: routed like the Internet, never used
            return str(probe.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def http_image_sink(image_api: str, token: Callable[[], str]) -> Any:
    """Snapshots streamed to the image API over HTTP: no state shared with the API."""
    from stowage.virt.images import HttpImageUpload

    async def sink(image_id: str, _context: dict[str, Any]) -> HttpImageUpload:
        return HttpImageUpload(image_api, image_id, token)

    return sink


def make_driver(
    kind: str,
    spec: HostSpec | None,
    disk_dir: Path,
    *,
    libvirt_uri: str = "qemu:///system",
    **libvirt_options: Any,
) -> Driver:
    """The host's driver; for libvirt, a `spec` of None reads the topology from libvirt and
    `libvirt_options` go to `LibvirtDriver` (virt_type, image_fetcher, CPU sets, ...)."""
    if kind == "sim":
        from stowage.virt.sim import SimConfig, SimDriver

        return SimDriver(SimConfig(disk_bytes=1024 * 1024), disk_dir=disk_dir)
    if kind == "libvirt":
        from stowage.virt.libvirt_driver import LibvirtDriver

        topology = None if spec is None else spec.topology
        return LibvirtDriver(libvirt_uri, topology, disk_dir, **libvirt_options)
    raise ValueError(f"unknown driver {kind!r}: sim or libvirt")


async def run_agent(
    cloud: Cloud,
    spec: HostSpec,
    driver: Driver,
    bus_url: str,
    stop: asyncio.Event,
    image_sink: Any = None,
    host_ip: str | None = None,
    *,
    metrics: AgentMetrics | None = None,
    console: ConsoleSettings | None = None,
) -> None:
    """Register the host, then heartbeat and serve its operations until `stop`; snapshots
    go to `image_sink` (the image API over HTTP, in production), its metrics into `metrics`,
    which the process may serve."""
    from stowage.agent.local import agent_server, make_reconciler, restore_guests
    from stowage.services.compute_catalog import record_host_ip
    from stowage.virt.sim import SimDriver

    await asyncio.to_thread(cloud.ledger.register_host, spec)
    await asyncio.to_thread(record_host_ip, cloud, spec.name, host_ip or my_ip())
    if isinstance(driver, SimDriver):
        # A simulated hypervisor forgets its guests with its process (libvirt keeps them):
        # before serving, it runs again what the ledger places here.
        restored = await asyncio.to_thread(restore_guests, cloud, spec.name, driver)
        log.info("agent of %s restored %d guest(s) from the ledger", spec.name, len(restored))
    bus = await _connect(bus_url)
    metrics = metrics or AgentMetrics.create()
    server = agent_server(cloud, spec.name, driver, bus, image_sink, console=console)
    await server.serve()
    reconciler = make_reconciler(cloud, spec.name, server, metrics)
    task: asyncio.Task[Any] = asyncio.create_task(reconciler.run_forever(60.0))
    # Heartbeat gaps and loop lag into the metrics, as `stowage up`'s agents export them.
    observed = asyncio.create_task(_observe(observe_agent(metrics, spec.name, server.agent)))
    log.info("agent of %s serving", spec.name)
    freeze_started_process(f"agent of {spec.name}")
    try:
        await stop.wait()
    finally:
        await _cancel(observed)
        await _cancel(task)
        await server.close()
        await bus.close()
