"""Compute v2.1: remote consoles (`POST /servers/{id}/remote-consoles` from 2.6, the legacy
`os-get*Console` actions up to 2.5) and the serial console's websocket proxy.

The serial console is offered, as Nova's with `[serial_console] enabled`: its URL is a
websocket on the API's own port (`/serial-console/{server_id}?token=...`, one-time token);
the proxy takes the token back, asks the server's host for a session and carries the bytes
between the websocket and the host's console proxy (`stowage.agent.console_proxy`). VNC,
SPICE, RDP and MKS answer as Nova does with those consoles disabled: 400, "Unavailable
console type"."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.websockets import WebSocket, WebSocketDisconnect

from stowage.api.auth import cloud_of, require_context
from stowage.api.common import ApiError, Context, json_body
from stowage.api.compute.microversion import mv
from stowage.api.responses import JSONResponse
from stowage.domain.errors import ConflictError
from stowage.ledger.objects import Document
from stowage.services import consoles
from stowage.services.cloud import Cloud

__all__ = ["CONSOLE_ACTIONS", "console_action", "router", "serial_console_websocket"]

router = APIRouter()
log = logging.getLogger(__name__)

SERIAL_PATH = "/serial-console"

# protocol -> the types Nova's schema allows with it, and from which microversion.
_PROTOCOLS: dict[str, tuple[tuple[int, int], tuple[str, ...]]] = {
    "vnc": ((2, 6), ("novnc", "xvpvnc")),
    "spice": ((2, 6), ("spice-html5", "spice-direct")),
    "rdp": ((2, 6), ("rdp-html5",)),
    "serial": ((2, 6), ("serial",)),
    "mks": ((2, 8), ("webmks",)),
}
_TYPE_SINCE = {"webmks": (2, 8), "spice-direct": (2, 99)}

# The legacy actions (2.1 to 2.5): action -> protocol; the body names the type.
CONSOLE_ACTIONS = {
    "os-getVNCConsole": "vnc",
    "os-getSPICEConsole": "spice",
    "os-getRDPConsole": "rdp",
    "os-getSerialConsole": "serial",
}
_LEGACY_UNTIL = (2, 5)
_CHUNK_BYTES = 16384


@router.post("/servers/{server_id}/remote-consoles")
async def create_remote_console(request: Request, server_id: str) -> Response:
    version = mv(request)
    if version < (2, 6):
        raise ApiError(404, "The resource could not be found.")
    from stowage.api.compute.servers import load_server

    ctx = require_context(request)
    cloud = cloud_of(request)
    doc = await asyncio.to_thread(load_server, cloud, ctx, server_id)
    payload = await json_body(request)
    given = payload.get("remote_console") if isinstance(payload, dict) else None
    if not isinstance(given, dict) or set(payload) != {"remote_console"}:
        raise ApiError(400, "Invalid input for field/attribute remote_console: required")
    extra = sorted(set(given) - {"protocol", "type"})
    if extra:
        raise ApiError(
            400,
            "Invalid input for field/attribute remote_console. Value: Additional properties "
            f"are not allowed ({extra[0]!r} was unexpected)",
        )
    protocols = [p for p, (since, _) in _PROTOCOLS.items() if version >= since]
    types = [
        t for p in protocols for t in _PROTOCOLS[p][1] if version >= _TYPE_SINCE.get(t, (2, 6))
    ]
    protocol, kind = given.get("protocol"), given.get("type")
    if protocol not in protocols:
        raise ApiError(
            400, f"Invalid input for field/attribute protocol. Value: {protocol}. "
            f"{protocol!r} is not one of {protocols}",
        )  # fmt: skip
    if kind not in types:
        raise ApiError(
            400, f"Invalid input for field/attribute type. Value: {kind}. "
            f"{kind!r} is not one of {types}",
        )  # fmt: skip
    url = await _console_url(request, ctx, cloud, doc, str(protocol), str(kind))
    return JSONResponse({"remote_console": {"protocol": protocol, "type": kind, "url": url}})


async def console_action(
    request: Request, ctx: Context, doc: Document, action: str, args: Any
) -> Response:
    """One of CONSOLE_ACTIONS (2.1 to 2.5; later: no such action, as Nova)."""
    if mv(request) > _LEGACY_UNTIL:
        raise ApiError(400, f"There is no such action: {action}")
    kind = args.get("type") if isinstance(args, dict) else None
    if not isinstance(kind, str) or not kind:
        raise ApiError(400, f"Invalid input for field/attribute {action}: 'type' is required")
    protocol = CONSOLE_ACTIONS[action]
    url = await _console_url(request, ctx, cloud_of(request), doc, protocol, kind)
    return JSONResponse({"console": {"type": kind, "url": url}})


async def _console_url(
    request: Request, ctx: Context, cloud: Cloud, doc: Document, protocol: str, kind: str
) -> str:
    if not ctx.can_write:
        raise ApiError(
            403, "Policy doesn't allow os_compute_api:os-remote-consoles to be performed."
        )
    if protocol != "serial":
        # Nova with [vnc], [spice], [rdp] or [mks] disabled: ConsoleTypeUnavailable.
        raise ApiError(400, f"Unavailable console type {kind}.")
    if kind != "serial":
        raise ApiError(400, f"Invalid console type {kind}")
    if doc.body.get("task_state") in ("deleting", "migrating"):
        raise ApiError(
            409, f"Cannot 'get_serial_console' instance {doc.id} while it is in task_state "
            f"{doc.body.get('task_state')}",
        )  # fmt: skip
    try:
        token = await consoles.create_serial_console(cloud, doc.id, doc.body)
    except ConflictError as exc:
        raise ApiError(409, exc.message) from None
    scheme = "wss" if request.url.scheme == "https" else "ws"
    return f"{scheme}://{request.url.netloc}{SERIAL_PATH}/{doc.id}?token={token}"


async def serial_console_websocket(websocket: WebSocket) -> None:
    """The websocket proxy (nova-serialproxy's part): a refused token closes the handshake
    (HTTP 403); else bytes both ways between the client and the host's console proxy,
    binary frames out, binary or text frames in ("binary" subprotocol when offered)."""
    cloud: Cloud = websocket.app.state.cloud
    server_id = str(websocket.path_params.get("server_id") or "")
    token = websocket.query_params.get("token") or ""
    try:
        endpoint = await consoles.open_serial_console(cloud, server_id, token)
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(endpoint.address, endpoint.port), cloud.config.op_timeout_s
        )
    except consoles.ConsoleRefused as exc:
        log.info("serial console of %s refused: %s", server_id, exc.message)
        await websocket.close(code=1008)
        return
    except (OSError, TimeoutError) as exc:
        log.warning("serial console of %s: the host's console proxy: %s", server_id, exc)
        await websocket.close(code=1011)
        return
    try:
        writer.write(endpoint.ticket.encode() + b"\n")
        answer = await asyncio.wait_for(reader.readline(), cloud.config.op_timeout_s)
        if answer.strip() != b"ok":
            await websocket.close(code=1011)
            return
        offered = websocket.scope.get("subprotocols") or []
        await websocket.accept(subprotocol="binary" if "binary" in offered else None)
        await _relay(websocket, reader, writer)
    except (OSError, TimeoutError):
        with contextlib.suppress(RuntimeError):
            await websocket.close(code=1011)
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def _relay(
    websocket: WebSocket, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    async def host_to_client() -> None:
        while data := await reader.read(_CHUNK_BYTES):
            await websocket.send_bytes(data)
        with contextlib.suppress(RuntimeError):
            await websocket.close()

    async def client_to_host() -> None:
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            data = message.get("bytes")
            if data is None:
                data = str(message.get("text") or "").encode()
            writer.write(data)
            await writer.drain()

    tasks = [asyncio.create_task(host_to_client()), asyncio.create_task(client_to_host())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, WebSocketDisconnect, OSError):
                await task
