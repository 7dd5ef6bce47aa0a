"""Host topology: the uniform builder, CPU set syntax, and inventory capacity."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stowage.domain.errors import InvalidSpec
from stowage.domain.topology import (
    DEFAULT_ALLOCATION_RATIOS,
    Cell,
    HostSpec,
    HostTopology,
    ResourceClass,
    format_cpu_set,
    parse_cpu_set,
)

FAST = settings(max_examples=150, deadline=None)


# --- HostTopology.uniform ---------------------------------------------------------------


def test_uniform_numbers_siblings_the_linux_intel_way() -> None:
    topo = HostTopology.uniform(cells=2, cores_per_cell=4, threads_per_core=2)
    # 2 cells x 4 cores = 8 cores; thread t of core k in cell c is t*8 + c*4 + k.
    assert topo.core_of(0) == {0, 8}
    assert topo.core_of(8) == {0, 8}
    assert topo.core_of(5) == {5, 13}
    assert topo.siblings[0] == {8}
    assert topo.cells[0].cpus == {0, 1, 2, 3, 8, 9, 10, 11}
    assert topo.cells[1].cpus == {4, 5, 6, 7, 12, 13, 14, 15}
    assert topo.cores_by_cell[0] == (
        frozenset({0, 8}),
        frozenset({1, 9}),
        frozenset({2, 10}),
        frozenset({3, 11}),
    )
    assert topo.threads_per_core == 2


def test_uniform_dedicates_the_first_half_of_each_cells_cores_by_default() -> None:
    topo = HostTopology.uniform(cells=2, cores_per_cell=4, threads_per_core=2)
    assert topo.cpu_dedicated_set == {0, 1, 8, 9, 4, 5, 12, 13}
    assert topo.cpu_shared_set == {2, 3, 10, 11, 6, 7, 14, 15}


def test_uniform_dedicated_cores_per_cell_can_be_all_or_none() -> None:
    every = HostTopology.uniform(cells=1, cores_per_cell=3, dedicated_cores_per_cell=3)
    assert every.cpu_shared_set == frozenset()
    assert len(every.cpu_dedicated_set) == 6
    none = HostTopology.uniform(cells=1, cores_per_cell=3, dedicated_cores_per_cell=0)
    assert none.cpu_dedicated_set == frozenset()
    assert len(none.cpu_shared_set) == 6


def test_uniform_single_thread_host() -> None:
    topo = HostTopology.uniform(cells=1, cores_per_cell=4, threads_per_core=1)
    assert topo.threads_per_core == 1
    assert all(topo.core_of(cpu) == {cpu} for cpu in range(4))
    assert topo.cores_by_cell[0] == tuple(frozenset({i}) for i in range(4))


def test_uniform_memory_adds_up_over_cells() -> None:
    topo = HostTopology.uniform(cells=3, cores_per_cell=1, memory_mb_per_cell=1000)
    assert topo.memory_mb == 3000
    assert [c.memory_mb for c in topo.cells] == [1000, 1000, 1000]


@pytest.mark.parametrize(
    "kwargs", [{"cells": 0}, {"cores_per_cell": 0}, {"threads_per_core": 0}, {"cells": -1}]
)
def test_uniform_rejects_empty_hosts(kwargs: dict[str, int]) -> None:
    with pytest.raises(InvalidSpec, match="at least one cell, core and thread"):
        HostTopology.uniform(**kwargs)


@FAST
@given(
    cells=st.integers(1, 4),
    cores=st.integers(1, 8),
    threads=st.integers(1, 4),
    dedicated=st.integers(0, 8),
)
def test_uniform_is_a_consistent_layout(
    cells: int, cores: int, threads: int, dedicated: int
) -> None:
    topo = HostTopology.uniform(
        cells=cells,
        cores_per_cell=cores,
        threads_per_core=threads,
        dedicated_cores_per_cell=dedicated,
    )
    every = frozenset(range(cells * cores * threads))
    # Cells partition the CPUs, ids match positions.
    assert [c.id for c in topo.cells] == list(range(cells))
    assert frozenset().union(*(c.cpus for c in topo.cells)) == every
    assert sum(len(c.cpus) for c in topo.cells) == len(every)
    # Dedicated and shared partition the CPUs, whole cores at a time.
    assert topo.cpu_dedicated_set | topo.cpu_shared_set == every
    assert not topo.cpu_dedicated_set & topo.cpu_shared_set
    assert len(topo.cpu_dedicated_set) == cells * min(dedicated, cores) * threads
    assert topo.threads_per_core == threads
    for cell in topo.cells:
        cell_cores = topo.cores_by_cell[cell.id]
        assert len(cell_cores) == cores
        assert frozenset().union(*cell_cores) == cell.cpus
        for core in cell_cores:
            assert len(core) == threads
            assert core <= topo.cpu_dedicated_set or core <= topo.cpu_shared_set
            for cpu in core:
                assert topo.core_of(cpu) == core
                assert topo.cell_of(cpu) == cell.id


# --- HostTopology validation ------------------------------------------------------------


def _no_siblings(n: int) -> dict[int, frozenset[int]]:
    return {i: frozenset() for i in range(n)}


def test_topology_rejects_cells_that_share_cpus() -> None:
    with pytest.raises(InvalidSpec, match="cell 1 repeats CPUs"):
        HostTopology(
            (Cell(0, frozenset({0, 1}), 1), Cell(1, frozenset({1, 2}), 1)),
            _no_siblings(3),
            frozenset(),
            frozenset(),
        )


def test_topology_rejects_overlapping_cpu_sets_and_names_the_overlap() -> None:
    with pytest.raises(InvalidSpec, match="overlap on 1-2"):
        HostTopology(
            (Cell(0, frozenset(range(4)), 1),),
            _no_siblings(4),
            frozenset({0, 1, 2}),
            frozenset({1, 2, 3}),
        )


def test_topology_rejects_cpu_sets_naming_absent_cpus() -> None:
    with pytest.raises(InvalidSpec, match="does not have: 7-8"):
        HostTopology(
            (Cell(0, frozenset(range(4)), 1),),
            _no_siblings(4),
            frozenset({0, 7, 8}),
            frozenset(),
        )


def test_cell_of_an_absent_cpu_is_an_error() -> None:
    topo = HostTopology.uniform(cells=1, cores_per_cell=1, threads_per_core=1)
    with pytest.raises(InvalidSpec, match="CPU 5 is in no cell"):
        topo.cell_of(5)


def test_topology_cell_ids_need_not_be_positions() -> None:
    topo = HostTopology(
        (Cell(0, frozenset({0, 1}), 10), Cell(2, frozenset({2, 3}), 20)),
        {0: frozenset({1}), 1: frozenset({0}), 2: frozenset({3}), 3: frozenset({2})},
        frozenset({0, 1, 2, 3}),
        frozenset(),
    )
    assert topo.cell_of(3) == 2
    assert topo.cores_by_cell[2] == (frozenset({2, 3}),)
    assert topo.memory_mb == 30


def test_topology_without_siblings_has_one_thread_per_core() -> None:
    topo = HostTopology((Cell(0, frozenset({0}), 1),), {}, frozenset({0}), frozenset())
    assert topo.threads_per_core == 1
    assert topo.core_of(0) == {0}


# --- parse_cpu_set / format_cpu_set -----------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", set()),
        ("0", {0}),
        ("0-3", {0, 1, 2, 3}),
        ("0-3,8", {0, 1, 2, 3, 8}),
        ("0-3,8,^2", {0, 1, 3, 8}),
        ("0-3,^1-2", {0, 3}),
        (" 1 , 4 - 5 ,, ", {1, 4, 5}),
        ("^ 2, 0-3", {0, 1, 3}),
        ("5-5", {5}),
        ("0-3,^0-3", set()),
    ],
)
def test_parse_cpu_set_examples(text: str, expected: set[int]) -> None:
    assert parse_cpu_set(text) == expected


def test_parse_cpu_set_exclusions_only_are_taken_from_the_universe() -> None:
    assert parse_cpu_set("^0-1", universe=frozenset(range(4))) == {2, 3}
    assert parse_cpu_set("^9", universe=frozenset(range(2))) == {0, 1}


def test_parse_cpu_set_exclusions_only_without_universe_is_an_error() -> None:
    with pytest.raises(InvalidSpec, match="my_key: '\\^0-1' only excludes CPUs"):
        parse_cpu_set("^0-1", what="my_key")


@pytest.mark.parametrize("bad", ["a", "1-", "-1", "3-1", "1-2-3", "^", "1.5", "0x2", "1,,x"])
def test_parse_cpu_set_rejects_malformed_parts_naming_the_key(bad: str) -> None:
    with pytest.raises(InvalidSpec) as err:
        parse_cpu_set(bad, what="hw:some_key")
    assert "hw:some_key" in str(err.value)
    assert err.value.code == "spec.invalid"


@pytest.mark.parametrize(
    ("cpus", "text"),
    [
        (set(), ""),
        ({0}, "0"),
        ({0, 1}, "0-1"),
        ({0, 1, 2, 3, 8}, "0-3,8"),
        ({5, 1, 3}, "1,3,5"),
        ({9, 10, 11, 2}, "2,9-11"),
    ],
)
def test_format_cpu_set_collapses_ranges(cpus: set[int], text: str) -> None:
    assert format_cpu_set(cpus) == text
    assert format_cpu_set(frozenset(cpus)) == text


@FAST
@given(st.frozensets(st.integers(0, 200), max_size=40))
def test_format_then_parse_round_trips(cpus: frozenset[int]) -> None:
    text = format_cpu_set(cpus)
    assert parse_cpu_set(text) == cpus
    # Canonical: formatting is stable and never repeats a CPU.
    assert format_cpu_set(parse_cpu_set(text)) == text
    assert " " not in text


@FAST
@given(
    include=st.frozensets(st.integers(0, 60), max_size=20),
    exclude=st.frozensets(st.integers(0, 60), max_size=20),
)
def test_parse_of_include_and_exclude_is_set_difference(
    include: frozenset[int], exclude: frozenset[int]
) -> None:
    parts = [format_cpu_set(include)] if include else []
    parts += [f"^{cpu}" for cpu in sorted(exclude)]
    universe = frozenset(range(61))
    expected = (include or universe) - exclude if exclude else include
    assert parse_cpu_set(",".join(parts), universe=universe) == expected


# --- HostSpec ---------------------------------------------------------------------------


def test_host_spec_totals_come_from_the_topology() -> None:
    topo = HostTopology.uniform(cells=2, cores_per_cell=4, threads_per_core=2)
    spec = HostSpec("h1", topo, disk_gb=500)
    assert spec.totals() == {
        ResourceClass.VCPU: 8,
        ResourceClass.PCPU: 8,
        ResourceClass.MEMORY_MB: 2 * 65536,
        ResourceClass.DISK_GB: 500,
    }


def test_host_spec_capacity_uses_default_ratios() -> None:
    topo = HostTopology.uniform(cells=1, cores_per_cell=4, threads_per_core=2)
    spec = HostSpec("h1", topo, disk_gb=100)
    assert spec.capacity(ResourceClass.VCPU) == 4 * 4  # shared CPUs x 4.0
    assert spec.capacity(ResourceClass.PCPU) == 4  # never overcommitted
    assert spec.capacity(ResourceClass.MEMORY_MB) == 65536
    assert spec.capacity(ResourceClass.DISK_GB) == 100


def test_host_spec_capacity_is_total_less_reserved_times_ratio() -> None:
    topo = HostTopology.uniform(
        cells=1, cores_per_cell=8, threads_per_core=2, memory_mb_per_cell=4096
    )
    spec = HostSpec(
        "h1",
        topo,
        disk_gb=100,
        reserved={ResourceClass.VCPU: 2, ResourceClass.MEMORY_MB: 512},
        allocation_ratios={ResourceClass.VCPU: 2.0, ResourceClass.MEMORY_MB: 1.5},
    )
    assert spec.capacity(ResourceClass.VCPU) == (8 - 2) * 2
    assert spec.capacity(ResourceClass.MEMORY_MB) == int((4096 - 512) * 1.5)
    # A ratio not given falls back to the default for that class.
    assert spec.capacity(ResourceClass.PCPU) == 8
    assert spec.capacity(ResourceClass.DISK_GB) == 100


def test_host_spec_default_ratios_are_not_shared_between_hosts() -> None:
    topo = HostTopology.uniform(cells=1, cores_per_cell=2)
    a, b = HostSpec("a", topo), HostSpec("b", topo)
    assert a.allocation_ratios == DEFAULT_ALLOCATION_RATIOS
    assert a.allocation_ratios is not b.allocation_ratios
    assert a.allocation_ratios is not DEFAULT_ALLOCATION_RATIOS


@FAST
@given(
    cores=st.integers(1, 8),
    threads=st.integers(1, 2),
    dedicated=st.integers(0, 8),
    disk=st.integers(0, 10_000),
    rc=st.sampled_from(list(ResourceClass)),
    reserved=st.integers(0, 16),
    ratio=st.sampled_from([0.5, 1.0, 1.5, 2.0, 4.0, 16.0]),
)
def test_host_spec_capacity_matches_the_placement_formula(
    *,
    cores: int,
    threads: int,
    dedicated: int,
    disk: int,
    rc: ResourceClass,
    reserved: int,
    ratio: float,
) -> None:
    topo = HostTopology.uniform(
        cells=2,
        cores_per_cell=cores,
        threads_per_core=threads,
        dedicated_cores_per_cell=dedicated,
        memory_mb_per_cell=1024,
    )
    total = HostSpec("h", topo, disk_gb=disk).totals()[rc]
    reserved = min(reserved, total)  # placement refuses reserved > total on an inventory
    spec = HostSpec("h", topo, disk_gb=disk, reserved={rc: reserved}, allocation_ratios={rc: ratio})
    assert spec.totals()[rc] == total
    assert spec.capacity(rc) == math.floor((total - reserved) * ratio)
    assert spec.totals()[ResourceClass.VCPU] + spec.totals()[ResourceClass.PCPU] == (
        2 * cores * threads
    )
