"""hosts' generations in a narrow table of their own

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06 03:40:00

Every claim and release bumps the generation of each host it touches (the first lock every
writer takes, in id order). In `hosts` that rewrote the row that also holds the topology, a
page of the database per few hosts; `host_generations` holds about a thousand hosts a page.
`ALTER TABLE ... DROP COLUMN` needs SQLite 3.35 or newer.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "host_generations",
        sa.Column(
            "host_id",
            sa.Integer(),
            sa.ForeignKey("hosts.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("generation", sa.Integer(), nullable=False),
    )
    op.execute(
        "INSERT INTO host_generations (host_id, generation) SELECT id, generation FROM hosts"
    )
    op.execute("ALTER TABLE hosts DROP COLUMN generation")


def downgrade() -> None:
    op.add_column(
        "hosts", sa.Column("generation", sa.Integer(), nullable=False, server_default="0")
    )
    op.execute(
        "UPDATE hosts SET generation = "
        "(SELECT generation FROM host_generations WHERE host_id = hosts.id)"
    )
    op.drop_table("host_generations")
