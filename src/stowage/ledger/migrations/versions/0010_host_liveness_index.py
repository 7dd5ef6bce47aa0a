"""hosts: a covering index of the liveness columns, for the schedulers' frequent read

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02 06:00:00
"""

from __future__ import annotations

from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_hosts_liveness", "hosts", ["last_seen", "forced_down", "disabled"])


def downgrade() -> None:
    op.drop_index("ix_hosts_liveness", table_name="hosts")
