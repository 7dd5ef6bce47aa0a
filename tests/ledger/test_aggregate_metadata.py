"""Aggregate metadata in the ledger: a change is a change row, so refreshed views see it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from stowage.domain.flavor import Flavor, shape_of
from stowage.domain.topology import HostSpec, HostTopology
from stowage.ledger import Ledger, make_engine, migrate
from stowage.scheduling.framework import Request
from stowage.services.scheduler import Scheduler

TOPOLOGY = HostTopology.uniform(cells=1, cores_per_cell=4, threads_per_core=2)
SSD = {"aggregate_instance_extra_specs:ssd": "true"}
SHAPE = shape_of(Flavor("ssd", 1, 256, 1, SSD))


@pytest.fixture
def ledger(db_url: str) -> Iterator[Ledger]:
    engine = make_engine(db_url)
    migrate(engine)
    opened = Ledger(engine)
    yield opened
    opened.close()


def ask() -> Request:
    name = f"vm-{uuid.uuid4().hex[:8]}"
    return Request(consumer_id=name, instance_id=name, shape=SHAPE, extra_specs=SSD)


def test_a_running_schedulers_view_follows_aggregate_metadata(ledger: Ledger) -> None:
    ids = {n: ledger.register_host(HostSpec(n, TOPOLOGY)) for n in ("host1", "host2", "host3")}
    scheduler = Scheduler(ledger)
    refused = scheduler.schedule([ask()])[0]  # loads the view before any metadata exists
    assert not refused.ok
    assert "3 hosts rejected by aggregate_extra_specs" in refused.reason

    ledger.set_host_state("host2", aggregate_metadata={"ssd": ["true"], "tier": ["a", "b"]})

    fresh = ledger.load_view().hosts[ids["host2"]]
    assert fresh.aggregate_metadata == {"ssd": frozenset({"true"}), "tier": frozenset("ab")}
    placed = scheduler.schedule([ask() for _ in range(3)])
    assert [p.claim.host_id if p.claim else p.reason for p in placed] == [ids["host2"]] * 3

    ledger.set_host_state("host2", aggregate_metadata={})
    again = scheduler.schedule([ask()])[0]
    assert not again.ok and "no aggregate of the host has ssd=true" in again.reason
