"""The deterministic simulation of the whole control plane (issue 9): many seeds with the
fault classes today's code survives, replays that give the same trace, the CLI, PostgreSQL."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from tests import conftest

from stowage.simulation.faults import ALL_FAULTS, DEFAULT_FAULTS, FaultKind, parse_faults
from stowage.simulation.runner import parse_seeds, run_seeds
from stowage.simulation.world import RunConfig, run

CLI = (sys.executable, "-m", "stowage.cli")


CHUNKS = 4  # the seeds in this many tests, so that pytest's workers share them


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_default_faults_hold_over_many_seeds(request: pytest.FixtureRequest, chunk: int) -> None:
    total = int(request.config.getoption("--sim-seeds"))
    per = -(-total // CHUNKS)
    seeds = range(chunk * per, min(total, (chunk + 1) * per))
    count = len(seeds)
    summary = run_seeds(seeds, DEFAULT_FAULTS)
    print(summary.figures())
    assert summary.seeds == count
    # Faults are really injected, most runs get several.
    assert summary.faults_per_run >= 3, summary.figures()
    reports = "\n".join(r.report() for r in summary.failed)
    assert not summary.failed, f"{summary.figures()}\n{reports}"


def test_a_seed_replays_to_the_same_trace() -> None:
    first = run(RunConfig(7, faults=ALL_FAULTS))
    again = run(RunConfig(7, faults=ALL_FAULTS))
    other = run(RunConfig(8, faults=ALL_FAULTS))
    assert first.injected, "seed 7 injects faults"
    assert first.trace == again.trace
    assert first.trace_hash == again.trace_hash
    assert [str(f) for f in first.injected] == [str(f) for f in again.injected]
    assert [str(v) for v in first.violations] == [str(v) for v in again.violations]
    assert other.trace_hash != first.trace_hash


def test_a_replay_in_another_process_gives_the_same_hash() -> None:
    """`stowage sim-test --seed N` in a fresh interpreter (another hash seed) replays it."""
    here = run(RunConfig(11, faults=DEFAULT_FAULTS))
    out = subprocess.run(
        [*CLI, "sim-test", "--seed", "11"],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONHASHSEED": "4242", "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert out.returncode == (0 if here.ok else 1), out.stdout + out.stderr
    assert f"trace hash {here.trace_hash}" in out.stdout
    assert "seeds/s" in out.stdout and "faults injected per run" in out.stdout


def test_cli_fails_on_a_failing_seed_and_prints_how_to_replay() -> None:
    """A run whose ledger is tampered with behind the use cases' back (`sabotage`: a
    migration that no operation will end) fails, names the invariant and how to replay it."""
    out = subprocess.run(
        [*CLI, "sim-test", "--seed", "105", "--faults", "host-down,evacuate,sabotage"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert "seed 105: FAILED" in out.stdout
    assert "VIOLATION [" in out.stdout and "sabotaged" in out.stdout
    assert "replay: stowage sim-test --seed 105 --faults evacuate,host-down,sabotage" in out.stdout
    assert "failed seeds: 105" in out.stdout


def test_fault_sets_and_seed_ranges_parse() -> None:
    assert parse_faults("default") == DEFAULT_FAULTS
    assert parse_faults("none") == frozenset()
    assert parse_faults("default,-bus-loss,+api-crash") == (
        DEFAULT_FAULTS - {FaultKind.BUS_LOSS}
    ) | {FaultKind.API_CRASH}
    with pytest.raises(ValueError):
        parse_faults("no-such-fault")
    assert parse_seeds("5") == range(5, 6)
    assert parse_seeds("10-19") == range(10, 20)
    with pytest.raises(ValueError):
        parse_seeds("9-3")


@pytest.mark.postgres
def test_postgresql_mode_runs_each_seed_in_a_schema_of_its_own() -> None:
    if conftest._PG_PROBLEM is not None:
        if os.environ.get("CI"):
            pytest.fail(f"PostgreSQL is required in CI: {conftest._PG_PROBLEM}")
        pytest.skip(f"PostgreSQL not reachable on 127.0.0.1: {conftest._PG_PROBLEM}")
    summary = run_seeds(range(3), DEFAULT_FAULTS, db_url=conftest.PG_ADMIN_URL)
    reports = "\n".join(r.report() for r in summary.failed)
    assert summary.seeds == 3 and not summary.failed, reports
