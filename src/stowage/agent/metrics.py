"""The agent's Prometheus metrics, in a registry of its own per process (or per test)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from stowage.agent.runtime import Agent, OpResult

__all__ = [
    "CONTENT_TYPE_LATEST",
    "AgentMetrics",
    "AgentObserver",
    "observe_agent",
    "record_op",
    "render",
]

# Heartbeats are due every interval (1 s by default): the buckets resolve around it, and
# reach past the default 60 s down time so a gap that got a host declared dead is visible.
HEARTBEAT_GAP_BUCKETS_S = (0.5, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0, 120.0)
LOOP_LAG_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
RECONCILE_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True)
class AgentMetrics:
    """Every metric the agent exports, registered in `registry` (never the global one)."""

    registry: CollectorRegistry
    reconcile_divergences: Counter
    reconcile_passes: Counter
    reconcile_pass_failures: Counter
    reconcile_record_failures: Counter
    reconcile_audited: Gauge
    reconcile_duration: Histogram
    heartbeat_gap: Histogram
    heartbeat_failures: Counter
    loop_lag: Histogram
    loop_lag_max: Gauge
    loop_stalls: Counter
    ops: Counter

    async def exposition(self) -> bytes:
        """The text exposition format of `registry` (what a runtime hands the API's
        `/metrics`; the compute process's handle has one that asks the process)."""
        return render(self.registry)

    @classmethod
    def create(cls, registry: CollectorRegistry | None = None) -> AgentMetrics:
        reg = registry if registry is not None else CollectorRegistry(auto_describe=True)
        return cls(
            registry=reg,
            reconcile_divergences=Counter(
                "stowage_reconcile_divergences",
                "Instances found diverging from the ledger, by kind",
                ("host", "kind"),
                registry=reg,
            ),
            reconcile_passes=Counter(
                "stowage_reconcile_passes",
                "Reconciler passes that audited the host",
                ("host",),
                registry=reg,
            ),
            reconcile_pass_failures=Counter(
                "stowage_reconcile_pass_failures",
                "Reconciler passes that could not read the hypervisor or the ledger",
                ("host",),
                registry=reg,
            ),
            reconcile_record_failures=Counter(
                "stowage_reconcile_record_failures",
                "Divergences found but not recorded (the fault or event write failed)",
                ("host",),
                registry=reg,
            ),
            reconcile_audited=Gauge(
                "stowage_reconcile_audited_instances",
                "Instances audited by the last complete pass",
                ("host",),
                registry=reg,
            ),
            reconcile_duration=Histogram(
                "stowage_reconcile_duration_seconds",
                "Time one reconciler pass took",
                ("host",),
                buckets=RECONCILE_BUCKETS_S,
                registry=reg,
            ),
            heartbeat_gap=Histogram(
                "stowage_agent_heartbeat_gap_seconds",
                "Time between the starts of consecutive heartbeats",
                ("host",),
                buckets=HEARTBEAT_GAP_BUCKETS_S,
                registry=reg,
            ),
            heartbeat_failures=Counter(
                "stowage_agent_heartbeat_failures",
                "Heartbeats that raised or timed out",
                ("host",),
                registry=reg,
            ),
            loop_lag=Histogram(
                "stowage_agent_loop_lag_seconds",
                "How late the event loop woke the lag watchdog",
                ("host",),
                buckets=LOOP_LAG_BUCKETS_S,
                registry=reg,
            ),
            loop_lag_max=Gauge(
                "stowage_agent_loop_lag_max_seconds",
                "The largest loop lag seen since the previous observation",
                ("host",),
                registry=reg,
            ),
            loop_stalls=Counter(
                "stowage_agent_loop_stalls",
                "Watchdog wake-ups late enough to count as a stall",
                ("host",),
                registry=reg,
            ),
            ops=Counter(
                "stowage_agent_ops",
                "Agent operations finished, by operation and result",
                ("host", "operation", "result"),
                registry=reg,
            ),
        )


def render(registry: CollectorRegistry) -> bytes:
    """The text exposition format for a `/metrics` endpoint (serve it as CONTENT_TYPE_LATEST)."""
    return generate_latest(registry)


def record_op(metrics: AgentMetrics, host: str, result: OpResult) -> None:
    """Count one finished operation; the result label is `success` or `error`."""
    outcome = "success" if result.ok else "error"
    metrics.ops.labels(host=host, operation=result.operation, result=outcome).inc()


class _Tally(deque[float]):
    """A bounded deque that also counts every append, so a reader can tell what is new."""

    def __init__(self, items: Iterable[float], maxlen: int | None) -> None:
        super().__init__(items, maxlen)
        self.appended = len(self)

    def append(self, x: float, /) -> None:
        super().append(x)
        self.appended += 1


class AgentObserver:
    """Copies an Agent's heartbeat gaps and loop-lag samples into the metrics.

    The agent keeps only bounded deques of samples; once full, their length stops telling
    what is new. So the observer swaps them (same contents, same bound) for deques that also
    count appends. Create it and call `observe()` on the agent's loop thread (the appends
    happen there, so each sample is then observed exactly once), as often as you like: the
    lag watchdog keeps
    `samples_max` samples, so call it at least once per `samples_max * lag_interval_s`
    (500 s by default) or the oldest unseen samples are skipped, and counted as dropped.
    """

    def __init__(self, metrics: AgentMetrics, host: str, agent: Agent) -> None:
        self.metrics = metrics
        self.host = host
        self.agent = agent
        gaps = agent.heartbeat_gaps_s
        lags = agent.watchdog.samples
        self._gaps = _Tally(gaps, gaps.maxlen)
        self._lags = _Tally(lags, lags.maxlen)
        agent.heartbeat_gaps_s = self._gaps
        agent.watchdog.samples = self._lags
        self._gaps_seen = 0
        self._lags_seen = 0
        self._hb_failures_seen = 0
        self._stalls_seen = 0
        self.dropped = 0  # samples that fell out of a deque before they were observed

    def observe(self) -> None:
        labels = {"host": self.host}
        gaps, self._gaps_seen = self._new(self._gaps, self._gaps_seen)
        gap_metric = self.metrics.heartbeat_gap.labels(**labels)
        for gap_s in gaps:
            gap_metric.observe(gap_s)
        lags, self._lags_seen = self._new(self._lags, self._lags_seen)
        lag_metric = self.metrics.loop_lag.labels(**labels)
        for lag_s in lags:
            lag_metric.observe(lag_s)
        if lags:
            self.metrics.loop_lag_max.labels(**labels).set(max(lags))
        failures = self.agent.heartbeat_failures
        self.metrics.heartbeat_failures.labels(**labels).inc(failures - self._hb_failures_seen)
        self._hb_failures_seen = failures
        stalls = self.agent.watchdog.stalls
        self.metrics.loop_stalls.labels(**labels).inc(stalls - self._stalls_seen)
        self._stalls_seen = stalls

    def _new(self, tally: _Tally, seen: int) -> tuple[list[float], int]:
        """The samples appended since `seen`, oldest first, and the new high-water mark."""
        total = tally.appended
        fresh = total - seen
        kept = min(fresh, len(tally))
        self.dropped += fresh - kept
        items = list(tally)
        return items[len(items) - kept :] if kept else [], total


def observe_agent(metrics: AgentMetrics, host: str, agent: Agent) -> AgentObserver:
    """Start observing `agent`; call `.observe()` on the result periodically."""
    return AgentObserver(metrics, host, agent)
