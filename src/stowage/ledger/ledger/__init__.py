"""The ledger: hosts, groups and claims, each change one transaction the database guards.

One class, `Ledger`, assembled from a part per concept: hosts (registration, service state),
groups (server groups and the checks of their policies), claims (claims, releases and moves)
and views (the scheduler's view, refreshed from the change log).
"""

from __future__ import annotations

from stowage.ledger.db import make_engine, migrate
from stowage.ledger.ledger.claims import Claims
from stowage.ledger.ledger.core import ClaimRefused, CommitClaim
from stowage.ledger.ledger.hosts import Hosts
from stowage.ledger.ledger.topology import topology_from_json, topology_to_json
from stowage.ledger.ledger.views import Views

__all__ = ["ClaimRefused", "CommitClaim", "Ledger", "topology_from_json", "topology_to_json"]


class Ledger(Hosts, Claims, Views):
    """Every claim, release and move is one transaction here; nothing else writes claims."""

    @classmethod
    def open(cls, url: str, *, upgrade: bool = True) -> Ledger:
        engine = make_engine(url)
        if upgrade:
            migrate(engine)
        return cls(engine)

    def close(self) -> None:
        self.engine.dispose()
