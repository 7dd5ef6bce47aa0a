"""What the simulation found, one case per class of failure, each with the seed that
reproduced it (`stowage sim-test --seed N --faults F` prints the run). Each failed on the code
before issue 9's fixes and is kept as a regression test: the invariants hold for that run.
"""

from __future__ import annotations

import pytest

from stowage.simulation.faults import parse_faults
from stowage.simulation.world import RunConfig, run

FINDINGS = [
    # build_servers committed the instance before its claim and operation: an API crash in
    # between left a server BUILD/scheduling that no process moved on.
    pytest.param("api-crash", 0, "instance.stuck", id="api-crash-mid-create"),
    # move() committed the instance, the migration record, the claim and the operation in
    # separate transactions: a crash in between left a migration pre-migrating with no
    # operation and the server moving for good.
    pytest.param("api-crash", 14, "migration.open", id="api-crash-mid-move"),
    # The conductor ended a delete in two transactions (claims and document, then the
    # ports): a conductor crash in between left ports bound to a gone server.
    pytest.param(
        "agent-crash,bus-duplicate,bus-loss,bus-reorder,concurrent,conductor-crash,"
        "driver-fault,host-down,slow-disk",
        86,
        "port.orphan",
        id="conductor-crash-mid-delete",
    ),
    # A spawn delivered after the conductor gave up on it and undid the destination ran
    # anyway: a guest the ledger did not place (once on pCPUs the ledger gave another guest).
    pytest.param(
        "bus-loss,bus-duplicate,bus-reorder,bus-late",
        62,
        "hypervisor.unplaced_guest",
        id="stale-spawn-after-undo",
    ),
    # The instances quota was checked in the handler, on min_count, outside the claim's
    # transaction: concurrent creates and max_count > quota exceeded it.
    pytest.param("quota-race", 2, "quota.exceeded", id="quota-race"),
    # An evacuation of a down host failed the pending build of a BUILD instance (superseded)
    # and then refused to move it: BUILD/spawning for good.
    pytest.param(
        "host-down,evacuate", 105, "instance.stuck", id="evacuate-fails-the-build-it-refuses"
    ),
    # evacuate_host stopped at the first instance it could not move (BUILD, PAUSED): the ones
    # before it stayed REBUILD with evacuations that no operation would end. Failed on the code
    # before the fix (cd077a3^'s evacuate_host, emulated on today's use cases: each start
    # committed alone, a refused instance raising): migration.open and instance.stuck.
    pytest.param(
        "evacuate,host-down,quota-race",
        109,
        "migration.open",
        id="evacuate-stops-at-an-instance-it-cannot-move",
    ),
    # Deleting a server while it moved (or waited in VERIFY_RESIZE) left its guest running
    # on the destination, where the ledger held nothing.
    pytest.param("delete-moving", 3, "hypervisor.unplaced_guest", id="delete-during-a-move"),
]


@pytest.mark.parametrize(("faults", "seed", "check"), FINDINGS)
def test_finding(faults: str, seed: int, check: str) -> None:
    result = run(RunConfig(seed, faults=parse_faults(faults)))
    broken = {v.check for v in result.violations}
    assert check not in broken, result.report()
    assert result.ok, result.report()
