"""hosts.aggregate_metadata: the host aggregates' metadata the scheduler filters on

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-29 22:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("hosts", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("aggregate_metadata", sa.Text(), server_default="{}", nullable=False)
        )


def downgrade() -> None:
    with op.batch_alter_table("hosts", schema=None) as batch_op:
        batch_op.drop_column("aggregate_metadata")
