"""What the simulation finds on today's code, one case per class of failure, each with a seed
that reproduces it (`stowage sim-test --seed N --faults F` prints the run).

Each case asserts the invariants hold and is expected to fail (strict): the day a fix lands,
its case passes, pytest reports XPASS as a failure, and the mark comes off. Issue 9 names the
causes; the lead's rewrite of these use cases is what makes them pass.
"""

from __future__ import annotations

import pytest

from stowage.simulation.faults import parse_faults
from stowage.simulation.world import RunConfig, run

FINDINGS = [
    pytest.param(
        "api-crash",
        0,
        "instance.stuck",
        id="api-crash-mid-create",
        marks=pytest.mark.xfail(
            strict=True,
            raises=AssertionError,
            reason="build_servers commits the instance before its claim and operation: an API "
            "crash in between leaves a server BUILD/scheduling that no process moves on",
        ),
    ),
    pytest.param(
        "api-crash",
        14,
        "migration.open",
        id="api-crash-mid-move",
        marks=pytest.mark.xfail(
            strict=True,
            raises=AssertionError,
            reason="move() commits the instance, the migration record, the claim and the "
            "operation in separate transactions: an API crash in between leaves a migration "
            "pre-migrating with no operation and the server moving for good",
        ),
    ),
    pytest.param(
        "agent-crash,bus-duplicate,bus-loss,bus-reorder,concurrent,conductor-crash,"
        "driver-fault,host-down,slow-disk",
        86,
        "port.orphan",
        id="conductor-crash-mid-delete",
        marks=pytest.mark.xfail(
            strict=True,
            raises=AssertionError,
            reason="the conductor ends a delete in two transactions (claims and document, then "
            "the ports): a conductor crash in between leaves ports bound to a gone server",
        ),
    ),
    pytest.param(
        "bus-loss,bus-duplicate,bus-reorder,bus-late",
        62,
        "hypervisor.unplaced_guest",
        id="stale-spawn-after-undo",
        marks=pytest.mark.xfail(
            strict=True,
            raises=AssertionError,
            reason="a spawn (prepare) delivered after the conductor gave up on it and undid the "
            "destination runs anyway: a guest the ledger does not place (seen on pCPUs the "
            "ledger gave another guest); agents do not fence stale operations",
        ),
    ),
    pytest.param(
        "quota-race",
        2,
        "quota.exceeded",
        id="quota-race",
        marks=pytest.mark.xfail(
            strict=True,
            raises=AssertionError,
            reason="the instances quota is checked in the handler, on min_count, outside the "
            "claim's transaction: concurrent creates and max_count > quota exceed it",
        ),
    ),
    pytest.param(
        "host-down,evacuate",
        105,
        "instance.stuck",
        id="evacuate-fails-the-build-it-refuses",
        marks=pytest.mark.xfail(
            strict=True,
            raises=AssertionError,
            reason="an evacuation of a down host fails the pending build operation of a BUILD "
            "instance (superseded) and then refuses to move it: BUILD/spawning for good",
        ),
    ),
    pytest.param(
        "delete-moving",
        3,
        "hypervisor.unplaced_guest",
        id="delete-during-a-move",
        marks=pytest.mark.xfail(
            strict=True,
            raises=AssertionError,
            reason="deleting a server while it moves (or waits in VERIFY_RESIZE) leaves its "
            "guest running on the destination, where the ledger holds nothing",
        ),
    ),
]


@pytest.mark.parametrize(("faults", "seed", "check"), FINDINGS)
def test_finding(faults: str, seed: int, check: str) -> None:
    result = run(RunConfig(seed, faults=parse_faults(faults)))
    broken = {v.check for v in result.violations}
    # Today: this invariant breaks (the expected failure); fixed, the run is clean.
    assert check not in broken, result.report()
    assert result.ok, result.report()
