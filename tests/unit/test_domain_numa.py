"""NUMA fitting by example: exact pCPUs per thread policy, and readable NoFit reasons."""

from __future__ import annotations

import pytest

from stowage.domain.flavor import Flavor, InstanceShape, shape_of
from stowage.domain.numa import NO_NUMA, CellFit, Fit, HostFree, NoFit, apply_fit, fit_instance
from stowage.domain.topology import Cell, HostTopology


def all_free(topo: HostTopology) -> HostFree:
    return HostFree(topo.cpu_dedicated_set, {c.id: c.memory_mb for c in topo.cells})


def pinned(vcpus: int, memory_mb: int = 1024, **extra: str) -> InstanceShape:
    """A dedicated shape; extra specs as keywords, `hw_x` standing for `hw:x`."""
    specs = {"hw:cpu_policy": "dedicated"}
    specs.update(
        {k.replace("_", ":", 1) if k.startswith("hw_") else k: v for k, v in extra.items()}
    )
    return shape_of(Flavor("f", vcpus, memory_mb, extra_specs=specs))


def shape(vcpus: int, memory_mb: int, specs: dict[str, str]) -> InstanceShape:
    return shape_of(Flavor("f", vcpus, memory_mb, extra_specs=specs))


def must_fit(result: Fit | NoFit) -> Fit:
    assert isinstance(result, Fit), result
    return result


def must_not_fit(result: Fit | NoFit) -> str:
    assert isinstance(result, NoFit), result
    return result.reason


# 2 cells x 4 cores x 2 threads; dedicated cores 0-1 of each cell:
#   cell 0 cores {0,8} {1,9} | shared {2,10} {3,11}
#   cell 1 cores {4,12} {5,13} | shared {6,14} {7,15}
SMT = HostTopology.uniform(cells=2, cores_per_cell=4, threads_per_core=2, memory_mb_per_cell=4096)
# Same without SMT: cell 0 dedicated {0,1}, cell 1 dedicated {4,5}.
NO_SMT = HostTopology.uniform(
    cells=2, cores_per_cell=4, threads_per_core=1, memory_mb_per_cell=4096
)


# --- instances without NUMA constraints --------------------------------------------------


def test_shared_instance_without_numa_needs_no_cells() -> None:
    s = shape(4, 1024, {})
    assert fit_instance(s, SMT, all_free(SMT)) == NO_NUMA
    assert NO_NUMA.cpus == frozenset()
    assert NO_NUMA.pins == {}


def test_apply_fit_of_no_numa_changes_nothing() -> None:
    free = all_free(SMT)
    assert apply_fit(free, NO_NUMA) is free


# --- prefer -----------------------------------------------------------------------------


def test_prefer_packs_guest_threads_onto_sibling_pairs() -> None:
    fit = must_fit(fit_instance(pinned(2), SMT, all_free(SMT)))
    (cell,) = fit.cells
    assert cell.host_cell == 0
    assert cell.guest_cell == 0
    assert cell.memory_mb == 1024
    assert dict(cell.pins) == {0: 0, 1: 8}  # one whole core: siblings
    assert cell.withheld == frozenset()
    assert fit.cpus == {0, 8}
    assert fit.pins == {0: 0, 1: 8}


def test_prefer_takes_the_tightest_core_for_an_odd_remainder() -> None:
    # Core {0,8} half used: a single vCPU should go to its free sibling, not split {1,9}.
    free = HostFree(SMT.cpu_dedicated_set - {0}, {0: 4096, 1: 4096})
    fit = must_fit(fit_instance(pinned(1), SMT, free))
    assert fit.pins == {0: 8}


def test_prefer_uses_the_whole_cell_when_asked() -> None:
    fit = must_fit(fit_instance(pinned(4), SMT, all_free(SMT)))
    assert fit.cpus == {0, 1, 8, 9}


def test_prefer_moves_to_the_next_cell_when_the_first_is_full() -> None:
    free = HostFree(SMT.cpu_dedicated_set - {0, 1, 8}, {0: 4096, 1: 4096})
    fit = must_fit(fit_instance(pinned(2), SMT, free))
    assert fit.cells[0].host_cell == 1
    assert fit.cpus == {4, 12}


def test_prefer_on_a_host_without_smt() -> None:
    fit = must_fit(fit_instance(pinned(2), NO_SMT, all_free(NO_SMT)))
    assert fit.cpus == {0, 1}


# --- isolate ----------------------------------------------------------------------------


def test_isolate_takes_one_thread_per_core_and_withholds_the_siblings() -> None:
    s = pinned(2, hw_cpu_thread_policy="isolate")
    fit = must_fit(fit_instance(s, SMT, all_free(SMT)))
    (cell,) = fit.cells
    assert dict(cell.pins) == {0: 0, 1: 1}
    assert cell.withheld == {8, 9}
    assert fit.cpus == {0, 1, 8, 9}
    after = apply_fit(all_free(SMT), fit)
    assert after.cpus == {4, 5, 12, 13}


def test_isolate_needs_whole_free_cores() -> None:
    # Cell 0 has 3 free CPUs but only one whole core; cell 1 is full.
    free = HostFree(frozenset({0, 8, 1}), {0: 4096, 1: 4096})
    s = pinned(2, hw_cpu_thread_policy="isolate")
    reason = must_not_fit(fit_instance(s, SMT, free))
    assert reason == (
        "need 2 whole free cores (isolate) on one NUMA cell, largest free is 1 whole cores"
    )


def test_isolate_on_a_host_without_smt_withholds_nothing() -> None:
    s = pinned(2, hw_cpu_thread_policy="isolate")
    fit = must_fit(fit_instance(s, NO_SMT, all_free(NO_SMT)))
    assert fit.cells[0].withheld == frozenset()
    assert fit.cpus == {0, 1}


# --- require ----------------------------------------------------------------------------


def test_require_fills_sibling_pairs() -> None:
    s = pinned(4, hw_cpu_thread_policy="require")
    fit = must_fit(fit_instance(s, SMT, all_free(SMT)))
    assert fit.cpus == {0, 8, 1, 9}
    assert fit.cells[0].withheld == frozenset()


def test_require_refuses_a_host_without_smt() -> None:
    s = pinned(2, hw_cpu_thread_policy="require")
    reason = must_not_fit(fit_instance(s, NO_SMT, all_free(NO_SMT)))
    assert reason == "thread policy require needs SMT, host has one thread per core"


def test_require_refuses_half_free_cores() -> None:
    free = HostFree(frozenset({0, 1, 4, 5}), {0: 4096, 1: 4096})  # no whole core anywhere
    s = pinned(2, hw_cpu_thread_policy="require")
    reason = must_not_fit(fit_instance(s, SMT, free))
    assert reason == (
        "need 1 whole free cores (require) on one NUMA cell, largest free is 0 whole cores"
    )


# --- mixed ------------------------------------------------------------------------------


def test_mixed_pins_only_the_masked_vcpus() -> None:
    s = shape(4, 1024, {"hw:cpu_policy": "mixed", "hw:cpu_dedicated_mask": "1,3"})
    fit = must_fit(fit_instance(s, SMT, all_free(SMT)))
    assert set(fit.pins) == {1, 3}
    assert fit.cpus == {0, 8}


def test_mixed_needs_enough_shared_cpus_in_the_cell() -> None:
    topo = HostTopology.uniform(
        cells=1, cores_per_cell=2, threads_per_core=1, dedicated_cores_per_cell=1
    )
    s = shape(3, 512, {"hw:cpu_policy": "mixed", "hw:cpu_dedicated_mask": "0"})
    reason = must_not_fit(fit_instance(s, topo, all_free(topo)))
    assert reason == "need 2 shared CPUs on one NUMA cell, cell 0 has 1"


# --- several guest cells ----------------------------------------------------------------


def test_two_guest_cells_go_to_two_host_cells() -> None:
    s = pinned(4, 2048, hw_numa_nodes="2")
    fit = must_fit(fit_instance(s, SMT, all_free(SMT)))
    assert [(c.guest_cell, c.host_cell) for c in fit.cells] == [(0, 0), (1, 1)]
    assert fit.pins == {0: 0, 1: 8, 2: 4, 3: 12}
    after = apply_fit(all_free(SMT), fit)
    assert after.cell_memory_mb == {0: 3072, 1: 3072}


def test_guest_cells_backtrack_to_find_an_arrangement() -> None:
    # Guest cell 0 fits host cell 0 first, but then guest cell 1 (2048 MB) cannot go to
    # host cell 1 (1024 MB free); the fitter must back up and swap them.
    s = shape(
        4,
        3072,
        {
            "hw:cpu_policy": "dedicated",
            "hw:numa_nodes": "2",
            "hw:numa_cpus.0": "0-2",
            "hw:numa_cpus.1": "3",
            "hw:numa_mem.0": "1024",
            "hw:numa_mem.1": "2048",
        },
    )
    free = HostFree(SMT.cpu_dedicated_set, {0: 4096, 1: 1024})
    fit = must_fit(fit_instance(s, SMT, free))
    assert [(c.guest_cell, c.host_cell) for c in fit.cells] == [(0, 1), (1, 0)]


def test_more_guest_cells_than_host_cells() -> None:
    s = pinned(4, 2048, hw_numa_nodes="2")
    one_cell = HostTopology.uniform(cells=1, cores_per_cell=8)
    assert must_not_fit(fit_instance(s, one_cell, all_free(one_cell))) == (
        "need 2 NUMA cells, host has 1"
    )


def test_shared_numa_instance_claims_memory_but_no_cpus() -> None:
    s = shape(4, 2048, {"hw:numa_nodes": "2"})
    fit = must_fit(fit_instance(s, SMT, all_free(SMT)))
    assert fit.cpus == frozenset()
    assert [c.memory_mb for c in fit.cells] == [1024, 1024]
    after = apply_fit(all_free(SMT), fit)
    assert after.cpus == SMT.cpu_dedicated_set
    assert after.cell_memory_mb == {0: 3072, 1: 3072}


# --- NoFit reasons read like an operator message -----------------------------------------


def test_reason_for_too_few_dedicated_cpus_names_need_and_largest_free() -> None:
    free = HostFree(frozenset({0, 8, 4}), {0: 4096, 1: 4096})
    reason = must_not_fit(fit_instance(pinned(4), SMT, free))
    assert reason == "need 4 dedicated CPUs on one NUMA cell, largest free is 2"


def test_reason_for_too_little_memory() -> None:
    free = HostFree(SMT.cpu_dedicated_set, {0: 512, 1: 1000})
    reason = must_not_fit(fit_instance(pinned(2, 2048), SMT, free))
    assert reason == "need 2048 MB on one NUMA cell, largest free is 1000 MB"


def test_reason_when_everything_is_pinned() -> None:
    free = HostFree(frozenset(), {0: 4096, 1: 4096})
    reason = must_not_fit(fit_instance(pinned(1), SMT, free))
    assert reason == "need 1 dedicated CPUs on one NUMA cell, largest free is 0"


def test_reason_on_a_host_without_dedicated_cpus() -> None:
    topo = HostTopology.uniform(cells=1, cores_per_cell=4, dedicated_cores_per_cell=0)
    reason = must_not_fit(fit_instance(pinned(1), topo, all_free(topo)))
    assert "need 1 dedicated CPUs" in reason
    assert "largest free is 0" in reason


# --- apply_fit --------------------------------------------------------------------------


def test_apply_fit_removes_pins_and_withheld_and_memory() -> None:
    free = all_free(SMT)
    fit = Fit(
        (
            CellFit(0, 1, 1000, {0: 4}, frozenset({12})),
            CellFit(1, 0, 24, {1: 0}, frozenset()),
        )
    )
    after = apply_fit(free, fit)
    assert after.cpus == SMT.cpu_dedicated_set - {0, 4, 12}
    assert after.cell_memory_mb == {0: 4072, 1: 3096}
    assert free.cpus == SMT.cpu_dedicated_set  # the input is left alone
    assert free.cell_memory_mb == {0: 4096, 1: 4096}


def test_free_cpus_per_cell_follow_the_state_and_the_topology_asked_about() -> None:
    free = all_free(SMT)
    assert free.cell_cpus_free(SMT) == (4, 4)  # cores {0,8} {1,9} | {4,12} {5,13}
    after = apply_fit(free, must_fit(fit_instance(pinned(3), SMT, free)))
    assert after.cell_cpus_free(SMT) == (1, 4)  # a new state counts again
    assert free.cell_cpus_free(SMT) == (4, 4)  # the old one keeps its own count
    # The count is kept per topology: another topology's cells are counted anew.
    assert free.cell_cpus_free(NO_SMT) == (2, 2)  # {0, 1} and {4, 5} of the SMT set
    assert free == all_free(SMT)  # the kept count is not part of the state's value


def test_filling_a_host_then_one_more_does_not_fit() -> None:
    free = all_free(SMT)
    for _ in range(4):
        fit = must_fit(fit_instance(pinned(2, 512), SMT, free))
        free = apply_fit(free, fit)
    assert free.cpus == frozenset()
    assert must_not_fit(fit_instance(pinned(1, 512), SMT, free)).startswith("need 1 dedicated CPUs")


# --- topologies whose cell ids are not positions ----------------------------------------


def _paired(cpus: range) -> dict[int, frozenset[int]]:
    out: dict[int, frozenset[int]] = {}
    for a in cpus[::2]:
        out[a], out[a + 1] = frozenset({a + 1}), frozenset({a})
    return out


def test_cell_ids_that_skip_a_number() -> None:
    # NUMA nodes 0 and 2 (node 1 offline): each has 2 shared and 2 dedicated CPUs.
    topo = HostTopology(
        (Cell(0, frozenset(range(4)), 1024), Cell(2, frozenset(range(4, 8)), 1024)),
        _paired(range(8)),
        frozenset({0, 1, 4, 5}),
        frozenset({2, 3, 6, 7}),
    )
    s = shape(
        4,
        1024,
        {"hw:cpu_policy": "mixed", "hw:cpu_dedicated_mask": "0,2", "hw:numa_nodes": "2"},
    )
    fit = must_fit(fit_instance(s, topo, all_free(topo)))
    assert [c.host_cell for c in fit.cells] == [0, 2]
    assert apply_fit(all_free(topo), fit).cell_memory_mb == {0: 512, 2: 512}


def test_cell_ids_in_reverse_order_check_the_right_cells_shared_cpus() -> None:
    # Cell id 1 comes first and has no shared CPUs; cell id 0 has two.
    topo = HostTopology(
        (Cell(1, frozenset(range(4)), 1024), Cell(0, frozenset(range(4, 8)), 1024)),
        _paired(range(8)),
        frozenset({0, 1, 2, 3}),
        frozenset({6, 7}),
    )
    s = shape(2, 512, {"hw:numa_nodes": "1"})
    fit = must_fit(fit_instance(s, topo, all_free(topo)))
    assert fit.cells[0].host_cell == 0


def test_memory_only_cell_does_not_break_require() -> None:
    # A CPU-less NUMA node (HBM, CXL memory) next to a normal SMT cell.
    topo = HostTopology(
        (Cell(0, frozenset(), 8192), Cell(1, frozenset(range(4)), 1024)),
        _paired(range(4)),
        frozenset(range(4)),
        frozenset(),
    )
    s = pinned(2, 512, hw_cpu_thread_policy="require")
    fit = must_fit(fit_instance(s, topo, all_free(topo)))
    assert fit.cells[0].host_cell == 1
    assert fit.cpus == {0, 1}
    too_big = pinned(6, 512, hw_cpu_thread_policy="require")
    assert "whole free cores (require)" in must_not_fit(fit_instance(too_big, topo, all_free(topo)))


@pytest.mark.parametrize("policy", ["prefer", "isolate", "require"])
def test_fit_is_repeatable(policy: str) -> None:
    s = pinned(3, 1024, hw_cpu_thread_policy=policy, hw_numa_nodes="1")
    free = HostFree(frozenset({0, 8, 1, 9, 4, 5, 13}), {1: 4096, 0: 4096})
    first = fit_instance(s, SMT, free)
    assert first == fit_instance(s, SMT, free)
    assert first == fit_instance(s, SMT, HostFree(frozenset(set(free.cpus)), {0: 4096, 1: 4096}))
