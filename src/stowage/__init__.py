"""Stowage: a compute cloud control plane with one transactional ledger for every claim."""

__version__ = "0.1.0"
