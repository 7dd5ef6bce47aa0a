"""The reconciler: what the hypervisor runs against what the ledger says, instance by instance.

A pass takes one snapshot of each side, then checks every instance on its own: an
instance that cannot be checked or whose divergence cannot be recorded is reported and
the pass goes on. Nothing here writes a claim: a pass's snapshots are stale the moment
they are read, so divergences are recorded (fault, event, metric, log), never "fixed".
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from stowage.agent.metrics import AgentMetrics
from stowage.services.reconcile import Divergence, DivergenceKind, Expected
from stowage.virt.driver import RunningInstance

__all__ = ["ReconcileReport", "Reconciler"]

log = logging.getLogger(__name__)

RunningFn = Callable[[], Awaitable[Mapping[str, RunningInstance]]]
ExpectedFn = Callable[[], Mapping[str, Expected]]
RecordFn = Callable[[Divergence], None]


@dataclass
class ReconcileReport:
    """One pass: every instance audited, what diverged, what could not be recorded."""

    host: str
    audited: list[str] = field(default_factory=list)  # instance ids, in audit order
    divergences: list[Divergence] = field(default_factory=list)
    unrecorded: list[str] = field(default_factory=list)  # ids whose divergence was not saved
    skipped: list[str] = field(default_factory=list)  # ids with an operation in flight
    error: str | None = None  # the pass could not read one side: nothing was audited
    duration_s: float = 0.0

    @property
    def audited_count(self) -> int:
        return len(self.audited)

    def of_kind(self, kind: DivergenceKind) -> list[Divergence]:
        return [d for d in self.divergences if d.kind is kind]


class Reconciler:
    """Audits one host, periodically (`run_forever`) and on demand (`trigger`, `run_once`).

    `running` is the hypervisor's view, awaited on the loop (the agent reads it in its
    driver pool); `expected` (the ledger's view) and `record` are blocking and run in
    threads. Passes never overlap. Each read and each record is bounded by `read_timeout_s`.
    """

    def __init__(
        self,
        host: str,
        running: RunningFn,
        expected: ExpectedFn,
        record: RecordFn,
        metrics: AgentMetrics,
        *,
        read_timeout_s: float = 60.0,
        busy: Callable[[], set[str]] | None = None,
    ) -> None:
        if read_timeout_s <= 0:
            raise ValueError("read_timeout_s must be positive")
        self.host = host
        self._running = running
        self._expected = expected
        self._record = record
        self.metrics = metrics
        self.read_timeout_s = read_timeout_s
        # Instances with an operation in flight on this host: their two views legitimately
        # disagree until the operation ends, so the pass leaves them for the next one.
        self._busy = busy
        self.last_report: ReconcileReport | None = None
        self._pass_lock = asyncio.Lock()
        self._wake = asyncio.Event()

    # -- passes ----------------------------------------------------------------------

    async def run_once(self) -> ReconcileReport:
        """One full pass; waits for a pass already running to finish first."""
        async with self._pass_lock:
            start = time.monotonic()
            report = await self._pass()
            report.duration_s = time.monotonic() - start
            self.metrics.reconcile_duration.labels(host=self.host).observe(report.duration_s)
            self.last_report = report
            return report

    def trigger(self) -> None:
        """Ask `run_forever` for a pass now instead of at the end of its interval."""
        self._wake.set()

    async def run_forever(self, interval_s: float) -> None:
        """A pass, then wait `interval_s` or for `trigger()`, until cancelled."""
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        while True:
            self._wake.clear()
            try:
                await self.run_once()
            except Exception:  # a bug in one pass must not end the periodic audit
                log.exception("reconcile pass on %s failed", self.host)
            try:
                async with asyncio.timeout(interval_s):
                    await self._wake.wait()
            except TimeoutError:
                pass

    async def _pass(self) -> ReconcileReport:
        report = ReconcileReport(self.host)
        labels = {"host": self.host}
        try:
            async with asyncio.timeout(self.read_timeout_s):
                # The ledger first: a claim committed after this read and spawned before the
                # next one shows up as unknown once, which is recorded and never acted on.
                busy = await asyncio.to_thread(self._busy) if self._busy else set()
                expected = dict(await asyncio.to_thread(self._expected))
                running = dict(await self._running())
                busy |= await asyncio.to_thread(self._busy) if self._busy else set()
        except Exception as exc:
            report.error = f"{type(exc).__name__}: {exc}"
            self.metrics.reconcile_pass_failures.labels(**labels).inc()
            log.error(
                "reconcile pass on %s could not read its views: %s",
                self.host,
                report.error,
                extra={"host": self.host, "error": report.error},
            )
            return report
        users = _pcpu_users(running)
        for instance_id in sorted(expected.keys() | running.keys()):
            if instance_id in busy:
                report.skipped.append(instance_id)
                continue
            report.audited.append(instance_id)
            divergence = self._check_safely(
                instance_id, expected.get(instance_id), running.get(instance_id), users
            )
            if divergence is None:
                continue
            report.divergences.append(divergence)
            self.metrics.reconcile_divergences.labels(
                host=self.host, kind=divergence.kind.value
            ).inc()
            if not await self._record_safely(divergence):
                report.unrecorded.append(instance_id)
        self.metrics.reconcile_passes.labels(**labels).inc()
        self.metrics.reconcile_audited.labels(**labels).set(report.audited_count)
        return report

    def _check_safely(
        self,
        instance_id: str,
        expected: Expected | None,
        running: RunningInstance | None,
        users: Mapping[int, list[str]],
    ) -> Divergence | None:
        try:
            return check(instance_id, expected, running, users)
        except Exception as exc:  # one instance's bad data never stops the audit of the rest
            log.exception("reconcile check of %s on %s failed", instance_id, self.host)
            return Divergence(
                DivergenceKind.CHECK_FAILED,
                instance_id,
                f"could not compare instance {instance_id}: {type(exc).__name__}: {exc}",
            )

    async def _record_safely(self, divergence: Divergence) -> bool:
        try:
            async with asyncio.timeout(self.read_timeout_s):
                await asyncio.to_thread(self._record, divergence)
        except Exception:  # a timeout too: the thread is abandoned, the pass goes on
            self.metrics.reconcile_record_failures.labels(host=self.host).inc()
            log.exception(
                "reconcile could not record the %s divergence of %s on %s",
                divergence.kind.value,
                divergence.instance_id,
                self.host,
                extra={
                    "host": self.host,
                    "instance_id": divergence.instance_id,
                    "divergence_kind": divergence.kind.value,
                },
            )
            return False
        return True


# -- pure comparison -----------------------------------------------------------------


def check(
    instance_id: str,
    expected: Expected | None,
    running: RunningInstance | None,
    users: Mapping[int, list[str]],
) -> Divergence | None:
    """The divergence of one instance, or None when the hypervisor matches the ledger.

    An in-flight move legitimately runs at either end, so a migration end that is not
    running here is no divergence; its pins, when it runs here, must match either end.
    """
    if expected is None:
        if running is None:
            return None
        actual = _pins(running)
        return Divergence(
            DivergenceKind.UNKNOWN_INSTANCE,
            instance_id,
            f"instance {instance_id} runs here with pins {_fmt(actual)} but the ledger places "
            "no instance or migration of it on this host",
            actual=actual,
        )
    wanted = {end.role.value: dict(end.pins) for end in expected.ends}
    if running is None:
        if expected.in_flight:
            return None
        return Divergence(
            DivergenceKind.MISSING_INSTANCE,
            instance_id,
            f"the ledger places instance {instance_id} on this host "
            f"(pins {_fmt(wanted.get('home', {}))}) but the hypervisor does not run it",
            expected=wanted,
        )
    actual = _pins(running)
    if expected.accepts(actual):
        return None
    claimed = " or ".join(f"{_fmt(p)} ({role})" for role, p in sorted(wanted.items()))
    detail = f"instance {instance_id} runs with pins {_fmt(actual)}, the ledger claims {claimed}"
    shared = {
        cpu: sorted(set(users.get(cpu, [])) - {instance_id}) for cpu in sorted(set(actual.values()))
    }
    shared = {cpu: others for cpu, others in shared.items() if others}
    if shared:
        detail += "; " + "; ".join(
            f"pCPU {cpu} is also pinned by {', '.join(others)}" for cpu, others in shared.items()
        )
    return Divergence(
        DivergenceKind.PINS_DIFFER, instance_id, detail, expected=wanted, actual=actual
    )


def _pins(running: RunningInstance) -> dict[int, int]:
    return {int(vcpu): int(cpu) for vcpu, cpu in running["pins"].items()}


def _pcpu_users(running: Mapping[str, RunningInstance]) -> dict[int, list[str]]:
    """pCPU -> the instances the hypervisor pins to it; rows it cannot read are skipped
    here and reported by their own check."""
    users: dict[int, list[str]] = {}
    for instance_id, row in running.items():
        try:
            cpus = set(_pins(row).values())
        except Exception:  # the instance's own check reports it
            continue
        for cpu in cpus:
            users.setdefault(cpu, []).append(instance_id)
    return users


def _fmt(pins: Mapping[int, int]) -> str:
    return "{" + ", ".join(f"{v}: {c}" for v, c in sorted(pins.items())) + "}"
