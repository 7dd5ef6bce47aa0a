"""ip_allocation documents keyed "<subnet id>/<address>" (was uuid5 of the two)

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01 21:20:00

The used addresses of a subnet are then read from the claims' ids alone, no body decoded.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

_objects = sa.table("objects", sa.column("kind"), sa.column("id"), sa.column("body"))


def _rekey(new_id: Callable[[dict[str, Any]], str]) -> None:
    conn = op.get_bind()
    rows = conn.execute(
        sa.select(_objects.c.id, _objects.c.body).where(_objects.c.kind == "ip_allocation")
    ).all()
    for old, body in rows:
        conn.execute(
            sa.update(_objects)
            .where(_objects.c.kind == "ip_allocation", _objects.c.id == old)
            .values(id=new_id(json.loads(body)))
        )


def upgrade() -> None:
    _rekey(lambda b: f"{b['subnet_id']}/{b['ip_address']}")


def downgrade() -> None:
    import uuid

    # The networks package's namespace for derived ids, as it was when this revision was made.
    namespace = uuid.UUID("6a1d5c0e-9d1b-4a55-8f1e-2a63c1f0b7aa")

    _rekey(lambda b: str(uuid.uuid5(namespace, "/".join(("ip", b["subnet_id"], b["ip_address"])))))
