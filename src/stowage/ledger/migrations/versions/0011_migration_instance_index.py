"""consumers: `instance_id` indexed for moves only; an instance's own row is found by `id`

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-05 19:30:00

An instance consumer's `id` is its instance's id, so the index of `instance_id` over every
row served only the moves' rows; it cost every claim a write at a random page of the index.
The upgrade refuses a ledger holding an instance consumer whose `id` is not its instance's
(none of Stowage's writes makes one): its moves' lookups would miss it.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

_MIGRATION = sa.text("kind = 'migration'")
_ODD = sa.text("SELECT id FROM consumers WHERE kind = 'instance' AND id <> instance_id LIMIT 1")


def upgrade() -> None:
    odd = op.get_bind().execute(_ODD).scalar()
    if odd is not None:
        raise RuntimeError(
            f"consumer {odd} is an instance whose id is not its instance_id; the ledger "
            "keys an instance's consumer by its instance id (revision 0011 relies on it)"
        )
    op.drop_index("ix_consumers_instance_id", table_name="consumers")
    op.create_index(
        "ix_consumers_migration_instance_id",
        "consumers",
        ["instance_id"],
        sqlite_where=_MIGRATION,
        postgresql_where=_MIGRATION,
    )


def downgrade() -> None:
    op.drop_index("ix_consumers_migration_instance_id", table_name="consumers")
    op.create_index("ix_consumers_instance_id", "consumers", ["instance_id"])
