"""Shared fixtures: a fresh ledger on SQLite and on PostgreSQL (127.0.0.1) for each test."""

from __future__ import annotations

import gc
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError

from stowage.ledger.db import GUARD_ENV

# Every ledger engine the tests make, and every process they start (`stowage up`, its agents,
# a CLI), refuses a second connection or transaction inside an open one: each such nesting can
# stall a process for good (SQLite's writer lock, a PostgreSQL row lock, the pool's last
# connection). Set at import, before any test makes an engine, so subprocesses inherit it;
# tests/api/test_guarded_cloud.py checks that a cloud process started here runs guarded.
os.environ.setdefault(GUARD_ENV, "1")


@pytest.fixture
def thawed() -> Iterator[None]:
    """Whatever a test freezes (gc.freeze: a scheduler's view, a started process) goes back
    to the collector afterwards."""
    yield
    gc.unfreeze()


PG_ADMIN_URL = os.environ.get(
    "STOWAGE_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


def _pg_reachable() -> str | None:
    try:
        engine = create_engine(PG_ADMIN_URL)
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        engine.dispose()
    except OperationalError as exc:
        return str(exc).splitlines()[0]
    return None


_PG_PROBLEM = _pg_reachable()


def pg_schema_url() -> Iterator[str]:
    """A URL whose connections live in a new, empty schema; the schema is dropped after."""
    if _PG_PROBLEM is not None:
        if os.environ.get("CI"):
            pytest.fail(f"PostgreSQL is required in CI: {_PG_PROBLEM}")
        pytest.skip(f"PostgreSQL not reachable on 127.0.0.1: {_PG_PROBLEM}")
    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield f"{PG_ADMIN_URL}?options=-csearch_path%3D{schema}"
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty ledger database URL, once per backend."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'ledger.db'}"
    else:
        yield from pg_schema_url()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--sim-seeds",
        type=int,
        default=int(os.environ.get("STOWAGE_SIM_SEEDS", "100")),
        help="How many seeds tests/sim/test_simulation.py runs (CI: 1000 or more).",
    )
