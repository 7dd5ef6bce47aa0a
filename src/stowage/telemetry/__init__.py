"""Logs and metrics every process shares: structured log lines with the request id bound,
and one Prometheus registry per process. Imports no other part of Stowage, so every layer
may use it."""

from __future__ import annotations

from stowage.telemetry.logs import bind, configure_logging, current_request_id, logger
from stowage.telemetry.metrics import REGISTRY, serve_metrics

__all__ = [
    "REGISTRY",
    "bind",
    "configure_logging",
    "current_request_id",
    "logger",
    "serve_metrics",
]
