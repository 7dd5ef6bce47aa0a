"""The test-mode guard (GUARD_ENV, on for the whole suite: tests/conftest.py): a thread that
opens a second connection or transaction while its own transaction is open is refused at once,
instead of waiting on what its first transaction holds."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from sqlalchemy import text

from stowage.ledger.db import READONLY, NestedTransaction, make_engine


def test_a_second_connection_inside_an_open_transaction_is_refused(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'g.db'}")
    try:
        with engine.begin() as conn:
            conn.execute(text("CREATE TABLE t (x INTEGER)"))
            with pytest.raises(NestedTransaction):
                engine.connect()
        # One after the other is fine, and another thread may hold its own meanwhile.
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO t VALUES (1)"))
            seen: list[int] = []

            def other() -> None:
                with engine.connect().execution_options(**READONLY) as other_conn:
                    seen.append(
                        int(other_conn.execute(text("SELECT count(*) FROM t")).scalar_one())
                    )

            thread = threading.Thread(target=other)
            thread.start()
            thread.join()
        assert seen == [0]  # the other thread read before this commit
    finally:
        engine.dispose()


def test_without_the_guard_engines_do_not_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("STOWAGE_GUARD_NESTED_TRANSACTIONS")
    engine = make_engine(f"sqlite:///{tmp_path / 'g.db'}")
    try:
        with engine.begin() as conn:
            conn.execute(text("CREATE TABLE t (x INTEGER)"))
            engine.connect().close()  # production: no check on the hot path
    finally:
        engine.dispose()
