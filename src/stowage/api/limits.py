"""What every request body must be: at most `max_request_body_size` bytes (Nova's and
Keystone's option), and JSON.

A body over the limit is refused with 413 before any handler parses it, and before any token is
checked: the count is of the bytes that arrive, so a chunked body without Content-Length is
cut off as soon as it passes the limit. A body of another media type (XML, a form) is refused
with 415, as Nova, Glance, Neutron and Placement answer (400 from identity, as Keystone). Image
data (`PUT /image/v2/images/{id}/file`) streams to disk and is exempt from both. A path with
a NUL character (a name in the path: a tag, a trait) is a 400.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stowage.domain.ids import new_request_id

__all__ = ["DEFAULT_MAX_BODY", "BodyLimit"]

DEFAULT_MAX_BODY = 114688  # bytes, Nova's and Keystone's default
_UNLIMITED = re.compile(r"^/image/v2/images/[^/]+/(file|stage)/?$")
# The dashboard's pages post HTML forms; its handlers read them (and check their CSRF token).
_FORMS = re.compile(r"^/dashboard(/|$)")

Render = Callable[[str, int, str, str], dict[str, Any]]


def _too_large(limit: int) -> str:
    return f"Request is too large: the body exceeds {limit} bytes."


def _json_media(raw: bytes) -> bool:
    """JSON (application/json, ...+json, Glance's json-patch types), or no type at all, or
    text/plain, which Nova reads as JSON too."""
    media = raw.decode("latin-1").split(";", 1)[0].strip().lower()
    return media in ("", "text/plain") or "json" in media.rsplit("/", 1)[-1]


def _form_media(path: str, raw: bytes) -> bool:
    media = raw.decode("latin-1").split(";", 1)[0].strip().lower()
    return media == "application/x-www-form-urlencoded" and bool(_FORMS.match(path))


class BodyLimit:
    """ASGI middleware: at most `limit()` bytes of JSON body per request, else 413 or 415."""

    def __init__(self, app: ASGIApp, limit: Callable[[], int], render: Render) -> None:
        self.app = app
        self.limit = limit
        self.render = render  # (path, status, message, request id) -> the service's error body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _UNLIMITED.match(scope["path"]):
            await self.app(scope, receive, send)
            return
        limit = self.limit()
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > limit:
            await self._refuse(scope, send, 413, _too_large(limit))
            return
        chunks: list[bytes] = []
        total = 0
        first: Message | None = None
        while True:
            message = await receive()
            if message["type"] != "http.request":
                first = message  # the client went away: let the app see it
                break
            body = message.get("body", b"")
            total += len(body)
            if total > limit:
                await self._refuse(scope, send, 413, _too_large(limit))
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        media = headers.get(b"content-type", b"")
        if total and not (_json_media(media) or _form_media(scope["path"], media)):
            status = 400 if scope["path"].startswith("/identity") else 415
            refusal = "Unsupported Content-Type: a request body must be application/json."
            await self._refuse(scope, send, status, refusal)
            return
        if "\x00" in scope["path"]:  # a tag or trait name of PUT .../tags/{tag}, say
            await self._refuse(scope, send, 400, "Invalid input: the path holds a NUL character.")
            return
        pending: list[Message] = [
            first or {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        ]

        async def replay() -> Message:
            if pending:
                return pending.pop()
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, send: Send, status: int, message: str) -> None:
        headers = dict(scope.get("headers") or [])
        rid = headers.get(b"x-openstack-request-id", b"").decode("latin-1")
        rid = rid or new_request_id()
        body = json.dumps(self.render(scope["path"], status, message, rid)).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"x-openstack-request-id", rid.encode("latin-1")),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
