"""The claim transaction: all or nothing per claim, refusals that say why, moves free one end."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Mapping
from contextlib import closing
from typing import Any

import pytest
from sqlalchemy import func, select, text

from stowage.domain.claims import Claim, ClaimOutcome, ConsumerKind, GroupSlot, RefusalCode
from stowage.domain.flavor import Flavor, InstanceShape, shape_of
from stowage.domain.groups import GroupPolicy, ServerGroup, parse_group
from stowage.domain.numa import CellFit, Fit, HostFree, fit_instance
from stowage.domain.topology import HostSpec, HostTopology, ResourceClass
from stowage.ledger import Ledger, audit
from stowage.ledger.db import READONLY
from stowage.ledger.schema import (
    allocations,
    cells,
    consumer_key,
    consumers,
    group_members,
    group_slots,
    host_generations,
    inventories,
    numa_claims,
    pins,
)

# Per host: 2 cells x 4 cores x 2 threads. Dedicated: cell 0 {0,1,8,9}, cell 1 {4,5,12,13}.
TOPOLOGY = HostTopology.uniform(
    cells=2, cores_per_cell=4, threads_per_core=2, memory_mb_per_cell=4096
)
PINNED4 = shape_of(Flavor("pinned.4", 4, 1024, 10, {"hw:cpu_policy": "dedicated"}))
SHARED2 = shape_of(Flavor("shared.2", 2, 1024, 10))
BIG_SHARED = shape_of(Flavor("shared.big", 1, 3000, 1))
NUMA_SHARED = shape_of(Flavor("numa.shared", 1, 3000, 1, {"hw:numa_nodes": "1"}))

ANTI = parse_group("g-anti", "web", "anti-affinity")
AFFINITY = parse_group("g-aff", "db", "affinity")
CLAIM_TABLES = (allocations, numa_claims, pins, group_slots)


@pytest.fixture
def ledger(db_url: str) -> Iterator[Ledger]:
    opened = Ledger.open(db_url)
    yield opened
    opened.close()


# --- helpers ----------------------------------------------------------------------------


def register(ledger: Ledger, *names: str) -> dict[str, int]:
    return {name: ledger.register_host(HostSpec(name, TOPOLOGY, disk_gb=100)) for name in names}


def make_claim(
    ledger: Ledger,
    consumer_id: str,
    host_id: int,
    shape: InstanceShape,
    *,
    instance_id: str | None = None,
    kind: ConsumerKind = ConsumerKind.INSTANCE,
    group: ServerGroup | None = None,
    slot: GroupSlot | None = None,
    free: HostFree | None = None,
) -> Claim:
    """A claim as the pipeline would build it, from the ledger's current view of the host."""
    host = ledger.load_view().hosts[host_id]
    fit = fit_instance(shape, host.topology, free if free is not None else host.free)
    assert isinstance(fit, Fit), fit
    amounts = shape.amounts()
    if fit.cells and ResourceClass.PCPU in amounts:
        amounts[ResourceClass.PCPU] = len(fit.cpus)
    return Claim(
        consumer_id=consumer_id,
        instance_id=instance_id or consumer_id,
        host_id=host_id,
        amounts=amounts,
        fit=fit,
        slots=(slot,) if slot is not None else (),
        affinity_groups=(group.id,) if group is not None and _is_affinity(group) else (),
        member_of=(group.id,) if group is not None else (),
        kind=kind,
    )


def _is_affinity(group: ServerGroup) -> bool:
    return group.policy is GroupPolicy.AFFINITY


def host_slot(group: ServerGroup, host_name: str, slot: int = 0) -> GroupSlot:
    return GroupSlot(group.id, f"host={host_name}", slot, group.max_per_domain)


def read(ledger: Ledger, query: Any) -> list[tuple[Any, ...]]:
    with ledger.engine.connect().execution_options(**READONLY) as conn:
        return [tuple(row) for row in conn.execute(query)]


def claim_rows(ledger: Ledger, consumer_id: str) -> dict[str, int]:
    """How many rows each claim table holds for a consumer."""
    return {
        table.name: read(
            ledger,
            select(func.count())
            .select_from(table)
            .where(table.c.consumer_seq == consumer_key(consumer_id)),
        )[0][0]
        for table in CLAIM_TABLES
    }


def usage(ledger: Ledger, host_id: int) -> dict[str, int]:
    rows = read(
        ledger,
        select(inventories.c.resource_class, inventories.c.used).where(
            inventories.c.host_id == host_id
        ),
    )
    return dict(rows)


def cell_usage(ledger: Ledger, host_id: int) -> dict[int, int]:
    rows = read(
        ledger, select(cells.c.cell_id, cells.c.memory_mb_used).where(cells.c.host_id == host_id)
    )
    return dict(rows)


def pins_of(ledger: Ledger, consumer_id: str) -> dict[tuple[int, int], int | None]:
    rows = read(
        ledger,
        select(pins.c.host_id, pins.c.cpu_id, pins.c.guest_vcpu).where(
            pins.c.consumer_seq == consumer_key(consumer_id)
        ),
    )
    return {(h, cpu): vcpu for h, cpu, vcpu in rows}


def slots_of(ledger: Ledger, group_id: str) -> set[tuple[str, int, str, int]]:
    rows = read(
        ledger,
        select(
            group_slots.c.domain,
            group_slots.c.slot,
            consumers.c.id,
            group_slots.c.host_id,
        )
        .select_from(group_slots.join(consumers, consumers.c.seq == group_slots.c.consumer_seq))
        .where(group_slots.c.group_id == group_id),
    )
    return {tuple(r) for r in rows}


def consumer_ids(ledger: Ledger) -> set[str]:
    return {r[0] for r in read(ledger, select(consumers.c.id))}


def idle(ledger: Ledger, host_id: int) -> None:
    """Assert the host holds nothing at all."""
    assert set(usage(ledger, host_id).values()) == {0}
    assert set(cell_usage(ledger, host_id).values()) == {0}
    assert read(ledger, select(pins.c.cpu_id).where(pins.c.host_id == host_id)) == []


def assert_clean(ledger: Ledger) -> None:
    assert [str(v) for v in audit(ledger)] == []


def assert_refused_without_trace(ledger: Ledger, consumer_id: str) -> None:
    """A refused new consumer leaves no consumer row, no claim row and no membership."""
    assert consumer_id not in consumer_ids(ledger)
    assert set(claim_rows(ledger, consumer_id).values()) == {0}
    assert (
        read(
            ledger,
            select(group_members.c.group_id).where(group_members.c.instance_id == consumer_id),
        )
        == []
    )


def corrupt(ledger: Ledger, sql: str, **params: Any) -> None:
    with ledger.engine.begin() as conn:
        conn.execute(text(sql), params)


def corrupt_without_foreign_keys(ledger: Ledger, *statements: str) -> None:
    """Run statements the foreign keys would stop, as a buggy tool or a bad restore might."""
    if ledger.engine.dialect.name == "sqlite":
        path = ledger.engine.url.database
        assert path
        with closing(sqlite3.connect(path)) as raw:
            raw.execute("PRAGMA foreign_keys=OFF")
            for statement in statements:
                raw.execute(statement)
            raw.commit()
        return
    with ledger.engine.begin() as conn:
        # Superuser only: turns off the triggers that check foreign keys, for this transaction.
        conn.execute(text("SET LOCAL session_replication_role = replica"))
        for statement in statements:
            conn.execute(text(statement))


def violations(ledger: Ledger) -> set[str]:
    return {str(v) for v in audit(ledger)}


# --- one claim --------------------------------------------------------------------------


def test_claim_commits_amounts_cells_pins_slot_and_host_at_once(ledger: Ledger) -> None:
    ids = register(ledger, "h1", "h2")
    h1 = ids["h1"]
    ledger.create_group(ANTI)
    generation_before = read(
        ledger, select(host_generations.c.generation).where(host_generations.c.host_id == h1)
    )[0][0]
    claim = make_claim(ledger, "vm-a", h1, PINNED4, group=ANTI, slot=host_slot(ANTI, "h1"))

    assert ledger.claim([claim]) == [ClaimOutcome("vm-a", h1, True)]

    assert usage(ledger, h1) == {"VCPU": 0, "PCPU": 4, "MEMORY_MB": 1024, "DISK_GB": 10}
    assert cell_usage(ledger, h1) == {0: 1024, 1: 0}
    assert pins_of(ledger, "vm-a") == {(h1, 0): 0, (h1, 1): 1, (h1, 8): 2, (h1, 9): 3}
    assert read(
        ledger,
        select(
            numa_claims.c.host_id,
            numa_claims.c.cell_id,
            numa_claims.c.guest_cell,
            numa_claims.c.memory_mb,
        ).where(numa_claims.c.consumer_seq == consumer_key("vm-a")),
    ) == [(h1, 0, 0, 1024)]
    assert slots_of(ledger, ANTI.id) == {("host=h1", 0, "vm-a", h1)}
    assert read(ledger, select(group_members.c.group_id, group_members.c.instance_id)) == [
        (ANTI.id, "vm-a")
    ]
    assert read(
        ledger, select(consumers.c.kind, consumers.c.host_id).where(consumers.c.id == "vm-a")
    ) == [("instance", h1)]
    generation_after = read(
        ledger, select(host_generations.c.generation).where(host_generations.c.host_id == h1)
    )[0][0]
    assert generation_after > generation_before
    idle(ledger, ids["h2"])

    view = ledger.load_view()
    assert view.hosts[h1].free.cpus == frozenset({4, 5, 12, 13})
    assert view.hosts[h1].free.cell_memory_mb == {0: 3072, 1: 4096}
    assert view.hosts[h1].used[ResourceClass.PCPU] == 4
    assert dict(view.groups[ANTI.id].per_domain) == {"host=h1": 1}
    assert dict(view.groups[ANTI.id].per_host) == {h1: 1}
    assert_clean(ledger)


def test_the_conductors_read_of_a_claim_gives_its_host_pins_cells_and_memory(
    ledger: Ledger,
) -> None:
    """`claim_in` (what a spawn or a move sends the agent) in one statement: the guest cells'
    host cells in guest order, the pins without the withheld siblings, the memory."""
    from stowage.services.conductor import claim_in

    ids = register(ledger, "h1")
    h1 = ids["h1"]
    # Guest cell 0 on host cell 1 (its vCPUs pinned out of order, sibling 12 withheld), guest
    # cell 1 on host cell 0.
    crossed = Fit(
        cells=(
            CellFit(0, 1, 512, {0: 5, 1: 4}, frozenset({12})),
            CellFit(1, 0, 512, {2: 0, 3: 1}, frozenset()),
        )
    )
    amounts = {ResourceClass.PCPU: 5, ResourceClass.MEMORY_MB: 1024, ResourceClass.DISK_GB: 10}
    pinned = Claim("vm-p", "vm-p", h1, amounts, crossed)
    shared = make_claim(ledger, "vm-s", h1, SHARED2)
    assert [o.ok for o in ledger.claim([pinned, shared])] == [True, True]

    with ledger.engine.connect().execution_options(**READONLY) as conn:
        assert claim_in(conn, "vm-p") == {
            "host": "h1",
            "pins": {"0": 5, "1": 4, "2": 0, "3": 1},
            "cells": [1, 0],
            "memory_mb": 1024,
        }
        assert claim_in(conn, "vm-s") == {"host": "h1", "pins": {}, "cells": [], "memory_mb": 1024}
        assert claim_in(conn, "vm-none") is None


# --- a batch with one bad claim ---------------------------------------------------------


def test_batch_refuses_the_claim_that_reuses_pinned_pcpus_and_commits_the_others(
    ledger: Ledger,
) -> None:
    h1 = register(ledger, "h1")["h1"]
    first = make_claim(ledger, "vm-a", h1, PINNED4)
    same_cpus = make_claim(ledger, "vm-b", h1, PINNED4)  # from the same, now stale, free set
    assert same_cpus.fit.cpus == first.fit.cpus
    other_cell = make_claim(
        ledger,
        "vm-c",
        h1,
        PINNED4,
        free=HostFree(TOPOLOGY.cpu_dedicated_set - first.fit.cpus, {0: 3072, 1: 4096}),
    )

    outcomes = ledger.claim([first, same_cpus, other_cell])

    assert [o.ok for o in outcomes] == [True, False, True]
    refused = outcomes[1]
    assert refused.code is RefusalCode.PCPU_TAKEN
    assert "already pinned" in refused.reason
    assert "[0, 1, 8, 9]" in refused.reason
    assert_refused_without_trace(ledger, "vm-b")
    assert usage(ledger, h1)["PCPU"] == 8
    assert cell_usage(ledger, h1) == {0: 1024, 1: 1024}
    assert set(pins_of(ledger, "vm-c")) == {(h1, 4), (h1, 5), (h1, 12), (h1, 13)}
    assert_clean(ledger)


def test_batch_refuses_the_claim_that_exceeds_inventory_capacity(ledger: Ledger) -> None:
    h1 = register(ledger, "h1")["h1"]  # 8192 MB in all
    batch = [make_claim(ledger, f"vm-{i}", h1, BIG_SHARED) for i in range(3)]

    outcomes = ledger.claim(batch)

    assert [o.ok for o in outcomes] == [True, True, False]
    assert outcomes[2].code is RefusalCode.CAPACITY
    assert "capacity" in outcomes[2].reason
    assert_refused_without_trace(ledger, "vm-2")
    assert usage(ledger, h1)["MEMORY_MB"] == 6000
    assert usage(ledger, h1)["VCPU"] == 2
    assert_clean(ledger)


def test_batch_refuses_the_claim_that_overfills_a_numa_cell(ledger: Ledger) -> None:
    h1 = register(ledger, "h1")["h1"]  # 4096 MB per cell; both fits pick cell 0
    batch = [make_claim(ledger, f"vm-{i}", h1, NUMA_SHARED) for i in range(2)]
    assert [c.fit.cells[0].host_cell for c in batch] == [0, 0]

    outcomes = ledger.claim(batch)

    assert [o.ok for o in outcomes] == [True, False]
    assert outcomes[1].code is RefusalCode.NUMA_MEMORY
    assert "NUMA cell" in outcomes[1].reason
    assert_refused_without_trace(ledger, "vm-1")
    assert cell_usage(ledger, h1) == {0: 3000, 1: 0}
    assert usage(ledger, h1)["MEMORY_MB"] == 3000
    assert_clean(ledger)


@pytest.mark.parametrize("slot", [0, 1], ids=["taken-slot", "slot-beyond-max"])
def test_batch_refuses_a_member_whose_anti_affinity_slot_is_taken(
    ledger: Ledger, slot: int
) -> None:
    ids = register(ledger, "h1", "h2")
    ledger.create_group(ANTI)
    a = make_claim(ledger, "vm-a", ids["h1"], SHARED2, group=ANTI, slot=host_slot(ANTI, "h1"))
    b = make_claim(ledger, "vm-b", ids["h1"], SHARED2, group=ANTI, slot=host_slot(ANTI, "h1", slot))
    c = make_claim(ledger, "vm-c", ids["h2"], SHARED2, group=ANTI, slot=host_slot(ANTI, "h2"))

    outcomes = ledger.claim([a, b, c])

    assert [o.ok for o in outcomes] == [True, False, True]
    assert outcomes[1].code is RefusalCode.ANTI_AFFINITY
    assert "anti-affinity" in outcomes[1].reason
    assert "host=h1" in outcomes[1].reason
    assert_refused_without_trace(ledger, "vm-b")
    assert slots_of(ledger, ANTI.id) == {
        ("host=h1", 0, "vm-a", ids["h1"]),
        ("host=h2", 0, "vm-c", ids["h2"]),
    }
    assert usage(ledger, ids["h1"])["VCPU"] == 2
    assert_clean(ledger)


def test_batch_refuses_an_instance_that_is_already_placed(ledger: Ledger) -> None:
    ids = register(ledger, "h1", "h2")
    assert ledger.claim([make_claim(ledger, "vm-a", ids["h1"], PINNED4)])[0].ok
    h1_usage = usage(ledger, ids["h1"])
    a_pins = pins_of(ledger, "vm-a")

    outcomes = ledger.claim(
        [
            make_claim(ledger, "vm-a", ids["h2"], PINNED4),
            make_claim(ledger, "vm-d", ids["h2"], SHARED2),
        ]
    )

    assert [o.ok for o in outcomes] == [False, True]
    assert outcomes[0].code is RefusalCode.CONSUMER_PLACED
    assert outcomes[0].reason
    assert ledger.consumer_host("vm-a") == ids["h1"]
    assert usage(ledger, ids["h1"]) == h1_usage
    assert pins_of(ledger, "vm-a") == a_pins
    assert usage(ledger, ids["h2"]) == {"VCPU": 2, "PCPU": 0, "MEMORY_MB": 1024, "DISK_GB": 10}
    assert_clean(ledger)


def test_batch_naming_one_instance_twice_places_it_once(ledger: Ledger) -> None:
    ids = register(ledger, "h1", "h2")

    outcomes = ledger.claim(
        [
            make_claim(ledger, "vm-a", ids["h1"], SHARED2),
            make_claim(ledger, "vm-a", ids["h2"], SHARED2),
            make_claim(ledger, "vm-b", ids["h2"], SHARED2),
        ]
    )

    assert [o.ok for o in outcomes] == [True, False, True]
    assert outcomes[1].code is RefusalCode.CONSUMER_PLACED
    assert ledger.consumer_host("vm-a") == ids["h1"]
    assert usage(ledger, ids["h2"])["VCPU"] == 2
    assert_clean(ledger)


def test_a_migration_consumer_id_is_claimed_once(ledger: Ledger) -> None:
    ids = register(ledger, "h1", "h2", "h3")
    assert ledger.claim([make_claim(ledger, "vm-a", ids["h1"], SHARED2)])[0].ok
    move = make_claim(
        ledger, "mig-1", ids["h2"], SHARED2, instance_id="vm-a", kind=ConsumerKind.MIGRATION
    )
    assert ledger.claim([move])[0].ok

    again = make_claim(
        ledger, "mig-1", ids["h3"], SHARED2, instance_id="vm-a", kind=ConsumerKind.MIGRATION
    )
    outcome = ledger.claim([again])[0]

    assert not outcome.ok
    assert outcome.code is RefusalCode.CONSUMER_PLACED
    assert ledger.consumer_host("mig-1") == ids["h2"]
    idle(ledger, ids["h3"])
    assert_clean(ledger)


def test_batch_refuses_a_claim_on_a_host_the_ledger_lacks(ledger: Ledger) -> None:
    h1 = register(ledger, "h1")["h1"]
    good = make_claim(ledger, "vm-a", h1, SHARED2)
    lost = Claim("vm-b", "vm-b", h1 + 100, SHARED2.amounts(), Fit(()))

    outcomes = ledger.claim([good, lost])

    assert [o.ok for o in outcomes] == [True, False]
    assert outcomes[1].code is RefusalCode.UNKNOWN_RESOURCE
    assert outcomes[1].reason
    assert_refused_without_trace(ledger, "vm-b")
    assert usage(ledger, h1)["VCPU"] == 2
    assert_clean(ledger)


def test_batch_refuses_a_claim_for_a_resource_class_the_host_lacks(ledger: Ledger) -> None:
    diskless = ledger.register_host(HostSpec("h1", TOPOLOGY, disk_gb=0))
    memory_only = {ResourceClass.MEMORY_MB: 512, ResourceClass.VCPU: 1}
    with_disk = {**memory_only, ResourceClass.DISK_GB: 10}

    outcomes = ledger.claim(
        [
            Claim("vm-a", "vm-a", diskless, memory_only, Fit(())),
            Claim("vm-b", "vm-b", diskless, with_disk, Fit(())),
        ]
    )

    assert [o.ok for o in outcomes] == [True, False]
    assert outcomes[1].code is RefusalCode.UNKNOWN_RESOURCE
    assert "resource class" in outcomes[1].reason
    assert_refused_without_trace(ledger, "vm-b")
    assert usage(ledger, diskless) == {"VCPU": 1, "PCPU": 0, "MEMORY_MB": 512}
    assert_clean(ledger)


# --- release ----------------------------------------------------------------------------


def test_release_is_idempotent_and_returns_usage_to_zero(ledger: Ledger) -> None:
    h1 = register(ledger, "h1")["h1"]
    ledger.create_group(ANTI)
    claim = make_claim(ledger, "vm-a", h1, PINNED4, group=ANTI, slot=host_slot(ANTI, "h1"))
    assert ledger.claim([claim])[0].ok

    assert ledger.release("vm-a") is True
    assert ledger.release("vm-a") is False

    idle(ledger, h1)
    assert claim_rows(ledger, "vm-a") == {t.name: 0 for t in CLAIM_TABLES}
    assert "vm-a" not in consumer_ids(ledger)
    view = ledger.load_view()
    assert view.hosts[h1].free.cpus == TOPOLOGY.cpu_dedicated_set
    assert dict(view.groups[ANTI.id].per_domain) == {}
    assert_clean(ledger)


def test_release_keeping_the_consumer_lets_the_instance_be_placed_again(ledger: Ledger) -> None:
    ids = register(ledger, "h1", "h2")
    assert ledger.claim([make_claim(ledger, "vm-a", ids["h1"], PINNED4)])[0].ok

    assert ledger.release("vm-a", forget=False) is True
    assert ledger.release("vm-a", forget=False) is False
    assert "vm-a" in consumer_ids(ledger)
    assert ledger.consumer_host("vm-a") is None
    idle(ledger, ids["h1"])

    assert ledger.claim([make_claim(ledger, "vm-a", ids["h2"], PINNED4)])[0].ok
    assert ledger.consumer_host("vm-a") == ids["h2"]
    assert_clean(ledger)


# --- migrations -------------------------------------------------------------------------


def _instance_and_migration(ledger: Ledger) -> dict[str, int]:
    """vm-a runs on h1; its migration mig-1 holds h2. Both hold an anti-affinity slot."""
    ids = register(ledger, "h1", "h2", "h3")
    ledger.create_group(ANTI)
    a = make_claim(ledger, "vm-a", ids["h1"], PINNED4, group=ANTI, slot=host_slot(ANTI, "h1"))
    assert ledger.claim([a])[0].ok
    move = make_claim(
        ledger,
        "mig-1",
        ids["h2"],
        PINNED4,
        instance_id="vm-a",
        kind=ConsumerKind.MIGRATION,
        group=ANTI,
        slot=host_slot(ANTI, "h2"),
    )
    assert ledger.claim([move])[0].ok
    assert usage(ledger, ids["h1"])["PCPU"] == 4
    assert usage(ledger, ids["h2"])["PCPU"] == 4
    assert_clean(ledger)
    return ids


def test_complete_migration_hands_the_destination_to_the_instance_and_frees_the_source(
    ledger: Ledger,
) -> None:
    ids = _instance_and_migration(ledger)
    h1, h2 = ids["h1"], ids["h2"]

    assert ledger.complete_migration("mig-1") is True

    idle(ledger, h1)
    assert consumer_ids(ledger) == {"vm-a"}
    assert ledger.consumer_host("vm-a") == h2
    assert set(pins_of(ledger, "vm-a")) == {(h2, 0), (h2, 1), (h2, 8), (h2, 9)}
    assert usage(ledger, h2) == {"VCPU": 0, "PCPU": 4, "MEMORY_MB": 1024, "DISK_GB": 10}
    assert read(
        ledger,
        select(consumers.c.id, allocations.c.host_id)
        .select_from(allocations.join(consumers, consumers.c.seq == allocations.c.consumer_seq))
        .distinct(),
    ) == [("vm-a", h2)]
    assert slots_of(ledger, ANTI.id) == {("host=h2", 0, "vm-a", h2)}
    assert claim_rows(ledger, "mig-1") == {t.name: 0 for t in CLAIM_TABLES}
    assert ledger.complete_migration("mig-1") is False
    assert ledger.complete_migration("vm-a") is False  # an instance is no migration
    assert_clean(ledger)
    # The source's slot is free again for another member.
    b = make_claim(ledger, "vm-b", h1, SHARED2, group=ANTI, slot=host_slot(ANTI, "h1"))
    assert ledger.claim([b])[0].ok
    assert_clean(ledger)


def test_fail_migration_frees_the_destination_and_keeps_the_source(ledger: Ledger) -> None:
    ids = _instance_and_migration(ledger)
    h1, h2 = ids["h1"], ids["h2"]
    source_pins = pins_of(ledger, "vm-a")

    assert ledger.fail_migration("mig-1") is True
    assert ledger.fail_migration("mig-1") is False

    idle(ledger, h2)
    assert consumer_ids(ledger) == {"vm-a"}
    assert ledger.consumer_host("vm-a") == h1
    assert pins_of(ledger, "vm-a") == source_pins
    assert usage(ledger, h1)["PCPU"] == 4
    assert slots_of(ledger, ANTI.id) == {("host=h1", 0, "vm-a", h1)}
    assert_clean(ledger)
    b = make_claim(ledger, "vm-b", h2, SHARED2, group=ANTI, slot=host_slot(ANTI, "h2"))
    assert ledger.claim([b])[0].ok
    assert_clean(ledger)


def test_both_ends_of_a_migration_count_for_anti_affinity(ledger: Ledger) -> None:
    ids = _instance_and_migration(ledger)

    for name in ("h1", "h2"):
        third = make_claim(
            ledger, "vm-b", ids[name], SHARED2, group=ANTI, slot=host_slot(ANTI, name)
        )
        outcome = ledger.claim([third])[0]
        assert not outcome.ok, name
        assert outcome.code is RefusalCode.ANTI_AFFINITY
        assert f"host={name}" in outcome.reason
        assert_refused_without_trace(ledger, "vm-b")

    view = ledger.load_view()
    assert dict(view.groups[ANTI.id].per_domain) == {"host=h1": 1, "host=h2": 1}
    third = make_claim(ledger, "vm-b", ids["h3"], SHARED2, group=ANTI, slot=host_slot(ANTI, "h3"))
    assert ledger.claim([third])[0].ok
    assert_clean(ledger)


# --- affinity ---------------------------------------------------------------------------


def test_strict_affinity_is_refused_when_a_member_sits_elsewhere(ledger: Ledger) -> None:
    ids = register(ledger, "h1", "h2")
    ledger.create_group(AFFINITY)
    a = make_claim(ledger, "vm-a", ids["h1"], SHARED2, group=AFFINITY)
    assert a.affinity_groups == (AFFINITY.id,)
    assert ledger.claim([a])[0].ok

    outcomes = ledger.claim(
        [
            make_claim(ledger, "vm-b", ids["h2"], SHARED2, group=AFFINITY),
            make_claim(ledger, "vm-c", ids["h1"], SHARED2, group=AFFINITY),
        ]
    )

    assert [o.ok for o in outcomes] == [False, True]
    assert outcomes[0].code is RefusalCode.AFFINITY
    assert "h1" in outcomes[0].reason
    assert_refused_without_trace(ledger, "vm-b")
    idle(ledger, ids["h2"])
    assert_clean(ledger)


# --- the audit finds what the keys cannot ----------------------------------------------


def _placed_pair(ledger: Ledger, group: ServerGroup) -> dict[str, int]:
    """vm-a on h1 (pinned) and vm-b on h2 (shared), both members of `group`."""
    ids = register(ledger, "h1", "h2")
    ledger.create_group(group)
    slots: Mapping[str, GroupSlot | None] = {
        name: host_slot(group, name) if group.slotted else None for name in ("h1", "h2")
    }
    a = make_claim(ledger, "vm-a", ids["h1"], PINNED4, group=group, slot=slots["h1"])
    assert ledger.claim([a])[0].ok
    b = make_claim(ledger, "vm-b", ids["h2"], SHARED2, group=group, slot=slots["h2"])
    if _is_affinity(group):
        # Affinity would refuse vm-b on h2; place it with h1's member first, then move it.
        b = make_claim(ledger, "vm-b", ids["h1"], SHARED2, group=group)
    assert ledger.claim([b])[0].ok
    assert_clean(ledger)
    return ids


def test_audit_reports_usage_that_differs_from_the_sum_of_claims(ledger: Ledger) -> None:
    ids = _placed_pair(ledger, ANTI)

    corrupt(
        ledger,
        "UPDATE inventories SET used = used + 5 WHERE host_id = :h AND resource_class != 'PCPU'",
        h=ids["h1"],
    )

    assert violations(ledger) == {
        "[usage.mismatch] h1 VCPU: usage 5, claims add up to 0",
        "[usage.mismatch] h1 MEMORY_MB: usage 1029, claims add up to 1024",
        "[usage.mismatch] h1 DISK_GB: usage 15, claims add up to 10",
    }


def test_audit_reports_numa_cell_memory_that_differs_from_the_claims(ledger: Ledger) -> None:
    ids = _placed_pair(ledger, ANTI)

    corrupt(
        ledger,
        "UPDATE cells SET memory_mb_used = memory_mb_used + 100 WHERE host_id = :h",
        h=ids["h1"],
    )

    assert violations(ledger) == {
        "[numa.memory_mismatch] h1 cell 0: usage 1124 MB, claims add up to 1024 MB",
        "[numa.memory_mismatch] h1 cell 1: usage 100 MB, claims add up to 0 MB",
    }


def test_audit_reports_two_anti_affinity_members_on_one_host(ledger: Ledger) -> None:
    ids = _placed_pair(ledger, ANTI)

    corrupt(ledger, "UPDATE consumers SET host_id = :h WHERE id = 'vm-b'", h=ids["h1"])

    assert violations(ledger) == {
        "[group.anti_affinity] group web (g-anti): 2 members on host=h1, at most 1 allowed",
        f"[claim.host_mismatch] consumer vm-b holds claims on host {ids['h2']} "
        f"but is placed on {ids['h1']}",
    }


def test_audit_reports_an_affinity_group_split_over_hosts(ledger: Ledger) -> None:
    ids = _placed_pair(ledger, AFFINITY)

    corrupt(ledger, "UPDATE consumers SET host_id = :h WHERE id = 'vm-b'", h=ids["h2"])

    found = violations(ledger)
    assert "[group.affinity] group db (g-aff) spans ['h1', 'h2']" in found
    assert any(v.startswith("[claim.host_mismatch] consumer vm-b") for v in found)


def test_audit_reports_a_pin_whose_consumer_holds_no_pcpu_allocation(ledger: Ledger) -> None:
    ids = _placed_pair(ledger, ANTI)
    assert ledger.release("vm-b", forget=False)  # vm-b stays known, holding nothing

    corrupt(
        ledger,
        "INSERT INTO pins (host_id, cpu_id, consumer_seq, guest_vcpu, dedicated) "
        "VALUES (:h, 4, (SELECT seq FROM consumers WHERE id = 'vm-b'), NULL, :t)",
        h=ids["h1"],
        t=True,
    )

    assert violations(ledger) == {
        "[pcpu.claim_mismatch] vm-b on h1: PCPU allocation 0 but 1 pinned pCPUs"
    }


def test_audit_reports_claims_left_behind_by_a_deleted_consumer(ledger: Ledger) -> None:
    ids = _placed_pair(ledger, ANTI)
    (gone,) = read(ledger, select(consumers.c.seq).where(consumers.c.id == "vm-a"))[0]

    corrupt_without_foreign_keys(
        ledger,
        "DELETE FROM consumers WHERE id = 'vm-a'",
        # A pin on a shared CPU (2) for a live consumer: the pcpus key would refuse it.
        f"INSERT INTO pins (host_id, cpu_id, consumer_seq, guest_vcpu, dedicated) "
        f"VALUES ({ids['h2']}, 2, (SELECT seq FROM consumers WHERE id = 'vm-b'), 0, true)",
    )

    found = violations(ledger)
    assert {
        f"[claim.orphan] allocation held by unknown consumer key {gone}",
        f"[claim.orphan] NUMA claim held by unknown consumer key {gone}",
        f"[claim.orphan] pin held by unknown consumer key {gone}",
        f"[claim.orphan] group slot held by unknown consumer key {gone}",
        "[pcpu.not_dedicated] h2 pCPU 2 pinned by vm-b is not in cpu_dedicated_set",
        "[pcpu.claim_mismatch] vm-b on h2: PCPU allocation 0 but 1 pinned pCPUs",
    } <= found


def test_an_instances_claim_is_keyed_by_its_instance_id(ledger: Ledger) -> None:
    """An instance's consumer row is found by its `id` alone (only moves have `instance_id`
    indexed), so the ledger refuses to key one by anything else, and writes nothing."""
    ids = register(ledger, "h1")
    odd = make_claim(ledger, "c-1", ids["h1"], SHARED2, instance_id="vm-1")
    with pytest.raises(ValueError, match="keyed by its instance id"):
        ledger.claim([odd])
    assert read(ledger, select(func.count()).select_from(consumers)) == [(0,)]


def test_a_groups_members_are_read_by_index_with_their_moves(tmp_path: Any) -> None:
    """The statements that find a group's members' consumers on the claim path (a claim's
    affinity check, a view's first read of a group) search `consumers` through an index, and
    see a member's move as well as the member."""
    from sqlalchemy import event

    from stowage.scheduling.view import View

    url = f"sqlite:///{tmp_path / 'members.db'}"
    ledger = Ledger.open(url)
    try:
        ids = register(ledger, "h1", "h2")
        ledger.create_group(AFFINITY)
        [first] = ledger.claim([make_claim(ledger, "vm-a", ids["h1"], SHARED2, group=AFFINITY)])
        assert first.ok
        move = make_claim(
            ledger, "mig-a", ids["h2"], SHARED2, instance_id="vm-a", kind=ConsumerKind.MIGRATION
        )
        assert ledger.claim([move])[0].ok
        seen: list[tuple[str, Any]] = []

        def capture(conn: Any, cursor: Any, sql: str, params: Any, *_: Any) -> None:
            if "group_members" in sql and "consumers" in sql:
                seen.append((sql, params))

        event.listen(ledger.engine, "before_cursor_execute", capture)
        # vm-a sits on h1 and its move on h2: an affinity member cannot join either alone.
        [refused] = ledger.claim([make_claim(ledger, "vm-b", ids["h1"], SHARED2, group=AFFINITY)])
        view = View()  # empty: the group's first read is ensure_group's
        ledger.ensure_group(view, AFFINITY.id)
        event.remove(ledger.engine, "before_cursor_execute", capture)
        assert refused.code is RefusalCode.AFFINITY, refused
        assert "h2" in refused.reason
        per_host = view.groups[AFFINITY.id].per_host
        assert (per_host[ids["h1"]], per_host[ids["h2"]]) == (1, 1)
        assert len(seen) >= 3, [s for s, _ in seen]
        with ledger.engine.connect() as conn:
            for sql, params in seen:
                plan = [
                    str(r[-1]) for r in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + sql, params)
                ]
                scans = [p for p in plan if p.startswith("SCAN consumers")]
                assert not scans, (sql, plan)
    finally:
        ledger.close()


def test_a_claim_bumps_its_hosts_generation_without_writing_the_hosts_row(
    ledger: Ledger,
) -> None:
    """Every claim bumps its host's generation first (the lock writers take in id order).
    In `hosts` that rewrote the row holding the topology: 43 of the 159 pages a batch of 256
    claims wrote at 10,000 hosts. The generation has a narrow table of its own."""
    from sqlalchemy import event

    ids = register(ledger, "h1", "h2")
    seen: list[str] = []

    def capture(conn: Any, cursor: Any, sql: str, *_: Any) -> None:
        seen.append(" ".join(sql.split()))

    event.listen(ledger.engine, "before_cursor_execute", capture)
    try:
        [placed] = ledger.claim([make_claim(ledger, "vm-a", ids["h1"], PINNED4)])
        ledger.release("vm-a")
    finally:
        event.remove(ledger.engine, "before_cursor_execute", capture)
    assert placed.ok
    assert [s for s in seen if s.startswith("UPDATE host_generations")], seen
    assert not [s for s in seen if s.startswith("UPDATE hosts")], seen
    generations = dict(
        read(ledger, select(host_generations.c.host_id, host_generations.c.generation))
    )
    assert generations == {ids["h1"]: 2, ids["h2"]: 0}
