"""What a guest's consoles show, asked of the agent on its host, and the serial console's
one-time tokens (Nova's console auth tokens: the API hands out a URL with a token; the
websocket proxy takes the token back once, checks it, and connects to the host)."""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stowage.bus.base import BusError, RemoteError, compute_topic
from stowage.domain.errors import ConflictError, StowageError

if TYPE_CHECKING:
    from stowage.services.cloud import Cloud

__all__ = [
    "ConsoleRefused",
    "SerialEndpoint",
    "console_output",
    "create_serial_console",
    "open_serial_console",
]

TOKEN_KIND = "console_token"


class ConsoleRefused(StowageError):
    """A console URL's token does not open a console: unknown, used, expired, or naming
    another server or a server that moved."""

    code = "console.token.refused"


@dataclass(frozen=True)
class SerialEndpoint:
    """Where one serial console session is served (a host's `ConsoleProxy`), and the
    one-time ticket that opens it."""

    address: str
    port: int
    ticket: str


async def console_output(
    cloud: Cloud, instance_id: str, body: Mapping[str, Any], length: int | None
) -> str:
    """The serial console log's last `length` lines (all of it for None); ConflictError while
    the server has no running guest to ask, or its host does not answer."""
    reply = await _ask_host(
        cloud, instance_id, body, "console_output", {"length": length}, "console-"
    )
    return str(reply.get("output") or "")


async def create_serial_console(cloud: Cloud, instance_id: str, body: Mapping[str, Any]) -> str:
    """A one-time token for a session on the server's serial console, valid for the cloud's
    `console_token_ttl_s`, once its host says the guest runs there with a console to open
    (ConflictError otherwise). Only the token's hash is kept."""
    await _ask_host(cloud, instance_id, body, "serial_console", {"ticket": False}, "serial-")
    token = secrets.token_urlsafe(32)
    now = cloud.clock()
    record = {
        "instance_id": instance_id,
        "host": str(body.get("host")),
        "console_type": "serial",
        "expires_at": now + cloud.config.console_token_ttl_s,
    }
    await asyncio.to_thread(_store_token, cloud, token, record, now)
    return token


async def open_serial_console(cloud: Cloud, server_id: str, token: str) -> SerialEndpoint:
    """Take `token` back (once: a second use is refused), check it names `server_id`, has not
    expired, and that the server is still on the host it was issued for, then ask that host
    for a session ticket. ConsoleRefused says why not."""
    record = await asyncio.to_thread(_take_token, cloud, token)
    if record is None:
        raise ConsoleRefused("The console token is unknown or was used already.")
    if record.get("instance_id") != server_id:
        raise ConsoleRefused("The console token was issued for another server.")
    if float(record.get("expires_at") or 0) <= cloud.clock():
        raise ConsoleRefused("The console token has expired.")
    doc = await asyncio.to_thread(cloud.objects.find, "instance", server_id)
    if doc is None or doc.body.get("deleted") or doc.body.get("host") != record.get("host"):
        raise ConsoleRefused(
            f"Server {server_id} is no longer on the host the console token was issued for."
        )
    try:
        reply = await _ask_host(
            cloud, server_id, doc.body, "serial_console", {"ticket": True}, "serial-"
        )
    except ConflictError as exc:
        raise ConsoleRefused(exc.message) from None
    return SerialEndpoint(str(reply["address"]), int(reply["port"]), str(reply["ticket"]))


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _store_token(cloud: Cloud, token: str, record: dict[str, Any], now: float) -> None:
    """Keep the token's record, and drop the records that have expired (Nova's clean-up of
    console auth tokens, done as new ones are made): one transaction, the store's list of
    the tokens read in it (`writing()`), not on a second connection."""
    with cloud.objects.writing() as conn:
        for old in cloud.objects.list(TOKEN_KIND):
            if float(old.body.get("expires_at") or 0) <= now:
                cloud.objects.delete_in(conn, TOKEN_KIND, old.id)
        cloud.objects.create_in(conn, TOKEN_KIND, _digest(token), record)


def _take_token(cloud: Cloud, token: str) -> dict[str, Any] | None:
    """The token's record, deleted in the same transaction: of two uses racing, one
    deletes it and the other finds nothing."""
    if not token:
        return None
    key = _digest(token)
    with cloud.ledger.engine.begin() as conn:
        found = cloud.objects.find_in(conn, TOKEN_KIND, key)
        if found is None or not cloud.objects.delete_in(conn, TOKEN_KIND, key):
            return None
    return dict(found.body)


async def _ask_host(
    cloud: Cloud,
    instance_id: str,
    body: Mapping[str, Any],
    method: str,
    payload: dict[str, Any],
    op_prefix: str,
) -> dict[str, Any]:
    """One console call to the agent of the server's host; ConflictError while the server
    has no running guest to ask, or its host does not answer or refuses."""
    host = body.get("host")
    if not host or body.get("vm_state") in ("building", "error") or cloud.bus is None:
        raise ConflictError(
            f"Instance {instance_id} is not ready: vm_state {body.get('vm_state')}, "
            f"host {host or 'none'}"
        )
    try:
        reply = await cloud.bus.call(
            compute_topic(str(host)),
            method,
            {"instance_id": instance_id, **payload},
            op_id=op_prefix + uuid.uuid4().hex,
            timeout_s=cloud.config.op_timeout_s,
        )
    except (BusError, RemoteError) as exc:
        raise ConflictError(
            f"Instance {instance_id}: its host {host} did not answer: {exc}"
        ) from None
    if not reply.get("ok"):
        raise ConflictError(f"Instance {instance_id}: {reply.get('error')}")
    return dict(reply)
