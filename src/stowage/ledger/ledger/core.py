"""What every part of the ledger shares: its engine and clock, retries, refusals."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError, OperationalError

from stowage.domain.claims import Claim, ClaimOutcome, RefusalCode
from stowage.domain.groups import GroupPolicy, ServerGroup
from stowage.domain.topology import (
    HostTopology,
)
from stowage.ledger.bulk import BulkWriter

# How often a whole batch is retried after a deadlock or serialization failure.
_BATCH_RETRIES_MAX = 5


class _Refusal(Exception):
    """A claim the ledger refuses before the database has to."""

    def __init__(self, code: RefusalCode, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class ClaimRefused(_Refusal):
    """Raised by a claim's `also` callback: what the claim was for is gone or has moved on
    (a deleted instance, a migration someone else settled), so the claim must not commit."""

    def __init__(self, reason: str) -> None:
        super().__init__(RefusalCode.CONSUMER_GONE, reason)


CommitClaim = Callable[[Connection, Claim], None]
"""Runs inside the transaction (or savepoint) that commits one claim: the documents and the
next step of the use case the claim serves commit with it, or neither does."""


class LedgerCore:
    """The state every part of the ledger works with."""

    engine: Engine
    clock: Callable[[], float]
    _pg: bool
    _topologies: dict[str, HostTopology]
    _bulk: BulkWriter

    def __init__(self, engine: Engine, *, clock: Callable[[], float] = time.time) -> None:
        self.engine = engine
        self.clock = clock
        self._pg = engine.dialect.name == "postgresql"
        self._topologies = {}
        self._bulk = BulkWriter(engine.dialect.name)

    def _retry(self, work: Callable[[Connection], bool]) -> bool:
        for attempt in range(_BATCH_RETRIES_MAX):
            try:
                with self.engine.begin() as conn:
                    return work(conn)
            except OperationalError as exc:
                if not _retryable(exc) or attempt == _BATCH_RETRIES_MAX - 1:
                    raise
        raise AssertionError("unreachable")


def _refused(claim: Claim, code: RefusalCode, reason: str) -> ClaimOutcome:
    return ClaimOutcome(claim.consumer_id, claim.host_id, False, code, reason)


def _then(result: bool, also: Callable[[Connection], None] | None, conn: Connection) -> bool:
    if also is not None:
        also(conn)
    return result


def _retryable(exc: DBAPIError) -> bool:
    """Deadlocks and serialization failures on PostgreSQL; a locked database on SQLite."""
    code = getattr(exc.orig, "sqlstate", None) or getattr(exc.orig, "pgcode", None)
    if code in ("40P01", "40001"):
        return True
    return "database is locked" in str(exc.orig)


def _group_from_row(row: Any) -> ServerGroup:
    return ServerGroup(
        id=row["id"],
        name=row["name"],
        policy=GroupPolicy(row["policy"]),
        max_per_domain=row["max_per_domain"],
        failure_domain=row["failure_domain"],
        project_id=row["project_id"],
        user_id=row["user_id"],
        rules=json.loads(row["rules"]),
    )
