"""The agent runtime: heartbeat, loop-lag watchdog, bounded executors, idempotent ops."""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from stowage.virt.driver import Driver, DriverError, Guest, InstanceNotFound, RunningInstance

__all__ = ["Agent", "AgentConfig", "LagWatchdog", "OpResult", "percentile"]

log = logging.getLogger(__name__)

T = TypeVar("T")
Sink = Callable[[bytes], Awaitable[None]]


def percentile(samples: list[float], q: float) -> float:
    """The `q` quantile (0..1) of `samples` by nearest rank; 0.0 when there are none."""
    if not samples:
        return 0.0
    ordered = sorted(samples)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1]


@dataclass(frozen=True)
class AgentConfig:
    """Every queue and pool is bounded; times in seconds."""

    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 5.0
    lag_interval_s: float = 0.05
    lag_stall_s: float = 0.5  # a wake-up this late is logged as a stall
    samples_max: int = 10_000  # heartbeat gaps and lag samples kept
    max_workers: int = 4  # driver calls (spawn, reboot, ...)
    max_concurrent_disk_ops: int = 2  # like nova's option, but 0 is not "unlimited"
    chunk_bytes: int = 1024 * 1024
    op_results_max: int = 10_000  # finished op ids remembered for redelivery

    def __post_init__(self) -> None:
        if self.max_workers < 1 or self.max_concurrent_disk_ops < 1:
            raise ValueError("max_workers and max_concurrent_disk_ops must be at least 1")
        if self.heartbeat_interval_s <= 0 or self.lag_interval_s <= 0:
            raise ValueError("intervals must be positive")


@dataclass(frozen=True)
class OpResult:
    """The outcome of one operation: a status value that carries the reason, not an exception."""

    op_id: str
    operation: str
    instance_id: str
    ok: bool
    error_code: str | None = None
    error: str | None = None
    duration_s: float = 0.0
    already: bool = False  # a spawn found the guest running as asked: nothing was done


class LagWatchdog:
    """Records how late the event loop wakes a sleeper that sleeps `interval_s` over and over.

    A late wake-up means something held the event loop: the agent's heartbeat, and every
    other task, was held with it. The agents that share a loop (`stowage up`'s simulated
    hosts, all on the compute loop) share one sleeper, which hands each wake-up's lag to
    every one of their watchdogs: sixty sleepers woke the loop 1,200 times a second to
    measure the same loop (7% of the compute process's CPU while it booted, 2026-12-06).
    """

    def __init__(self, interval_s: float, stall_s: float, samples_max: int) -> None:
        self.interval_s = interval_s
        self.stall_s = stall_s
        self.samples: deque[float] = deque(maxlen=samples_max)
        self.stalls = 0
        self.on_stall: Callable[[], None] = lambda: None

    async def run(self) -> None:
        """Watch the running loop until cancelled."""
        await _LoopSleeper.of(asyncio.get_running_loop(), self.interval_s).watch(self)

    def woke(self, lag_s: float) -> None:
        self.samples.append(lag_s)
        if lag_s >= self.stall_s:
            self.stalls += 1
            self.on_stall()
            log.warning("event loop stalled for %.3f s", lag_s)

    @property
    def lag_max_s(self) -> float:
        return max(self.samples, default=0.0)

    @property
    def lag_p99_s(self) -> float:
        return percentile(list(self.samples), 0.99)


class _LoopSleeper:
    """The one sleeper of a loop and an interval: it runs while some watchdog watches, each
    watchdog's `run` awaiting it shielded, so that one watchdog's cancel stops only its own."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.watchers: list[LagWatchdog] = []
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop, interval_s: float) -> _LoopSleeper:
        sleepers = _SLEEPERS.setdefault(loop, {})
        found = sleepers.get(interval_s)
        if found is None:
            found = sleepers[interval_s] = cls(interval_s)
        return found

    async def watch(self, watcher: LagWatchdog) -> None:
        """Hand `watcher` every wake-up until the caller is cancelled."""
        self.watchers.append(watcher)
        try:
            if self._task is None or self._task.done():
                self._task = asyncio.get_running_loop().create_task(
                    self._sleep(), name="agent-watchdog-sleeper"
                )
            await asyncio.shield(self._task)
        finally:
            self.watchers.remove(watcher)
            if not self.watchers and self._task is not None:
                self._task.cancel()  # the last one stopped: nothing is left pending on the loop
                self._task = None

    async def _sleep(self) -> None:
        while self.watchers:
            start = time.monotonic()
            await asyncio.sleep(self.interval_s)
            lag_s = max(0.0, time.monotonic() - start - self.interval_s)
            for watcher in list(self.watchers):
                watcher.woke(lag_s)


_SLEEPERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[float, _LoopSleeper]]
_SLEEPERS = weakref.WeakKeyDictionary()


class Agent:
    """The compute agent for one host.

    Three pools keep the kinds of work from starving each other: one thread for the
    heartbeat, `max_workers` threads for driver calls, and `max_concurrent_disk_ops`
    threads (behind a semaphore of the same size) for disk-heavy work such as snapshots.
    Nothing that can block runs on the event loop.
    """

    def __init__(
        self,
        driver: Driver,
        heartbeat: Callable[[], None],
        config: AgentConfig | None = None,
    ) -> None:
        self.driver = driver
        self.config = config or AgentConfig()
        self._heartbeat = heartbeat
        cfg = self.config
        self.heartbeat_gaps_s: deque[float] = deque(maxlen=cfg.samples_max)
        self.heartbeat_failures = 0
        self.watchdog = LagWatchdog(cfg.lag_interval_s, cfg.lag_stall_s, cfg.samples_max)
        self._ops: OrderedDict[str, asyncio.Task[OpResult]] = OrderedDict()
        self._tasks: list[asyncio.Task[None]] = []
        self._hb_pool: ThreadPoolExecutor | None = None
        self._driver_pool: ThreadPoolExecutor | None = None
        self._disk_pool: ThreadPoolExecutor | None = None
        self._disk_slots: asyncio.Semaphore | None = None

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Start the pools, the heartbeat and the watchdog on the running loop."""
        if self._tasks:
            raise RuntimeError("agent already started")
        cfg = self.config
        self._hb_pool = ThreadPoolExecutor(1, thread_name_prefix="agent-heartbeat")
        self._driver_pool = ThreadPoolExecutor(cfg.max_workers, thread_name_prefix="agent-driver")
        self._disk_pool = ThreadPoolExecutor(
            cfg.max_concurrent_disk_ops, thread_name_prefix="agent-disk"
        )
        self._disk_slots = asyncio.Semaphore(cfg.max_concurrent_disk_ops)
        self._tasks = [
            asyncio.create_task(self._heartbeat_loop(), name="agent-heartbeat"),
            asyncio.create_task(self.watchdog.run(), name="agent-watchdog"),
        ]

    async def stop(self, grace_s: float = 5.0) -> None:
        """Wait up to `grace_s` for running ops, then stop the tasks and the pools.

        Threads still blocked in the driver after the grace period are abandoned (a
        thread cannot be killed); the pools stop accepting work either way.
        """
        running = [t for t in self._ops.values() if not t.done()]
        if running:
            await asyncio.wait(running, timeout=grace_s)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        for pool in (self._hb_pool, self._driver_pool, self._disk_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        self._hb_pool = self._driver_pool = self._disk_pool = None

    async def __aenter__(self) -> Agent:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def forget(self) -> None:
        """Drop every remembered operation, as a restarted agent process would."""
        self._ops.clear()

    # -- figures ---------------------------------------------------------------------

    @property
    def heartbeat_gap_max_s(self) -> float:
        return max(self.heartbeat_gaps_s, default=0.0)

    def heartbeat_gap_quantile_s(self, q: float) -> float:
        return percentile(list(self.heartbeat_gaps_s), q)

    # -- operations ------------------------------------------------------------------

    async def spawn(
        self,
        op_id: str,
        instance_id: str,
        pins: dict[int, int],
        cells: list[int],
        memory_mb: int,
        guest: Guest | None = None,
    ) -> OpResult:
        return await self._submit(
            op_id,
            "spawn",
            instance_id,
            lambda: self.driver.spawn(instance_id, pins, cells, memory_mb, guest),
        )

    async def call(
        self, op_id: str, operation: str, instance_id: str, fn: Callable[[], bool | None]
    ) -> OpResult:
        """Any other driver operation, once per op id, in the driver pool; `fn` returns True
        when it found the work done already (`OpResult.already`)."""
        return await self._submit(op_id, operation, instance_id, fn)

    async def in_driver_pool(self, fn: Callable[..., T], *args: Any) -> T:
        """A driver read (console, migration progress) in the driver pool."""
        return await self._in_pool(self._driver_pool, fn, *args)

    async def destroy(self, op_id: str, instance_id: str) -> OpResult:
        return await self._submit(
            op_id, "destroy", instance_id, lambda: self.driver.destroy(instance_id)
        )

    async def reboot(self, op_id: str, instance_id: str) -> OpResult:
        return await self._submit(
            op_id, "reboot", instance_id, lambda: self.driver.reboot(instance_id)
        )

    async def power_off(self, op_id: str, instance_id: str) -> OpResult:
        return await self._submit(
            op_id, "power_off", instance_id, lambda: self.driver.power_off(instance_id)
        )

    async def power_on(self, op_id: str, instance_id: str) -> OpResult:
        return await self._submit(
            op_id, "power_on", instance_id, lambda: self.driver.power_on(instance_id)
        )

    async def running(self) -> dict[str, RunningInstance]:
        """What the hypervisor runs, read in the driver pool."""
        return await self._in_pool(self._driver_pool, self.driver.running)

    async def snapshot(self, instance_id: str, sink: Sink, disk_format: str | None = None) -> int:
        """Stream the instance's disk to `sink`, chunk by chunk; returns the bytes sent.

        Waits for a disk slot first; each chunk is read in the disk pool, so a saturated
        disk slows the snapshot down and nothing else.
        """
        slots = self._disk_slots
        if slots is None:
            raise RuntimeError("agent not started")
        async with slots:
            chunks = await self._in_pool(
                self._disk_pool,
                (
                    self.driver.read_disk
                    if disk_format is None
                    else functools.partial(self.driver.read_disk, disk_format=disk_format)
                ),
                instance_id,
                self.config.chunk_bytes,
            )
            sent = 0
            try:
                while (
                    chunk := await self._in_pool(self._disk_pool, _next_chunk, chunks)
                ) is not None:
                    await sink(chunk)
                    sent += len(chunk)
            finally:
                close = getattr(chunks, "close", None)
                if close is not None:
                    await self._in_pool(self._disk_pool, close)
            return sent

    async def export_disk(self, instance_id: str) -> dict[str, Any]:
        """The source's part of a cold move: the disk staged for the destination, in a disk
        slot (it copies the whole disk)."""
        slots = self._disk_slots
        if slots is None:
            raise RuntimeError("agent not started")
        async with slots:
            return await self._in_pool(self._disk_pool, self.driver.export_disk, instance_id)

    async def _submit(
        self, op_id: str, operation: str, instance_id: str, call: Callable[[], bool | None]
    ) -> OpResult:
        """Run `call` once per `op_id`; a redelivered op id gets the first run's outcome.

        The run is a task of its own and is shielded: a caller that gives up (a timeout,
        a cancelled RPC) does not cancel the work, and a redelivery waits for it.
        """
        task = self._ops.get(op_id)
        if task is None:
            task = asyncio.create_task(
                self._run_op(op_id, operation, instance_id, call), name=f"op-{op_id}"
            )
            self._ops[op_id] = task
            self._forget_old_ops()
        else:
            log.info("op %s %s redelivered; returning the first run's outcome", op_id, operation)
        return await asyncio.shield(task)

    async def _run_op(
        self, op_id: str, operation: str, instance_id: str, call: Callable[[], bool | None]
    ) -> OpResult:
        start = time.monotonic()
        try:
            already = await self._in_pool(self._driver_pool, call)
        except DriverError as exc:
            if operation == "destroy" and isinstance(exc, InstanceNotFound):
                # Nothing to destroy (a live migration's source, say): what was asked holds.
                log.info("op %s destroy %s: not on this host", op_id, instance_id)
            else:
                log.warning("op %s %s %s failed: %s", op_id, operation, instance_id, exc)
            return OpResult(
                op_id,
                operation,
                instance_id,
                ok=False,
                error_code=exc.code,
                error=exc.message,
                duration_s=time.monotonic() - start,
            )
        return OpResult(
            op_id,
            operation,
            instance_id,
            ok=True,
            duration_s=time.monotonic() - start,
            already=already is True,
        )

    def _forget_old_ops(self) -> None:
        """Keep at most `op_results_max` op ids, dropping the oldest finished ones."""
        excess = len(self._ops) - self.config.op_results_max
        for op_id in [k for k, t in self._ops.items() if t.done()][: max(0, excess)]:
            del self._ops[op_id]

    # -- heartbeat -------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        interval_s = self.config.heartbeat_interval_s
        last: float | None = None
        while True:
            now = time.monotonic()
            if last is not None:
                self.heartbeat_gaps_s.append(now - last)
            last = now
            await self._beat()
            # The next beat is due one interval after this one started: a slow beat
            # shortens the sleep, and a late one is not followed by a burst of catch-ups.
            await asyncio.sleep(max(0.0, now + interval_s - time.monotonic()))

    async def _beat(self) -> None:
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a
            # cancellation that races with the result, and stop() would then wait forever.
            async with asyncio.timeout(self.config.heartbeat_timeout_s):
                await self._in_pool(self._hb_pool, self._heartbeat)
        except Exception:  # a failed heartbeat is reported, and the next one still goes out
            self.heartbeat_failures += 1
            log.exception("heartbeat failed")

    async def _in_pool(
        self, pool: ThreadPoolExecutor | None, fn: Callable[..., T], *args: Any
    ) -> T:
        if pool is None:
            raise RuntimeError("agent not started")
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)


def _next_chunk(chunks: Iterator[bytes]) -> bytes | None:
    return next(chunks, None)
