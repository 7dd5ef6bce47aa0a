"""consumers keyed by an integer `seq`; the claim tables reference it (was the UUID)

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02 04:40:00

The claim tables' keys and indexes then grow at their last page, in insert order, instead of
taking a random page for every claim (each page written is a WAL frame at commit). The UUID
stays on `consumers` as a unique `id`. Both ways rebuild the five tables and copy their rows
(read whole into memory: the claims of a ledger, a few rows an instance); new keys follow
the consumers' creation order.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

_CONSUMER = ("kind", "instance_id", "project_id", "user_id", "host_id", "generation", "created_at")
# Each claim table's columns, but the consumer's, in a fixed order.
_CLAIMS = {
    "allocations": ("host_id", "resource_class", "amount"),
    "numa_claims": ("host_id", "cell_id", "guest_cell", "memory_mb"),
    "pins": ("host_id", "cpu_id", "guest_vcpu", "dedicated"),
    "group_slots": ("group_id", "domain", "slot", "max_per_domain", "host_id"),
}


def _consumer_fk(table: str, column: str, keyed: bool) -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(
        [column],
        ["consumers.seq" if keyed else "consumers.id"],
        name=op.f(f"fk_{table}_{column}_consumers"),
    )


def _create(keyed: bool) -> None:
    """The five tables as this revision (`keyed`) or the one before describes them."""
    ref = "consumer_seq" if keyed else "consumer_id"
    ref_type: Any = sa.Integer() if keyed else sa.String(length=36)
    key_columns = (
        [
            sa.Column("seq", sa.Integer(), autoincrement=True, nullable=False),
            sa.Column("id", sa.String(length=36), nullable=False),
        ]
        if keyed
        else [sa.Column("id", sa.String(length=36), nullable=False)]
    )
    op.create_table(
        "consumers",
        *key_columns,
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("instance_id", sa.String(length=36), nullable=False),
        sa.Column("project_id", sa.String(length=64), nullable=False),
        sa.Column("user_id", sa.String(length=64), nullable=False),
        sa.Column("host_id", sa.Integer(), nullable=True),
        sa.Column("generation", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.CheckConstraint("kind IN ('instance', 'migration')", name="ck_consumers_kind"),
        sa.ForeignKeyConstraint(["host_id"], ["hosts.id"], name=op.f("fk_consumers_host_id_hosts")),
        sa.PrimaryKeyConstraint("seq" if keyed else "id", name=op.f("pk_consumers")),
        *([sa.UniqueConstraint("id", name=op.f("uq_consumers_id"))] if keyed else []),
    )
    op.create_index("ix_consumers_host_id", "consumers", ["host_id"])
    op.create_index("ix_consumers_instance_id", "consumers", ["instance_id"])
    op.create_table(
        "allocations",
        sa.Column(ref, ref_type, nullable=False),
        sa.Column("host_id", sa.Integer(), nullable=False),
        sa.Column("resource_class", sa.String(length=64), nullable=False),
        sa.Column("amount", sa.Integer(), nullable=False),
        sa.CheckConstraint("amount > 0", name="ck_allocations_amount"),
        _consumer_fk("allocations", ref, keyed),
        sa.PrimaryKeyConstraint(ref, "host_id", "resource_class", name=op.f("pk_allocations")),
    )
    op.create_index("ix_allocations_host_id", "allocations", ["host_id"])
    op.create_table(
        "numa_claims",
        sa.Column(ref, ref_type, nullable=False),
        sa.Column("host_id", sa.Integer(), nullable=False),
        sa.Column("cell_id", sa.Integer(), nullable=False),
        sa.Column("guest_cell", sa.Integer(), nullable=False),
        sa.Column("memory_mb", sa.Integer(), nullable=False),
        _consumer_fk("numa_claims", ref, keyed),
        sa.PrimaryKeyConstraint(ref, "host_id", "cell_id", name=op.f("pk_numa_claims")),
    )
    op.create_index("ix_numa_claims_host_id", "numa_claims", ["host_id"])
    op.create_table(
        "pins",
        sa.Column("host_id", sa.Integer(), nullable=False),
        sa.Column("cpu_id", sa.Integer(), nullable=False),
        sa.Column(ref, ref_type, nullable=False),
        sa.Column("guest_vcpu", sa.Integer(), nullable=True),
        sa.Column("dedicated", sa.Boolean(), nullable=False),
        sa.CheckConstraint("dedicated", name="ck_pins_dedicated"),
        _consumer_fk("pins", ref, keyed),
        sa.ForeignKeyConstraint(
            ["host_id", "cpu_id", "dedicated"],
            ["pcpus.host_id", "pcpus.cpu_id", "pcpus.dedicated"],
            name=op.f("fk_pins_host_id_pcpus"),
        ),
        sa.PrimaryKeyConstraint("host_id", "cpu_id", name=op.f("pk_pins")),
    )
    op.create_index(f"ix_pins_{ref}", "pins", [ref])
    op.create_table(
        "group_slots",
        sa.Column("group_id", sa.String(length=36), nullable=False),
        sa.Column("domain", sa.String(length=255), nullable=False),
        sa.Column("slot", sa.Integer(), nullable=False),
        sa.Column("max_per_domain", sa.Integer(), nullable=False),
        sa.Column(ref, ref_type, nullable=False),
        sa.Column("host_id", sa.Integer(), nullable=False),
        sa.CheckConstraint("slot >= 0 AND slot < max_per_domain", name="ck_group_slots_slot"),
        _consumer_fk("group_slots", ref, keyed),
        sa.ForeignKeyConstraint(
            ["group_id"], ["server_groups.id"], name=op.f("fk_group_slots_group_id_server_groups")
        ),
        sa.ForeignKeyConstraint(
            ["host_id"], ["hosts.id"], name=op.f("fk_group_slots_host_id_hosts")
        ),
        sa.PrimaryKeyConstraint("group_id", "domain", "slot", name=op.f("pk_group_slots")),
        sa.UniqueConstraint("group_id", ref, name="uq_group_slots_consumer"),
    )
    op.create_index(f"ix_group_slots_{ref}", "group_slots", [ref])
    op.create_index("ix_group_slots_host_id", "group_slots", ["host_id"])


def _rebuild(keyed: bool) -> None:
    """Read the five tables, create them again in the other shape, write the rows back."""
    conn = op.get_bind()
    old_ref, new_ref = ("consumer_id", "consumer_seq") if keyed else ("consumer_seq", "consumer_id")
    key = "id" if keyed else "seq"
    consumers = conn.execute(
        sa.text(f"SELECT {key}, id, {', '.join(_CONSUMER)} FROM consumers ORDER BY created_at, id")
    ).all()
    claims = {
        table: conn.execute(sa.text(f"SELECT {old_ref}, {', '.join(cols)} FROM {table}")).all()
        for table, cols in _CLAIMS.items()
    }
    # consumer_id -> new seq (upgrade), or seq -> consumer_id (downgrade).
    to_new = {row[0]: (n if keyed else row[1]) for n, row in enumerate(consumers, start=1)}
    for table, rows in claims.items():
        unknown = {r[0] for r in rows} - set(to_new)
        if unknown:
            raise RuntimeError(
                f"{table} holds claims of consumers the ledger lacks ({sorted(unknown)[:3]}): "
                "run `stowage audit` and clean them up before migrating"
            )
    for table in ("group_slots", "pins", "numa_claims", "allocations", "consumers"):
        op.drop_table(table)
    _create(keyed)
    columns = (("seq", "id") if keyed else ("id",)) + _CONSUMER
    _insert(
        "consumers",
        columns,
        [
            ((n, row[1]) if keyed else (row[1],)) + tuple(row[2:])
            for n, row in enumerate(consumers, 1)
        ],
    )
    for table, rows in claims.items():
        _insert(table, (new_ref, *_CLAIMS[table]), [(to_new[r[0]], *r[1:]) for r in rows])
    if keyed and conn.dialect.name == "postgresql":
        # Rows written with their keys leave the serial's sequence behind: the next is n + 1.
        conn.execute(
            sa.text(
                "SELECT setval(pg_get_serial_sequence('consumers', 'seq'), "
                "coalesce(max(seq), 0) + 1, false) FROM consumers"
            )
        )


def _insert(table: str, columns: tuple[str, ...], rows: list[tuple[Any, ...]]) -> None:
    if rows:
        target = sa.table(table, *(sa.column(c) for c in columns))
        op.get_bind().execute(target.insert(), [dict(zip(columns, r, strict=True)) for r in rows])


def upgrade() -> None:
    _rebuild(keyed=True)


def downgrade() -> None:
    _rebuild(keyed=False)
