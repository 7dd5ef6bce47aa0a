"""Processes the tests start run with the nesting guard on: tests/conftest.py sets GUARD_ENV
at import, `stowage up` (and any other child) inherits it, and every ledger engine made there
refuses a second connection or transaction inside an open one, so a request path that nests
fails its test (a 500 from the cloud) instead of passing unchecked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.api.cloudproc import RunningCloud

from stowage.ledger.db import GUARD_ENV

_NEST = """
import sys
from stowage.ledger.db import READONLY, NestedTransaction, make_engine, sqlite_url
engine = make_engine(sqlite_url(sys.argv[1]))
with engine.connect().execution_options(**READONLY) as conn, conn.begin():
    try:
        engine.connect().close()
    except NestedTransaction:
        print("refused")
    else:
        print("allowed")
"""


def test_a_cloud_started_by_the_tests_runs_guarded(cloud: RunningCloud) -> None:
    environ = Path(f"/proc/{cloud.process.pid}/environ").read_bytes().split(b"\0")
    assert f"{GUARD_ENV}=1".encode() in environ
    # Its ledger engines were built guarded: the guard says so as it is installed.
    log = cloud.log.read_text()
    assert "raises NestedTransaction on a second connection or transaction" in log, log[-2000:]


def test_a_process_started_by_the_tests_refuses_a_nested_transaction(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _NEST, str(tmp_path / "ledger.db")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "refused"
