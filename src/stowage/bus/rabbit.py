"""The bus on RabbitMQ (aio-pika): durable topics, confirmed publishes, acks after handling.

Delivery is at least once; servers deduplicate by op id (`ReplyCache`), so a call retried
with the same op id after a broker restart completes exactly once, as long as the same
server process sees every delivery of that op id (its memory of op ids is in-process).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from typing import Any

import aio_pika
from aio_pika.abc import (
    AbstractIncomingMessage,
    AbstractRobustChannel,
    AbstractRobustConnection,
)

from stowage.bus.base import (
    OP_IDS_MAX,
    BusClosed,
    BusTimeout,
    Handler,
    ReplyCache,
    unwrap,
    with_request_id,
)

__all__ = ["RabbitTransport"]

log = logging.getLogger(__name__)

Payload = dict[str, Any]

PUBLISH_RETRY_INTERVAL_S = 0.2
"""Pause between attempts to publish while the broker is unreachable."""


class RabbitTransport:
    """One robust connection: a publishing channel, a reply queue, one channel per served topic.

    Build it with `RabbitTransport.connect(url)`.
    """

    def __init__(
        self,
        connection: AbstractRobustConnection,
        *,
        resend_interval_s: float = 15.0,
        publish_timeout_s: float = 30.0,
        prefetch_max: int = 32,
        op_ids_max: int = OP_IDS_MAX,
    ) -> None:
        assert resend_interval_s > 0 and publish_timeout_s > 0 and prefetch_max > 0
        self._connection = connection
        self._resend_interval_s = resend_interval_s
        self._publish_timeout_s = publish_timeout_s
        self._prefetch_max = prefetch_max
        self._op_ids_max = op_ids_max
        self._publisher: AbstractRobustChannel | None = None
        self._reply_queue_name = f"stowage.reply.{uuid.uuid4().hex}"
        self._calls: dict[str, asyncio.Future[Payload]] = {}
        self._declared: set[str] = set()
        self._server_channels: list[AbstractRobustChannel] = []
        self._handling: set[asyncio.Task[Payload]] = set()
        self._caches: list[ReplyCache] = []
        self._reconnected = asyncio.Event()
        self._closed = False
        self.reconnects_n = 0
        """How many times the connection came back after a loss (for tests and metrics)."""

    @property
    def repeats_n(self) -> int:
        """Deliveries this transport's servers answered from stored replies."""
        return sum(cache.repeats_n for cache in self._caches)

    @classmethod
    async def connect(
        cls,
        url: str = "amqp://guest:guest@127.0.0.1:5672/",
        *,
        reconnect_interval_s: float = 1.0,
        connect_timeout_s: float = 5.0,
        name: str | None = None,
        **options: Any,
    ) -> RabbitTransport:
        """Connect (failing fast if the broker is unreachable now) and open the reply queue;
        `name` is the connection's name on the broker (`rabbitmqctl list_connections`)."""
        connection = await aio_pika.connect_robust(
            url,
            timeout=connect_timeout_s,
            reconnect_interval=reconnect_interval_s,
            client_properties=None if name is None else {"connection_name": name},
        )
        transport = cls(connection, **options)
        try:
            await transport._open()
        except BaseException:
            await connection.close()
            raise
        return transport

    async def _open(self) -> None:
        self._publisher = await self._connection.channel(publisher_confirms=True)
        replies = await self._connection.channel(publisher_confirms=False)
        queue = await replies.declare_queue(self._reply_queue_name, exclusive=True)
        await queue.consume(self._on_reply, no_ack=True)
        self._connection.reconnect_callbacks.add(self._on_reconnect)

    # -- client ---------------------------------------------------------------------------

    async def call(
        self, topic: str, method: str, payload: Payload, *, op_id: str, timeout_s: float
    ) -> Payload:
        self._check_open()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        correlation_id = uuid.uuid4().hex
        reply: asyncio.Future[Payload] = loop.create_future()
        self._calls[correlation_id] = reply
        body = _encode(method, payload)
        try:
            while not reply.done():
                if loop.time() >= deadline:
                    raise BusTimeout(f"{topic}.{method} op {op_id}: no reply in {timeout_s}s")
                reconnected = self._reconnected
                published = await self._publish(
                    topic, body, op_id, deadline, correlation_id=correlation_id
                )
                if not published:
                    continue  # the deadline passed; the loop raises BusTimeout
                wait_s = min(self._resend_interval_s, max(0.0, deadline - loop.time()))
                await _first_of(reply, reconnected, wait_s)
            return unwrap(reply.result())
        finally:
            self._calls.pop(correlation_id, None)

    async def cast(self, topic: str, method: str, payload: Payload, *, op_id: str) -> None:
        self._check_open()
        deadline = asyncio.get_running_loop().time() + self._publish_timeout_s
        if not await self._publish(topic, _encode(method, payload), op_id, deadline):
            raise BusTimeout(f"{topic}.{method} op {op_id}: not confirmed by the broker")

    async def _publish(
        self,
        topic: str,
        body: bytes,
        op_id: str,
        deadline: float,
        *,
        correlation_id: str | None = None,
    ) -> bool:
        """Publish until the broker confirms; False if the deadline passed first."""
        loop = asyncio.get_running_loop()
        message = aio_pika.Message(
            body,
            content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            message_id=op_id,
            correlation_id=correlation_id,
            reply_to=self._reply_queue_name if correlation_id else None,
        )
        while (remaining_s := deadline - loop.time()) > 0:
            self._check_open()
            try:
                async with asyncio.timeout(remaining_s):
                    await self._declare(topic)
                    assert self._publisher is not None
                    await self._publisher.default_exchange.publish(message, routing_key=topic)
                return True
            except TimeoutError:
                return False
            except Exception as exc:  # broker away: wait for the robust connection to return
                log.debug("publish to %s failed (%s); retrying", topic, exc)
                self._declared.discard(topic)
                await asyncio.sleep(min(PUBLISH_RETRY_INTERVAL_S, max(0.0, remaining_s)))
        return False

    async def _declare(self, topic: str) -> None:
        """Make sure the durable topic queue exists, so nothing is published into the void."""
        if topic in self._declared:
            return
        assert self._publisher is not None
        await self._publisher.declare_queue(topic, durable=True)
        self._declared.add(topic)

    async def _on_reply(self, message: AbstractIncomingMessage) -> None:
        reply = self._calls.get(message.correlation_id or "")
        if reply is None or reply.done():
            return  # a late or repeated reply
        try:
            envelope = json.loads(message.body)
        except ValueError:
            log.warning("dropping a malformed reply %s", message.correlation_id)
            return
        reply.set_result(envelope)

    def _on_reconnect(self, _sender: object) -> None:
        # Replies sent while the broker was restarting are lost with the reply queue:
        # wake every pending call so it resends with the same op id.
        self.reconnects_n += 1
        self._declared.clear()
        woken, self._reconnected = self._reconnected, asyncio.Event()
        woken.set()

    # -- server ---------------------------------------------------------------------------

    async def serve(self, topic: str, handler: Handler) -> None:
        self._check_open()
        cache = ReplyCache(handler, self._op_ids_max)
        self._caches.append(cache)
        channel = await self._connection.channel(publisher_confirms=True)
        self._server_channels.append(channel)
        await channel.set_qos(prefetch_count=self._prefetch_max)
        queue = await channel.declare_queue(topic, durable=True)

        async def on_message(message: AbstractIncomingMessage) -> None:
            await self._handle(channel, cache, message)

        await queue.consume(on_message, no_ack=False)

    async def _handle(
        self,
        channel: AbstractRobustChannel,
        cache: ReplyCache,
        message: AbstractIncomingMessage,
    ) -> None:
        try:
            method, payload = _decode(message.body)
        except ValueError:
            log.warning("rejecting a malformed message %s", message.message_id)
            await _settle(message.reject(requeue=False))
            return
        op_id = message.message_id or ""
        # Shielded: a channel lost mid-handler must not abort the operation; its
        # redelivery then finds the stored reply instead of running the handler again.
        handling = asyncio.create_task(cache.handle(method, payload, op_id))
        self._handling.add(handling)
        handling.add_done_callback(self._handling.discard)
        envelope = await asyncio.shield(handling)
        if message.reply_to:
            try:
                await channel.default_exchange.publish(
                    aio_pika.Message(
                        json.dumps(envelope).encode(),
                        content_type="application/json",
                        correlation_id=message.correlation_id,
                        message_id=op_id,
                    ),
                    routing_key=message.reply_to,
                )
            except Exception as exc:
                # Leave the request unacknowledged: it comes back, and the stored reply with it.
                log.info("reply for op %s not sent (%s); awaiting redelivery", op_id, exc)
                await _settle(message.nack(requeue=True))
                return
        await _settle(message.ack())

    # -- lifecycle ------------------------------------------------------------------------

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for reply in self._calls.values():
            if not reply.done():
                reply.set_exception(BusClosed("transport closed"))
        self._reconnected.set()
        with contextlib.suppress(Exception):
            self._connection.reconnect_callbacks.discard(self._on_reconnect)
        for handling in self._handling:
            handling.cancel()
        await asyncio.gather(*self._handling, return_exceptions=True)
        await self._connection.close()

    async def delete_topic(self, topic: str) -> None:
        """Delete a topic's queue and its messages (tests and tear-down)."""
        self._check_open()
        channel = await self._connection.channel(publisher_confirms=False)
        try:
            await channel.queue_delete(topic)
        finally:
            await channel.close()
        self._declared.discard(topic)

    def _check_open(self) -> None:
        if self._closed:
            raise BusClosed("transport closed")


def _encode(method: str, payload: Payload) -> bytes:
    return json.dumps({"method": method, "payload": with_request_id(payload)}).encode()


def _decode(body: bytes) -> tuple[str, Payload]:
    data = json.loads(body)
    if not isinstance(data, dict) or not isinstance(data.get("method"), str):
        raise ValueError("not a bus message")
    payload = data.get("payload")
    if not isinstance(payload, dict):
        raise ValueError("payload is not an object")
    return data["method"], payload


async def _settle(settling: Any) -> None:
    """Ack, nack or reject; a delivery from a channel lost to a reconnect is redelivered anyway."""
    try:
        await settling
    except Exception as exc:
        log.debug("could not settle a delivery: %s", exc)


async def _first_of(reply: asyncio.Future[Payload], event: asyncio.Event, wait_s: float) -> None:
    """Wait until the reply arrives, the event is set, or ``wait_s`` passes."""
    if wait_s <= 0:
        return
    waiter: asyncio.Future[Any] = asyncio.ensure_future(event.wait())
    either: set[asyncio.Future[Any]] = {reply, waiter}
    try:
        await asyncio.wait(either, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiter
