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
