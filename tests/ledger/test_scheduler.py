"""The scheduler service on a real ledger: plans placed together, policies kept, races settled."""

from __future__ import annotations

import gc
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, select

from stowage.domain.claims import ConsumerKind, RefusalCode
from stowage.domain.flavor import Flavor, InstanceShape, shape_of
from stowage.domain.groups import ServerGroup, parse_group
from stowage.domain.topology import HostSpec, HostTopology, ResourceClass
from stowage.ledger import Ledger, audit, make_engine, migrate
from stowage.ledger.db import READONLY
from stowage.ledger.schema import consumers, group_members, group_slots, inventories
from stowage.scheduling.framework import Request
from stowage.scheduling.pipeline import Pipeline
from stowage.scheduling.view import View
from stowage.scheduling.weighers import RamWeigher, SoftAntiAffinityWeigher
from stowage.services import scheduler as scheduler_module
from stowage.services.scheduler import THAW_EVERY, Placement, Scheduler

# One cell, 4 cores x 2 threads: 4 dedicated pCPUs (one PINNED4 instance), 16 shared vCPUs.
ONE_CELL = HostTopology.uniform(
    cells=1, cores_per_cell=4, threads_per_core=2, memory_mb_per_cell=8192
)
# Two cells of 4 dedicated pCPUs each.
TWO_CELLS = HostTopology.uniform(
    cells=2, cores_per_cell=4, threads_per_core=2, memory_mb_per_cell=4096
)
PINNED4 = shape_of(Flavor("pinned.4", 4, 1024, 1, {"hw:cpu_policy": "dedicated"}))
PINNED6 = shape_of(Flavor("pinned.6", 6, 1024, 1, {"hw:cpu_policy": "dedicated"}))
SMALL = shape_of(Flavor("small", 1, 512, 1))
FILLER = shape_of(Flavor("filler", 1, 2048, 1))
T0 = 1_000_000.0


class Clock:
    """Time the test moves by hand."""

    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def ledger(db_url: str, clock: Clock) -> Iterator[Ledger]:
    engine = make_engine(db_url)
    migrate(engine)
    opened = Ledger(engine, clock=clock)
    yield opened
    opened.close()


class LaggingScheduler(Scheduler):
    """A worker whose view does not catch up between requests, as one behind a slow log."""

    def current_view(self) -> View:
        if self.view is None:
            self.view = self.ledger.load_view(self.writer)
        return self.view


# --- helpers ----------------------------------------------------------------------------


def register(
    ledger: Ledger, *names: str, topology: HostTopology = ONE_CELL, **spec: Any
) -> dict[str, int]:
    return {name: ledger.register_host(HostSpec(name, topology, **spec)) for name in names}


def req(shape: InstanceShape, name: str | None = None, **fields: Any) -> Request:
    vm = name or f"vm-{uuid.uuid4().hex[:8]}"
    return Request(consumer_id=vm, instance_id=vm, shape=shape, **fields)


def hosts_of(placements: Sequence[Placement]) -> list[int]:
    out = []
    for p in placements:
        assert p.claim is not None, p.reason
        out.append(p.claim.host_id)
    return out


def read(ledger: Ledger, query: Any) -> list[tuple[Any, ...]]:
    with ledger.engine.connect().execution_options(**READONLY) as conn:
        return [tuple(row) for row in conn.execute(query)]


def consumer_hosts(ledger: Ledger) -> dict[str, int | None]:
    return dict(read(ledger, select(consumers.c.id, consumers.c.host_id)))


def members_per_host(ledger: Ledger, group_id: str) -> Counter[int]:
    """Where a group's consumers sit, both ends of migrations counted."""
    rows = read(
        ledger,
        select(consumers.c.host_id)
        .select_from(
            group_members.join(consumers, consumers.c.instance_id == group_members.c.instance_id)
        )
        .where(group_members.c.group_id == group_id, consumers.c.host_id.is_not(None)),
    )
    return Counter(h for (h,) in rows)


def total_used(ledger: Ledger) -> int:
    return sum(u for (u,) in read(ledger, select(inventories.c.used)))


def assert_clean(ledger: Ledger) -> None:
    assert [str(v) for v in audit(ledger)] == []


def group(ledger: Ledger, policy: str, rules: dict[str, object] | None = None) -> ServerGroup:
    created = parse_group(f"g-{uuid.uuid4().hex[:8]}", "web", policy, rules)
    ledger.create_group(created)
    return created


def assert_view_matches_ledger(view: View, ledger: Ledger) -> None:
    fresh = ledger.load_view()
    assert set(view.hosts) == set(fresh.hosts)
    for host_id, host in fresh.hosts.items():
        mine = view.hosts[host_id]
        assert {k: v for k, v in mine.used.items() if v} == {
            k: v for k, v in host.used.items() if v
        }, host.name
        assert mine.free == host.free, host.name
    for group_id, state in fresh.groups.items():
        if group_id in view.groups:
            assert +view.groups[group_id].per_host == +state.per_host
            assert +view.groups[group_id].per_domain == +state.per_domain


# --- plans ------------------------------------------------------------------------------


def test_a_multi_instance_request_is_placed_together(ledger: Ledger, clock: Clock) -> None:
    ids = register(ledger, "h1", "h2", "h3")
    scheduler = Scheduler(ledger, clock=clock)

    placements = scheduler.schedule([req(PINNED4, f"vm-{i}") for i in range(3)])

    assert sorted(hosts_of(placements)) == sorted(ids.values())  # one PINNED4 fits per host
    assert consumer_hosts(ledger) == {
        f"vm-{i}": p.claim.host_id for i, p in enumerate(placements) if p.claim is not None
    }
    assert scheduler.conflicts == 0
    assert_clean(ledger)

    late = scheduler.schedule([req(PINNED4)])[0]
    assert not late.ok
    assert late.code is RefusalCode.NO_VALID_HOST
    assert late.reason == "No valid host was found. 3 hosts rejected by cpu: need 4 PCPU, 0 free"


def test_min_count_not_met_leaves_nothing_claimed(ledger: Ledger, clock: Clock) -> None:
    register(ledger, "h1", "h2")
    scheduler = Scheduler(ledger, clock=clock)

    placements = scheduler.schedule([req(PINNED4) for _ in range(3)], min_count=3)

    assert [p.ok for p in placements] == [False, False, False]
    for p in placements:
        assert p.code is RefusalCode.NO_VALID_HOST
        assert p.reason.startswith("only 2 of the minimum 3 instances fit. No valid host")
    assert consumer_hosts(ledger) == {}
    assert total_used(ledger) == 0
    assert_clean(ledger)
    # The undone claims are gone from the scheduler's view too.
    again = scheduler.schedule([req(PINNED4) for _ in range(2)], min_count=2)
    assert [p.ok for p in again] == [True, True]
    assert_clean(ledger)


def test_no_valid_host_explains_the_rejections_per_filter(ledger: Ledger, clock: Clock) -> None:
    register(ledger, "h1", "h2", "h3", topology=TWO_CELLS)
    ledger.set_host_state("h3", disabled=True)
    scheduler = Scheduler(ledger, clock=clock)

    placement = scheduler.schedule([req(PINNED6)])[0]

    assert not placement.ok
    assert placement.code is RefusalCode.NO_VALID_HOST
    assert placement.reason == (
        "No valid host was found. 2 hosts rejected by numa_topology: need 6 dedicated CPUs "
        "on one NUMA cell, largest free is 4; 1 host rejected by compute: compute service "
        "is disabled"
    )
    assert consumer_hosts(ledger) == {}


def test_a_flavor_without_a_root_disk_is_placed(ledger: Ledger, clock: Clock) -> None:
    """Boot-from-volume flavors have disk 0; a zero amount is no claim on DISK_GB."""
    ids = register(ledger, "h1")
    scheduler = Scheduler(ledger, clock=clock)
    volume_backed = shape_of(Flavor("bfv", 1, 512, 0))

    placement = scheduler.schedule([req(volume_backed, "vm-bfv")])[0]

    assert placement.ok, placement.reason
    assert hosts_of([placement]) == [ids["h1"]]
    assert scheduler.conflicts == 0
    assert_clean(ledger)


# --- server groups ----------------------------------------------------------------------


def test_anti_affinity_group_larger_than_the_cloud_gets_one_member_per_host(
    ledger: Ledger, clock: Clock
) -> None:
    ids = register(ledger, "h1", "h2", "h3")
    anti = group(ledger, "anti-affinity")
    scheduler = Scheduler(ledger, clock=clock)

    placements = scheduler.schedule([req(SMALL, group_id=anti.id) for _ in range(5)])

    placed = [p for p in placements if p.ok]
    refused = [p for p in placements if not p.ok]
    assert sorted(hosts_of(placed)) == sorted(ids.values())
    assert len(refused) == 2
    for p in refused:
        assert p.code is RefusalCode.NO_VALID_HOST
        assert "3 hosts rejected by server_group: anti-affinity: host=h" in p.reason
        assert "already holds 1 of at most 1 members" in p.reason
    assert members_per_host(ledger, anti.id) == Counter(ids.values())
    assert scheduler.conflicts == 0
    assert_clean(ledger)


def test_max_server_per_host_allows_that_many_members_per_host(
    ledger: Ledger, clock: Clock
) -> None:
    ids = register(ledger, "h1", "h2")
    anti = group(ledger, "anti-affinity", {"max_server_per_host": 2})
    scheduler = Scheduler(ledger, clock=clock)

    placements = scheduler.schedule([req(SMALL, group_id=anti.id) for _ in range(5)])

    assert Counter(hosts_of([p for p in placements if p.ok])) == {ids["h1"]: 2, ids["h2"]: 2}
    refused = [p for p in placements if not p.ok]
    assert len(refused) == 1
    assert "already holds 2 of at most 2 members" in refused[0].reason
    slots = read(ledger, select(group_slots.c.domain, group_slots.c.slot))
    assert sorted(slots) == [("host=h1", 0), ("host=h1", 1), ("host=h2", 0), ("host=h2", 1)]
    assert_clean(ledger)


def test_failure_domain_rule_spreads_members_over_racks(ledger: Ledger, clock: Clock) -> None:
    ids = register(ledger, "h1", "h2", labels={"rack": "r1"})
    ids |= register(ledger, "h3", labels={"rack": "r2"})
    ids |= register(ledger, "h4")  # no rack label: never holds a member
    anti = group(ledger, "anti-affinity", {"failure_domain": "rack"})
    scheduler = Scheduler(ledger, clock=clock)

    placements = scheduler.schedule([req(SMALL, group_id=anti.id) for _ in range(3)])

    placed = [p for p in placements if p.ok]
    assert len(placed) == 2
    assert ids["h4"] not in hosts_of(placed)
    assert sorted(d for (d,) in read(ledger, select(group_slots.c.domain))) == [
        "rack=r1",
        "rack=r2",
    ]
    refused = next(p for p in placements if not p.ok)
    assert "4 hosts rejected by failure_domain: anti-affinity: " in refused.reason
    assert_clean(ledger)


def test_affinity_group_lands_on_one_host(ledger: Ledger, clock: Clock) -> None:
    ids = register(ledger, "h1", "h2", "h3")
    together = group(ledger, "affinity")
    scheduler = Scheduler(ledger, clock=clock)

    first = scheduler.schedule([req(SMALL, group_id=together.id) for _ in range(3)])
    later = scheduler.schedule([req(SMALL, group_id=together.id)])

    assert len(set(hosts_of([*first, *later]))) == 1
    home = hosts_of(first)[0]
    ledger.set_host_state(next(n for n, h in ids.items() if h == home), disabled=True)
    stranded = scheduler.schedule([req(SMALL, group_id=together.id)])[0]
    assert not stranded.ok
    assert "2 hosts rejected by server_group: affinity: members already run on" in stranded.reason
    assert "1 host rejected by compute: compute service is disabled" in stranded.reason
    assert_clean(ledger)


def test_soft_anti_affinity_spreads_members_while_there_is_room(
    ledger: Ledger, clock: Clock
) -> None:
    ids = register(ledger, "h1", "h2", "h3")
    soft = group(ledger, "soft-anti-affinity")
    packing = [RamWeigher(-1.0)]  # alone, it stacks everything on one host
    packer = Scheduler(ledger, clock=clock, pipeline=Pipeline(weighers=packing))
    spreader = Scheduler(
        ledger,
        clock=clock,
        pipeline=Pipeline(weighers=[*packing, SoftAntiAffinityWeigher(10.0)]),
    )

    stacked = packer.schedule([req(SMALL) for _ in range(3)])
    assert len(set(hosts_of(stacked))) == 1

    spread = spreader.schedule([req(SMALL, group_id=soft.id) for _ in range(3)])
    assert sorted(hosts_of(spread)) == sorted(ids.values())
    # Soft: more members than hosts still all land, evenly.
    more = spreader.schedule([req(SMALL, group_id=soft.id) for _ in range(3)])
    assert all(p.ok for p in more)
    assert members_per_host(ledger, soft.id) == dict.fromkeys(ids.values(), 2)
    assert_clean(ledger)


# --- hints, zones and service state -----------------------------------------------------


def test_same_host_and_different_host_hints(ledger: Ledger, clock: Clock) -> None:
    register(ledger, "h1", "h2", "h3")
    spreader = Scheduler(ledger, clock=clock)  # default weighers spread
    packer = Scheduler(ledger, clock=clock, pipeline=Pipeline(weighers=[RamWeigher(-1.0)]))
    anchor = hosts_of(spreader.schedule([req(SMALL, "vm-anchor")]))[0]

    beside = spreader.schedule([req(SMALL, same_host=frozenset({anchor})) for _ in range(3)])
    assert set(hosts_of(beside)) == {anchor}

    away = packer.schedule([req(SMALL, different_host=frozenset({anchor})) for _ in range(3)])
    assert anchor not in hosts_of(away)
    assert len(set(hosts_of(away))) == 1  # packed, just not beside the anchor
    assert_clean(ledger)


def test_availability_zone_and_force_host(ledger: Ledger, clock: Clock) -> None:
    ids = register(ledger, "h1", availability_zone="az1")
    ids |= register(ledger, "h2", "h3", availability_zone="az2")
    scheduler = Scheduler(ledger, clock=clock)

    in_az1 = scheduler.schedule([req(SMALL, availability_zone="az1") for _ in range(2)])
    assert hosts_of(in_az1) == [ids["h1"], ids["h1"]]
    forced = scheduler.schedule([req(SMALL, force_host="h3") for _ in range(2)])
    assert hosts_of(forced) == [ids["h3"], ids["h3"]]

    nowhere = scheduler.schedule([req(SMALL, availability_zone="az3")])[0]
    assert not nowhere.ok
    assert "3 hosts rejected by availability_zone: in zone az" in nowhere.reason
    assert "not az3" in nowhere.reason
    mismatch = scheduler.schedule([req(SMALL, availability_zone="az1", force_host="h3")])[0]
    assert not mismatch.ok
    assert "rejected by availability_zone" in mismatch.reason
    assert_clean(ledger)


def test_compute_filter_rejects_disabled_forced_down_and_silent_hosts(
    ledger: Ledger, clock: Clock
) -> None:
    ids = register(ledger, "h1", "h2", "h3", "h4")
    ledger.set_host_state("h1", disabled=True)
    ledger.set_host_state("h2", forced_down=True)
    ledger.set_host_state("h3", last_seen=T0 - 120)
    scheduler = Scheduler(ledger, clock=clock)

    placements = scheduler.schedule([req(SMALL) for _ in range(3)])
    assert hosts_of(placements) == [ids["h4"]] * 3

    clock.now += 61  # no host has sent a heartbeat since T0
    silent = scheduler.schedule([req(SMALL)])[0]
    assert not silent.ok
    assert "4 hosts rejected by compute: compute service" in silent.reason

    ledger.set_host_state("h3", last_seen=clock.now)
    back = scheduler.schedule([req(SMALL)])[0]
    assert hosts_of([back]) == [ids["h3"]]
    assert_clean(ledger)


# --- evacuation -------------------------------------------------------------------------


def test_evacuating_a_failed_host_replaces_its_members_as_one_plan_honouring_anti_affinity(
    ledger: Ledger, clock: Clock
) -> None:
    ids = register(ledger, "h1", "h2", "h3", "h4")
    anti = group(ledger, "anti-affinity", {"max_server_per_host": 2})
    scheduler = Scheduler(ledger, clock=clock)
    layout = {"m0": "h1", "m1": "h1", "m2": "h2", "m3": "h3", "m4": "h3"}
    for vm, host in layout.items():
        assert scheduler.schedule([req(SMALL, vm, group_id=anti.id, force_host=host)])[0].ok
    # h4 is the fullest host: every spreading weigher prefers h2 for both evacuees.
    fillers = scheduler.schedule([req(FILLER, force_host="h4") for _ in range(3)])
    assert all(p.ok for p in fillers)
    ledger.set_host_state("h1", forced_down=True)

    evacuees = [
        Request(
            consumer_id=f"mig-{vm}",
            instance_id=vm,
            shape=SMALL,
            kind=ConsumerKind.MIGRATION,
            group_id=anti.id,
            ignore_hosts=frozenset({ids["h1"]}),
        )
        for vm in ("m0", "m1")
    ]
    moves = scheduler.schedule(evacuees)

    assert sorted(hosts_of(moves)) == sorted([ids["h2"], ids["h4"]])
    assert scheduler.conflicts == 0  # the plan itself kept the rule, not the ledger's keys
    # Both ends count while the moves are in flight.
    assert members_per_host(ledger, anti.id) == {
        ids["h1"]: 2,
        ids["h2"]: 2,
        ids["h3"]: 2,
        ids["h4"]: 1,
    }
    assert_clean(ledger)
    newcomer = scheduler.schedule([req(SMALL, group_id=anti.id)])[0]
    assert hosts_of([newcomer]) == [ids["h4"]]  # h1 is down, h2 and h3 are full

    assert ledger.complete_migration("mig-m0")
    assert ledger.complete_migration("mig-m1")
    assert members_per_host(ledger, anti.id) == {ids["h2"]: 2, ids["h3"]: 2, ids["h4"]: 2}
    hosts_now = consumer_hosts(ledger)
    assert {hosts_now["m0"], hosts_now["m1"]} == {ids["h2"], ids["h4"]}
    assert_clean(ledger)


# --- concurrent schedulers --------------------------------------------------------------


def _race(
    ledger: Ledger, clock: Clock, *, free_other_host: bool
) -> tuple[Scheduler, Scheduler, Placement, dict[str, int]]:
    """hB is full when both views load; the fresh worker takes hA's last pinned CPUs; the
    lagging one still believes hA is free."""
    ids = register(ledger, "hA", "hB")
    fresh = Scheduler(ledger, clock=clock, seed=1)
    lagging = LaggingScheduler(ledger, clock=clock, seed=2)
    assert fresh.schedule([req(PINNED4, "vm-filler", force_host="hB")])[0].ok
    lagging.current_view()
    assert hosts_of(fresh.schedule([req(PINNED4, "vm-x")])) == [ids["hA"]]
    if free_other_host:
        assert ledger.release("vm-filler")

    loser = lagging.schedule([req(PINNED4, "vm-y")])[0]

    assert loser.attempts == 2
    assert lagging.conflicts == 1
    assert fresh.conflicts == 0
    assert_clean(ledger)
    for worker in (fresh, lagging):
        assert worker.view is not None
        ledger.refresh(worker.view)
        assert_view_matches_ledger(worker.view, ledger)
    return fresh, lagging, loser, ids


def test_a_scheduler_with_a_stale_view_retries_and_lands_elsewhere(
    ledger: Ledger, clock: Clock
) -> None:
    _, _, loser, ids = _race(ledger, clock, free_other_host=True)

    assert hosts_of([loser]) == [ids["hB"]]
    assert consumer_hosts(ledger) == {"vm-x": ids["hA"], "vm-y": ids["hB"]}


def test_a_scheduler_with_a_stale_view_is_refused_with_a_reason_when_nothing_is_left(
    ledger: Ledger, clock: Clock
) -> None:
    _, _, loser, ids = _race(ledger, clock, free_other_host=False)

    assert not loser.ok
    assert loser.code is RefusalCode.NO_VALID_HOST
    assert loser.reason == "No valid host was found. 2 hosts rejected by cpu: need 4 PCPU, 0 free"
    assert consumer_hosts(ledger) == {"vm-filler": ids["hB"], "vm-x": ids["hA"]}


def test_a_group_created_after_a_view_loaded_is_still_honoured(
    ledger: Ledger, clock: Clock
) -> None:
    ids = register(ledger, "h1", "h2")
    early = Scheduler(ledger, clock=clock, seed=3)
    early.current_view()
    other = Scheduler(ledger, clock=clock, seed=4)
    anti = group(ledger, "anti-affinity")
    first = hosts_of(other.schedule([req(SMALL, group_id=anti.id)]))[0]

    second = early.schedule([req(SMALL, group_id=anti.id) for _ in range(2)])

    assert [p.ok for p in second] == [True, False]
    assert hosts_of(second[:1]) == [h for h in ids.values() if h != first]
    assert early.conflicts == 0
    assert_clean(ledger)


def test_heartbeats_reach_a_long_lived_view_without_change_rows(
    ledger: Ledger, clock: Clock
) -> None:
    """Heartbeats write no change rows; the worker still sees hosts alive an hour later."""
    register(ledger, "h1", "h2")
    scheduler = Scheduler(ledger, clock=clock)
    first = scheduler.schedule([req(SMALL)])
    assert first[0].ok
    for _ in range(60):  # an hour of beats, one a minute, while the view lives on
        clock.now += 60
        ledger.heartbeat()
    later = scheduler.schedule([req(SMALL)])
    assert later[0].ok, later[0].reason


def test_a_host_whose_heartbeats_stop_is_left_out(ledger: Ledger, clock: Clock) -> None:
    ids = register(ledger, "h1", "h2")
    scheduler = Scheduler(ledger, clock=clock)
    assert scheduler.schedule([req(SMALL)])[0].ok
    clock.now += 300
    ledger.heartbeat(["h2"])  # h1 has been silent for five minutes
    placements = scheduler.schedule([req(SMALL) for _ in range(3)])
    assert hosts_of(placements) == [ids["h2"]] * 3


def test_a_view_older_than_the_pruned_change_log_reads_every_host_again(
    ledger: Ledger, clock: Clock
) -> None:
    ids = register(ledger, "h1", "h2")
    behind = Scheduler(ledger, clock=clock)
    ahead = Scheduler(ledger, clock=clock)
    behind.current_view()
    placed = ahead.schedule([req(FILLER) for _ in range(4)])
    assert all(p.ok for p in placed)
    clock.now += 3600
    ledger.heartbeat()
    assert ledger.prune_changes(older_than_s=600) > 0
    view = behind.current_view()
    assert_view_matches_ledger(view, ledger)
    assert sum(view.hosts[h].used.get(ResourceClass.MEMORY_MB, 0) for h in ids.values()) == (
        4 * FILLER.memory_mb
    )


# --- the view out of the cyclic collector's reach -----------------------------------------


def _collected(obj: object) -> bool:
    """True while the cyclic collector still walks `obj` (frozen objects are not listed)."""
    return any(o is obj for o in gc.get_objects())


def test_a_freezing_scheduler_freezes_its_view_after_each_full_read(
    ledger: Ledger, clock: Clock, thawed: None
) -> None:
    ids = register(ledger, "h1", "h2")
    behind = Scheduler(ledger, clock=clock, freeze_view=True)
    ahead = Scheduler(ledger, clock=clock)
    first = behind.current_view()
    assert not _collected(first.hosts[ids["h1"]])
    assert all(p.ok for p in ahead.schedule([req(FILLER) for _ in range(2)]))
    clock.now += 3600
    ledger.heartbeat()
    assert ledger.prune_changes(older_than_s=600) > 0

    view = behind.current_view()  # the pruned log: every host read again

    assert view.loads == 2
    assert_view_matches_ledger(view, ledger)
    assert not any(_collected(h) for h in view.hosts.values())


def test_a_freezing_scheduler_freezes_what_its_claims_change_and_thaws_now_and_then(
    ledger: Ledger, clock: Clock, thawed: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pinned claim replaces its host's free state in the view with new objects, which the
    full read's freeze never saw: at 100,000 hosts every full collection walked them again.
    After every REFREEZE_CLAIMS claims they are frozen too; every THAW_EVERY freezes, all is
    thawed and collected once, so garbage cycles among frozen objects cannot pile up."""
    monkeypatch.setattr(scheduler_module, "REFREEZE_CLAIMS", 30)
    ids = register(ledger, *(f"h{i}" for i in range(32)))
    scheduler = Scheduler(ledger, clock=clock, freeze_view=True)
    view = scheduler.current_view()
    for _ in range(14):
        assert all(p.ok for p in scheduler.schedule([req(PINNED4), req(PINNED4)]))
    assert scheduler.current_view() is view  # 28 claims: not yet
    claimed = [h for h in ids.values() if view.hosts[h].used.get(ResourceClass.PCPU)]
    walked = {id(o) for o in gc.get_objects()}
    assert len(claimed) >= 8
    assert all(id(view.hosts[h].free) in walked for h in claimed)

    assert all(p.ok for p in scheduler.schedule([req(PINNED4), req(PINNED4)]))  # 30
    scheduler.current_view()
    walked = {id(o) for o in gc.get_objects()}
    assert not any(id(view.hosts[h].free) in walked for h in claimed)

    thaws: list[None] = []
    unfreeze = gc.unfreeze
    monkeypatch.setattr(gc, "unfreeze", lambda: (thaws.append(None), unfreeze())[1])
    monkeypatch.setattr(scheduler_module, "REFREEZE_CLAIMS", 0)  # a freeze at every read
    for _ in range(THAW_EVERY - 2):
        scheduler.current_view()
    assert thaws == []
    scheduler.current_view()
    assert thaws == [None]
    assert view.loads == 1  # no full read: the thaw is the count's, not a reload's


def test_a_scheduler_leaves_the_collector_alone_by_default(
    ledger: Ledger, clock: Clock, thawed: None
) -> None:
    ids = register(ledger, "h1")
    view = Scheduler(ledger, clock=clock).current_view()
    assert _collected(view.hosts[ids["h1"]])


# --- two schedulers on one ledger: each view reads the other's claims, not its own ---------


def test_two_schedulers_on_one_ledger_each_see_the_others_claims(
    ledger: Ledger, clock: Clock
) -> None:
    ids = register(ledger, *(f"h{i}" for i in range(32)))
    a = Scheduler(ledger, clock=clock, seed=1)
    b = Scheduler(ledger, clock=clock, seed=2)
    for _ in range(3):  # interleaved batches, each worker's claims applied to its own view
        assert all(p.ok for p in a.schedule([req(SMALL) for _ in range(10)]))
        assert all(p.ok for p in b.schedule([req(FILLER) for _ in range(5)]))
    # More of b's change rows (one a host a transaction) than a refresh's window behind.
    for _ in range(300):
        assert b.schedule([req(SMALL)])[0].ok
    assert all(p.ok for p in a.schedule([req(SMALL) for _ in range(4)]))

    for worker in (a, b):
        view = worker.current_view()
        assert_view_matches_ledger(view, ledger)
        used = sum(view.hosts[h].used.get(ResourceClass.MEMORY_MB, 0) for h in ids.values())
        assert used == 334 * SMALL.memory_mb + 15 * FILLER.memory_mb
    assert a.conflicts == b.conflicts == 0
    assert_clean(ledger)


# SQLite only: PostgreSQL commits sequences out of order, so its refresh reads a window.
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_refresh_on_sqlite_fetches_no_change_row_of_its_own_claims(
    ledger: Ledger, clock: Clock
) -> None:
    assert ledger.engine.dialect.name == "sqlite"
    ids = register(ledger, "h1", "h2", "h3")
    worker = Scheduler(ledger, clock=clock)
    other = Scheduler(ledger, clock=clock)
    assert other.schedule([req(SMALL, force_host="h3")])[0].ok
    worker.current_view()
    for _ in range(5):
        assert worker.schedule([req(SMALL)])[0].ok
    assert other.schedule([req(SMALL, force_host="h3")])[0].ok
    reads: list[tuple[str, Any]] = []

    def note(_c: Any, _cur: Any, statement: str, params: Any, _ctx: Any, _many: bool) -> None:
        # The rows themselves, not the bounds (min and max).
        bounds = "min(" in statement.lower() or "max(" in statement.lower()
        if statement.lstrip().startswith("SELECT") and "FROM changes" in statement and not bounds:
            reads.append((statement, params))

    event.listen(ledger.engine, "before_cursor_execute", note)
    try:
        view = worker.current_view()
    finally:
        event.remove(ledger.engine, "before_cursor_execute", note)

    with ledger.engine.connect() as conn:  # the same reads again, on the same rows
        fetched = [row for sql, params in reads for row in conn.exec_driver_sql(sql, params)]
    # The one row of the other worker's claim, none of the five the worker applied itself.
    assert [tuple(row) for row in fetched] == [(ids["h3"],)]
    assert_view_matches_ledger(view, ledger)


def test_a_cloud_freezes_its_schedulers_view_only_when_its_config_says(
    ledger: Ledger, tmp_path: Path
) -> None:
    from stowage.services.cloud import Cloud, CloudConfig

    assert not Cloud(CloudConfig(state_dir=tmp_path / "a"), ledger).scheduler.freeze_view
    frozen = CloudConfig(state_dir=tmp_path / "b", scheduler_freeze_view=True)
    assert Cloud(frozen, ledger).scheduler.freeze_view
