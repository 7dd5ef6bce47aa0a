"""Hosts registered one by one and in bulk: the same rows, in every table registration writes."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
from sqlalchemy import select
from tests.conftest import pg_schema_url

from stowage.domain.topology import HostSpec, HostTopology, ResourceClass
from stowage.ledger import Ledger, audit, make_engine, migrate
from stowage.ledger.schema import cells, changes, hosts, inventories, pcpus

TWO_CELLS = HostTopology.uniform(
    cells=2, cores_per_cell=4, threads_per_core=2, memory_mb_per_cell=4096
)
ONE_CELL = HostTopology.uniform(
    cells=1, cores_per_cell=3, threads_per_core=1, memory_mb_per_cell=2048
)
T0 = 1_000_000.0


def specs() -> list[HostSpec]:
    """Hosts that differ in every field registration writes, one with no disk inventory."""
    return [
        HostSpec("h-a", TWO_CELLS, disk_gb=100, labels={"rack": "r1", "row": "2"}),
        HostSpec(
            "h-b",
            ONE_CELL,
            disk_gb=0,
            reserved={ResourceClass.MEMORY_MB: 512},
            allocation_ratios={ResourceClass.VCPU: 4.0},
            availability_zone="az2",
            hypervisor_type="qemu",
            architecture="aarch64",
        ),
        HostSpec("h-c", TWO_CELLS, disk_gb=7),
    ]


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def two_urls(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """Two fresh, empty ledger databases on one backend."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'one.db'}", f"sqlite:///{tmp_path / 'bulk.db'}"
        return
    with ExitStack() as stack:
        urls = [stack.enter_context(contextmanager(pg_schema_url)()) for _ in range(2)]
        yield urls[0], urls[1]


def _ledger(url: str) -> Ledger:
    engine = make_engine(url)
    migrate(engine)
    return Ledger(engine, clock=lambda: T0)


def _rows(ledger: Ledger) -> dict[str, list[tuple[object, ...]]]:
    out = {}
    with ledger.engine.connect() as conn:
        for table in (hosts, cells, pcpus, inventories, changes):
            order = table.primary_key.columns
            out[table.name] = [tuple(r) for r in conn.execute(select(table).order_by(*order))]
    return out


def test_bulk_registration_writes_the_rows_single_registration_does(
    two_urls: tuple[str, str],
) -> None:
    one_url, bulk_url = two_urls
    one, bulk = _ledger(one_url), _ledger(bulk_url)
    try:
        one_ids = [one.register_host(spec) for spec in specs()]
        bulk_ids = bulk.register_hosts(specs())
        assert one_ids == bulk_ids
        one_rows, bulk_rows = _rows(one), _rows(bulk)
        assert one_rows == bulk_rows
        # Not vacuous: every table has the rows of every host.
        assert {r[0] for r in one_rows["hosts"]} == set(one_ids)
        for name in ("cells", "pcpus", "inventories", "changes"):
            column = 0 if name != "changes" else 1
            assert {r[column] for r in one_rows[name]} == set(one_ids), name
        assert len(one_rows["pcpus"]) == 2 * 16 + 3
        assert audit(one) == [] and audit(bulk) == []
    finally:
        one.close()
        bulk.close()


def test_bulk_registration_returns_ids_in_the_order_of_the_specs(db_url: str) -> None:
    ledger = _ledger(db_url)
    try:
        first = ledger.register_hosts(specs()[:1])
        ids = ledger.register_hosts(list(reversed(specs()[1:])))
        for host_id, spec in zip(
            first + ids, specs()[:1] + list(reversed(specs()[1:])), strict=True
        ):
            assert ledger.host_id(spec.name) == host_id
        # The single path stays idempotent on a host the bulk path registered.
        assert ledger.register_host(specs()[1]) == ledger.host_id("h-b")
        assert ledger.register_hosts([]) == []
    finally:
        ledger.close()


def test_the_schedulers_liveness_read_scans_an_index_not_the_hosts_rows(tmp_path: Path) -> None:
    """Every scheduler reads every host's liveness every few seconds: on SQLite from the
    covering index alone, never the rows with their topology JSON (at 100,000 hosts that scan
    was a third of a scheduler's time), and it reads what the rows say."""
    from stowage.ledger.ledger.views import _LIVENESS

    ledger = _ledger(f"sqlite:///{tmp_path / 'live.db'}")
    try:
        ledger.register_hosts(specs())
        ledger.set_host_state("h-b", forced_down=True, last_seen=T0 + 5)
        with ledger.engine.connect() as conn:
            plan = " ".join(
                str(r[-1]) for r in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + _LIVENESS)
            )
            rows = sorted(conn.exec_driver_sql(_LIVENESS).fetchall())
        assert "COVERING INDEX ix_hosts_liveness" in plan, plan
        assert [(r[1], bool(r[2]), bool(r[3])) for r in rows] == [
            (T0, False, False),
            (T0 + 5, True, False),
            (T0, False, False),
        ]
    finally:
        ledger.close()
