"""Capacity what-if on a real ledger: a failed host's instances planned in memory, room counted."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import select

from stowage.domain.errors import NotFound
from stowage.domain.groups import ServerGroup, parse_group
from stowage.domain.topology import HostSpec, HostTopology
from stowage.ledger import Ledger, audit, make_engine, migrate
from stowage.ledger.db import READONLY
from stowage.ledger.schema import (
    changes,
    consumers,
    group_members,
    group_slots,
    inventories,
    numa_claims,
    pins,
)
from stowage.scheduling.framework import Request
from stowage.services.capacity import CapacityReport, what_if_host_fails, what_if_hosts_fail
from stowage.services.compute import shape_of_flavor
from stowage.services.scheduler import Scheduler

# One cell, 4 cores x 2 threads: 4 dedicated pCPUs, 4 shared threads (16 VCPU), 8 GiB.
ONE_CELL = HostTopology.uniform(
    cells=1, cores_per_cell=4, threads_per_core=2, memory_mb_per_cell=8192
)
TINY = {"id": "1", "name": "tiny", "vcpus": 1, "ram": 512, "disk": 1, "extra_specs": {}}
PINNED = {
    "id": "c1",
    "name": "pinned",
    "vcpus": 1,
    "ram": 256,
    "disk": 1,
    "extra_specs": {"hw:cpu_policy": "dedicated"},
}
PINNED4 = dict(PINNED, id="c4", name="pinned4", vcpus=4, ram=1024)
FLAVORS = [TINY, PINNED, PINNED4]
T0 = 1_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def ledger(db_url: str) -> Iterator[Ledger]:
    engine = make_engine(db_url)
    migrate(engine)
    opened = Ledger(engine, clock=Clock())
    yield opened
    opened.close()


def register(ledger: Ledger, *names: str) -> dict[str, int]:
    return {n: ledger.register_host(HostSpec(n, ONE_CELL)) for n in names}


def anti_affinity(ledger: Ledger) -> ServerGroup:
    group = parse_group(f"g-{uuid.uuid4().hex[:8]}", "web", "anti-affinity", None)
    ledger.create_group(group)
    return group


def boot(
    ledger: Ledger, host: str, flavor: dict[str, Any], group: ServerGroup | None = None
) -> dict[str, Any]:
    """Place one instance on `host` through the scheduler; returns its document."""
    instance_id = str(uuid.uuid4())
    request = Request(
        consumer_id=instance_id,
        instance_id=instance_id,
        shape=shape_of_flavor(flavor),
        group_id=group.id if group else None,
        force_host=host,
    )
    placement = Scheduler(ledger, clock=ledger.clock).schedule([request])[0]
    assert placement.ok, placement.reason
    return {
        "id": instance_id,
        "name": f"vm-{instance_id[:6]}",
        "flavor": flavor,
        "group_id": group.id if group else None,
        "host": host,
    }


def snapshot(ledger: Ledger) -> dict[str, list[tuple[Any, ...]]]:
    """Every table a claim or a change would touch, in a stable order."""
    out = {}
    for table in (changes, consumers, group_members, group_slots, inventories, numa_claims, pins):
        with ledger.engine.connect().execution_options(**READONLY) as conn:
            rows = conn.execute(select(table)).all()
        out[table.name] = sorted((tuple(r) for r in rows), key=repr)
    return out


def destinations(report: CapacityReport) -> dict[str, str | None]:
    return {p.instance_id: p.host for p in report.instances}


def room(report: CapacityReport) -> dict[str, int]:
    return {f.name: f.count for f in report.flavors}


def test_every_instance_finds_a_place_honouring_groups_and_pinning(ledger: Ledger) -> None:
    register(ledger, "host1", "host2", "host3")
    group = anti_affinity(ledger)
    member = boot(ledger, "host1", TINY, group)
    boot(ledger, "host2", TINY, group)
    pinned = boot(ledger, "host1", PINNED4)
    tiny = boot(ledger, "host1", TINY)
    before = snapshot(ledger)

    report = what_if_host_fails(
        ledger, "host1", [member, pinned, tiny], FLAVORS, now=ledger.clock()
    )

    assert report.fits, report.instances
    where = destinations(report)
    assert where[member["id"]] == "host3"  # host2 holds the group's other member
    assert where[pinned["id"]] in ("host2", "host3")
    assert where[tiny["id"]] in ("host2", "host3")
    # Room left on host2 and host3 once the three are placed, by hand:
    # 8 dedicated pCPUs less the 4 the pinned4 takes; one host keeps all 4 free.
    assert room(report)["pinned"] == 4
    assert room(report)["pinned4"] == 1
    shared = {"host2": 1, "host3": 0}  # host2's own group member
    memory = {"host2": 512, "host3": 0}
    for instance in (member, pinned, tiny):
        dest = where[instance["id"]]
        assert dest is not None
        shared[dest] += 0 if instance is pinned else 1
        memory[dest] += instance["flavor"]["ram"]
    tiny_room = sum(min(16 - shared[h], (8192 - memory[h]) // 512) for h in ("host2", "host3"))
    assert room(report)["tiny"] == tiny_room
    # The explanation of the next one that does not fit names a filter.
    pinned4_room = next(f for f in report.flavors if f.name == "pinned4")
    assert "No valid host was found" in pinned4_room.reason and not pinned4_room.capped
    # Nothing was written: no claim, no change row.
    assert snapshot(ledger) == before
    assert [str(v) for v in audit(ledger)] == []


def test_an_instance_with_nowhere_to_go_says_why_and_the_rest_still_land(
    ledger: Ledger,
) -> None:
    register(ledger, "host1", "host2", "host3")
    group = anti_affinity(ledger)
    member = boot(ledger, "host1", TINY, group)
    boot(ledger, "host2", TINY, group)
    boot(ledger, "host3", TINY, group)
    pinned = boot(ledger, "host1", PINNED4)
    boot(ledger, "host2", PINNED4)
    boot(ledger, "host3", PINNED4)
    tiny = boot(ledger, "host1", TINY)
    before = snapshot(ledger)

    report = what_if_host_fails(
        ledger, "host1", [member, pinned, tiny], FLAVORS, now=ledger.clock()
    )

    assert not report.fits
    plans = {p.instance_id: p for p in report.instances}
    assert plans[member["id"]].host is None
    assert "server_group" in plans[member["id"]].reason
    assert plans[pinned["id"]].host is None
    assert "No valid host was found" in plans[pinned["id"]].reason
    assert plans[tiny["id"]].host in ("host2", "host3")
    assert room(report)["pinned"] == 0 and room(report)["pinned4"] == 0
    assert snapshot(ledger) == before


def test_the_failed_hosts_group_slot_is_free_for_its_own_member(ledger: Ledger) -> None:
    """Two hosts, one member each: failing one leaves no place (the other holds a member)."""
    register(ledger, "host1", "host2")
    group = anti_affinity(ledger)
    member = boot(ledger, "host1", TINY, group)
    report = what_if_host_fails(ledger, "host1", [member], FLAVORS, now=ledger.clock())
    assert destinations(report) == {member["id"]: "host2"}
    boot(ledger, "host2", TINY, group)
    report = what_if_host_fails(ledger, "host1", [member], FLAVORS, now=ledger.clock())
    assert destinations(report) == {member["id"]: None}


def test_down_hosts_take_nothing_and_counts_stop_at_the_bound(ledger: Ledger) -> None:
    register(ledger, "host1", "host2", "host3")
    ledger.set_host_state("host3", forced_down=True)
    tiny = boot(ledger, "host1", TINY)
    report = what_if_host_fails(ledger, "host1", [tiny], FLAVORS, now=ledger.clock(), count_max=5)
    assert destinations(report) == {tiny["id"]: "host2"}
    tiny_room = next(f for f in report.flavors if f.name == "tiny")
    assert (tiny_room.count, tiny_room.capped, tiny_room.reason) == (5, True, "")
    assert room(report)["pinned4"] == 1  # host2 only; host3 is down


def test_an_unknown_host_is_not_found(ledger: Ledger) -> None:
    register(ledger, "host1")
    with pytest.raises(NotFound):
        what_if_host_fails(ledger, "nope", [], FLAVORS, now=ledger.clock())


def test_a_whole_rack_failing_plans_both_hosts_instances_together(ledger: Ledger) -> None:
    """host1 and host2 (one rack) fail at once: an anti-affinity pair on them cannot both
    land on host3, and nothing lands on the other failed host."""
    register(ledger, "host1", "host2", "host3", "host4")
    group = anti_affinity(ledger)
    first = boot(ledger, "host1", TINY, group)
    second = boot(ledger, "host2", TINY, group)
    pinned = boot(ledger, "host2", PINNED4)
    before = snapshot(ledger)

    report = what_if_hosts_fail(
        ledger, "rack=r1", ["host1", "host2"], [first, second, pinned], FLAVORS, now=ledger.clock()
    )

    assert report.host == "rack=r1" and report.fits, report.instances
    placed = destinations(report)
    assert {placed[first["id"]], placed[second["id"]]} == {"host3", "host4"}
    assert placed[pinned["id"]] in {"host3", "host4"}
    # Two hosts left, one of them holding the 4 pinned CPUs: 4 more fit, not 8.
    assert room(report)["pinned"] == 4
    assert snapshot(ledger) == before
