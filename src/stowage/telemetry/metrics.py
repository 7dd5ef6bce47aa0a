"""The process's Prometheus registry and the metrics every process kind may record into:
requests per route, operation steps, scheduler decisions and conflicts, claim batches, and
heartbeat age per host (a collector the process registers with its own reader)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric

__all__ = [
    "CLAIM_BATCH",
    "HTTP_REQUESTS",
    "HTTP_SECONDS",
    "OPERATION_SECONDS",
    "OPERATION_STEP_SECONDS",
    "REGISTRY",
    "SCHEDULER_CONFLICTS",
    "SCHEDULER_DECISIONS",
    "HeartbeatAges",
    "Union",
    "serve_metrics",
    "watch_heartbeats",
]

REGISTRY = CollectorRegistry(auto_describe=True)

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_STEP_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

HTTP_REQUESTS = Counter(
    "stowage_http_requests",
    "HTTP requests answered, per route template, method and status",
    ["route", "method", "status"],
    registry=REGISTRY,
)
HTTP_SECONDS = Histogram(
    "stowage_http_request_seconds",
    "Time to answer an HTTP request, per route template and method",
    ["route", "method"],
    buckets=_LATENCY_BUCKETS_S,
    registry=REGISTRY,
)
OPERATION_STEP_SECONDS = Histogram(
    "stowage_operation_step_seconds",
    "Time a conductor spent on one step of a long operation, per kind and step",
    ["kind", "step"],
    buckets=_STEP_BUCKETS_S,
    registry=REGISTRY,
)
OPERATION_SECONDS = Histogram(
    "stowage_operation_seconds",
    "Time from a long operation's creation to its end, per kind and outcome",
    ["kind", "outcome"],
    buckets=_STEP_BUCKETS_S,
    registry=REGISTRY,
)
SCHEDULER_DECISIONS = Counter(
    "stowage_scheduler_decisions",
    "Scheduling decisions, per outcome (placed, no_valid_host)",
    ["outcome"],
    registry=REGISTRY,
)
SCHEDULER_CONFLICTS = Counter(
    "stowage_scheduler_conflicts",
    "Claims the ledger refused because the scheduler's view was stale (then re-picked)",
    registry=REGISTRY,
)
CLAIM_BATCH = Histogram(
    "stowage_claim_batch_size",
    "Claims committed together in one ledger transaction",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
    registry=REGISTRY,
)


class HeartbeatAges:
    """`stowage_host_heartbeat_age_seconds{host}`, read at each scrape from `read`
    (host name -> seconds since its last heartbeat; None for never)."""

    def __init__(self, read: Callable[[], Mapping[str, float | None]]) -> None:
        self.read = read

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "stowage_host_heartbeat_age_seconds",
            "Seconds since each compute host's last heartbeat, as the ledger holds it",
            labels=["host"],
        )
        for host, age in sorted(self.read().items()):
            if age is not None:
                family.add_metric([host], age)
        yield family


HEARTBEATS = HeartbeatAges(dict)
REGISTRY.register(HEARTBEATS)


def watch_heartbeats(read: Callable[[], Mapping[str, float | None]]) -> None:
    """Where this process reads heartbeat ages from (its ledger), at each scrape."""
    HEARTBEATS.read = read


class Union:
    """A collector of several registries' metrics, to serve them on one port."""

    def __init__(self, *registries: CollectorRegistry) -> None:
        self.registries = registries

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        for registry in self.registries:
            yield from registry.collect()


def serve_metrics(port: int, addr: str = "127.0.0.1", *extra: CollectorRegistry) -> Any:
    """Serve this process's registry (and `extra` ones) at http://addr:port/metrics."""
    served = CollectorRegistry(auto_describe=False)
    served.register(Union(REGISTRY, *extra))
    return start_http_server(port, addr=addr, registry=served)
