"""A boot's and a live migration's statements search by key; none reads a whole table. A
scan costs nothing in a test's cloud and grows with every server and host a real one holds,
and the rows it returns do not show it: three did (a create's flavor and image read scanned
every document on SQLite; each schedule batch of builds, and of moves, read every host's
name). SQLite's plan of each statement says."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, event
from tests.api.inprocess import InProcessCloud, in_process_cloud

from stowage.ledger.db import sqlite_scans
from stowage.ledger.ledger.views import _LIVENESS


def _boot(cloud: InProcessCloud, names: list[str], network: str) -> list[str]:
    """Create these servers, each with a port on `network`, and wait until all are ACTIVE."""
    ids = []
    for name in names:
        body = cloud.tiny_server(name, networks=[{"uuid": network}])
        made = cloud.request("POST", "/compute/v2.1/servers", json=body)
        assert made.status_code == 202, made.text
        ids.append(made.json()["server"]["id"])
    deadline = time.monotonic() + 60
    for server_id in ids:
        while True:
            shown = cloud.request("GET", f"/compute/v2.1/servers/{server_id}")
            if shown.json()["server"]["status"] == "ACTIVE":
                break
            assert time.monotonic() < deadline, shown.text
            time.sleep(0.05)
    return ids


@contextmanager
def _statements(engine: Engine) -> Iterator[dict[str, Any]]:
    """Every distinct statement run meanwhile, with the parameters of its first run."""
    executed: dict[str, Any] = {}

    def keep(_conn: Any, _cursor: Any, statement: str, params: Any, *_rest: Any) -> None:
        executed.setdefault(statement, params)

    event.listen(engine, "before_cursor_execute", keep)
    try:
        yield executed
    finally:
        event.remove(engine, "before_cursor_execute", keep)


def _scans(engine: Engine, executed: dict[str, Any]) -> dict[str, list[str]]:
    """The statements whose SQLite plan reads a whole table or index, with the plan. Not the
    scheduler's liveness read, which reads every host's narrow index by design, once every
    `liveness_interval_s` whatever the requests: a boot or a move that outlasts the interval
    on a loaded machine meets it (a move in CI did, 2026-12-07)."""
    scans = {}
    with engine.connect() as conn:
        for statement, params in executed.items():
            if statement.split()[0].upper() not in ("SELECT", "UPDATE", "DELETE"):
                continue
            if statement == _LIVENESS:
                continue
            steps = sqlite_scans(conn, statement, params)
            if steps:
                scans[" ".join(statement.split())] = steps
    return scans


@pytest.fixture(scope="module")
def cloud(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessCloud]:
    with in_process_cloud(Path(tmp_path_factory.mktemp("plans")), hosts=3) as running:
        # A first boot, not counted: the token, and the scheduler's view read whole once.
        _boot(running, ["warm"], _private(running))
        yield running


def _private(cloud: InProcessCloud) -> str:
    networks = cloud.request("GET", "/networking/v2.0/networks").json()["networks"]
    return str(next(n["id"] for n in networks if n["name"] == "private"))


def test_no_statement_of_a_boot_scans_a_table(cloud: InProcessCloud) -> None:
    engine = cloud.cloud.ledger.engine
    with _statements(engine) as executed:
        _boot(cloud, [f"planned-{i}" for i in range(3)], _private(cloud))
    assert len(executed) > 20  # the boots' statements were seen
    assert _scans(engine, executed) == {}


def test_no_statement_of_a_live_migration_scans_a_table(cloud: InProcessCloud) -> None:
    """The move's schedule step named its destination from a read of every host's name."""
    engine = cloud.cloud.ledger.engine
    [server_id] = _boot(cloud, ["moved"], _private(cloud))
    source = _host_of(cloud, server_id)
    with _statements(engine) as executed:
        moved = cloud.request(
            "POST",
            f"/compute/v2.1/servers/{server_id}/action",
            json={"os-migrateLive": {"host": None, "block_migration": "auto"}},
        )
        assert moved.status_code == 202, moved.text
        deadline = time.monotonic() + 60
        while _host_of(cloud, server_id) == source or _task_of(cloud, server_id):
            assert time.monotonic() < deadline, "the live migration did not end"
            time.sleep(0.05)
    assert len(executed) > 10
    assert _scans(engine, executed) == {}


def _server(cloud: InProcessCloud, server_id: str) -> dict[str, Any]:
    shown = cloud.request("GET", f"/compute/v2.1/servers/{server_id}")
    assert shown.status_code == 200, shown.text
    server: dict[str, Any] = shown.json()["server"]
    return server


def _host_of(cloud: InProcessCloud, server_id: str) -> str:
    return str(_server(cloud, server_id)["OS-EXT-SRV-ATTR:host"])


def _task_of(cloud: InProcessCloud, server_id: str) -> str | None:
    task: str | None = _server(cloud, server_id)["OS-EXT-STS:task_state"]
    return task
