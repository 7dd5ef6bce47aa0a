"""Use cases over the ledger: scheduling now; build, migrate, evacuate and reconcile to come."""
