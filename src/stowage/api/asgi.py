"""Pure ASGI middleware for what every response carries (request ids, microversions).

Starlette's `BaseHTTPMiddleware` (`@app.middleware("http")`) runs the rest of the app in a
task group of its own and streams the response back through memory channels: per request
and per layer, a task, two streams and a cancel scope. Under load, three such layers cost
more CPU than the handler of a trivial GET. These wrap `send` instead: the same headers on
the same responses, in the request's own task.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.datastructures import MutableHeaders
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["OnResponse", "ResponseHeaders"]

# Given the request, either a response to send at once (a refusal), or a function that
# edits the status line's headers of whatever response the app sends.
OnResponse = Callable[[int, MutableHeaders], None]
Enter = Callable[[Request], "Response | OnResponse"]


class ResponseHeaders:
    """ASGI middleware: `enter(request)` answers early or says how to edit the response's
    headers; `exit()` (optional) runs when the app is done, whatever happened."""

    def __init__(
        self, app: ASGIApp, enter: Enter, exit: Callable[[Request], None] | None = None
    ) -> None:
        self.app = app
        self.enter = enter
        self.exit = exit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        outcome = self.enter(request)
        if isinstance(outcome, Response):
            await outcome(scope, receive, send)
            return
        edit = outcome

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                raw = list(message.get("headers") or [])
                edit(int(message["status"]), MutableHeaders(raw=raw))
                message = {**message, "headers": raw}
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            if self.exit is not None:
                self.exit(request)
