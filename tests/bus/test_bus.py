"""The bus contract, run on the in-process bus and on RabbitMQ (127.0.0.1:5672)."""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import pytest

from stowage.bus import BusTimeout, InProcTransport, RemoteError, Transport

AMQP_URL = os.environ.get("STOWAGE_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
AMQP_ADDRESS = (urlsplit(AMQP_URL).hostname or "127.0.0.1", urlsplit(AMQP_URL).port or 5672)

Payload = dict[str, Any]


def _rabbit_problem() -> str | None:
    try:
        with socket.create_connection(AMQP_ADDRESS, timeout=1.0):
            return None
    except OSError as exc:
        return str(exc)


def _require_rabbit() -> None:
    problem = _rabbit_problem()
    if problem is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"RabbitMQ is required in CI: {problem}")
    pytest.skip(f"RabbitMQ not reachable on {AMQP_ADDRESS}: {problem}")


@pytest.fixture(params=["inproc", "rabbit"])
def kind(request: pytest.FixtureRequest) -> str:
    if request.param == "rabbit":
        _require_rabbit()
    return str(request.param)


class Bus:
    """A transport under test, plus unique topic names that are deleted afterwards."""

    def __init__(self, transport: Transport, kind: str) -> None:
        self.transport = transport
        self.kind = kind
        self.topics: list[str] = []

    def topic(self) -> str:
        name = f"test.bus.{uuid.uuid4().hex[:12]}"
        self.topics.append(name)
        return name


async def _open(kind: str, **options: Any) -> Transport:
    if kind == "inproc":
        return InProcTransport()
    from stowage.bus.rabbit import RabbitTransport

    return await RabbitTransport.connect(AMQP_URL, **options)


@asynccontextmanager
async def bus(kind: str, **options: Any) -> AsyncIterator[Bus]:
    transport = await _open(kind, **options)
    opened = Bus(transport, kind)
    try:
        yield opened
    finally:
        await _delete_topics(opened.topics, kind)
        await transport.close()


async def _delete_topics(topics: list[str], kind: str) -> None:
    if kind != "rabbit" or not topics:
        return
    from stowage.bus.rabbit import RabbitTransport

    cleaner = await RabbitTransport.connect(AMQP_URL)
    try:
        for topic in topics:
            await cleaner.delete_topic(topic)
    finally:
        await cleaner.close()


def counting_handler(
    counts: Counter[str], delay_s: float = 0.0
) -> Callable[[str, Payload, str], Awaitable[Payload]]:
    async def handle(method: str, payload: Payload, op_id: str) -> Payload:
        counts[op_id] += 1
        if delay_s:
            await asyncio.sleep(delay_s)
        if method == "fail":
            raise ValueError(f"refused {payload['n']}")
        return {"method": method, "n": payload["n"], "op_id": op_id}

    return handle


def test_call_gets_the_handlers_reply(kind: str) -> None:
    async def scenario() -> None:
        async with bus(kind) as b:
            counts: Counter[str] = Counter()
            topic = b.topic()
            await b.transport.serve(topic, counting_handler(counts))
            reply = await b.transport.call(topic, "echo", {"n": 7}, op_id="op-1", timeout_s=5)
            assert reply == {"method": "echo", "n": 7, "op_id": "op-1"}
            with pytest.raises(RemoteError, match="refused 8"):
                await b.transport.call(topic, "fail", {"n": 8}, op_id="op-2", timeout_s=5)

    asyncio.run(scenario())


def test_call_without_a_server_times_out(kind: str) -> None:
    async def scenario() -> None:
        async with bus(kind) as b:
            started = time.monotonic()
            with pytest.raises(BusTimeout):
                await b.transport.call(b.topic(), "echo", {"n": 1}, op_id="op-1", timeout_s=0.5)
            assert 0.5 <= time.monotonic() - started < 2.0

    asyncio.run(scenario())


def test_cast_is_delivered(kind: str) -> None:
    async def scenario() -> None:
        async with bus(kind) as b:
            topic = b.topic()
            for n in range(5):  # sent before anyone serves: the topic keeps them
                await b.transport.cast(topic, "note", {"n": n}, op_id=f"cast-{n}")
            seen: asyncio.Queue[int] = asyncio.Queue()

            async def handle(method: str, payload: Payload, op_id: str) -> Payload:
                await seen.put(payload["n"])
                return {}

            await b.transport.serve(topic, handle)
            got = [await asyncio.wait_for(seen.get(), 5) for _ in range(5)]
            assert sorted(got) == [0, 1, 2, 3, 4]

    asyncio.run(scenario())


def test_repeated_op_id_runs_the_handler_once(kind: str) -> None:
    async def scenario() -> None:
        async with bus(kind) as b:
            counts: Counter[str] = Counter()
            topic = b.topic()
            await b.transport.serve(topic, counting_handler(counts, delay_s=0.1))
            first = await b.transport.call(topic, "echo", {"n": 1}, op_id="op-a", timeout_s=5)
            again = await b.transport.call(topic, "echo", {"n": 2}, op_id="op-a", timeout_s=5)
            assert again == first  # the stored reply, not a second run
            together = await asyncio.gather(
                *(
                    b.transport.call(topic, "echo", {"n": 3}, op_id="op-b", timeout_s=5)
                    for _ in range(3)
                )
            )
            assert together == [{"method": "echo", "n": 3, "op_id": "op-b"}] * 3
            await b.transport.cast(topic, "echo", {"n": 4}, op_id="op-b")
            with pytest.raises(RemoteError):
                await b.transport.call(topic, "fail", {"n": 5}, op_id="op-c", timeout_s=5)
            with pytest.raises(RemoteError):
                await b.transport.call(topic, "fail", {"n": 5}, op_id="op-c", timeout_s=5)
            await b.transport.call(topic, "echo", {"n": 6}, op_id="op-d", timeout_s=5)
            assert counts == {"op-a": 1, "op-b": 1, "op-c": 1, "op-d": 1}

    asyncio.run(scenario())


async def _rabbitmqctl(*args: str) -> str:
    process = await asyncio.create_subprocess_exec(
        "rabbitmqctl",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await process.communicate()
    text = output.decode(errors="replace")
    assert process.returncode == 0, text
    return text


async def _close_connections_named(prefix: str) -> int:
    """Have the broker close every connection whose name starts with `prefix`, as a broker
    restart or a network cut does to them (and to no other user of the shared broker)."""
    listing = await _rabbitmqctl("list_connections", "-q", "pid", "client_properties")
    pids = [
        line.split("\t", 1)[0]
        for line in listing.splitlines()
        if f'{{"connection_name","{prefix}' in line
    ]
    for pid in pids:
        await _rabbitmqctl("close_connection", pid, "stowage test: connection cut")
    return len(pids)


def test_calls_complete_exactly_once_across_lost_connections() -> None:
    """Calls in flight when the broker drops both sides' connections (what a broker restart
    does) all complete, each handler run once: the held requests are redelivered after their
    handlers ran, and answered from the stored replies."""
    _require_rabbit()
    from stowage.bus.rabbit import RabbitTransport

    calls_n, held_from = 20, 10
    name = f"stowage-test-{uuid.uuid4().hex[:8]}"

    async def scenario() -> None:
        options = {"reconnect_interval_s": 0.5, "resend_interval_s": 3.0}
        async with (
            bus("rabbit", name=f"{name}-server", **options) as server,
            bus("rabbit", name=f"{name}-client", **options) as client,
        ):
            counts: Counter[str] = Counter()
            released = asyncio.Event()
            echo = counting_handler(counts)

            started: set[str] = set()

            async def handler(method: str, payload: Payload, op_id: str) -> Payload:
                started.add(op_id)
                if payload["n"] >= held_from:
                    await released.wait()  # still running when the connections go
                return await echo(method, payload, op_id)

            topic = server.topic()
            await server.transport.serve(topic, handler)

            def one(n: int) -> Awaitable[Payload]:
                return client.transport.call(topic, "echo", {"n": n}, op_id=f"op-{n}", timeout_s=60)

            before = await asyncio.gather(*(one(n) for n in range(held_from)))
            held = [asyncio.create_task(one(n)) for n in range(held_from, calls_n)]
            deadline = time.monotonic() + 30
            while len(started) < calls_n:  # every request delivered
                assert time.monotonic() < deadline, "the held requests were not delivered"
                await asyncio.sleep(0.05)
            assert await _close_connections_named(name) == 2
            released.set()  # the handlers end while their connection is gone
            replies = before + list(await asyncio.gather(*held))

            # aio-pika restores a connection's channels (and so its consumers) before it
            # runs the reconnect callbacks: replies can arrive before the count moves.
            transports = [side.transport for side in (server, client)]
            assert all(isinstance(t, RabbitTransport) for t in transports)
            deadline = time.monotonic() + 30
            while not all(t.reconnects_n >= 1 for t in transports):  # type: ignore[attr-defined]
                assert time.monotonic() < deadline, "a side never reported its reconnect"
                await asyncio.sleep(0.05)
            # Requests came back after their handler had run: the path under test.
            assert server.transport.repeats_n >= 1
            assert replies == [
                {"method": "echo", "n": n, "op_id": f"op-{n}"} for n in range(calls_n)
            ]
            assert counts == {f"op-{n}": 1 for n in range(calls_n)}

    asyncio.run(scenario())
