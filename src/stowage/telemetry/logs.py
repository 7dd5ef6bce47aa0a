"""Structured logs through structlog: JSON or key=value lines on stderr, the standard
library's loggers included, each line carrying what is bound in the context (the request
id of the work it belongs to, the operation, the process)."""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterator, Mapping, MutableMapping
from contextvars import ContextVar
from types import MappingProxyType
from typing import Any, TextIO

import structlog

__all__ = ["FORMATS", "LEVELS", "bind", "configure_logging", "current_request_id", "logger"]

FORMATS = ("json", "kv")
LEVELS = ("debug", "info", "warning", "error", "critical")


# What `bind` bound: one variable holding the whole mapping (never changed in place), so a
# bind is one set and one reset, and a line merges one dict. structlog's own contextvars
# keep a variable per key and copy the whole context at every line and every bind
# (9 us a bind; under load 15% of the compute process's GIL samples ended in structlog).
_BOUND: ContextVar[Mapping[str, Any]] = ContextVar(
    "stowage_log_bound", default=MappingProxyType({})
)


def _merge_bound(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    for key, value in _BOUND.get().items():
        event.setdefault(key, value)
    return event


_second: list[tuple[int, str]] = [(0, "")]  # the second last formatted, and its text


def _stamp(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """The line's time as ISO 8601 in UTC with microseconds (as structlog's
    `TimeStamper(fmt="iso", utc=True)` writes it), the date and second formatted once a
    second."""
    now = time.time()
    second = int(now)
    formatted, text = _second[0]  # one read: another thread may be storing the next
    if formatted != second:
        text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        _second[0] = (second, text)
    event["timestamp"] = f"{text}.{int((now - second) * 1e6):06d}Z"
    return event


_configured = [0]  # structlog's configurations so far: a `logger` binds again after each


def _configure(**settings: Any) -> None:
    structlog.configure(**settings)
    _configured[0] += 1


def _route_to_stdlib() -> None:
    """Until a process command configures its logs, structlog's lines go through the
    standard library's loggers and levels (as plain key=value messages), never to stdout."""
    _configure(
        processors=[
            structlog.stdlib.filter_by_level,
            _merge_bound,
            structlog.processors.KeyValueRenderer(key_order=["event"], drop_missing=True),
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )


if not structlog.is_configured():
    _route_to_stdlib()


class _Line:
    """The logger structlog wraps once configured: one named standard library logger's
    level decides, and each rendered line goes to the handler's stream under its lock."""

    def __init__(self, name: str, handler: logging.StreamHandler[TextIO]) -> None:
        self.name = name
        self.std = logging.getLogger(name)
        self._handler = handler

    def msg(self, message: str) -> None:
        handler = self._handler
        handler.acquire()
        try:
            handler.stream.write(message + handler.terminator)
            handler.flush()
        except (OSError, ValueError):  # a closed stream: the line is lost, the work goes on
            pass
        finally:
            handler.release()

    debug = info = warning = warn = error = exception = critical = fatal = log = msg


class _Lines:
    def __init__(self, handler: logging.StreamHandler[TextIO]) -> None:
        self._handler = handler
        self._made: dict[str, _Line] = {}

    def line(self, *args: Any) -> _Line:
        name = str(args[0]) if args else "stowage"
        made = self._made.get(name)
        if made is None:
            made = self._made[name] = _Line(name, self._handler)
        return made


def _enabled(
    logger: _Line, method: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    if not logger.std.isEnabledFor(structlog.processors.NAME_TO_LEVEL.get(method, logging.INFO)):
        raise structlog.DropEvent
    return event


def configure_logging(
    fmt: str = "kv", level: str = "info", *, process: str = "stowage", stream: TextIO | None = None
) -> None:
    """Every log line of this process as `fmt` (json or kv) at `level` and above."""
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: one of {', '.join(FORMATS)}")
    if level.lower() not in LEVELS:
        raise ValueError(f"log level {level!r}: one of {', '.join(LEVELS)}")

    def add_process(_: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
        event.setdefault("process", process)
        return event

    shared: list[Any] = [
        _merge_bound,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        _stamp,
        add_process,
    ]
    renderer: Any
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer(sort_keys=False)
    else:
        renderer = structlog.processors.KeyValueRenderer(
            key_order=["timestamp", "level", "event", "request_id"], drop_missing=True
        )
    handler = logging.StreamHandler(stream or sys.stderr)
    # Stowage's own structlog lines are rendered by structlog and written straight to the
    # handler's stream, under its lock (a whole line at a time beside the standard
    # library's): the round trip through a LogRecord and the formatter cost about three
    # times as much per line, and the API writes one per request. The standard library's
    # level of each logger still decides (`_enabled`), as `filter_by_level` did.
    lines = _Lines(handler)
    _configure(
        processors=[
            _enabled,
            *shared,  # a `_Line` has the name `add_logger_name` reads
            structlog.processors.format_exc_info,
            renderer,
        ],
        logger_factory=lines.line,
        wrapper_class=structlog.make_filtering_bound_logger(level.lower()),
        cache_logger_on_first_use=False,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.ExtraAdder()],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            renderer,
        ],
    )
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level.upper())
    # Libraries' chatter stays at warnings; uvicorn's own access log is replaced by ours.
    for name in ("aio_pika", "aiormq", "httpx", "httpcore", "uvicorn.access"):
        logging.getLogger(name).setLevel(max(logging.WARNING, root.level))


class _Logger:
    """A structlog logger over the standard library's (so configure_logging formats it),
    bound once for each configuration: structlog's lazy proxy binds again at every line
    (8 of a line's 20 us), and caching it for good would keep the first configuration."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._bound: Any = None
        self._under = -1

    def __getattr__(self, method: str) -> Any:
        if self._under != _configured[0]:
            self._bound = structlog.get_logger(self._name).bind()
            self._under = _configured[0]
        return getattr(self._bound, method)


def logger(name: str) -> Any:
    """A structlog logger over the standard library's (so configure_logging formats it)."""
    return _Logger(name)


@contextlib.contextmanager
def bind(**values: Any) -> Iterator[None]:
    """Bind `values` (request_id, op_id, ...) to every log line of the work inside; values
    that are None or empty are left out, and what was bound before comes back after."""
    kept = {k: v for k, v in values.items() if v not in (None, "")}
    if not kept:
        yield
        return
    token = _BOUND.set({**_BOUND.get(), **kept})
    try:
        yield
    finally:
        _BOUND.reset(token)


def current_request_id() -> str | None:
    """The request id bound to the work in progress, if any."""
    value = _BOUND.get().get("request_id")
    return str(value) if value else None
