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


async def _rabbitmqctl(*args: str) -> None:
    process = await asyncio.create_subprocess_exec(
        "rabbitmqctl",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await process.communicate()
    assert process.returncode == 0, output.decode(errors="replace")


async def _wait_for_port(timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while _rabbit_problem() is not None:
        assert time.monotonic() < deadline, "RabbitMQ did not come back"
        await asyncio.sleep(0.2)


def test_calls_complete_exactly_once_across_a_broker_restart() -> None:
    _require_rabbit()
    from stowage.bus.rabbit import RabbitTransport

    calls_n = 20

    async def scenario() -> None:
        options = {"reconnect_interval_s": 0.5, "resend_interval_s": 3.0}
        async with bus("rabbit", **options) as server, bus("rabbit", **options) as client:
            counts: Counter[str] = Counter()
            topic = server.topic()
            await server.transport.serve(topic, counting_handler(counts, delay_s=0.3))

            async def one(n: int) -> Payload:
                await asyncio.sleep(n * 0.1)  # spread the calls around the restart
                return await client.transport.call(
                    topic, "echo", {"n": n}, op_id=f"op-{n}", timeout_s=40
                )

            calls = [asyncio.create_task(one(n)) for n in range(calls_n)]
            await asyncio.sleep(0.8)
            done_before = sum(call.done() for call in calls)
            await _rabbitmqctl("stop_app")
            await _rabbitmqctl("start_app")
            await _wait_for_port(30)
            replies = await asyncio.gather(*calls)

            assert 0 < done_before < calls_n, "the restart must fall among the calls"
            for side in (server, client):
                assert isinstance(side.transport, RabbitTransport)
                assert side.transport.reconnects_n >= 1
            # Some requests came back after their handler had run: the path under test.
            assert server.transport.repeats_n >= 1

            assert replies == [
                {"method": "echo", "n": n, "op_id": f"op-{n}"} for n in range(calls_n)
            ]
            assert counts == {f"op-{n}": 1 for n in range(calls_n)}

    asyncio.run(scenario())
