"""storage_pools and volume_claims: block storage capacity as claims

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 13:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "storage_pools",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("backend", sa.String(length=32), nullable=False),
        sa.Column("total_gb", sa.Integer(), nullable=False),
        sa.Column("reserved_gb", sa.Integer(), nullable=False),
        sa.Column("allocation_ratio", sa.Float(), nullable=False),
        sa.Column("used_gb", sa.Integer(), nullable=False),
        sa.CheckConstraint(
            "used_gb >= 0 AND used_gb <= (total_gb - reserved_gb) * allocation_ratio",
            name="ck_storage_pools_capacity",
        ),
        sa.PrimaryKeyConstraint("id", name="pk_storage_pools"),
        sa.UniqueConstraint("name", name="uq_storage_pools_name"),
    )
    op.create_table(
        "volume_claims",
        sa.Column("consumer_id", sa.String(length=36), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("pool_id", sa.Integer(), nullable=False),
        sa.Column("project_id", sa.String(length=64), nullable=False),
        sa.Column("gigabytes", sa.Integer(), nullable=False),
        sa.CheckConstraint("gigabytes > 0", name="ck_volume_claims_gigabytes"),
        sa.CheckConstraint("kind IN ('volume', 'snapshot')", name="ck_volume_claims_kind"),
        sa.ForeignKeyConstraint(
            ["pool_id"], ["storage_pools.id"], name="fk_volume_claims_pool_id_storage_pools"
        ),
        sa.PrimaryKeyConstraint("consumer_id", name="pk_volume_claims"),
    )
    op.create_index("ix_volume_claims_pool_id", "volume_claims", ["pool_id"])


def downgrade() -> None:
    op.drop_index("ix_volume_claims_pool_id", table_name="volume_claims")
    op.drop_table("volume_claims")
    op.drop_table("storage_pools")
