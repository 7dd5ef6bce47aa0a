"""Flavor extra specs to instance shapes: Nova's hw:cpu_* and hw:numa_* keys."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stowage.domain.errors import InvalidSpec
from stowage.domain.flavor import (
    CpuPolicy,
    Flavor,
    GuestCell,
    InstanceShape,
    ThreadPolicy,
    shape_of,
)
from stowage.domain.topology import ResourceClass, format_cpu_set

FAST = settings(max_examples=200, deadline=None)


def shape(
    vcpus: int = 4, memory_mb: int = 2048, specs: dict[str, str] | None = None
) -> InstanceShape:
    return shape_of(Flavor("f1", vcpus, memory_mb, disk_gb=10, extra_specs=specs or {}))


# --- valid shapes -----------------------------------------------------------------------


def test_no_extra_specs_is_a_shared_instance_without_numa() -> None:
    s = shape(4, 2048)
    assert s.cpu_policy is CpuPolicy.SHARED
    assert s.thread_policy is ThreadPolicy.PREFER
    assert s.dedicated_vcpus == frozenset()
    assert s.cells == ()
    assert not s.numa
    assert s.vcpus == 4
    assert s.memory_mb == 2048
    assert s.disk_gb == 10


def test_disk_includes_ephemeral() -> None:
    s = shape_of(Flavor("f", 1, 512, disk_gb=10, ephemeral_gb=5))
    assert s.disk_gb == 15


def test_dedicated_policy_pins_every_vcpu_in_one_implicit_cell() -> None:
    s = shape(4, 2048, {"hw:cpu_policy": "dedicated"})
    assert s.cpu_policy is CpuPolicy.DEDICATED
    assert s.dedicated_vcpus == {0, 1, 2, 3}
    assert s.cells == (GuestCell(0, frozenset(range(4)), frozenset(range(4)), 2048),)
    assert s.numa


@pytest.mark.parametrize("raw", ["Dedicated", " dedicated ", "DEDICATED"])
def test_policy_values_are_case_and_space_insensitive(raw: str) -> None:
    assert shape(2, 512, {"hw:cpu_policy": raw}).cpu_policy is CpuPolicy.DEDICATED


def test_explicit_shared_policy_is_the_default() -> None:
    assert shape(2, 512, {"hw:cpu_policy": "shared"}) == shape(2, 512)


@pytest.mark.parametrize("policy", list(ThreadPolicy))
def test_thread_policy_is_parsed_with_dedicated(policy: ThreadPolicy) -> None:
    s = shape(2, 512, {"hw:cpu_policy": "dedicated", "hw:cpu_thread_policy": policy.value})
    assert s.thread_policy is policy


def test_mixed_policy_takes_the_dedicated_mask() -> None:
    s = shape(4, 2048, {"hw:cpu_policy": "mixed", "hw:cpu_dedicated_mask": "2-3"})
    assert s.cpu_policy is CpuPolicy.MIXED
    assert s.dedicated_vcpus == {2, 3}
    (cell,) = s.cells
    assert cell.vcpus == {0, 1, 2, 3}
    assert cell.dedicated == {2, 3}
    assert cell.shared == {0, 1}


def test_mixed_mask_may_be_written_as_exclusions() -> None:
    s = shape(4, 2048, {"hw:cpu_policy": "mixed", "hw:cpu_dedicated_mask": "^0"})
    assert s.dedicated_vcpus == {1, 2, 3}


def test_mixed_with_thread_policy() -> None:
    s = shape(
        4,
        2048,
        {
            "hw:cpu_policy": "mixed",
            "hw:cpu_dedicated_mask": "0",
            "hw:cpu_thread_policy": "isolate",
        },
    )
    assert s.thread_policy is ThreadPolicy.ISOLATE
    assert s.dedicated_vcpus == {0}


def test_numa_nodes_split_cpus_and_memory_evenly() -> None:
    s = shape(4, 2048, {"hw:numa_nodes": "2"})
    assert s.cpu_policy is CpuPolicy.SHARED
    assert s.cells == (
        GuestCell(0, frozenset({0, 1}), frozenset(), 1024),
        GuestCell(1, frozenset({2, 3}), frozenset(), 1024),
    )
    assert s.numa


def test_numa_nodes_one_is_a_single_cell() -> None:
    s = shape(3, 1536, {"hw:numa_nodes": "1"})
    assert s.cells == (GuestCell(0, frozenset({0, 1, 2}), frozenset(), 1536),)


def test_explicit_numa_cells_may_be_uneven() -> None:
    s = shape(
        6,
        3072,
        {
            "hw:numa_nodes": "2",
            "hw:numa_cpus.0": "0,5",
            "hw:numa_cpus.1": "1-4",
            "hw:numa_mem.0": "1024",
            "hw:numa_mem.1": "2048",
        },
    )
    assert s.cells == (
        GuestCell(0, frozenset({0, 5}), frozenset(), 1024),
        GuestCell(1, frozenset({1, 2, 3, 4}), frozenset(), 2048),
    )


def test_mixed_over_two_numa_cells_splits_the_mask_per_cell() -> None:
    s = shape(
        4,
        2048,
        {"hw:cpu_policy": "mixed", "hw:cpu_dedicated_mask": "1,3", "hw:numa_nodes": "2"},
    )
    assert [c.dedicated for c in s.cells] == [frozenset({1}), frozenset({3})]
    assert [c.shared for c in s.cells] == [frozenset({0}), frozenset({2})]


def test_dedicated_over_two_numa_cells() -> None:
    s = shape(4, 2048, {"hw:cpu_policy": "dedicated", "hw:numa_nodes": "2"})
    assert [c.dedicated for c in s.cells] == [frozenset({0, 1}), frozenset({2, 3})]
    assert [c.memory_mb for c in s.cells] == [1024, 1024]


def test_accepted_and_foreign_keys_pass_validation() -> None:
    specs = {
        "hw:mem_page_size": "large",
        "hw:cpu_sockets": "1",
        "hw:watchdog_action": "reset",
        "hw_rng:allowed": "true",
        "hw_video:ram_max_mb": "64",
        "quota:cpu_shares": "1024",
        "aggregate_instance_extra_specs:ssd": "true",
        "trait:HW_CPU_X86_AVX2": "required",
        "resources:VGPU": "1",
        "some_out_of_tree_filter": "x",
    }
    assert shape(2, 512, specs) == shape(2, 512)


def test_amounts_for_shared_dedicated_and_mixed() -> None:
    assert shape(4, 2048).amounts() == {
        ResourceClass.VCPU: 4,
        ResourceClass.MEMORY_MB: 2048,
        ResourceClass.DISK_GB: 10,
    }
    assert shape(4, 2048, {"hw:cpu_policy": "dedicated"}).amounts() == {
        ResourceClass.PCPU: 4,
        ResourceClass.MEMORY_MB: 2048,
        ResourceClass.DISK_GB: 10,
    }
    mixed = shape(4, 2048, {"hw:cpu_policy": "mixed", "hw:cpu_dedicated_mask": "0"})
    assert mixed.amounts() == {
        ResourceClass.VCPU: 3,
        ResourceClass.PCPU: 1,
        ResourceClass.MEMORY_MB: 2048,
        ResourceClass.DISK_GB: 10,
    }


# --- InvalidSpec paths: each message names the offending key ----------------------------

BAD_SPECS: list[tuple[str, int, int, dict[str, str], str]] = [
    # (id, vcpus, memory_mb, extra specs, key the message must name)
    ("unknown hw key", 2, 512, {"hw:cpu_polcy": "dedicated"}, "hw:cpu_polcy"),
    ("image property spelling", 2, 512, {"hw_cpu_policy": "dedicated"}, "hw_cpu_policy"),
    ("bad policy value", 2, 512, {"hw:cpu_policy": "pinned"}, "hw:cpu_policy"),
    (
        "bad thread policy value",
        2,
        512,
        {"hw:cpu_policy": "dedicated", "hw:cpu_thread_policy": "never"},
        "hw:cpu_thread_policy",
    ),
    (
        "thread policy without pinning",
        2,
        512,
        {"hw:cpu_thread_policy": "isolate"},
        "hw:cpu_thread_policy",
    ),
    (
        "thread policy with explicit shared",
        2,
        512,
        {"hw:cpu_policy": "shared", "hw:cpu_thread_policy": "prefer"},
        "hw:cpu_thread_policy",
    ),
    ("mask without policy", 2, 512, {"hw:cpu_dedicated_mask": "0"}, "hw:cpu_dedicated_mask"),
    (
        "mask with shared",
        2,
        512,
        {"hw:cpu_policy": "shared", "hw:cpu_dedicated_mask": "0"},
        "hw:cpu_dedicated_mask",
    ),
    (
        "mask with dedicated",
        2,
        512,
        {"hw:cpu_policy": "dedicated", "hw:cpu_dedicated_mask": "0"},
        "hw:cpu_dedicated_mask",
    ),
    ("mixed without mask", 2, 512, {"hw:cpu_policy": "mixed"}, "hw:cpu_dedicated_mask"),
    (
        "mask names absent vcpus",
        2,
        512,
        {"hw:cpu_policy": "mixed", "hw:cpu_dedicated_mask": "0,5"},
        "hw:cpu_dedicated_mask",
    ),
    (
        "mask dedicates everything",
        2,
        512,
        {"hw:cpu_policy": "mixed", "hw:cpu_dedicated_mask": "0-1"},
        "hw:cpu_dedicated_mask",
    ),
    (
        "mask dedicates nothing",
        2,
        512,
        {"hw:cpu_policy": "mixed", "hw:cpu_dedicated_mask": "^0-1"},
        "hw:cpu_dedicated_mask",
    ),
    (
        "mask unreadable",
        2,
        512,
        {"hw:cpu_policy": "mixed", "hw:cpu_dedicated_mask": "zero"},
        "hw:cpu_dedicated_mask",
    ),
    (
        "mixed with one vcpu",
        1,
        512,
        {"hw:cpu_policy": "mixed", "hw:cpu_dedicated_mask": "0"},
        "hw:cpu_dedicated_mask",
    ),
    ("numa nodes not a number", 2, 512, {"hw:numa_nodes": "two"}, "hw:numa_nodes"),
    ("numa nodes zero", 2, 512, {"hw:numa_nodes": "0"}, "hw:numa_nodes"),
    ("numa nodes negative", 2, 512, {"hw:numa_nodes": "-1"}, "hw:numa_nodes"),
    ("more numa nodes than vcpus", 2, 512, {"hw:numa_nodes": "3"}, "hw:numa_nodes"),
    ("uneven vcpus", 3, 512, {"hw:numa_nodes": "2"}, "hw:numa_nodes"),
    ("uneven memory", 2, 513, {"hw:numa_nodes": "2"}, "hw:numa_nodes"),
    ("numa cpus without nodes", 2, 512, {"hw:numa_cpus.0": "0-1"}, "hw:numa_cpus.0"),
    ("numa mem without nodes", 2, 512, {"hw:numa_mem.0": "512"}, "hw:numa_mem.0"),
    (
        "numa cpus for a cell that does not exist",
        2,
        512,
        {
            "hw:numa_nodes": "1",
            "hw:numa_cpus.0": "0-1",
            "hw:numa_mem.0": "512",
            "hw:numa_cpus.1": "1",
        },
        "hw:numa_cpus.1",
    ),
    (
        "numa mem for a cell that does not exist",
        2,
        512,
        {
            "hw:numa_nodes": "1",
            "hw:numa_cpus.0": "0-1",
            "hw:numa_mem.0": "512",
            "hw:numa_mem.7": "1",
        },
        "hw:numa_mem.7",
    ),
    (
        "numa cell index not a number",
        2,
        512,
        {"hw:numa_nodes": "1", "hw:numa_cpus.x": "0-1"},
        "hw:numa_cpus.x",
    ),
    (
        "numa cell index empty",
        2,
        512,
        {"hw:numa_nodes": "1", "hw:numa_cpus.": "0-1"},
        "hw:numa_cpus.",
    ),
    (
        "numa cell index with leading zero",
        2,
        512,
        {
            "hw:numa_nodes": "2",
            "hw:numa_cpus.0": "0",
            "hw:numa_cpus.1": "1",
            "hw:numa_mem.0": "256",
            "hw:numa_mem.1": "256",
            "hw:numa_cpus.01": "0",
        },
        "hw:numa_cpus.01",
    ),
    (
        "numa cell index in non-ascii digits",
        2,
        512,
        {
            "hw:numa_nodes": "2",
            "hw:numa_cpus.0": "0",
            "hw:numa_cpus.1": "1",
            "hw:numa_mem.0": "256",
            "hw:numa_mem.1": "256",
            "hw:numa_mem.\u00b2": "0",
        },
        "hw:numa_mem.\u00b2",
    ),
    (
        "numa cpus missing for a cell",
        2,
        512,
        {"hw:numa_nodes": "2", "hw:numa_cpus.0": "0-1", "hw:numa_mem.0": "256"},
        "hw:numa_cpus.1",
    ),
    (
        "numa mem missing for a cell",
        2,
        512,
        {
            "hw:numa_nodes": "2",
            "hw:numa_cpus.0": "0",
            "hw:numa_cpus.1": "1",
            "hw:numa_mem.0": "512",
        },
        "hw:numa_mem.1",
    ),
    (
        "numa cpus only, no mem at all",
        2,
        512,
        {"hw:numa_nodes": "1", "hw:numa_cpus.0": "0-1"},
        "hw:numa_mem.0",
    ),
    (
        "numa mem only, no cpus at all",
        2,
        512,
        {"hw:numa_nodes": "1", "hw:numa_mem.0": "512"},
        "hw:numa_cpus.0",
    ),
    (
        "numa cpus empty",
        2,
        512,
        {"hw:numa_nodes": "1", "hw:numa_cpus.0": "", "hw:numa_mem.0": "512"},
        "hw:numa_cpus.0",
    ),
    (
        "numa cpus exclusions only",
        2,
        512,
        {"hw:numa_nodes": "1", "hw:numa_cpus.0": "^0", "hw:numa_mem.0": "512"},
        "hw:numa_cpus.0",
    ),
    (
        "numa cpus unreadable",
        2,
        512,
        {"hw:numa_nodes": "1", "hw:numa_cpus.0": "0-x", "hw:numa_mem.0": "512"},
        "hw:numa_cpus.0",
    ),
    (
        "numa cpus beyond the flavor",
        2,
        512,
        {"hw:numa_nodes": "1", "hw:numa_cpus.0": "0-2", "hw:numa_mem.0": "512"},
        "hw:numa_cpus.0",
    ),
    (
        "numa cpus in two cells",
        3,
        512,
        {
            "hw:numa_nodes": "2",
            "hw:numa_cpus.0": "0-1",
            "hw:numa_cpus.1": "1-2",
            "hw:numa_mem.0": "256",
            "hw:numa_mem.1": "256",
        },
        "hw:numa_cpus.1",
    ),
    (
        "numa cpus leave a vcpu out",
        3,
        512,
        {
            "hw:numa_nodes": "2",
            "hw:numa_cpus.0": "0",
            "hw:numa_cpus.1": "1",
            "hw:numa_mem.0": "256",
            "hw:numa_mem.1": "256",
        },
        "hw:numa_cpus",
    ),
    (
        "numa mem does not add up",
        2,
        512,
        {
            "hw:numa_nodes": "2",
            "hw:numa_cpus.0": "0",
            "hw:numa_cpus.1": "1",
            "hw:numa_mem.0": "256",
            "hw:numa_mem.1": "128",
        },
        "hw:numa_mem",
    ),
    (
        "numa mem zero",
        2,
        512,
        {
            "hw:numa_nodes": "2",
            "hw:numa_cpus.0": "0",
            "hw:numa_cpus.1": "1",
            "hw:numa_mem.0": "512",
            "hw:numa_mem.1": "0",
        },
        "hw:numa_mem.1",
    ),
    (
        "numa mem unreadable",
        2,
        512,
        {
            "hw:numa_nodes": "2",
            "hw:numa_cpus.0": "0",
            "hw:numa_cpus.1": "1",
            "hw:numa_mem.0": "256MB",
            "hw:numa_mem.1": "256",
        },
        "hw:numa_mem.0",
    ),
]


@pytest.mark.parametrize(
    ("vcpus", "memory_mb", "specs", "key"),
    [case[1:] for case in BAD_SPECS],
    ids=[case[0] for case in BAD_SPECS],
)
def test_invalid_spec_names_the_offending_key(
    vcpus: int, memory_mb: int, specs: dict[str, str], key: str
) -> None:
    with pytest.raises(InvalidSpec) as err:
        shape(vcpus, memory_mb, specs)
    assert key in str(err.value)
    assert key in err.value.message
    assert err.value.code == "spec.invalid"


@pytest.mark.parametrize(
    ("vcpus", "memory_mb", "disk_gb", "word"),
    [(0, 512, 0, "vcpus"), (1, 0, 0, "ram"), (1, 512, -1, "disk")],
)
def test_invalid_flavor_sizes_are_named(
    vcpus: int, memory_mb: int, disk_gb: int, word: str
) -> None:
    with pytest.raises(InvalidSpec) as err:
        shape_of(Flavor("tiny", vcpus, memory_mb, disk_gb=disk_gb))
    assert word in str(err.value)
    assert "'tiny'" in str(err.value)


# --- properties -------------------------------------------------------------------------


@st.composite
def valid_flavors(draw: st.DrawFn) -> tuple[Flavor, dict[str, object]]:
    """A flavor valid by construction, and what its shape must be."""
    policy = draw(st.sampled_from(list(CpuPolicy)))
    nodes = draw(st.sampled_from([None, 1, 2, 3]))
    low = max(2 if policy is CpuPolicy.MIXED else 1, nodes or 1)
    vcpus = draw(st.integers(low, 8))
    per_node_mb = draw(st.sampled_from([256, 512, 1024]))
    memory_mb = per_node_mb * (nodes or 1)
    specs: dict[str, str] = {"hw:cpu_policy": policy.value}
    if policy is CpuPolicy.SHARED and draw(st.booleans()):
        del specs["hw:cpu_policy"]
    thread = None
    if policy is not CpuPolicy.SHARED and draw(st.booleans()):
        thread = draw(st.sampled_from(list(ThreadPolicy)))
        specs["hw:cpu_thread_policy"] = thread.value
    dedicated = frozenset(range(vcpus)) if policy is CpuPolicy.DEDICATED else frozenset()
    if policy is CpuPolicy.MIXED:
        dedicated = draw(st.frozensets(st.integers(0, vcpus - 1), min_size=1, max_size=vcpus - 1))
        if draw(st.booleans()):
            specs["hw:cpu_dedicated_mask"] = format_cpu_set(dedicated)
        else:
            shared = frozenset(range(vcpus)) - dedicated
            specs["hw:cpu_dedicated_mask"] = ",".join(f"^{v}" for v in sorted(shared))
    cells: list[frozenset[int]] = []
    mems: list[int] = []
    if nodes is not None:
        specs["hw:numa_nodes"] = str(nodes)
        if vcpus % nodes == 0 and draw(st.booleans()):
            per = vcpus // nodes
            cells = [frozenset(range(i * per, (i + 1) * per)) for i in range(nodes)]
            mems = [per_node_mb] * nodes
        else:
            # Explicit cells: a random partition of the vCPUs, uneven memory.
            order = draw(st.permutations(range(vcpus)))
            cuts = draw(
                st.sets(st.integers(1, max(1, vcpus - 1)), min_size=nodes - 1, max_size=nodes - 1)
            )
            bounds = [0, *sorted(cuts), vcpus]
            cells = [frozenset(order[bounds[i] : bounds[i + 1]]) for i in range(nodes)]
            mems = [draw(st.sampled_from([128, 256, 1000])) for _ in range(nodes)]
            memory_mb = sum(mems)
            for i, (cpus, mem) in enumerate(zip(cells, mems, strict=True)):
                specs[f"hw:numa_cpus.{i}"] = format_cpu_set(cpus)
                specs[f"hw:numa_mem.{i}"] = str(mem)
    elif policy is not CpuPolicy.SHARED:
        cells = [frozenset(range(vcpus))]
        mems = [memory_mb]
    expected: dict[str, object] = {
        "policy": policy,
        "thread": thread or ThreadPolicy.PREFER,
        "dedicated": dedicated,
        "cells": cells,
        "mems": mems,
    }
    return Flavor("f", vcpus, memory_mb, extra_specs=specs), expected


@FAST
@given(valid_flavors())
def test_valid_flavors_give_the_shape_they_describe(case: tuple[Flavor, dict[str, object]]) -> None:
    fl, expected = case
    s = shape_of(fl)
    assert s.cpu_policy is expected["policy"]
    assert s.thread_policy is expected["thread"]
    assert s.dedicated_vcpus == expected["dedicated"]
    assert [c.vcpus for c in s.cells] == expected["cells"]
    assert [c.memory_mb for c in s.cells] == expected["mems"]
    # Structural invariants of every shape.
    assert [c.id for c in s.cells] == list(range(len(s.cells)))
    if s.cells:
        assert frozenset().union(*(c.vcpus for c in s.cells)) == frozenset(range(fl.vcpus))
        assert sum(len(c.vcpus) for c in s.cells) == fl.vcpus
        assert sum(c.memory_mb for c in s.cells) == fl.memory_mb
        assert frozenset().union(*(c.dedicated for c in s.cells)) == s.dedicated_vcpus
    for c in s.cells:
        assert c.dedicated <= c.vcpus
        assert c.dedicated == c.vcpus & s.dedicated_vcpus
        assert c.shared == c.vcpus - c.dedicated
    assert s.numa == (s.cpu_policy is not CpuPolicy.SHARED or "hw:numa_nodes" in fl.extra_specs)
    amounts = s.amounts()
    assert amounts.get(ResourceClass.PCPU, 0) + amounts.get(ResourceClass.VCPU, 0) == fl.vcpus
    assert amounts.get(ResourceClass.PCPU, 0) == len(s.dedicated_vcpus)


SPEC_KEYS = [
    "hw:cpu_policy",
    "hw:cpu_thread_policy",
    "hw:cpu_dedicated_mask",
    "hw:numa_nodes",
    "hw:numa_cpus.0",
    "hw:numa_cpus.1",
    "hw:numa_cpus.2",
    "hw:numa_mem.0",
    "hw:numa_mem.1",
    "hw:numa_cpus.\u0663",
    "hw:numa_mem.\u00b2",
    "hw:numa_mem.x",
    "hw:numa_mem.00",
    "hw:bogus",
    "hw_cpu_policy",
]
SPEC_VALUES = [
    "shared",
    "dedicated",
    "mixed",
    "prefer",
    "isolate",
    "require",
    "0",
    "1",
    "2",
    "-1",
    "0-1",
    "^0",
    "1,3",
    "512",
    "",
    "x",
    "\u0661",
]


@FAST
@given(
    vcpus=st.integers(0, 5),
    memory_mb=st.sampled_from([0, 1, 512, 1024]),
    specs=st.dictionaries(st.sampled_from(SPEC_KEYS), st.sampled_from(SPEC_VALUES), max_size=6),
)
def test_shape_of_either_validates_or_raises_invalid_spec(
    vcpus: int, memory_mb: int, specs: dict[str, str]
) -> None:
    """Any junk is refused with InvalidSpec, never another exception; a shape is consistent."""
    try:
        s = shape_of(Flavor("f", vcpus, memory_mb, extra_specs=specs))
    except InvalidSpec as err:
        assert err.message
        return
    assert s.dedicated_vcpus <= frozenset(range(vcpus))
    assert sum(len(c.vcpus) for c in s.cells) in (0, vcpus)
    assert all(c.memory_mb >= 1 for c in s.cells)


@FAST
@given(
    vcpus=st.integers(1, 4),
    nodes=st.integers(1, 3),
    cells=st.dictionaries(
        st.tuples(
            st.sampled_from(["hw:numa_cpus.", "hw:numa_mem."]),
            st.one_of(
                st.sampled_from(["0", "1", "2", "01", "", "-1", "+1", " 1"]),
                st.text(st.characters(categories=["Nd", "No"]), min_size=1, max_size=2),
            ),
        ),
        st.sampled_from(["0", "1", "0-1", "^0", "2-3", "256", "512", "x"]),
        max_size=5,
    ),
)
def test_numa_cell_keys_either_validate_or_raise_invalid_spec(
    vcpus: int, nodes: int, cells: dict[tuple[str, str], str]
) -> None:
    """Odd cell indices ("01", "\u00b2", "\u0663") are refused by name, never crash or vanish."""
    specs = {"hw:numa_nodes": str(nodes), **{f"{k}{i}": v for (k, i), v in cells.items()}}
    try:
        s = shape_of(Flavor("f", vcpus, 512, extra_specs=specs))
    except InvalidSpec as err:
        assert err.message
        return
    # Accepted: every cell key named a real cell in canonical form, and was used.
    assert len(s.cells) == nodes
    for key in cells:
        index = key[1]
        assert index.isascii()
        assert index.isdigit()
        assert str(int(index)) == index
        assert int(index) < nodes
