"""A host's serial consoles over TCP: the compute side of the API's websocket proxy.

Nova's nova-serialproxy connects to a TCP port QEMU listens on, on the compute host. Here
the agent owns that end: the API asks it on the bus for a ticket (`issue`, the
`serial_console` call), connects to `address:port`, sends the ticket as its first line, and
after an `ok` line the connection carries the guest's serial bytes both ways. A ticket is
random, used once and short-lived, so only a caller of the bus (the API) can open a console,
and the hypervisor is asked for the session only once a connection presents one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stowage.virt.driver import Driver, DriverError, SerialConsole

__all__ = ["ConsoleProxy"]

log = logging.getLogger(__name__)

_HANDSHAKE_TIMEOUT_S = 10.0
_CHUNK_BYTES = 16384
_TICKETS_MAX = 1000


@dataclass(frozen=True)
class _Ticket:
    instance_id: str
    expires_at: float


class ConsoleProxy:
    """Listens on `listen:port` (port 0: any free one) and serves at most `sessions_max`
    console sessions at once; `address` is what the API is told to connect to (the host's
    address when listening on every interface)."""

    def __init__(
        self,
        driver: Driver,
        run_blocking: Callable[..., Any],
        *,
        listen: str = "127.0.0.1",
        port: int = 0,
        address: str | None = None,
        ticket_ttl_s: float = 30.0,
        sessions_max: int = 32,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.driver = driver
        self._run_blocking = run_blocking  # the agent's driver pool: opening may block
        self.listen = listen
        self.port = port
        self.address = address or listen
        self.ticket_ttl_s = ticket_ttl_s
        self.sessions_max = sessions_max
        self.clock = clock
        self._tickets: dict[str, _Ticket] = {}
        self._server: asyncio.Server | None = None
        self._sessions: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.listen, self.port)
        self.port = int(self._server.sockets[0].getsockname()[1])
        log.info("serial console proxy on %s:%d", self.listen, self.port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in list(self._sessions):
            task.cancel()
        for task in list(self._sessions):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def issue(self, instance_id: str) -> dict[str, Any]:
        """A one-time ticket for a session on the instance's console, and where to use it."""
        now = self.clock()
        for key, old in list(self._tickets.items()):
            if old.expires_at <= now:
                del self._tickets[key]
        if len(self._tickets) >= _TICKETS_MAX:
            raise DriverError("too many console tickets outstanding", code="agent.console.busy")
        ticket = secrets.token_urlsafe(32)
        self._tickets[ticket] = _Ticket(instance_id, now + self.ticket_ttl_s)
        return {"address": self.address, "port": self.port, "ticket": ticket}

    def _take(self, ticket: str) -> str | None:
        found = self._tickets.pop(ticket, None)
        if found is None or found.expires_at <= self.clock():
            return None
        return found.instance_id

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._sessions.add(task)
        try:
            await self._session(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._sessions.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), _HANDSHAKE_TIMEOUT_S)
        except TimeoutError:
            return
        instance_id = self._take(line.decode(errors="replace").strip())
        if instance_id is None:
            await _refuse(writer, "the console ticket is unknown, used or expired")
            return
        if len(self._sessions) > self.sessions_max:
            await _refuse(writer, f"{self.sessions_max} console sessions are open already")
            return
        loop = asyncio.get_running_loop()
        said: asyncio.Queue[bytes] = asyncio.Queue()

        def output(data: bytes) -> None:  # from any thread
            loop.call_soon_threadsafe(said.put_nowait, data)

        try:
            console: SerialConsole = await self._run_blocking(
                self.driver.open_serial_console, instance_id, output
            )
        except DriverError as exc:
            await _refuse(writer, exc.message)
            return
        try:
            writer.write(b"ok\n")
            await _pump(reader, writer, said, console)
        finally:
            await self._run_blocking(console.close)


async def _refuse(writer: asyncio.StreamWriter, why: str) -> None:
    writer.write(f"error {why}\n".encode())
    with contextlib.suppress(ConnectionError):
        await writer.drain()


async def _pump(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    said: asyncio.Queue[bytes],
    console: SerialConsole,
) -> None:
    """Bytes both ways until either end closes."""

    async def guest_to_caller() -> None:
        while data := await said.get():
            writer.write(data)
            await writer.drain()

    async def caller_to_guest() -> None:
        while data := await reader.read(_CHUNK_BYTES):
            console.write(data)  # queued by the driver: never blocks on the guest

    tasks = [asyncio.create_task(guest_to_caller()), asyncio.create_task(caller_to_guest())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                await task
