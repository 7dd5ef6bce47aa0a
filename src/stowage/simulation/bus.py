"""The bus between the conductor and the agents, with the seed's lost, duplicated and
reordered messages.

Each agent process serves on an in-process transport of its own, so that an agent that dies
takes its consumers (and the replies it owed) with it, as a process on RabbitMQ does. A call
to a topic nobody serves waits out its timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from stowage.bus.base import BusTimeout, Handler
from stowage.bus.inproc import InProcTransport
from stowage.simulation.faults import FaultKind, Schedule

__all__ = ["FaultyBus"]

Payload = dict[str, Any]

_FOREVER_S = 10**9


class FaultyBus:
    """A Transport for the conductor; `endpoint()` gives each agent process its own."""

    def __init__(self, schedule: Schedule, trace: Callable[[str], None]) -> None:
        self.schedule = schedule
        self.trace = trace
        self.faults = True  # off while the run settles
        self._routes: dict[str, InProcTransport] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    def endpoint(self) -> Endpoint:
        return Endpoint(self)

    async def call(
        self, topic: str, method: str, payload: Payload, *, op_id: str, timeout_s: float
    ) -> Payload:
        s = self.schedule
        rng = s.rng
        lose = reply_lost = False

        def late(options: tuple[float, ...]) -> tuple[float, ...]:
            return options if s.on(FaultKind.BUS_LATE) else ()

        delays = [0.0]
        if self.faults:
            if s.bus_loss_p and rng.random() < s.bus_loss_p:
                lose = True
                reply_lost = rng.random() < 0.5
                what = "reply" if reply_lost else "request"
                s.note(FaultKind.BUS_LOSS, f"{topic}.{method} {op_id}: {what} lost")
            if s.bus_reorder_p and rng.random() < s.bus_reorder_p:
                delays[0] = rng.choice((0.5, 2.0, *late((timeout_s * 1.5,))))
                s.note(FaultKind.BUS_REORDER, f"{topic}.{method} {op_id}: held {delays[0]} s")
            if s.bus_duplicate_p and rng.random() < s.bus_duplicate_p:
                delays.append(rng.choice((0.0, 1.0, *late((timeout_s * 2,)))))
                s.note(FaultKind.BUS_DUPLICATE, f"{topic}.{method} {op_id}: again +{delays[1]} s")
        self.trace(f"call {topic}.{method} {op_id}{' lost' if lose else ''} {delays}")
        deliveries = []
        for index, delay in enumerate(delays):
            if lose and index == 0 and not reply_lost:
                continue
            task = asyncio.create_task(self._deliver(topic, method, payload, op_id, delay))
            self._tasks.add(task)
            task.add_done_callback(self._done)
            deliveries.append(task)
        if lose or not deliveries:
            await asyncio.sleep(timeout_s)
            raise BusTimeout(f"{topic}.{method} op {op_id}: no reply in {timeout_s}s")
        try:
            async with asyncio.timeout(timeout_s):
                return await asyncio.shield(deliveries[0])
        except TimeoutError:
            raise BusTimeout(f"{topic}.{method} op {op_id}: no reply in {timeout_s}s") from None

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a delivery nobody waits for may fail quietly

    async def _deliver(
        self, topic: str, method: str, payload: Payload, op_id: str, delay_s: float
    ) -> Payload:
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        route = self._routes.get(topic)
        if route is None:
            await asyncio.sleep(_FOREVER_S)  # nobody serves it: the caller times out
            raise BusTimeout(topic)
        return await route.call(topic, method, payload, op_id=op_id, timeout_s=_FOREVER_S)

    async def cast(self, topic: str, method: str, payload: Payload, *, op_id: str) -> None:
        route = self._routes.get(topic)
        if route is not None:
            await route.cast(topic, method, payload, op_id=op_id)

    async def serve(self, topic: str, handler: Handler) -> None:
        raise NotImplementedError("agents serve on an endpoint()")

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
        for route in set(self._routes.values()):
            await route.close()
        self._routes.clear()


class Endpoint:
    """One agent process's side of the bus: its topics die with `close()`."""

    def __init__(self, bus: FaultyBus) -> None:
        self._bus = bus
        self._transport = InProcTransport()
        self._topics: list[str] = []

    async def call(
        self, topic: str, method: str, payload: Payload, *, op_id: str, timeout_s: float
    ) -> Payload:
        return await self._bus.call(topic, method, payload, op_id=op_id, timeout_s=timeout_s)

    async def cast(self, topic: str, method: str, payload: Payload, *, op_id: str) -> None:
        await self._bus.cast(topic, method, payload, op_id=op_id)

    async def serve(self, topic: str, handler: Handler) -> None:
        await self._transport.serve(topic, handler)
        self._bus._routes[topic] = self._transport
        self._topics.append(topic)

    async def close(self) -> None:
        for topic in self._topics:
            if self._bus._routes.get(topic) is self._transport:
                del self._bus._routes[topic]
        await self._transport.close()
