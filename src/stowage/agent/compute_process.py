"""`stowage up --compute-process`: the one-machine cloud's compute side (the conductor, one
agent per host, their reconcilers: `LocalCompute`) in a process of its own beside the APIs'.

In one process the APIs' handlers and the conductor take turns at one interpreter lock, and
`stowage up` cannot use more than one core (docs/performance.md, session 11). Here each
process has its own, on the same SQLite ledger: the ledger's writer gate hands the write
lock from process to process (`ledger.db._WriterGate`), and the conductor finds its work in
the ledger as it does in production. Between the two processes, in a directory only their
owner may enter:

- a datagram socket, `kick`: the API's nudge that there is work now (`Cloud.kick`), one
  `sendto` per create, no answer; the conductor also looks every `poll_s` without it;
- a stream socket, `control`: the API's calls to an agent (consoles, the simulated
  hypervisor's controls), a connection a call, one JSON line each way, and the agents'
  metrics for the API's `/metrics`.

The parent starts the child and waits until its agents serve; the child ends when the parent
tells it to or when the parent is gone (its end of the pipe closes), so no compute process
outlives its cloud. A child that dies is started again by the API's watchdog
(`stowage.wiring`): its operations are leased in the ledger and the new conductor takes them
over, as after any crash.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import multiprocessing
import shutil
import signal
import socket
import tempfile
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from stowage.bus.base import (
    BusClosed,
    BusError,
    BusTimeout,
    Payload,
    RemoteError,
    failure_envelope,
    success_envelope,
    unwrap,
)

__all__ = ["START_TIMEOUT_S", "ComputeProcess"]

log = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0
"""How long the child may take to start: open the ledger, start each host's agent and bring
back the guests the ledger places on it (a libvirt host's take seconds each)."""

STOP_TIMEOUT_S = 30.0
REPLY_MARGIN_S = 5.0
"""A call's reply may come this long after the call's own timeout (the child's answer that
it timed out, and the way back) before the parent gives up on the child."""


@dataclass(frozen=True)
class _Settings:
    """What the child is started with: its cloud and logs, and the sockets' paths."""

    config: Any
    db_url: str
    log_format: str
    log_level: str
    kick_path: str
    control_path: str


class ComputeProcess:
    """The parent's handle on the compute process: start, stop, and the calls to it."""

    def __init__(self, config: Any, db_url: str, *, log_format: str, log_level: str) -> None:
        # Short (a socket's path has at most 107 bytes; a state directory may be deeper) and
        # the owner's alone (mkdtemp makes it 0700): no other user reaches the agents here.
        self._dir = Path(tempfile.mkdtemp(prefix="stowage-compute-"))
        self.settings = _Settings(
            config,
            db_url,
            log_format,
            log_level,
            kick_path=str(self._dir / "kick"),
            control_path=str(self._dir / "control"),
        )
        self._kicks = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._kicks.setblocking(False)
        self._process: multiprocessing.process.BaseProcess | None = None
        self._pipe: Connection | None = None
        # Start, stop and close take turns (the watchdog's start again may meet the cloud's
        # stop), and nothing starts once closed: no child is left that nobody stops.
        self._turns = threading.Lock()
        self._closed = False

    def start(self) -> None:
        """Start the child and return once its agents serve; RuntimeError if it cannot."""
        with self._turns:
            if self._closed:
                raise RuntimeError("the compute process's cloud has stopped")
            self._start()

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")
        mine, theirs = context.Pipe()
        process = context.Process(
            target=_child_main,
            args=(self.settings, theirs),
            name="stowage-compute",
        )
        process.start()
        theirs.close()
        self._process, self._pipe = process, mine
        if not mine.poll(START_TIMEOUT_S):
            self._stop()
            raise RuntimeError(f"the compute process did not start in {START_TIMEOUT_S:.0f} s")
        try:
            message = mine.recv()
        except EOFError:
            message = ("failed", f"it exited with code {process.exitcode}")
        if message[0] != "ready":
            self._stop()
            raise RuntimeError(f"the compute process did not start: {message[1]}")

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    @property
    def exitcode(self) -> int | None:
        return self._process.exitcode if self._process is not None else None

    def kick(self) -> None:
        """There is work now (safe from any thread; lost if the child is not listening, and
        then found by the conductor's next look)."""
        with contextlib.suppress(OSError):
            self._kicks.sendto(b"k", self.settings.kick_path)

    async def call(
        self, topic: str, method: str, payload: Payload, *, op_id: str, timeout_s: float
    ) -> Payload:
        """A call to an agent's topic, made by the child on its bus (the `Calls` port)."""
        reply = await self._ask(
            {
                "op": "call",
                "topic": topic,
                "method": method,
                "payload": payload,
                "op_id": op_id,
                "timeout_s": timeout_s,
            },
            timeout_s + REPLY_MARGIN_S,
        )
        # The child's bus failed to deliver: the same fault here; else the handler's reply.
        kind, message = reply.get("kind"), str(reply.get("message"))
        if kind == "BusTimeout":
            raise BusTimeout(message)
        if kind == "BusClosed":
            raise BusClosed(message)
        return unwrap(reply)

    async def exposition(self) -> bytes:
        """The agents' metrics in the text exposition format (empty if the child is down)."""
        try:
            reply = await self._ask({"op": "metrics"}, REPLY_MARGIN_S)
        except BusError as exc:
            log.warning("the compute process's metrics are missing: %s", exc)
            return b""
        return str(reply.get("text", "")).encode()

    async def _ask(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        try:
            async with asyncio.timeout(timeout_s):
                reader, writer = await asyncio.open_unix_connection(self.settings.control_path)
                try:
                    writer.write(json.dumps(request).encode() + b"\n")
                    await writer.drain()
                    line = await reader.readline()
                finally:
                    writer.close()
                    with contextlib.suppress(OSError):
                        await writer.wait_closed()
        except TimeoutError:
            raise BusTimeout(f"the compute process did not answer in {timeout_s:.0f} s") from None
        except OSError as exc:
            raise BusClosed(f"the compute process is not reachable: {exc}") from None
        if not line:
            raise BusClosed("the compute process closed the connection")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def stop(self) -> None:
        """Stop the child (its agents and conductor end their work as at any stop)."""
        with self._turns:
            self._stop()

    def _stop(self) -> None:
        process, pipe = self._process, self._pipe
        if process is not None:
            if pipe is not None:
                with contextlib.suppress(OSError, ValueError):
                    pipe.send("stop")
            process.join(STOP_TIMEOUT_S)
            if process.is_alive():
                log.warning("the compute process did not stop in %.0f s: killed", STOP_TIMEOUT_S)
                process.kill()
                process.join()
        if pipe is not None:
            pipe.close()
        self._process = self._pipe = None

    def close(self) -> None:
        """Stop the child, for good, and remove the sockets' directory."""
        with self._turns:
            self._closed = True
            self._stop()
        self._kicks.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def _child_main(settings: _Settings, parent: Connection) -> None:
    """The compute process: `LocalCompute` on its own loop, and the two sockets."""
    # Ctrl-C, or a SIGTERM to the whole group (an init system's stop), reaches both
    # processes: the parent stops this one in its turn, once the APIs have stopped.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from stowage.agent.local import LocalCompute
    from stowage.services.runtime import open_cloud
    from stowage.telemetry import configure_logging

    configure_logging(settings.log_format, settings.log_level, process="up:compute")
    try:
        cloud = open_cloud(settings.config, db_url=settings.db_url)
        local = LocalCompute(cloud)
        local.start_thread()
        loop = local.loop
        servers = asyncio.run_coroutine_threadsafe(_serve(local, settings), loop).result()
    except BaseException as exc:
        log.exception("the compute process did not start")
        parent.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    parent.send(("ready", ""))
    told = None
    with contextlib.suppress(EOFError, OSError):
        told = parent.recv()  # "stop", or the parent is gone
    asyncio.run_coroutine_threadsafe(_close(servers), loop).result()
    local.stop_thread()
    cloud.ledger.close()
    if told is None:  # the parent died and cannot remove the sockets' directory: this does
        shutil.rmtree(Path(settings.control_path).parent, ignore_errors=True)
    log.info("the compute process stopped (%s)", "told to" if told else "its parent is gone")


async def _serve(local: Any, settings: _Settings) -> list[Any]:
    loop = asyncio.get_running_loop()
    kicks = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    with contextlib.suppress(FileNotFoundError):
        Path(settings.kick_path).unlink()
    kicks.bind(settings.kick_path)
    kicks.setblocking(False)

    def kicked() -> None:
        with contextlib.suppress(BlockingIOError):
            while kicks.recv(64):  # every nudge queued so far is one look
                pass
        local.conductor.kick()

    loop.add_reader(kicks.fileno(), kicked)
    with contextlib.suppress(FileNotFoundError):
        Path(settings.control_path).unlink()
    control = await asyncio.start_unix_server(
        lambda r, w: _answer(local, r, w), path=settings.control_path
    )
    return [kicks, control]


async def _close(servers: list[Any]) -> None:
    kicks, control = servers
    asyncio.get_running_loop().remove_reader(kicks.fileno())
    kicks.close()
    control.close()
    await control.wait_closed()


async def _answer(local: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    from stowage.agent.metrics import render

    try:
        request = json.loads(await reader.readline())
        reply: dict[str, Any]
        if request.get("op") == "metrics":
            reply = {"ok": True, "text": render(local.metrics.registry).decode()}
        else:
            try:
                result = await local.bus.call(
                    request["topic"],
                    request["method"],
                    request["payload"],
                    op_id=request["op_id"],
                    timeout_s=float(request["timeout_s"]),
                )
                reply = success_envelope(result)
            except RemoteError as exc:  # the handler's failure, as its envelope said it
                reply = {"ok": False, "kind": exc.kind, "message": exc.message}
            except BusError as exc:
                reply = failure_envelope(exc)
        writer.write(json.dumps(reply).encode() + b"\n")
        await writer.drain()
    except Exception:
        log.exception("a call to the compute process failed")
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
