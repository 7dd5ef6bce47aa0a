"""`stowage audit`: exit 0 on a clean ledger, 1 with every violation listed, 2 without a ledger."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import text
from typer.testing import CliRunner, Result

from stowage.cli import app
from stowage.domain.claims import Claim
from stowage.domain.flavor import Flavor, shape_of
from stowage.domain.numa import Fit, fit_instance
from stowage.domain.topology import HostSpec, HostTopology
from stowage.ledger import Ledger, audit
from stowage.ledger.db import sqlite_url

TOPOLOGY = HostTopology.uniform(
    cells=2, cores_per_cell=4, threads_per_core=2, memory_mb_per_cell=4096
)
NUMA_SMALL = shape_of(Flavor("numa.small", 1, 1024, 1, {"hw:numa_nodes": "1"}))


def stowage(*args: str) -> Result:
    # Wide enough that no report line wraps.
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "300"})


def populate(url: str) -> Ledger:
    """A ledger with one host and one NUMA-bound instance on it, consistent."""
    ledger = Ledger.open(url)
    host_id = ledger.register_host(HostSpec("h1", TOPOLOGY, disk_gb=100))
    fit = fit_instance(NUMA_SMALL, TOPOLOGY, ledger.load_view().hosts[host_id].free)
    assert isinstance(fit, Fit)
    outcome = ledger.claim([Claim("vm-a", "vm-a", host_id, NUMA_SMALL.amounts(), fit)])
    assert outcome[0].ok
    assert audit(ledger) == []
    return ledger


def test_audit_says_ledger_clean_and_exits_0_on_a_consistent_ledger(db_url: str) -> None:
    populate(db_url).close()

    result = stowage("audit", "--db", db_url)

    assert result.exit_code == 0, result.output
    assert "ledger clean" in result.output


def test_audit_exits_1_and_prints_each_violation(db_url: str) -> None:
    ledger = populate(db_url)
    with ledger.engine.begin() as conn:
        conn.execute(text("UPDATE inventories SET used = used + 5 WHERE resource_class = 'VCPU'"))
        conn.execute(text("UPDATE cells SET memory_mb_used = memory_mb_used + 7 WHERE cell_id = 1"))
    found = [str(v) for v in audit(ledger)]
    ledger.close()

    result = stowage("audit", "--db", db_url)

    assert result.exit_code == 1, result.output
    assert sorted(found) == [
        "[numa.memory_mismatch] h1 cell 1: usage 7 MB, claims add up to 0 MB",
        "[usage.mismatch] h1 VCPU: usage 6, claims add up to 1",
    ]
    lines = [line.strip() for line in result.output.splitlines()]
    assert "2 invariant violation(s)" in lines
    for violation in found:
        assert violation in lines
    assert "ledger clean" not in result.output


def test_audit_exits_2_when_the_state_dir_holds_no_ledger(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("STOWAGE_DB_URL", raising=False)
    state = tmp_path / "cloud"
    state.mkdir()

    result = stowage("audit", "--state-dir", str(state))

    assert result.exit_code == 2, result.output
    assert "No ledger at" in result.output
    assert "ledger.db" in result.output
    assert list(state.iterdir()) == []  # looking did not create one


def test_audit_finds_the_ledger_of_a_state_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("STOWAGE_DB_URL", raising=False)
    state = tmp_path / "cloud"
    upgraded = stowage("db-upgrade", "--state-dir", str(state))
    assert upgraded.exit_code == 0, upgraded.output
    assert (state / "ledger.db").exists()
    populate(sqlite_url(state / "ledger.db")).close()

    result = stowage("audit", "--state-dir", str(state))

    assert result.exit_code == 0, result.output
    assert "ledger clean" in result.output


def test_audit_exits_2_when_the_database_holds_no_ledger(tmp_path: Path) -> None:
    path = tmp_path / "nothing.db"

    result = stowage("audit", "--db", sqlite_url(path))

    assert result.exit_code == 2, result.output
    assert not path.exists()
