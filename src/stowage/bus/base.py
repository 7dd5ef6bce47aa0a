"""The bus port: request/reply and fire-and-forget messages between services and agents."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from stowage.telemetry import bind, current_request_id, logger

__all__ = [
    "OP_IDS_MAX",
    "BusClosed",
    "BusError",
    "BusTimeout",
    "Calls",
    "Handler",
    "LoopBridge",
    "RemoteError",
    "ReplyCache",
    "Transport",
    "compute_topic",
    "control_topic",
    "failure_envelope",
    "success_envelope",
    "unwrap",
    "with_request_id",
]

Payload = dict[str, Any]
Handler = Callable[[str, Payload, str], Awaitable[Payload]]
"""A server's handler: ``(method, payload, op_id) -> reply``."""

log = logging.getLogger(__name__)
served = logger("stowage.bus.served")

OP_IDS_MAX = 10_000
"""How many op ids (and their replies) a server remembers for deduplication."""


class BusError(Exception):
    """An operating fault on the bus."""


class BusTimeout(BusError):
    """No reply arrived before the call's deadline; the operation may or may not have run."""


class BusClosed(BusError):
    """The transport was closed."""


class RemoteError(BusError):
    """The remote handler raised; the operation ran (once) and failed."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


class Calls(Protocol):
    """The part of a bus an API process needs: calls to an agent's topic."""

    async def call(
        self, topic: str, method: str, payload: Payload, *, op_id: str, timeout_s: float
    ) -> Payload: ...


class LoopBridge:
    """Calls on a bus that lives on one event loop, made from any loop or thread.

    A bus's connection and futures belong to the loop that opened it (aio-pika's do); API
    handlers run off that loop, each worker thread on a loop of its own, so their calls
    cross into the bus's loop and wait there.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, bus: Calls) -> None:
        self._loop = loop
        self._bus = bus

    async def call(
        self, topic: str, method: str, payload: Payload, *, op_id: str, timeout_s: float
    ) -> Payload:
        coro = self._bus.call(topic, method, payload, op_id=op_id, timeout_s=timeout_s)
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            return await coro
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return await asyncio.wrap_future(future)


class Transport(Protocol):
    """What services and agents need from a message bus."""

    async def call(
        self, topic: str, method: str, payload: Payload, *, op_id: str, timeout_s: float
    ) -> Payload:
        """Send a request and wait for its reply; raise BusTimeout after ``timeout_s``."""
        ...

    async def cast(self, topic: str, method: str, payload: Payload, *, op_id: str) -> None:
        """Send a message without a reply, delivered at least once."""
        ...

    async def serve(self, topic: str, handler: Handler) -> None:
        """Handle the messages of ``topic``; a repeated op id gets the stored reply."""
        ...

    async def close(self) -> None:
        """Stop serving and release connections; pending calls fail with BusClosed."""
        ...


def with_request_id(payload: Payload) -> Payload:
    """A copy of `payload` carrying the request id bound to the sender's work (if any and
    if the payload names none), so the receiver's log lines carry it too."""
    rid = current_request_id()
    if rid is None or payload.get("request_id"):
        return dict(payload)
    return {**payload, "request_id": rid}


def success_envelope(result: Payload) -> Payload:
    return {"ok": True, "result": result}


def failure_envelope(exc: BaseException) -> Payload:
    return {"ok": False, "kind": type(exc).__name__, "message": str(exc)}


def unwrap(envelope: Payload) -> Payload:
    """The handler's reply, or its failure raised as RemoteError."""
    if envelope.get("ok"):
        result: Payload = envelope["result"]
        return result
    raise RemoteError(str(envelope.get("kind")), str(envelope.get("message")))


class ReplyCache:
    """Runs a handler at most once per op id and remembers the replies (bounded LRU).

    A redelivery that arrives while the first delivery is still being handled waits for
    the same reply instead of running the handler again.
    """

    def __init__(self, handler: Handler, op_ids_max: int = OP_IDS_MAX) -> None:
        assert op_ids_max > 0
        self._handler = handler
        self._op_ids_max = op_ids_max
        self._replies: OrderedDict[str, asyncio.Future[Payload]] = OrderedDict()
        self.repeats_n = 0
        """Deliveries answered without running the handler (redeliveries, retries)."""

    def __len__(self) -> int:
        return len(self._replies)

    async def handle(self, method: str, payload: Payload, op_id: str) -> Payload:
        """The reply envelope for ``op_id``; the handler runs only for a new op id, with the
        sender's request id (carried in the payload) bound to every line it logs."""
        with bind(request_id=payload.get("request_id"), op_id=op_id):
            started = time.perf_counter()
            envelope = await self._handle(method, payload, op_id)
            served.info(
                "bus call handled",
                method=method,
                ok=bool(envelope.get("ok")),
                duration_ms=round((time.perf_counter() - started) * 1000, 1),
            )
            return envelope

    async def _handle(self, method: str, payload: Payload, op_id: str) -> Payload:
        reply = self._replies.get(op_id)
        if reply is not None:
            self.repeats_n += 1
            log.debug("op %s repeated: answering with its stored reply", op_id)
            self._replies.move_to_end(op_id)
            return await asyncio.shield(reply)
        reply = asyncio.get_running_loop().create_future()
        self._replies[op_id] = reply
        self._evict()
        try:
            envelope = success_envelope(await self._handler(method, payload, op_id))
        except asyncio.CancelledError:
            # Not handled: forget the op id so that a redelivery runs the handler.
            self._replies.pop(op_id, None)
            reply.cancel()
            raise
        except Exception as exc:
            envelope = failure_envelope(exc)
        reply.set_result(envelope)
        return envelope

    def _evict(self) -> None:
        while len(self._replies) > self._op_ids_max:
            oldest = next(iter(self._replies))
            if not self._replies[oldest].done():
                break  # never forget an operation still running
            del self._replies[oldest]


def compute_topic(host: str) -> str:
    """The topic a host's agent serves its operations on."""
    return f"compute.{host}"


def control_topic(host: str) -> str:
    """The topic a host's agent serves its controls on (the simulated hypervisor's)."""
    return f"control.{host}"
