"""The ledger: tables, migrations, the claim transaction and the audit."""

from stowage.ledger.audit import Violation, audit
from stowage.ledger.db import default_url, make_engine, migrate
from stowage.ledger.ledger import Ledger

__all__ = ["Ledger", "Violation", "audit", "default_url", "make_engine", "migrate"]
