"""The ledger's PostgreSQL engine: a read runs without a transaction of its own and keeps the
statements the driver prepared; the pool keeps every connection it opened (each a backend
PostgreSQL forks and warms)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from sqlalchemy import Connection, Engine, text
from tests.conftest import pg_schema_url

from stowage.ledger.db import READONLY, make_engine

pytestmark = pytest.mark.postgres

_XID = text("SELECT pg_current_xact_id()")
_XID_IF_ASSIGNED = text("SELECT pg_current_xact_id_if_assigned()")


@pytest.fixture
def engine() -> Iterator[Engine]:
    for url in pg_schema_url():
        made = make_engine(url, pool_size=1)  # sequential checkouts reuse one connection
        try:
            yield made
        finally:
            made.dispose()


def _in_one_transaction(conn: Connection) -> bool:
    """Whether the connection's statements share a transaction: the second sees the id the
    first assigned."""
    conn.execute(_XID).scalar_one()
    return conn.execute(_XID_IF_ASSIGNED).scalar_one() is not None


def test_a_read_runs_its_statements_without_a_transaction(engine: Engine) -> None:
    with engine.connect().execution_options(**READONLY) as conn:
        assert not _in_one_transaction(conn)
    with engine.connect() as conn:  # the same connection, back to transactions
        assert _in_one_transaction(conn)
        conn.rollback()
    with engine.connect().execution_options(**READONLY) as conn, conn.begin():
        assert not _in_one_transaction(conn)


def test_reads_keep_the_statements_the_driver_prepared(engine: Engine) -> None:
    """psycopg prepares a statement at its fifth use on a connection, and forgets all it
    prepared at a ROLLBACK: when every read ended with one, nothing stayed prepared."""
    query = text("SELECT count(*) FROM pg_class WHERE relname = :name")
    prepared = text("SELECT count(*) FROM pg_prepared_statements")
    for _ in range(7):
        with engine.connect().execution_options(**READONLY) as conn:
            conn.execute(query, {"name": "objects"}).scalar_one()
            kept = conn.execute(prepared).scalar_one()
    assert kept >= 1


def test_the_pool_keeps_every_connection_it_opened(engine: Engine) -> None:
    """make_engine(pool_size=1) opens at most 2; both stay open once returned (before, the
    second closed at its return and the next burst forked a new backend)."""
    together = threading.Barrier(2)
    pids: list[int] = []

    def hold() -> None:
        with engine.connect() as conn:
            pids.append(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())
            together.wait(timeout=30)

    for _ in range(2):
        threads = [threading.Thread(target=hold) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert engine.pool.checkedin() == 2  # type: ignore[attr-defined]
    assert len(set(pids)) == 2  # the second burst ran on the first one's backends


def test_a_server_reading_as_of_one_moment_keeps_its_read_transactions() -> None:
    """Where the server's default isolation is REPEATABLE READ, a read transaction does read
    as of one moment: it stays one."""
    for url in pg_schema_url():
        strict = make_engine(url + "%20-cdefault_transaction_isolation%3Drepeatable%5C%20read")
        try:
            with strict.connect().execution_options(**READONLY) as conn:
                assert _in_one_transaction(conn)
        finally:
            strict.dispose()
