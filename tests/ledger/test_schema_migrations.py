"""Alembic migrations: head builds exactly the schema the models describe, both ways, twice."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import CheckConstraint, Engine, inspect
from typer.testing import CliRunner

from stowage.cli import app
from stowage.domain.topology import HostSpec, HostTopology
from stowage.ledger import Ledger, audit, make_engine, migrate
from stowage.ledger.db import alembic_config
from stowage.ledger.schema import metadata

MODEL_TABLES = set(metadata.tables)


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    made = make_engine(db_url)
    yield made
    made.dispose()


def tables(engine: Engine) -> set[str]:
    return set(inspect(engine).get_table_names())


def url_of(engine: Engine) -> str:
    return engine.url.render_as_string(hide_password=False)


def head(engine: Engine) -> str | None:
    return ScriptDirectory.from_config(alembic_config(url_of(engine))).get_current_head()


def current(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def schema_diff(engine: Engine) -> list[Any]:
    """What autogenerate would write to bring the database to the models."""
    with engine.connect() as conn:
        context = MigrationContext.configure(
            conn, opts={"compare_type": True, "compare_server_default": True}
        )
        return list(compare_metadata(context, metadata))


def test_upgrade_from_an_empty_database_creates_every_model_table(engine: Engine) -> None:
    assert tables(engine) == set()

    migrate(engine)

    assert tables(engine) == MODEL_TABLES | {"alembic_version"}
    assert head(engine) is not None
    assert current(engine) == head(engine)


def test_head_matches_the_models_exactly(engine: Engine) -> None:
    migrate(engine)

    assert schema_diff(engine) == []


def test_head_has_every_check_constraint_of_the_models(engine: Engine) -> None:
    """Autogenerate does not compare CHECK constraints, and the ledger leans on them."""
    migrate(engine)
    inspector = inspect(engine)

    for table in metadata.sorted_tables:
        wanted = {c.name for c in table.constraints if isinstance(c, CheckConstraint) and c.name}
        found = {c["name"] for c in inspector.get_check_constraints(table.name)}
        assert wanted <= found, table.name


def test_upgrading_twice_changes_nothing(engine: Engine) -> None:
    migrate(engine)
    migrate(engine)

    assert current(engine) == head(engine)
    assert schema_diff(engine) == []


def test_downgrade_to_base_and_upgrade_again(engine: Engine) -> None:
    migrate(engine)
    config = alembic_config(url_of(engine))

    command.downgrade(config, "base")
    assert tables(engine) - {"alembic_version"} == set()
    assert current(engine) is None

    command.upgrade(config, "head")
    assert tables(engine) == MODEL_TABLES | {"alembic_version"}
    assert current(engine) == head(engine)
    assert schema_diff(engine) == []
    ledger = Ledger(engine)
    ledger.register_host(HostSpec("h1", HostTopology.uniform(cells=1, cores_per_cell=2)))
    assert audit(ledger) == []


def test_db_upgrade_command_is_idempotent(db_url: str, engine: Engine) -> None:
    runner = CliRunner()

    for _ in range(2):
        result = runner.invoke(app, ["db-upgrade", "--db", db_url], env={"COLUMNS": "300"})
        assert result.exit_code == 0, result.output
        assert "ledger at revision head" in result.output

    assert tables(engine) == MODEL_TABLES | {"alembic_version"}
    assert current(engine) == head(engine)


def test_a_ledger_with_claims_upgrades_from_the_first_schema_intact(engine: Engine) -> None:
    """Every revision after 0001 applies to a ledger in use: claims and usage survive."""
    from stowage.domain.claims import Claim
    from stowage.domain.flavor import Flavor, shape_of
    from stowage.domain.numa import HostFree, fit_instance
    from stowage.domain.topology import ResourceClass

    migrate(engine, "0001")
    ledger = Ledger(engine)
    topology = HostTopology.uniform(cells=2, cores_per_cell=4, threads_per_core=2)
    host_id = ledger.register_host(HostSpec("old-host", topology))
    # A fresh host has all of it free (no view: today's code reads columns 0001 lacks).
    free = HostFree(topology.cpu_dedicated_set, {c.id: c.memory_mb for c in topology.cells})
    shape = shape_of(Flavor("pinned", 2, 1024, 10, {"hw:cpu_policy": "dedicated"}))
    fit = fit_instance(shape, topology, free)
    assert not isinstance(fit, str) and hasattr(fit, "cpus")
    amounts = dict(shape.amounts())
    amounts[ResourceClass.PCPU] = len(fit.cpus)  # type: ignore[union-attr]
    outcome = ledger.claim([Claim("vm-old", "vm-old", host_id, amounts, fit)])  # type: ignore[arg-type]
    assert outcome[0].ok

    migrate(engine)

    assert current(engine) == head(engine)
    assert audit(ledger) == []
    after = ledger.load_view().hosts[host_id]
    assert after.used[ResourceClass.PCPU] == 2
    assert after.used[ResourceClass.MEMORY_MB] == 1024
    assert ledger.release("vm-old") is True
    assert audit(ledger) == []


def test_a_ledger_in_use_upgrades_from_0005_to_block_storage(engine: Engine) -> None:
    """0006 adds storage pools and volume claims beside a ledger with hosts: they hold
    gigabytes, refuse an overcommit by the pool's CHECK, and audit clean."""
    from stowage.ledger.storage import (
        StorageCapacityExceeded,
        claim_storage,
        ensure_pool,
        pool_usage,
        release_storage,
    )

    migrate(engine, "0005")
    ledger = Ledger(engine)
    ledger.register_host(
        HostSpec("old-host", HostTopology.uniform(cells=1, cores_per_cell=2, threads_per_core=1))
    )
    migrate(engine)
    assert current(engine) == head(engine)
    with engine.begin() as conn:
        ensure_pool(conn, "local", "local-file", 10)
        claim_storage(conn, "local", "vol-1", "volume", "p", 6)
    with pytest.raises(StorageCapacityExceeded), engine.begin() as conn:
        claim_storage(conn, "local", "vol-2", "volume", "p", 5)
    with engine.begin() as conn:
        assert [p.used_gb for p in pool_usage(conn)] == [6]
        assert release_storage(conn, "vol-1") is True
        assert release_storage(conn, "vol-1") is False
        assert [p.free_gb for p in pool_usage(conn)] == [10]
    assert audit(ledger) == []


def test_ports_written_before_0007_are_found_by_their_device_after_it(engine: Engine) -> None:
    """0007 indexes what a port refers to (its device): ports stored before it are filled in
    by the upgrade, and every later write keeps the column what the body says."""
    import json

    from sqlalchemy import insert

    from stowage.ledger.objects import ObjectStore
    from stowage.ledger.schema import objects

    migrate(engine, "0006")
    with engine.begin() as conn:
        for port_id, device in (("p-1", "vm-1"), ("p-2", "vm-2"), ("p-3", "")):
            conn.execute(
                insert(objects).values(
                    kind="port",
                    id=port_id,
                    project_id="p",
                    name="",
                    created_at=1.0,
                    updated_at=1.0,
                    body=json.dumps({"id": port_id, "device_id": device}, sort_keys=True),
                )
            )
    migrate(engine)
    store = ObjectStore(engine)
    assert [d.id for d in store.list("port", ref="vm-1")] == ["p-1"]
    assert store.list("port", ref="") == []  # no device: no ref

    # Every write path of the store keeps the ref to the body.
    store.update("port", "p-3", {"id": "p-3", "device_id": "vm-1"})
    assert [d.id for d in store.list("port", ref="vm-1")] == ["p-1", "p-3"]
    assert store.swap("port", "p-1", store.get("port", "p-1").body, {"id": "p-1", "device_id": ""})
    with engine.begin() as conn:
        store.update_in(conn, "port", "p-2", {"id": "p-2", "device_id": "vm-1"})
        store.create_in(conn, "port", "p-4", {"id": "p-4", "device_id": "vm-1"})
    assert [d.id for d in store.list("port", ref="vm-1")] == ["p-2", "p-3", "p-4"]
    with pytest.raises(ValueError):
        store.list("network", ref="vm-1")  # networks keep no ref


def test_address_claims_are_keyed_by_subnet_and_address_from_0008(engine: Engine) -> None:
    """0008 re-keys the address claims made before it (uuid5 ids) as `<subnet>/<address>`,
    so a subnet's used addresses are read from ids alone; a downgrade keys them back."""
    import json
    import uuid

    from sqlalchemy import insert, select

    from stowage.ledger.objects import ObjectStore
    from stowage.ledger.schema import objects
    from stowage.services.networks.common import _uuid5

    migrate(engine, "0007")
    claims = [("sub-1", "10.0.0.2"), ("sub-1", "10.0.0.3"), ("sub-2", "fd00::2")]
    with engine.begin() as conn:
        for subnet, address in claims:
            body = {"subnet_id": subnet, "ip_address": address, "port_id": str(uuid.uuid4())}
            conn.execute(
                insert(objects).values(
                    kind="ip_allocation",
                    id=_uuid5("ip", subnet, address),
                    project_id=None,
                    name=subnet,
                    created_at=1.0,
                    updated_at=1.0,
                    body=json.dumps(body, sort_keys=True),
                )
            )
    migrate(engine)
    store = ObjectStore(engine)
    assert sorted(store.ids("ip_allocation", name="sub-1")) == ["sub-1/10.0.0.2", "sub-1/10.0.0.3"]
    assert store.ids("ip_allocation", name="sub-2") == ["sub-2/fd00::2"]
    command.downgrade(alembic_config(url_of(engine)), "0007")
    with engine.connect() as conn:
        ids = set(
            conn.execute(select(objects.c.id).where(objects.c.kind == "ip_allocation")).scalars()
        )
    assert ids == {_uuid5("ip", s, a) for s, a in claims}
