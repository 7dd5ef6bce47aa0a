"""An in-process bus on asyncio queues, for `stowage up` and tests."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

from stowage.bus.base import (
    OP_IDS_MAX,
    BusClosed,
    BusTimeout,
    Handler,
    ReplyCache,
    unwrap,
    with_request_id,
)

__all__ = ["InProcTransport"]

Payload = dict[str, Any]


@dataclass(frozen=True)
class _Message:
    method: str
    payload: Payload
    op_id: str
    reply: asyncio.Future[Payload] | None = field(default=None, compare=False)


class InProcTransport:
    """Topics are unbounded queues; several servers of one topic compete for its messages."""

    def __init__(self, *, op_ids_max: int = OP_IDS_MAX, concurrency_max: int = 32) -> None:
        assert concurrency_max > 0
        self._op_ids_max = op_ids_max
        self._concurrency_max = concurrency_max
        self._queues: dict[str, asyncio.Queue[_Message]] = {}
        self._servers: list[asyncio.Task[None]] = []
        self._pending: set[asyncio.Future[Payload]] = set()
        self._closed = False

    async def call(
        self, topic: str, method: str, payload: Payload, *, op_id: str, timeout_s: float
    ) -> Payload:
        self._check_open()
        reply: asyncio.Future[Payload] = asyncio.get_running_loop().create_future()
        self._pending.add(reply)
        try:
            self._queue(topic).put_nowait(_Message(method, with_request_id(payload), op_id, reply))
            try:
                envelope = await asyncio.wait_for(asyncio.shield(reply), timeout_s)
            except TimeoutError:
                raise BusTimeout(f"{topic}.{method} op {op_id}: no reply in {timeout_s}s") from None
        finally:
            self._pending.discard(reply)
        return unwrap(envelope)

    async def cast(self, topic: str, method: str, payload: Payload, *, op_id: str) -> None:
        self._check_open()
        self._queue(topic).put_nowait(_Message(method, with_request_id(payload), op_id))

    async def serve(self, topic: str, handler: Handler) -> None:
        self._check_open()
        cache = ReplyCache(handler, self._op_ids_max)
        task = asyncio.create_task(self._consume(self._queue(topic), cache), name=f"bus:{topic}")
        self._servers.append(task)

    async def close(self) -> None:
        self._closed = True
        for task in self._servers:
            task.cancel()
        for task in self._servers:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._servers.clear()
        for reply in self._pending:
            if not reply.done():
                reply.set_exception(BusClosed("transport closed"))
        self._pending.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise BusClosed("transport closed")

    def _queue(self, topic: str) -> asyncio.Queue[_Message]:
        return self._queues.setdefault(topic, asyncio.Queue())

    async def _consume(self, queue: asyncio.Queue[_Message], cache: ReplyCache) -> None:
        slots = asyncio.Semaphore(self._concurrency_max)
        running: set[asyncio.Task[None]] = set()
        try:
            while True:
                message = await queue.get()
                await slots.acquire()
                task = asyncio.create_task(self._deliver(message, cache, slots))
                running.add(task)
                task.add_done_callback(running.discard)
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    @staticmethod
    async def _deliver(message: _Message, cache: ReplyCache, slots: asyncio.Semaphore) -> None:
        try:
            envelope = await cache.handle(message.method, message.payload, message.op_id)
            if message.reply is not None and not message.reply.done():
                message.reply.set_result(envelope)
        finally:
            slots.release()
