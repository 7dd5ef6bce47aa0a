"""Server groups, and the locks and checks that keep their policies."""

from __future__ import annotations

import json
from collections.abc import Callable

from sqlalchemy import Connection, insert, select

from stowage.domain.claims import Claim, RefusalCode
from stowage.domain.errors import NotFound
from stowage.domain.groups import ServerGroup
from stowage.ledger.db import READONLY
from stowage.ledger.ledger.core import LedgerCore, _group_from_row, _Refusal
from stowage.ledger.schema import (
    consumers,
    consumers_of_instance,
    group_members,
    hosts,
    server_groups,
)


class Groups(LedgerCore):
    """Creates server groups and guards their policies inside claims."""

    def create_group(
        self, group: ServerGroup, *, also: Callable[[Connection], None] | None = None
    ) -> None:
        """A new server group; `also` runs first in the same transaction (its quota)."""
        with self.engine.begin() as conn:
            if also is not None:
                also(conn)
            conn.execute(
                insert(server_groups),
                {
                    "id": group.id,
                    "name": group.name,
                    "policy": group.policy.value,
                    "max_per_domain": group.max_per_domain,
                    "failure_domain": group.failure_domain,
                    "rules": json.dumps(dict(group.rules), sort_keys=True),
                    "project_id": group.project_id,
                    "user_id": group.user_id,
                    "created_at": self.clock(),
                },
            )

    def get_group(self, group_id: str) -> ServerGroup:
        with self.engine.connect().execution_options(**READONLY) as conn:
            row = conn.execute(select(server_groups).where(server_groups.c.id == group_id)).first()
        if row is None:
            raise NotFound(f"server group {group_id} not found")
        return _group_from_row(row._mapping)

    def _lock_groups(self, conn: Connection, group_ids: set[str]) -> None:
        """Lock strict affinity groups' rows in id order, before any member row refers to them.

        Taken after the hosts and before the members' foreign keys share-lock the same rows,
        so two writers for one group queue instead of deadlocking.
        """
        if not group_ids:
            return
        query = (
            select(server_groups.c.id)
            .where(server_groups.c.id.in_(group_ids))
            .order_by(server_groups.c.id)
        )
        if self._pg:
            query = query.with_for_update()
        found = set(conn.execute(query).scalars())
        missing = sorted(group_ids - found)
        if missing:
            raise _Refusal(RefusalCode.AFFINITY, f"server group {missing[0]} not found")

    def _check_affinity(self, conn: Connection, group_id: str, claim: Claim) -> None:
        """Strict affinity under the group's row lock: no member may sit on another host."""
        elsewhere = conn.execute(
            select(hosts.c.name)
            .select_from(
                group_members.join(
                    consumers, consumers_of_instance(group_members.c.instance_id)
                ).join(hosts, hosts.c.id == consumers.c.host_id)
            )
            .where(group_members.c.group_id == group_id, consumers.c.host_id != claim.host_id)
            .limit(1)
        ).scalar()
        if elsewhere is not None:
            raise _Refusal(
                RefusalCode.AFFINITY,
                f"affinity group {group_id} already has a member on {elsewhere}",
            )
