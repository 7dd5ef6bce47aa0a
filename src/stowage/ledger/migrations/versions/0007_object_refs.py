"""objects.ref: an indexed copy of what some documents refer to (a port's device)

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01 20:30:00
"""

from __future__ import annotations

import json

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

# As `ObjectStore.REFS` had it when this revision was written.
_REFS = {"port": "device_id"}


def upgrade() -> None:
    with op.batch_alter_table("objects") as batch:
        batch.add_column(sa.Column("ref", sa.String(length=255), nullable=True))
        batch.create_index("ix_objects_kind_ref", ["kind", "ref"])
    conn = op.get_bind()
    objects = sa.table(
        "objects", sa.column("kind"), sa.column("id"), sa.column("body"), sa.column("ref")
    )
    for kind, field in _REFS.items():
        rows = conn.execute(sa.select(objects.c.id, objects.c.body).where(objects.c.kind == kind))
        for id_, body in rows.all():
            value = json.loads(body).get(field)
            if value:
                conn.execute(
                    sa.update(objects)
                    .where(objects.c.kind == kind, objects.c.id == id_)
                    .values(ref=str(value))
                )


def downgrade() -> None:
    with op.batch_alter_table("objects") as batch:
        batch.drop_index("ix_objects_kind_ref")
        batch.drop_column("ref")
