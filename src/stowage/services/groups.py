"""Server groups: a new group is counted against its project's quota in its own commit."""

from __future__ import annotations

from sqlalchemy import Connection

from stowage.domain.groups import ServerGroup
from stowage.services import quotas
from stowage.services.cloud import Cloud

__all__ = ["create_server_group"]


def create_server_group(cloud: Cloud, group: ServerGroup) -> None:
    """Create `group` unless its project is at its `server_groups` quota (QuotaExceeded):
    the count and the insert are one transaction, so concurrent creates cannot pass it."""

    def counted(conn: Connection) -> None:
        quotas.reserve_server_group(cloud, conn, group.project_id)

    cloud.ledger.create_group(group, also=counted)
