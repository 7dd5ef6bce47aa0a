"""An agent on the bus: one host's compute service, its operations and its sim controls.

Two topics per host: `compute.<host>` carries the operations the conductor sends (each keyed
by an op id, so a redelivery is answered, not repeated) and `control.<host>` carries the
simulation controls behind `stowage sim` (stop, start, fault, slow-disk, clear, show), which
answer even while the agent is "stopped".

A stopped agent neither heartbeats nor executes: operations wait in its queue, as they would
in RabbitMQ for a `systemctl stop`ped nova-compute. A crash (an injected `crash` fault) stops
it the same way, forgets what it was doing, and restarts it a moment later; the interrupted
operation then runs again from the start, which every operation here allows.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from stowage.agent.console_proxy import ConsoleProxy
from stowage.agent.runtime import Agent, AgentConfig, OpResult
from stowage.bus.base import Transport, compute_topic, control_topic
from stowage.virt.driver import (
    Driver,
    DriverCrashed,
    DriverError,
    Guest,
    ImageSpec,
    InstanceNotFound,
    InstanceState,
    MigrationProgress,
    MigrationTarget,
    Nic,
)

__all__ = [
    "AgentServer",
    "ConsoleSettings",
    "ImageSink",
    "ImageUpload",
    "compute_topic",
    "control_topic",
]

log = logging.getLogger(__name__)

Payload = dict[str, Any]

# Driver operations served as they are (see `AgentServer._guest_method`).
_GUEST_METHODS = frozenset(
    {
        "console_output",
        "pause",
        "unpause",
        "suspend",
        "resume",
        "prepare_migration",
        "export_disk",
        "live_migrate",
        "migration_progress",
        "finish_migration",
        "abort_migration",
        "force_complete_migration",
        "rollback_migration",
        "attach_volume",
        "detach_volume",
        "rescue",
        "unrescue",
        "attach_interface",
        "detach_interface",
        "set_admin_password",
        "inject_nmi",
    }
)


class ImageUpload(Protocol):
    """One snapshot's data on its way to the image service."""

    async def write(self, chunk: bytes) -> None: ...

    async def commit(self) -> None: ...

    async def abort(self) -> None: ...


ImageSink = Callable[[str, Payload], Awaitable[ImageUpload]]
"""Opens the upload of an image's data: `(image_id, context) -> upload`."""


_UNLOCKED = frozenset(
    {
        "console_output",
        "serial_console",
        "migration_progress",
        "abort_migration",
        "force_complete_migration",
    }
)
_NO_LOCK = contextlib.nullcontext()
# Calls that change what a host runs: one issued before a call already run is stale.
_FENCED = frozenset(
    {"spawn", "destroy", "power_off", "power_on", "reboot", "pause", "unpause", "suspend",
     "resume", "prepare_migration", "live_migrate", "finish_migration", "rollback_migration",
     "rescue", "unrescue"}
)  # fmt: skip
_ISSUED_MAX = 100_000


@dataclass(frozen=True)
class ConsoleSettings:
    """Where a host's serial console proxy listens (port 0: any free port), and the address
    the API is told to connect to (default: `listen`)."""

    listen: str = "127.0.0.1"
    port: int = 0
    address: str | None = None


class _Crashed(Exception):
    """The hypervisor connection died under an operation: the agent process goes down."""


class AgentServer:
    """Serves one host's `Agent` on the bus; `stop()`/`start()` act like the service's."""

    def __init__(
        self,
        host: str,
        driver: Driver,
        bus: Transport,
        heartbeat: Callable[[], None],
        *,
        config: AgentConfig | None = None,
        image_sink: ImageSink | None = None,
        crash_restart_s: float = 1.0,
        reconcile: Callable[[], Awaitable[Payload]] | None = None,
        clock: Callable[[], float] = time.time,
        console: ConsoleSettings | None = None,
    ) -> None:
        self.host = host
        self.clock = clock
        # Calls issued before this process started are stale (the fence forgets with a
        # restart, and a conductor re-issues what still matters, with a new time).
        self._issued_floor = clock()
        self.driver = driver
        self.bus = bus
        self.image_sink = image_sink
        self.crash_restart_s = crash_restart_s
        self.reconcile = reconcile  # set by whoever runs the host's reconciler
        self._beat = heartbeat
        self.agent = Agent(driver, self._heartbeat, config)
        # The serial consoles' TCP end (none: the host offers no interactive console).
        self.console = (
            None
            if console is None
            else ConsoleProxy(
                driver,
                self.agent.in_driver_pool,
                listen=console.listen,
                port=console.port,
                address=console.address,
            )
        )
        self._up = asyncio.Event()
        self._locks: dict[str, asyncio.Lock] = {}
        self.crashes = 0
        self.ops_done: dict[str, int] = {}
        # When the conductor issued the newest call run for each instance (the fence).
        self._issued: OrderedDict[str, float] = OrderedDict()
        # The last progress of each live migration this host sends, by instance id.
        self.migration_progress: dict[str, dict[str, int]] = {}

    # -- lifecycle -------------------------------------------------------------------

    async def serve(self) -> None:
        """Start the agent and listen on both topics."""
        await self.agent.start()
        if self.console is not None:
            try:
                await self.console.start()
            except OSError as exc:
                # A console proxy that cannot listen (an address this machine does not
                # have, a port taken) costs the host its serial consoles, not its agent.
                log.error(
                    "%s offers no serial console: its proxy cannot listen on %s:%d: %s",
                    self.host,
                    self.console.listen,
                    self.console.port,
                    exc,
                )
                self.console = None
        self._up.set()
        await self.bus.serve(compute_topic(self.host), self._handle)
        await self.bus.serve(control_topic(self.host), self._control)

    async def close(self) -> None:
        self._up.set()  # let waiting handlers run into the closed pools and end
        if self.console is not None:
            await self.console.close()
        await self.agent.stop(grace_s=1.0)

    @property
    def running(self) -> bool:
        return self._up.is_set()

    def stop(self) -> None:
        """Like `systemctl stop`: no heartbeats, no operations, until `start()`."""
        self._up.clear()

    def start(self) -> None:
        self._up.set()

    def _heartbeat(self) -> None:
        if self._up.is_set():
            self._beat()

    async def _crash(self, reason: str) -> None:
        self.crashes += 1
        self.agent.forget()  # a restarted process remembers no operation
        log.error(
            "agent %s crashed (%s); restarting in %.1f s", self.host, reason, self.crash_restart_s
        )
        self.stop()
        await asyncio.sleep(self.crash_restart_s)
        self._issued.clear()
        self._issued_floor = self.clock()
        self.start()

    # -- operations ------------------------------------------------------------------

    async def _handle(self, method: str, payload: Payload, op_id: str) -> Payload:
        """Run one operation; a crash in the middle runs it again after the restart."""
        while True:
            await self._up.wait()
            instance_id = str(payload.get("instance_id", ""))
            # Reads and the calls that act on a running migration job must not queue
            # behind the migration itself.
            lock = (
                _NO_LOCK
                if method in _UNLOCKED
                else self._locks.setdefault(instance_id, asyncio.Lock())
            )
            try:
                async with lock:
                    await self._up.wait()
                    reply = self._stale(method, payload, instance_id) or await self._run(
                        method, payload, op_id
                    )
            except (_Crashed, DriverCrashed) as exc:
                await self._crash(str(exc))
                continue
            key = f"{method}:{'ok' if reply.get('ok') else 'error'}"
            self.ops_done[key] = self.ops_done.get(key, 0) + 1
            return reply

    def _stale(self, method: str, payload: Payload, instance_id: str) -> Payload | None:
        """Refuse a call the conductor issued before one this host already ran for the
        instance (a message the bus delivered late): a spawn arriving after the destroy that
        undid it would run a guest the ledger no longer places. None: run it."""
        issued = payload.get("issued_at")
        if method not in _FENCED or not isinstance(issued, int | float):
            return None
        last = self._issued.get(instance_id, self._issued_floor)
        if issued < last:
            return {
                "ok": False,
                "code": "agent.call.stale",
                "error": f"{method} of {instance_id} was issued before a call already run here",
            }
        self._issued[instance_id] = float(issued)
        self._issued.move_to_end(instance_id)
        while len(self._issued) > _ISSUED_MAX:
            self._issued.popitem(last=False)
        return None

    async def _run(self, method: str, payload: Payload, op_id: str) -> Payload:
        instance_id = str(payload.get("instance_id", ""))
        agent = self.agent
        if method == "spawn":
            pins = {int(k): int(v) for k, v in dict(payload.get("pins") or {}).items()}
            guest = Guest.from_payload(payload) if payload.get("vcpus") else None
            spawn = functools.partial(
                _spawn_once,
                self.driver,
                instance_id,
                pins,
                [int(c) for c in payload.get("cells") or []],
                int(payload.get("memory_mb") or 0),
                guest,
            )
            spawned = await agent.call(op_id, "spawn", instance_id, spawn)
            if spawned.already:
                return {"ok": True, "already": True}
            return await self._result(spawned)
        if method == "destroy":
            result = await agent.destroy(op_id, instance_id)
            if not result.ok and result.error_code == InstanceNotFound.code:
                return {"ok": True, "absent": True}
            return await self._result(result)
        if method in ("power_off", "power_on", "reboot"):
            call = getattr(agent, method)
            return await self._result(await call(op_id, instance_id))
        if method == "snapshot":
            return await self._snapshot(op_id, instance_id, payload)
        if method in _GUEST_METHODS:
            return await self._guest_method(method, payload, op_id)
        if method == "running":
            return {"ok": True, "instances": _running_view(await agent.running())}
        if method == "serial_console":
            return await self._serial_console(instance_id, bool(payload.get("ticket")))
        return {"ok": False, "code": "agent.method.unknown", "error": f"no method {method!r}"}

    async def _guest_method(self, method: str, payload: Payload, op_id: str) -> Payload:
        """Console, pause/suspend and the live-migration phases, straight to the driver."""
        instance_id = str(payload.get("instance_id", ""))
        driver, agent = self.driver, self.agent
        try:
            if method == "console_output":
                length = payload.get("length")
                text = await agent.in_driver_pool(
                    driver.console_output, instance_id, None if length is None else int(length)
                )
                return {"ok": True, "output": text}
            if method == "migration_progress":
                seen = await agent.in_driver_pool(driver.migration_progress, instance_id)
                return {"ok": True, "progress": None if seen is None else dict(seen.__dict__)}
            if method == "prepare_migration":
                guest = Guest.from_payload(payload)
                handle = await agent.in_driver_pool(driver.prepare_migration, instance_id, guest)
                return {"ok": True, "handle": handle}
            if method == "export_disk":
                return {"ok": True, "handle": await agent.export_disk(instance_id)}
        except DriverError as exc:
            return {"ok": False, "code": exc.code, "error": exc.message}
        if method == "live_migrate":
            target = MigrationTarget(
                host=str(payload["dest"]),
                guest=Guest.from_payload(payload["dest_guest"]),
                handle=dict(payload["handle"]),
            )
            progress = self.migration_progress.setdefault(instance_id, {})

            def record(seen: MigrationProgress) -> None:
                progress.update(seen.__dict__)

            return await self._result(
                await agent.call(
                    op_id,
                    method,
                    instance_id,
                    lambda: driver.migrate(instance_id, target, record),
                )
            )
        if method in ("attach_volume", "detach_volume"):
            device = str(payload["device"])
            connection = dict(payload.get("connection") or {})
            volume_call = (
                (lambda: driver.attach_volume(instance_id, device, connection))
                if method == "attach_volume"
                else (lambda: driver.detach_volume(instance_id, device))
            )
            return await self._result(await agent.call(op_id, method, instance_id, volume_call))
        guest_call = _guest_call(driver, method, instance_id, payload)
        return await self._result(await agent.call(op_id, method, instance_id, guest_call))

    async def _serial_console(self, instance_id: str, ticket: bool) -> Payload:
        """Whether the instance runs here with a console to open; with `ticket`, a one-time
        ticket for a session and where to present it (`ConsoleProxy`)."""
        if self.console is None:
            return {
                "ok": False,
                "code": "agent.console.unavailable",
                "error": f"{self.host} offers no serial console proxy",
            }
        seen = (await self.agent.running()).get(instance_id)
        if seen is None:
            return {
                "ok": False,
                "code": InstanceNotFound.code,
                "error": f"instance {instance_id} is not on {self.host}",
            }
        if seen["state"] != InstanceState.RUNNING:
            return {
                "ok": False,
                "code": "virt.console.not_running",
                "error": f"instance {instance_id} is {seen['state']}, not running",
            }
        if not ticket:
            return {"ok": True}
        try:
            return {"ok": True, **self.console.issue(instance_id)}
        except DriverError as exc:
            return {"ok": False, "code": exc.code, "error": exc.message}

    async def _result(self, result: OpResult) -> Payload:
        if result.ok:
            return {"ok": True, "duration_s": result.duration_s}
        return {"ok": False, "code": result.error_code, "error": result.error}

    async def _snapshot(self, op_id: str, instance_id: str, payload: Payload) -> Payload:
        """The disk streamed into the image; with `power_off` (a shelve) the guest is stopped
        first, so the copy is of a disk nothing writes to."""
        if self.image_sink is None:
            return {"ok": False, "code": "agent.snapshot.no_sink", "error": "no image service"}
        if payload.get("power_off"):
            stopped = await self.agent.power_off(f"{op_id}:power_off", instance_id)
            if not stopped.ok:
                return await self._result(stopped)
        upload = await self.image_sink(str(payload["image_id"]), payload)
        try:
            disk_format = payload.get("disk_format")
            sent = await self.agent.snapshot(
                instance_id, upload.write, None if disk_format is None else str(disk_format)
            )
        except DriverCrashed as exc:
            await upload.abort()
            raise _Crashed(str(exc)) from None
        except Exception as exc:
            await upload.abort()
            code = getattr(exc, "code", "agent.snapshot.failed")
            return {"ok": False, "code": code, "error": str(exc)}
        try:
            await upload.commit()
        except DriverError as exc:  # the image service refused the data (an HTTP upload)
            return {"ok": False, "code": exc.code, "error": exc.message}
        return {"ok": True, "bytes": sent}

    # -- simulation controls -----------------------------------------------------------

    async def _control(self, method: str, payload: Payload, op_id: str) -> Payload:
        from stowage.virt.sim import FaultKind, SimDriver

        if method == "show":
            return self.show(await asyncio.to_thread(self.driver.running))
        if method == "reconcile":
            if self.reconcile is None:
                raise ValueError(f"{self.host} runs no reconciler")
            return await self.reconcile()
        if method == "stop":
            self.stop()
        elif method == "start":
            self.start()
        elif not isinstance(self.driver, SimDriver):
            raise ValueError(f"{method} needs the simulated driver; {self.host} runs another")
        elif method == "fault":
            self.driver.inject(
                str(payload["operation"]),
                str(payload["step"]),
                FaultKind(str(payload.get("action", "fail"))),
                int(payload.get("times", 1)),
            )
        elif method == "slow_disk":
            seconds = float(payload["seconds"])
            if seconds < 0:
                raise ValueError("seconds must be >= 0")
            self.driver.config.slow_disk_s = seconds
        elif method == "latency":
            self.driver.set_latency(
                str(payload["operation"]), str(payload["step"]), float(payload["seconds"])
            )
        elif method == "repin":
            pins = {int(k): int(v) for k, v in dict(payload["pins"]).items()}
            await asyncio.to_thread(self.driver.tamper_pins, str(payload["instance_id"]), pins)
        elif method == "clear":
            self.driver.clear_faults()
            self.driver.config.slow_disk_s = 0.0
            self.driver.clear_latency()
        else:
            raise ValueError(f"unknown control {method!r}")
        return self.show(await asyncio.to_thread(self.driver.running))

    def show(self, running: dict[str, Any]) -> Payload:
        agent = self.agent
        return {
            "host": self.host,
            "running": self.running,
            "crashes": self.crashes,
            "heartbeat_gap_max_s": round(agent.heartbeat_gap_max_s, 3),
            "loop_lag_max_s": round(agent.watchdog.lag_max_s, 3),
            "slow_disk_s": getattr(getattr(self.driver, "config", None), "slow_disk_s", None),
            "instances": _running_view(running, _details(self.driver)),
            "at": time.time(),
        }


def _guest_call(
    driver: Driver, method: str, instance_id: str, payload: Payload
) -> Callable[[], None]:
    """The driver call of a guest method, with its arguments from the payload."""
    if method == "rescue":
        image = payload.get("image")
        spec = ImageSpec(**dict(image)) if image else None
        return lambda: driver.rescue(instance_id, spec, str(payload.get("admin_password") or ""))
    if method == "attach_interface":
        nic = dict(payload["nic"])
        made = Nic(
            mac=str(nic["mac"]),
            ips=tuple(str(ip) for ip in nic.get("ips") or ()),
            network_id=str(nic.get("network_id") or ""),
            port_id=str(nic.get("port_id") or ""),
        )
        return lambda: driver.attach_interface(instance_id, made)
    if method == "detach_interface":
        return lambda: driver.detach_interface(instance_id, str(payload["mac"]))
    if method == "set_admin_password":
        return lambda: driver.set_admin_password(instance_id, str(payload["password"]))
    call = getattr(driver, method)
    return lambda: call(instance_id)


def _details(driver: Driver) -> dict[str, dict[str, Any]]:
    """What a simulated guest records beyond its state (rescue, NICs, password, NMIs)."""
    from stowage.virt.sim import SimDriver

    return driver.guest_details() if isinstance(driver, SimDriver) else {}


def _running_view(
    running: dict[str, Any], details: dict[str, dict[str, Any]] | None = None
) -> dict[str, Any]:
    return {
        iid: {
            "state": str(inst["state"]),
            "pins": {str(k): v for k, v in inst["pins"].items()},
            **(details or {}).get(iid, {}),
        }
        for iid, inst in sorted(running.items())
    }


def _spawn_once(
    driver: Driver,
    instance_id: str,
    pins: dict[int, int],
    cells: list[int],
    memory_mb: int,
    guest: Guest | None,
) -> bool:
    """A spawn, in one trip to the driver pool, that settles a repeated one first: a guest
    the host runs already with these pins is left as it is (True: a spawn that finished
    before), one stopped with them is started again (interrupted after its define), one
    with other pins is destroyed (a stale one) and the guest spawned."""
    present = driver.running().get(instance_id)
    if present is not None and present["pins"] == pins:
        if present["state"] == InstanceState.RUNNING:
            return True
        driver.power_on(instance_id)
        return False
    if present is not None:
        try:
            driver.destroy(instance_id)
        except DriverError as exc:  # the spawn says what is wrong, if anything is
            log.warning("spawn %s: the stale guest is still there: %s", instance_id, exc)
    driver.spawn(instance_id, pins, cells, memory_mb, guest)
    return False
