"""Structured log lines: the bound request id on structlog's and the standard library's
lines alike, in JSON and in key=value."""

from __future__ import annotations

import datetime
import io
import json
import logging
import re
from collections.abc import Iterator

import pytest

from stowage.telemetry import bind, configure_logging, current_request_id, logger
from stowage.telemetry import logs as telemetry_logs


@pytest.fixture
def restored_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        root.handlers, root.level = handlers, level
        telemetry_logs._route_to_stdlib()


def test_json_lines_carry_the_bound_request_id(restored_logging: None) -> None:
    out = io.StringIO()
    configure_logging("json", "info", process="test", stream=out)
    with bind(request_id="req-1", op_id=None):
        assert current_request_id() == "req-1"
        logger("stowage.test").info("claimed", host="h1")
        logging.getLogger("stowage.test.std").warning("plain %s", "line")
    logger("stowage.test").debug("below the level")
    logger("stowage.test").info("after")
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(ln["event"], ln.get("request_id")) for ln in lines] == [
        ("claimed", "req-1"),
        ("plain line", "req-1"),
        ("after", None),
    ]
    assert lines[0]["host"] == "h1" and lines[0]["level"] == "info"
    assert "op_id" not in lines[0]  # None is not bound
    assert {ln["process"] for ln in lines} == {"test"}


def test_key_value_lines_and_refused_options(restored_logging: None) -> None:
    out = io.StringIO()
    configure_logging("kv", "warning", process="test", stream=out)
    with bind(request_id="req-2"):
        logger("stowage.test").info("hidden")
        logger("stowage.test").error("failed", why="disk")
    (line,) = out.getvalue().splitlines()
    assert line.split(" ")[1:5] == [
        "level='error'",
        "event='failed'",
        "request_id='req-2'",
        "why='disk'",
    ]
    with pytest.raises(ValueError, match="log format"):
        configure_logging("xml", "info")
    with pytest.raises(ValueError, match="log level"):
        configure_logging("kv", "loud")


def test_structlog_lines_keep_each_loggers_level_and_share_the_stream(
    restored_logging: None,
) -> None:
    """Stowage's structlog lines are written by structlog itself (not through a LogRecord):
    the standard library's level of each logger still decides, positional arguments are
    formatted, and a closed stream loses the line without failing the caller."""
    out = io.StringIO()
    configure_logging("kv", "info", process="test", stream=out)
    quiet = logging.getLogger("stowage.test.quiet")
    quiet.setLevel(logging.ERROR)
    try:
        logger("stowage.test.quiet").info("dropped")
        logger("stowage.test.quiet").error("kept")
        logger("stowage.test").info("op %s waits", "o1")
        logging.getLogger("stowage.test").info("std")
    finally:
        quiet.setLevel(logging.NOTSET)
    events = [line.split(" ")[2] for line in out.getvalue().splitlines()]
    assert events == ["event='kept'", "event='op", "event='std'"]
    assert "event='op o1 waits'" in out.getvalue()
    out.close()
    logger("stowage.test").info("after the stream closed")  # does not raise


def test_nested_binds_a_logger_made_before_and_the_lines_time(restored_logging: None) -> None:
    """A logger made before the configuration writes under it (and under the next one), an
    inner bind adds to the outer and gives it back whole, and each line's time is ISO 8601
    in UTC with microseconds, as structlog's own stamper writes it."""
    made_early = logger("stowage.test.early")
    first, second = io.StringIO(), io.StringIO()
    configure_logging("json", "info", process="test", stream=first)
    before = datetime.datetime.now(datetime.UTC)
    with bind(request_id="req-outer", op_id="op-1"):
        with bind(request_id="req-inner", op_kind="build", host=None):
            made_early.info("inner")
        made_early.info("outer")
    after = datetime.datetime.now(datetime.UTC)
    configure_logging("json", "info", process="again", stream=second)
    made_early.info("reconfigured")
    lines = [json.loads(line) for line in first.getvalue().splitlines()]
    assert [(ln["event"], ln["request_id"], ln["op_id"], ln.get("op_kind")) for ln in lines] == [
        ("inner", "req-inner", "op-1", "build"),
        ("outer", "req-outer", "op-1", None),
    ]
    assert "host" not in lines[0]
    assert current_request_id() is None
    for ln in lines:
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", ln["timestamp"])
        stamped = datetime.datetime.fromisoformat(ln["timestamp"].replace("Z", "+00:00"))
        assert before <= stamped <= after
    (again,) = [json.loads(line) for line in second.getvalue().splitlines()]
    assert (again["event"], again["process"]) == ("reconfigured", "again")
