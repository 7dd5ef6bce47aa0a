"""The operator's dashboard at `/dashboard`: server-rendered pages over the services' read
models, a Keystone login, and live updates from a cheap change feed."""

from __future__ import annotations

from stowage.api.dashboard.app import create_dashboard_app

__all__ = ["create_dashboard_app"]
