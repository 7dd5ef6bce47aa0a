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


def _claim_by_uuid(
    engine: Engine, consumer: str, instance: str, host_id: int, kind: str = "instance"
) -> None:
    """A pinned claim of 2 pCPUs and 1024 MB on a cell, written as the ledger wrote it
    before 0009 (its tables keyed by the consumer's UUID): today's code writes 0009's."""
    from sqlalchemy import text

    with engine.begin() as conn:
        cpus = conn.execute(
            text(
                "SELECT p.cpu_id, p.cell_id FROM pcpus p WHERE p.host_id = :h AND p.dedicated "
                "AND NOT EXISTS (SELECT 1 FROM pins WHERE pins.host_id = p.host_id "
                "AND pins.cpu_id = p.cpu_id) ORDER BY p.cpu_id LIMIT 2"
            ),
            {"h": host_id},
        ).all()
        cell = cpus[0].cell_id
        conn.execute(
            text(
                "INSERT INTO consumers (id, kind, instance_id, project_id, user_id, host_id, "
                "generation, created_at) VALUES (:c, :k, :i, 'p', 'u', :h, 0, 1.0)"
            ),
            {"c": consumer, "k": kind, "i": instance, "h": host_id},
        )
        for rc, amount in (("PCPU", 2), ("MEMORY_MB", 1024)):
            conn.execute(
                text(
                    "INSERT INTO allocations (consumer_id, host_id, resource_class, amount) "
                    "VALUES (:c, :h, :rc, :a)"
                ),
                {"c": consumer, "h": host_id, "rc": rc, "a": amount},
            )
            conn.execute(
                text(
                    "UPDATE inventories SET used = used + :a "
                    "WHERE host_id = :h AND resource_class = :rc"
                ),
                {"h": host_id, "rc": rc, "a": amount},
            )
        conn.execute(
            text(
                "INSERT INTO numa_claims (consumer_id, host_id, cell_id, guest_cell, memory_mb) "
                "VALUES (:c, :h, :cell, 0, 1024)"
            ),
            {"c": consumer, "h": host_id, "cell": cell},
        )
        conn.execute(
            text(
                "UPDATE cells SET memory_mb_used = memory_mb_used + 1024 "
                "WHERE host_id = :h AND cell_id = :cell"
            ),
            {"h": host_id, "cell": cell},
        )
        for vcpu, (cpu, _) in enumerate(cpus):
            conn.execute(
                text(
                    "INSERT INTO pins (host_id, cpu_id, consumer_id, guest_vcpu, dedicated) "
                    "VALUES (:h, :cpu, :c, :v, :t)"
                ),
                {"h": host_id, "cpu": cpu, "c": consumer, "v": vcpu, "t": True},
            )


def _host_before_0012(ledger: Ledger, spec: HostSpec) -> int:
    """A host registered as before 0012, with its generation in its own row: today's
    registration writes `host_generations`, which the earlier revisions lack."""
    from sqlalchemy import text

    from stowage.ledger.ledger.topology import topology_to_json

    with ledger.engine.begin() as conn:
        host_id = conn.execute(
            text(
                "INSERT INTO hosts (uuid, name, availability_zone, labels, hypervisor_type, "
                "architecture, topology, disabled, forced_down, last_seen, generation) "
                "VALUES (:uuid, :name, 'nova', '{}', 'sim', 'x86_64', :topology, false, false, "
                "0, 0) RETURNING id"
            ),
            {
                "uuid": f"uuid-of-{spec.name}",
                "name": spec.name,
                "topology": topology_to_json(spec.topology),
            },
        ).scalar_one()
        ledger._insert_host_parts(conn, [host_id], [spec])
        conn.execute(text("INSERT INTO changes (host_id, at) VALUES (:h, 0)"), {"h": host_id})
    return int(host_id)


def _claim_rows(engine: Engine) -> dict[str, set[tuple[Any, ...]]]:
    """Every claim row, with its consumer named by UUID whatever the revision keys it by."""
    from sqlalchemy import text

    with engine.connect() as conn:
        keyed = "seq" in {c["name"] for c in inspect(conn).get_columns("consumers")}
        consumer = "k.id" if keyed else "t.consumer_id"
        join = " JOIN consumers k ON k.seq = t.consumer_seq" if keyed else ""
        columns = {
            "allocations": "t.host_id, t.resource_class, t.amount",
            "numa_claims": "t.host_id, t.cell_id, t.guest_cell, t.memory_mb",
            "pins": "t.host_id, t.cpu_id, t.guest_vcpu",
            "group_slots": "t.group_id, t.domain, t.slot, t.max_per_domain, t.host_id",
        }
        rows = {
            table: {
                tuple(r)
                for r in conn.execute(text(f"SELECT {consumer}, {cols} FROM {table} t{join}"))
            }
            for table, cols in columns.items()
        }
        rows["consumers"] = {
            tuple(r)
            for r in conn.execute(
                text("SELECT id, kind, instance_id, project_id, user_id, host_id FROM consumers")
            )
        }
    return rows


def test_a_ledger_with_claims_upgrades_from_the_first_schema_intact(engine: Engine) -> None:
    """Every revision after 0001 applies to a ledger in use: claims and usage survive."""
    from stowage.domain.topology import ResourceClass

    migrate(engine, "0001")
    ledger = Ledger(engine)
    topology = HostTopology.uniform(cells=2, cores_per_cell=4, threads_per_core=2)
    host_id = _host_before_0012(ledger, HostSpec("old-host", topology))
    _claim_by_uuid(engine, "vm-old", "vm-old", host_id)

    migrate(engine)

    assert current(engine) == head(engine)
    assert audit(ledger) == []
    after = ledger.load_view().hosts[host_id]
    assert after.used[ResourceClass.PCPU] == 2
    assert after.used[ResourceClass.MEMORY_MB] == 1024
    assert ledger.release("vm-old") is True
    assert audit(ledger) == []


def test_claims_keyed_by_uuid_are_keyed_by_integer_from_0009_and_back(engine: Engine) -> None:
    """0009 keys consumers by an integer the claim tables reference: an instance, its move
    in flight and its group slot upgrade intact, downgrade to the same rows, and the ledger
    goes on with them (a move completes, new consumers get keys after the old ones)."""
    from sqlalchemy import text

    from stowage.domain.groups import parse_group
    from stowage.domain.topology import ResourceClass

    migrate(engine, "0008")
    ledger = Ledger(engine)
    topology = HostTopology.uniform(cells=2, cores_per_cell=4, threads_per_core=2)
    h1 = _host_before_0012(ledger, HostSpec("h1", topology))
    h2 = _host_before_0012(ledger, HostSpec("h2", topology))
    ledger.create_group(parse_group("g-1", "web", "anti-affinity", {}, project_id="p"))
    _claim_by_uuid(engine, "vm-a", "vm-a", h1)
    _claim_by_uuid(engine, "mig-a", "vm-a", h2, kind="migration")
    _claim_by_uuid(engine, "vm-b", "vm-b", h1)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO group_members VALUES ('g-1', 'vm-a')"))
        conn.execute(
            text(
                "INSERT INTO group_slots (group_id, domain, slot, max_per_domain, consumer_id, "
                "host_id) VALUES ('g-1', 'host=h1', 0, 1, 'vm-a', :h)"
            ),
            {"h": h1},
        )
    before = _claim_rows(engine)
    assert {t: len(rows) for t, rows in before.items()} == {
        "allocations": 6,
        "numa_claims": 3,
        "pins": 6,
        "group_slots": 1,
        "consumers": 3,
    }

    migrate(engine)
    assert _claim_rows(engine) == before
    assert audit(ledger) == []
    command.downgrade(alembic_config(url_of(engine)), "0008")
    assert _claim_rows(engine) == before
    migrate(engine)
    assert _claim_rows(engine) == before
    assert schema_diff(engine) == []

    assert ledger.consumer_host("vm-a") == h1
    assert ledger.complete_migration("mig-a") is True
    assert ledger.consumer_host("vm-a") == h2
    assert ledger.consumer_host("mig-a") is None
    view = ledger.load_view()
    assert view.hosts[h1].used[ResourceClass.PCPU] == 2  # vm-b's
    assert view.hosts[h2].used[ResourceClass.PCPU] == 2
    assert audit(ledger) == []
    # A new consumer's key follows the upgraded ones (PostgreSQL's sequence moved on too).
    _claim_by_uuid_today(ledger, "vm-c", h2)
    with engine.connect() as conn:
        keys = {r.id: r.seq for r in conn.execute(text("SELECT id, seq FROM consumers"))}
    assert keys["vm-c"] > max(keys["vm-a"], keys["vm-b"])
    assert ledger.release("vm-a") and ledger.release("vm-b") and ledger.release("vm-c")
    assert audit(ledger) == []
    assert _claim_rows(engine) == {table: set() for table in before}


def _claim_by_uuid_today(ledger: Ledger, consumer: str, host_id: int) -> None:
    """A plain 1 GiB claim through today's code."""
    from stowage.domain.claims import Claim
    from stowage.domain.numa import Fit
    from stowage.domain.topology import ResourceClass

    outcome = ledger.claim(
        [Claim(consumer, consumer, host_id, {ResourceClass.MEMORY_MB: 1024}, Fit(()))]
    )
    assert outcome[0].ok, outcome


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
    _host_before_0012(
        ledger,
        HostSpec("old-host", HostTopology.uniform(cells=1, cores_per_cell=2, threads_per_core=1)),
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


def _consumer_indexes(engine: Engine) -> dict[str, list[str]]:
    return {
        str(ix["name"]): [str(c) for c in ix["column_names"]]
        for ix in inspect(engine).get_indexes("consumers")
    }


def test_from_0011_only_moves_have_their_instance_id_indexed(engine: Engine) -> None:
    """0011 replaces the index of every consumer's `instance_id` (a write at a random page
    for every claim) with one of the moves' alone; an instance in flight is still found with
    its move, and a downgrade puts the full index back."""
    from sqlalchemy import insert, select

    from stowage.ledger.schema import consumers, consumers_of_instance

    migrate(engine, "0010")
    assert _consumer_indexes(engine)["ix_consumers_instance_id"] == ["instance_id"]
    rows = [
        {"seq": 1, "id": "vm-a", "kind": "instance", "instance_id": "vm-a"},
        {"seq": 2, "id": "mig-a", "kind": "migration", "instance_id": "vm-a"},
        {"seq": 3, "id": "vm-b", "kind": "instance", "instance_id": "vm-b"},
    ]
    common = {"project_id": "p", "user_id": "u", "generation": 0, "created_at": 1.0}
    with engine.begin() as conn:
        conn.execute(insert(consumers), [{**r, **common} for r in rows])
    migrate(engine)
    indexes = _consumer_indexes(engine)
    assert "ix_consumers_instance_id" not in indexes
    assert indexes["ix_consumers_migration_instance_id"] == ["instance_id"]
    with engine.connect() as conn:
        found = conn.execute(
            select(consumers.c.id).where(consumers_of_instance("vm-a")).order_by(consumers.c.id)
        ).scalars()
        assert list(found) == ["mig-a", "vm-a"]
        if engine.dialect.name == "sqlite":
            (sql,) = conn.exec_driver_sql(
                "SELECT sql FROM sqlite_master WHERE name = 'ix_consumers_migration_instance_id'"
            ).one()
            assert "WHERE kind = 'migration'" in sql, sql
    command.downgrade(alembic_config(url_of(engine)), "0010")
    assert _consumer_indexes(engine)["ix_consumers_instance_id"] == ["instance_id"]


def test_0011_refuses_an_instance_consumer_keyed_by_another_id(engine: Engine) -> None:
    """The moves-only index finds an instance's own row by its id: a ledger where that does
    not hold is refused, not upgraded into one whose lookups miss the row."""
    from sqlalchemy import insert

    from stowage.ledger.schema import consumers

    migrate(engine, "0010")
    with engine.begin() as conn:
        conn.execute(
            insert(consumers).values(
                seq=1,
                id="c-1",
                kind="instance",
                instance_id="vm-1",
                project_id="p",
                user_id="u",
                generation=0,
                created_at=1.0,
            )
        )
    with pytest.raises(RuntimeError, match="c-1 is an instance whose id is not its instance_id"):
        migrate(engine)
    assert current(engine) == "0010"


def test_from_0012_hosts_generations_have_a_table_of_their_own(engine: Engine) -> None:
    """0012 moves each host's generation out of `hosts` (whose rows hold the topology, so a
    claim's bump rewrote a wide row) into `host_generations`, values kept both ways."""
    from sqlalchemy import text

    migrate(engine, "0011")
    with engine.begin() as conn:
        for n, generation in ((1, 5), (2, 7)):
            conn.execute(
                text(
                    "INSERT INTO hosts (id, uuid, name, availability_zone, labels, "
                    "hypervisor_type, architecture, topology, disabled, forced_down, "
                    "generation) VALUES (:id, :uuid, :name, 'nova', '{}', 'sim', 'x86_64', "
                    "'{}', false, false, :generation)"
                ),
                {"id": n, "uuid": f"u-{n}", "name": f"h{n}", "generation": generation},
            )
    migrate(engine)
    assert "generation" not in {c["name"] for c in inspect(engine).get_columns("hosts")}
    with engine.connect() as conn:
        moved = conn.execute(text("SELECT host_id, generation FROM host_generations")).all()
    assert sorted(tuple(r) for r in moved) == [(1, 5), (2, 7)]
    command.downgrade(alembic_config(url_of(engine)), "0011")
    assert "host_generations" not in tables(engine)
    with engine.connect() as conn:
        back = conn.execute(text("SELECT id, generation FROM hosts ORDER BY id")).all()
    assert [tuple(r) for r in back] == [(1, 5), (2, 7)]
