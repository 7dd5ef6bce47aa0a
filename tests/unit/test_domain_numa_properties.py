"""NUMA fitting properties: no pCPU is handed out twice, policies hold, and fitting is complete.

Each property runs random uniform hosts against random flavors. An independent oracle
(`_oracle_fits`) says, cell by cell, whether an arrangement exists; the fitter must find
one exactly when it does, so a fitter that gives up too early fails as surely as one that
over-commits.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from stowage.domain.flavor import (
    CpuPolicy,
    Flavor,
    GuestCell,
    InstanceShape,
    ThreadPolicy,
    shape_of,
)
from stowage.domain.numa import NO_NUMA, Fit, HostFree, NoFit, apply_fit, fit_instance
from stowage.domain.topology import Cell, HostTopology, format_cpu_set

PROPERTY = settings(max_examples=200, deadline=None)


# --- strategies -------------------------------------------------------------------------


@st.composite
def topologies(draw: st.DrawFn) -> HostTopology:
    cores = draw(st.integers(1, 8))
    return HostTopology.uniform(
        cells=draw(st.one_of(st.integers(2, 4), st.integers(1, 4))),
        cores_per_cell=cores,
        threads_per_core=draw(st.integers(1, 2)),
        dedicated_cores_per_cell=draw(
            st.one_of(st.just(cores - cores // 4), st.integers(0, cores))
        ),
        memory_mb_per_cell=draw(st.sampled_from([1024, 4096, 8192, 16384])),
    )


@st.composite
def flavors(draw: st.DrawFn, thread: ThreadPolicy | None = None) -> Flavor:
    """A valid flavor: shared, dedicated or mixed, any thread policy, 1-2 guest NUMA cells.

    With `thread` given, the flavor is pinned (dedicated or mixed) with that thread policy.
    """
    pinned = [CpuPolicy.DEDICATED, CpuPolicy.DEDICATED, CpuPolicy.MIXED]
    policy = draw(st.sampled_from(pinned if thread else [*pinned, CpuPolicy.SHARED]))
    nodes = draw(st.sampled_from([None, 1, 2]))
    low = 2 if policy is CpuPolicy.MIXED or nodes == 2 else 1
    vcpus = draw(st.one_of(st.integers(low, 3), st.integers(low, 8)))  # small ones fit more
    specs: dict[str, str] = {"hw:cpu_policy": policy.value}
    if policy is not CpuPolicy.SHARED:
        thread = thread or draw(st.sampled_from([None, *ThreadPolicy]))
        if thread is not None:
            specs["hw:cpu_thread_policy"] = thread.value
    if policy is CpuPolicy.MIXED:
        mask = draw(st.frozensets(st.integers(0, vcpus - 1), min_size=1, max_size=vcpus - 1))
        specs["hw:cpu_dedicated_mask"] = format_cpu_set(mask)
    mems = [draw(st.sampled_from([256, 512, 1024, 2048])) for _ in range(nodes or 1)]
    if nodes is not None:
        specs["hw:numa_nodes"] = str(nodes)
    if nodes == 2 and (vcpus % 2 or mems[0] != mems[1] or draw(st.booleans())):
        first = draw(st.frozensets(st.integers(0, vcpus - 1), min_size=1, max_size=vcpus - 1))
        specs["hw:numa_cpus.0"] = format_cpu_set(first)
        specs["hw:numa_cpus.1"] = format_cpu_set(frozenset(range(vcpus)) - first)
        specs["hw:numa_mem.0"], specs["hw:numa_mem.1"] = str(mems[0]), str(mems[1])
    return Flavor("f", vcpus, sum(mems), extra_specs=specs)


@st.composite
def free_pools(draw: st.DrawFn, topo: HostTopology) -> HostFree:
    """Any free state, not only those reachable by claims: fragmented sibling sets too."""
    dedicated = sorted(topo.cpu_dedicated_set)
    if not dedicated:
        return HostFree(frozenset(), {c.id: draw(st.integers(0, c.memory_mb)) for c in topo.cells})
    cores = sorted({topo.core_of(cpu) for cpu in dedicated}, key=min)
    style = draw(st.sampled_from(["free", "taken", "cores"]))
    if style == "cores":
        # Whole cores taken, then a few single threads: many whole cores and some halves.
        taken_cores = draw(st.sets(st.sampled_from(cores)))
        singles = draw(st.sets(st.sampled_from(dedicated), max_size=3))
        cpus = set(dedicated) - set().union(*taken_cores) - singles
    else:
        picked = draw(st.sets(st.sampled_from(dedicated)))
        cpus = picked if style == "free" else set(dedicated) - picked
    memory = {
        c.id: draw(st.one_of(st.just(c.memory_mb), st.integers(0, c.memory_mb))) for c in topo.cells
    }
    return HostFree(frozenset(cpus), memory)


def all_free(topo: HostTopology) -> HostFree:
    return HostFree(topo.cpu_dedicated_set, {c.id: c.memory_mb for c in topo.cells})


# --- the oracle: whether an arrangement exists, computed without the fitter -------------


def _cores(topo: HostTopology, cell: Cell) -> set[frozenset[int]]:
    return {topo.core_of(cpu) for cpu in cell.cpus}


def _cell_can_take(
    shape: InstanceShape, topo: HostTopology, free: HostFree, guest: GuestCell, cell: Cell
) -> bool:
    if free.cell_memory_mb.get(cell.id, 0) < guest.memory_mb:
        return False
    if len(guest.shared) > len(cell.cpus & topo.cpu_shared_set):
        return False
    need = len(guest.dedicated)
    if not need:
        return True
    whole = sum(1 for core in _cores(topo, cell) if core <= free.cpus)
    if shape.thread_policy is ThreadPolicy.PREFER:
        return len(cell.cpus & free.cpus) >= need
    if shape.thread_policy is ThreadPolicy.ISOLATE:
        return whole >= need
    return topo.threads_per_core >= 2 and whole * topo.threads_per_core >= need


def _oracle_fits(shape: InstanceShape, topo: HostTopology, free: HostFree) -> bool:
    return any(
        all(
            _cell_can_take(shape, topo, free, guest, cell)
            for guest, cell in zip(shape.cells, arrangement, strict=True)
        )
        for arrangement in itertools.permutations(topo.cells, len(shape.cells))
    )


# --- what every fit must satisfy --------------------------------------------------------


def check_fit(shape: InstanceShape, topo: HostTopology, free: HostFree, fit: Fit) -> None:
    """Assert every invariant of one fit against the free state it was made from."""
    cells_by_id = {c.id: c for c in topo.cells}
    guests = {g.id: g for g in shape.cells}
    # Each guest cell placed exactly once, each on a distinct host cell.
    assert sorted(c.guest_cell for c in fit.cells) == sorted(guests)
    hosts = [c.host_cell for c in fit.cells]
    assert len(set(hosts)) == len(hosts)
    # The pins map exactly the dedicated vCPUs, each to its own pCPU.
    assert set(fit.pins) == shape.dedicated_vcpus
    assert sum(len(c.pins) for c in fit.cells) == len(shape.dedicated_vcpus)
    assert len(set(fit.pins.values())) == len(shape.dedicated_vcpus)
    seen: set[int] = set()
    for cell_fit in fit.cells:
        guest = guests[cell_fit.guest_cell]
        host = cells_by_id[cell_fit.host_cell]
        pcpus = set(cell_fit.pins.values())
        assert set(cell_fit.pins) == guest.dedicated
        assert cell_fit.memory_mb == guest.memory_mb
        assert cell_fit.memory_mb <= free.cell_memory_mb[host.id]
        # Only free dedicated pCPUs of the named host cell, none twice.
        assert pcpus <= topo.cpu_dedicated_set
        assert cell_fit.withheld <= topo.cpu_dedicated_set
        assert pcpus | cell_fit.withheld <= host.cpus
        assert pcpus | cell_fit.withheld <= free.cpus
        assert not pcpus & cell_fit.withheld
        assert not cell_fit.cpus & seen
        seen |= cell_fit.cpus
        _check_thread_policy(shape.thread_policy, topo, free, pcpus, cell_fit.withheld)
        # Shared vCPUs of a mixed cell need room in the same host cell's shared set.
        assert len(guest.shared) <= len(host.cpus & topo.cpu_shared_set)
    assert fit.cpus == seen


def _check_thread_policy(
    policy: ThreadPolicy,
    topo: HostTopology,
    free: HostFree,
    pcpus: set[int],
    withheld: frozenset[int],
) -> None:
    cores = {topo.core_of(p) for p in pcpus}
    if policy is ThreadPolicy.PREFER:
        assert withheld == frozenset()
    elif policy is ThreadPolicy.ISOLATE:
        # One pin per core, each core wholly free, the other threads withheld, nothing else.
        assert len(cores) == len(pcpus)
        assert all(core <= free.cpus for core in cores)
        assert withheld == frozenset().union(*cores) - pcpus
    else:
        threads = topo.threads_per_core
        assert threads >= 2
        assert withheld == frozenset()
        assert all(core <= free.cpus for core in cores)
        # Pins fill whole cores: as few cores as possible, at most one of them part-used.
        assert len(cores) == -(-len(pcpus) // threads)
        assert sum(1 for core in cores if not core <= pcpus) <= 1
        if len(pcpus) % threads == 0:
            assert pcpus == frozenset().union(*cores)


# --- properties -------------------------------------------------------------------------


@PROPERTY
@given(topo=topologies(), batch=st.lists(flavors(), min_size=1, max_size=12))
def test_claims_in_sequence_never_share_a_pcpu(topo: HostTopology, batch: list[Flavor]) -> None:
    free = all_free(topo)
    taken: set[int] = set()
    memory_used: Counter[int] = Counter()
    placed = 0
    for flavor in batch:
        shape = shape_of(flavor)
        result = fit_instance(shape, topo, free)
        assert isinstance(result, Fit) == _oracle_fits(shape, topo, free), result
        if isinstance(result, NoFit):
            assert result.reason
            if shape.thread_policy is ThreadPolicy.REQUIRE and topo.threads_per_core == 1:
                event("require refused on a host without SMT")
            continue
        if not shape.cells:
            assert result == NO_NUMA
            continue
        check_fit(shape, topo, free, result)
        # Never handed out twice, across every instance placed so far.
        assert not result.cpus & taken
        taken |= result.cpus
        for cell_fit in result.cells:
            memory_used[cell_fit.host_cell] += cell_fit.memory_mb
        before = free
        free = apply_fit(free, result)
        assert free.cpus == before.cpus - result.cpus
        assert free.cpus == topo.cpu_dedicated_set - taken
        for cell in topo.cells:
            assert free.cell_memory_mb[cell.id] == cell.memory_mb - memory_used[cell.id]
            assert free.cell_memory_mb[cell.id] >= 0
        placed += 1
    event(f"placed {min(placed, 3)}{'+' if placed >= 3 else ''} NUMA instances")


@pytest.mark.parametrize("thread", [None, *ThreadPolicy])
@settings(max_examples=100, deadline=None)
@given(topo=topologies(), data=st.data())
def test_fit_agrees_with_the_oracle_on_any_free_pool(
    thread: ThreadPolicy | None, topo: HostTopology, data: st.DataObject
) -> None:
    free = data.draw(free_pools(topo))
    shape = shape_of(data.draw(flavors(thread=thread)))
    result = fit_instance(shape, topo, free)
    expected = _oracle_fits(shape, topo, free) if shape.cells else True
    assert isinstance(result, Fit) == expected, result
    if isinstance(result, Fit) and shape.cells:
        check_fit(shape, topo, free, result)
        event(f"fit {shape.thread_policy.value}")
    elif isinstance(result, NoFit):
        assert result.reason
        event(f"no fit {shape.thread_policy.value}")


@PROPERTY
@given(topo=topologies(), data=st.data())
def test_a_single_cell_prefer_request_fits_wherever_a_cell_has_room(
    topo: HostTopology, data: st.DataObject
) -> None:
    free = data.draw(free_pools(topo))
    count = data.draw(st.integers(1, 16))
    memory_mb = data.draw(st.sampled_from([1, 256, 1024, 4096]))
    shape = shape_of(
        Flavor(
            "p",
            count,
            memory_mb,
            extra_specs={"hw:cpu_policy": "dedicated", "hw:cpu_thread_policy": "prefer"},
        )
    )
    roomy = [
        c.id
        for c in topo.cells
        if len(c.cpus & free.cpus) >= count and free.cell_memory_mb[c.id] >= memory_mb
    ]
    result = fit_instance(shape, topo, free)
    if roomy:
        assert isinstance(result, Fit), (roomy, result)
        # Host cells are tried in id order: the first roomy cell is taken.
        assert result.cells[0].host_cell == roomy[0]
        check_fit(shape, topo, free, result)
        event("roomy")
    else:
        assert isinstance(result, NoFit)
        largest = max(len(c.cpus & free.cpus) for c in topo.cells)
        if all(free.cell_memory_mb[c.id] >= memory_mb for c in topo.cells):
            # Memory is no excuse anywhere, so the reason must be the CPUs.
            assert f"need {count} dedicated CPUs on one NUMA cell" in result.reason
            assert result.reason.endswith(f"largest free is {largest}")


@settings(max_examples=100, deadline=None)
@given(topo=topologies(), data=st.data())
def test_fit_is_deterministic(topo: HostTopology, data: st.DataObject) -> None:
    free = data.draw(free_pools(topo))
    flavor = data.draw(flavors())
    other = data.draw(flavors())
    first = fit_instance(shape_of(flavor), topo, free)
    # No hidden state: fitting something else in between changes nothing.
    fit_instance(shape_of(other), topo, free)
    assert fit_instance(shape_of(flavor), topo, free) == first
    # Equal inputs built afresh (another topology object, memory listed in reverse) agree.
    twin_topo = HostTopology(
        tuple(topo.cells), dict(topo.siblings), topo.cpu_dedicated_set, topo.cpu_shared_set
    )
    twin_free = HostFree(
        frozenset(sorted(free.cpus, reverse=True)),
        dict(reversed(list(free.cell_memory_mb.items()))),
    )
    assert fit_instance(shape_of(flavor), twin_topo, twin_free) == first


@PROPERTY
@given(
    cells=st.integers(1, 4),
    cores=st.integers(1, 8),
    flavor=flavors(thread=ThreadPolicy.REQUIRE),
)
def test_require_never_fits_a_host_without_smt(cells: int, cores: int, flavor: Flavor) -> None:
    topo = HostTopology.uniform(
        cells=cells,
        cores_per_cell=cores,
        threads_per_core=1,
        dedicated_cores_per_cell=cores,
        memory_mb_per_cell=16384,
    )
    shape = shape_of(flavor)
    assert shape.thread_policy is ThreadPolicy.REQUIRE
    reason = fit_instance(shape, topo, all_free(topo))
    assert isinstance(reason, NoFit)
    if len(shape.cells) <= cells:
        assert reason.reason == "thread policy require needs SMT, host has one thread per core"
