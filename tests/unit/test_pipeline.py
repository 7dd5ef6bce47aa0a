"""The decision cycle on a hand-built view: diagnoses, the candidate limit, weighers, seeds."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable
from typing import Any

import pytest

from stowage.domain.claims import GroupSlot
from stowage.domain.flavor import Flavor, InstanceShape, shape_of
from stowage.domain.groups import parse_group
from stowage.domain.numa import HostFree, fit_instance
from stowage.domain.topology import HostSpec, HostTopology, ResourceClass
from stowage.scheduling.framework import CycleState, Request, Weigher
from stowage.scheduling.pipeline import Diagnosis, Pipeline
from stowage.scheduling.view import HostGroups, HostState, View
from stowage.scheduling.weighers import (
    BuildFailureWeigher,
    CpuWeigher,
    RamWeigher,
    default_weighers,
)

NOW = 10_000.0
# Two cells, 4 cores x 2 threads each: dedicated {0,1,8,9} and {4,5,12,13}; 8 shared CPUs.
TWO_CELLS = HostTopology.uniform(
    cells=2, cores_per_cell=4, threads_per_core=2, memory_mb_per_cell=4096
)
ONE_CELL = HostTopology.uniform(
    cells=1, cores_per_cell=4, threads_per_core=2, memory_mb_per_cell=8192
)
SMALL = shape_of(Flavor("small", 1, 512, 1))
PINNED4 = shape_of(Flavor("pinned.4", 4, 1024, 1, {"hw:cpu_policy": "dedicated"}))
PINNED6 = shape_of(Flavor("pinned.6", 6, 1024, 1, {"hw:cpu_policy": "dedicated"}))
ISOLATED2 = shape_of(
    Flavor(
        "isolated.2",
        2,
        1024,
        1,
        {"hw:cpu_policy": "dedicated", "hw:cpu_thread_policy": "isolate"},
    )
)


def host(
    host_id: int,
    *,
    topology: HostTopology = TWO_CELLS,
    memory_mb_used: int = 0,
    vcpu_used: int = 0,
    build_failures: int = 0,
    disabled: bool = False,
    labels: dict[str, str] | None = None,
) -> HostState:
    spec = HostSpec(f"h{host_id}", topology, disk_gb=100)
    used = dict.fromkeys(ResourceClass, 0)
    used[ResourceClass.MEMORY_MB] = memory_mb_used
    used[ResourceClass.VCPU] = vcpu_used
    return HostState(
        id=host_id,
        name=spec.name,
        topology=topology,
        capacity={rc: spec.capacity(rc) for rc in ResourceClass},
        used=used,
        max_unit=spec.totals(),
        free=HostFree(topology.cpu_dedicated_set, {c.id: c.memory_mb for c in topology.cells}),
        labels=labels or {},
        disabled=disabled,
        last_seen=NOW,
        build_failures=build_failures,
    )


def view_of(hosts: Iterable[HostState]) -> View:
    view = View()
    for state in hosts:
        view.replace_host(state, HostGroups())
    return view


def req(name: str, shape: InstanceShape = SMALL, **fields: Any) -> Request:
    return Request(consumer_id=name, instance_id=name, shape=shape, **fields)


class OnlyHosts:
    """A filter that passes the given host ids and records every host it is asked about."""

    name = "only"

    def __init__(self, allowed: Iterable[int] | None = None) -> None:
        self.allowed = None if allowed is None else set(allowed)
        self.asked: list[int] = []

    def prefilter(self, request: Request, view: View, state: CycleState) -> bool:
        return True

    def filter(self, request: Request, host: HostState, state: CycleState) -> str | None:
        self.asked.append(host.id)
        if self.allowed is None or host.id in self.allowed:
            return None
        return f"host {host.id} is not allowed"


def picked(pipeline: Pipeline, view: View, request: Request) -> int:
    decision = pipeline.decide(view, request, NOW)
    assert decision.claim is not None, decision.diagnosis and decision.diagnosis.explain()
    return decision.claim.host_id


# --- diagnosis --------------------------------------------------------------------------


def test_no_valid_host_counts_rejections_per_filter_most_first() -> None:
    view = view_of([host(1), host(2), host(3, disabled=True)])

    decision = Pipeline().decide(view, req("vm", PINNED6), NOW)

    assert decision.claim is None
    assert decision.diagnosis is not None
    assert decision.diagnosis.hosts_total == 3
    assert decision.diagnosis.rejected == {"numa_topology": 2, "compute": 1}
    assert decision.diagnosis.explain() == (
        "No valid host was found. 2 hosts rejected by numa_topology: need 6 dedicated CPUs "
        "on one NUMA cell, largest free is 4; 1 host rejected by compute: compute service "
        "is disabled"
    )


def test_no_valid_host_speaks_of_one_host_in_the_singular() -> None:
    view = view_of([host(1, memory_mb_used=7168)])

    decision = Pipeline().decide(view, req("vm", shape_of(Flavor("big", 1, 4096, 1))), NOW)

    assert decision.diagnosis is not None
    assert decision.diagnosis.explain() == (
        "No valid host was found. 1 host rejected by ram: need 4096 MEMORY_MB, 1024 free"
    )


def test_no_valid_host_says_when_there_are_no_hosts() -> None:
    decision = Pipeline().decide(View(), req("vm"), NOW)

    assert decision.claim is None
    assert decision.diagnosis == Diagnosis(0)
    assert decision.diagnosis.explain() == "No valid host was found. There are no compute hosts."


# --- the candidate limit ----------------------------------------------------------------


def test_candidates_max_stops_the_scan_once_enough_hosts_pass() -> None:
    view = view_of(host(i) for i in range(1, 21))
    only = OnlyHosts()

    chosen = picked(Pipeline([only], [], candidates_max=3), view, req("vm"))

    assert len(only.asked) == 3
    assert len(set(only.asked)) == 3
    assert chosen in only.asked


def test_the_scan_visits_every_host_when_few_pass() -> None:
    view = view_of(host(i) for i in range(1, 21))
    only = OnlyHosts({5, 17})

    chosen = picked(Pipeline([only], [], candidates_max=3), view, req("vm"))

    assert sorted(only.asked) == list(range(1, 21))
    assert chosen in {5, 17}


def test_the_scan_stops_at_the_limit_even_past_rejected_hosts() -> None:
    view = view_of(host(i) for i in range(1, 41))
    evens = OnlyHosts(range(2, 41, 2))

    pipeline = Pipeline([evens], [], candidates_max=4)
    decision = pipeline.decide(view, req("vm"), NOW)

    passed = [h for h in evens.asked if h % 2 == 0]
    assert len(passed) == 4
    assert evens.asked[-1] % 2 == 0  # the scan ended on the fourth candidate
    assert decision.claim is not None
    assert decision.claim.host_id in passed


def test_consecutive_requests_fill_the_hosts_round_robin() -> None:
    view = view_of(host(i, topology=ONE_CELL) for i in range(1, 21))

    decisions = Pipeline(rng=random.Random(3)).plan(view, [req(f"vm-{i}") for i in range(20)], NOW)

    assert sorted(d.claim.host_id for d in decisions if d.claim is not None) == list(range(1, 21))


def test_a_batch_lands_on_few_blocks_of_neighbouring_host_ids() -> None:
    # 64 requests on 1,000 hosts: a random start per request would touch about 60 blocks.
    view = view_of(host(i, topology=ONE_CELL) for i in range(1, 1001))

    decisions = Pipeline(rng=random.Random(5), block_hosts=32).plan(
        view, [req(f"vm-{i}") for i in range(64)], NOW
    )

    blocks = {(d.claim.host_id - 1) // 32 for d in decisions if d.claim is not None}
    assert len(decisions) == 64
    assert len(blocks) <= 4


def test_the_next_scan_starts_past_the_first_host_that_passed() -> None:
    view = view_of(host(i, topology=ONE_CELL) for i in range(1, 41))
    evens = OnlyHosts(range(2, 41, 2))
    pipeline = Pipeline([evens], [], candidates_max=1, block_hosts=40)

    first = picked(pipeline, view, req("a"))
    evens.asked.clear()
    second = picked(pipeline, view, req("b"))

    assert evens.asked[0] == first % 40 + 1  # the hosts before `first` are not asked again
    assert second == first + 2 or (first == 40 and second == 2)


def test_a_block_of_no_hosts_is_refused() -> None:
    with pytest.raises(ValueError, match="block_hosts"):
        Pipeline(block_hosts=0)


# --- weighers ---------------------------------------------------------------------------


def test_a_negative_ram_multiplier_packs_and_a_positive_one_spreads() -> None:
    view = view_of([host(1), host(2, memory_mb_used=4096), host(3, memory_mb_used=6144)])

    packing = Pipeline(weighers=[RamWeigher(-1.0)], candidates_max=10)
    spreading = Pipeline(weighers=[RamWeigher(1.0)], candidates_max=10)

    assert picked(packing, view, req("a")) == 3
    assert picked(spreading, view, req("b")) == 1


def test_each_weigher_is_scaled_by_its_multiplier() -> None:
    # h1: all RAM free, a quarter of its VCPU free; h2: half its RAM free, all VCPU free.
    view = view_of([host(1, vcpu_used=24), host(2, memory_mb_used=4096)])

    def pick(ram: float, cpu: float) -> int:
        weighers: list[Weigher] = [RamWeigher(ram), CpuWeigher(cpu)]
        return picked(Pipeline(weighers=weighers, candidates_max=10), view, req("vm"))

    assert pick(ram=1.0, cpu=1.0) == 2  # 1.0 + 0.25 < 0.5 + 1.0
    assert pick(ram=3.0, cpu=1.0) == 1  # 3.0 + 0.25 > 1.5 + 1.0
    assert pick(ram=1.0, cpu=0.0) == 1


def test_recent_build_failures_sink_a_host() -> None:
    view = view_of([host(1, build_failures=3), host(2, memory_mb_used=6144)])

    assert picked(Pipeline(candidates_max=10), view, req("vm")) == 2
    without = [w for w in default_weighers() if not isinstance(w, BuildFailureWeigher)]
    assert picked(Pipeline(weighers=without, candidates_max=10), view, req("vm")) == 1


# --- seeds ------------------------------------------------------------------------------


def _plan_hosts(seed: int) -> tuple[int | None, ...]:
    view = view_of(host(i, topology=ONE_CELL) for i in range(1, 9))
    pipeline = Pipeline(weighers=[], candidates_max=2, rng=random.Random(seed))
    decisions = pipeline.plan(view, [req(f"vm-{i}") for i in range(12)], NOW)
    return tuple(d.claim.host_id if d.claim else None for d in decisions)


def test_the_same_seed_gives_the_same_plan() -> None:
    assert _plan_hosts(42) == _plan_hosts(42)
    assert None not in _plan_hosts(42)


def test_the_seed_decides_among_equal_hosts() -> None:
    plans = {_plan_hosts(seed) for seed in range(8)}

    assert len(plans) > 1


# --- the claim a decision carries -------------------------------------------------------


def test_a_plan_sees_its_own_earlier_picks() -> None:
    view = view_of([host(1, topology=ONE_CELL), host(2, topology=ONE_CELL)])

    decisions = Pipeline().plan(view, [req(f"vm-{i}", PINNED4) for i in range(3)], NOW)

    placed = [d.claim.host_id for d in decisions if d.claim is not None]
    assert sorted(placed) == [1, 2]
    assert decisions[2].claim is None
    assert decisions[2].diagnosis is not None
    assert decisions[2].diagnosis.explain() == (
        "No valid host was found. 2 hosts rejected by cpu: need 4 PCPU, 0 free"
    )
    assert view.hosts[1].free.cpus == frozenset()
    assert view.hosts[1].used[ResourceClass.PCPU] == 4


def test_the_claim_carries_the_checked_fit_and_counts_withheld_siblings() -> None:
    view = view_of([host(1)])
    expected = fit_instance(ISOLATED2, TWO_CELLS, view.hosts[1].free)

    decision = Pipeline().decide(view, req("vm", ISOLATED2), NOW)

    assert decision.claim is not None
    assert decision.claim.fit == expected
    assert len(decision.claim.fit.pins) == 2
    assert decision.claim.fit.cells[0].withheld  # the pinned cores' siblings stay idle
    assert decision.claim.amounts == {
        ResourceClass.PCPU: 4,
        ResourceClass.MEMORY_MB: 1024,
        ResourceClass.DISK_GB: 1,
    }


def test_an_anti_affinity_claim_takes_the_first_free_slot_of_its_domain() -> None:
    group = parse_group("g1", "web", "anti-affinity", {"max_server_per_host": 2})
    view = View()
    view.add_group(group)
    view.replace_host(host(1), HostGroups(Counter({"g1": 1}), [("g1", "host=h1", 0)]))
    view.replace_host(host(2), HostGroups())

    decisions = Pipeline().plan(
        view, [req(f"vm-{i}", group_id="g1", force_host="h1") for i in range(2)], NOW
    )

    first = decisions[0].claim
    assert first is not None
    assert first.slots == (GroupSlot("g1", "host=h1", 1, 2),)
    assert first.member_of == ("g1",)
    assert first.affinity_groups == ()
    assert decisions[1].claim is None
    assert decisions[1].diagnosis is not None
    assert "already holds 2 of at most 2 members" in decisions[1].diagnosis.explain()


def test_an_affinity_claim_asks_the_ledger_to_check_the_group() -> None:
    group = parse_group("g2", "db", "affinity")
    view = view_of([host(1), host(2)])
    view.add_group(group)

    decisions = Pipeline().plan(view, [req(f"vm-{i}", group_id="g2") for i in range(3)], NOW)

    claims = [d.claim for d in decisions if d.claim is not None]
    assert len(claims) == 3
    assert len({c.host_id for c in claims}) == 1
    assert {(c.affinity_groups, c.slots) for c in claims} == {(("g2",), ())}


def test_an_affinity_rejection_names_the_host_the_members_run_on() -> None:
    group = parse_group("g4", "db", "affinity")
    view = View()
    view.add_group(group)
    view.replace_host(host(1, disabled=True), HostGroups(Counter({"g4": 1})))
    view.replace_host(host(2), HostGroups())

    decision = Pipeline().decide(view, req("vm", group_id="g4"), NOW)

    assert decision.diagnosis is not None
    assert decision.diagnosis.sample["server_group"] == "affinity: members already run on h1"


def test_a_failure_domain_group_never_lands_on_a_host_without_the_label() -> None:
    group = parse_group("g3", "web", "anti-affinity", {"failure_domain": "rack"})
    view = view_of([host(1), host(2, labels={"rack": "r1"}), host(3, labels={"rack": "r1"})])
    view.add_group(group)

    decisions = Pipeline().plan(view, [req(f"vm-{i}", group_id="g3") for i in range(2)], NOW)

    first = decisions[0].claim
    assert first is not None
    assert first.host_id in {2, 3}
    assert first.slots == (GroupSlot("g3", "rack=r1", 0, 1),)
    assert decisions[1].claim is None
    assert decisions[1].diagnosis is not None
    assert decisions[1].diagnosis.rejected == {"failure_domain": 3}
