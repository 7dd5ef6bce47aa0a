"""Scheduling as a service: pick from a recent view, commit, re-pick on conflict."""

from __future__ import annotations

import gc
import random
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from stowage.domain.claims import Claim, ClaimOutcome, RefusalCode
from stowage.ledger.ledger import CommitClaim, Ledger
from stowage.scheduling.framework import Request
from stowage.scheduling.pipeline import Decision, Pipeline
from stowage.scheduling.view import View
from stowage.telemetry.metrics import CLAIM_BATCH, SCHEDULER_CONFLICTS, SCHEDULER_DECISIONS

REFREEZE_CLAIMS = 4096
"""Claims between two freezes of what they left alive in the view (16 full batches)."""
THAW_EVERY = 64
"""Freezes between two full collections of everything (`gc.unfreeze` first)."""

__all__ = ["Placement", "Scheduler"]


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a request landed, or why it could not."""

    request: Request
    claim: Claim | None
    code: RefusalCode | None = None
    reason: str = ""
    attempts: int = 1

    @property
    def ok(self) -> bool:
        return self.claim is not None


class Scheduler:
    """One scheduler worker. Several may run against one database; the ledger keeps them honest."""

    def __init__(
        self,
        ledger: Ledger,
        *,
        pipeline: Pipeline | None = None,
        clock: Callable[[], float] = time.time,
        seed: int = 0,
        retries_max: int = 4,
        batch_max: int = 256,
        shard: tuple[int, int] | None = None,
        liveness_interval_s: float = 5.0,
        freeze_view: bool = False,
    ) -> None:
        self.ledger = ledger
        self.pipeline = pipeline or Pipeline(rng=random.Random(seed), shard=shard)
        self.shard = shard or self.pipeline.shard
        self.clock = clock
        self.retries_max = retries_max
        self.batch_max = batch_max
        self.view: View | None = None
        self.conflicts = 0
        self.liveness_interval_s = liveness_interval_s
        self._liveness_at = float("-inf")
        # After each full read of the view, move everything then alive out of the cyclic
        # collector's reach (gc.freeze): at 10,000 hosts the view is about 90,000 tracked
        # objects, and every collection of the oldest generation walked them all (64-75 ms,
        # the slowest batches). Objects stay freed by their reference counts; only cycles
        # among frozen objects would never be collected, so before freezing again after a
        # full reload everything is thawed and collected first.
        #
        # What the claims change in the view after that (each claim replaces its host's free
        # state: a HostFree, its frozenset and tuples) is new and unfrozen. At 100,000 hosts
        # that was 105,000 objects halfway through placing 200,000 instances, walked again by
        # every full collection: 41 of them took 5.2 s of the 30 s, and the p99 batch was
        # 200 ms against 70-80 ms with this. So after every REFREEZE_CLAIMS claims, what is
        # alive then is frozen too, after a collection that walks only what came since the
        # last freeze. Counted in claims, not schedules: a conductor under a few creates at a
        # time schedules often and changes little. Garbage cycles among frozen objects would
        # stay: every THAW_EVERY freezes, everything is thawed and collected once, as at a
        # full read.
        self.freeze_view = freeze_view
        self._frozen_loads = 0
        self._claims_since_freeze = 0
        self._freezes_since_thaw = 0
        # An identity, not a decision: unique per worker even when seeds repeat.
        self.writer = str(uuid.uuid4())

    def current_view(self) -> View:
        if self.view is None:
            self.view = self.ledger.load_view(self.writer)
            self._liveness_at = self.clock()
        else:
            self.ledger.refresh(self.view, defer=self._elsewhere)
            if self.clock() - self._liveness_at >= self.liveness_interval_s:
                self.ledger.refresh_liveness(self.view)
                self._liveness_at = self.clock()
        if self.freeze_view:
            if self.view.loads != self._frozen_loads:
                self._freeze(self.view.loads)
            elif self._claims_since_freeze >= REFREEZE_CLAIMS:
                self._refreeze()
        return self.view

    def warm(self) -> None:
        """For the processes that schedule for their life (`freeze_view`): read the view and
        freeze now, before the process serves, not under its first requests. The freeze's
        first full collection walks every object the process has made (0.4-0.7 s with the
        GIL held, measured under the first burst of creates of `stowage up`: every request
        in flight waited for it). A no-op without `freeze_view` or once the view is read."""
        if self.freeze_view and self.view is None:
            self.current_view()

    def _freeze(self, loads: int) -> None:
        if self._frozen_loads:
            gc.unfreeze()  # the earlier view's objects, so cycles among them can go now
        gc.collect()
        gc.freeze()
        self._frozen_loads = loads
        self._claims_since_freeze = 0
        self._freezes_since_thaw = 0

    def _refreeze(self) -> None:
        """Freeze what the schedules since the last freeze left alive (see __init__)."""
        self._freezes_since_thaw += 1
        if self._freezes_since_thaw >= THAW_EVERY:
            self._freeze(self._frozen_loads)
            return
        gc.collect()
        gc.freeze()
        self._claims_since_freeze = 0

    def _elsewhere(self, host_id: int) -> bool:
        """True for hosts of another worker's shard, whose changes this worker may read late."""
        if self.shard is None:
            return False
        index, count = self.shard
        return host_id % count != index

    def schedule(
        self,
        requests: Sequence[Request],
        *,
        min_count: int | None = None,
        also: CommitClaim | None = None,
    ) -> list[Placement]:
        """Place requests together as one plan (see `_schedule`), counted in the metrics."""
        placements = self._schedule(requests, min_count=min_count, also=also)
        placed = sum(p.ok for p in placements)
        if placed:
            SCHEDULER_DECISIONS.labels("placed").inc(placed)
        if placed < len(placements):
            SCHEDULER_DECISIONS.labels("no_valid_host").inc(len(placements) - placed)
        return placements

    def _schedule(
        self,
        requests: Sequence[Request],
        *,
        min_count: int | None = None,
        also: CommitClaim | None = None,
    ) -> list[Placement]:
        """Place requests together as one plan.

        With `min_count`, fewer placed means none are: the placed ones commit in one
        transaction or not at all, so nothing is ever claimed and then undone. `also` runs in
        the transaction of each claim (ledger.Ledger.claim), so what the claim is for commits
        with it.
        """
        view = self.current_view()
        for request in requests:
            if request.group_id is not None:
                self.ledger.ensure_group(view, request.group_id)
        atomic = min_count is not None and min_count > 1
        results: dict[int, Placement] = {}
        pending = list(enumerate(requests))
        for attempt in range(1, self.retries_max + 1):
            decisions = self.pipeline.plan(view, [r for _, r in pending], self.clock())
            to_commit: list[tuple[int, Decision]] = []
            for (index, _), decision in zip(pending, decisions, strict=True):
                if decision.claim is None:
                    diagnosis = decision.diagnosis
                    reason = diagnosis.explain() if diagnosis else "No valid host was found."
                    results[index] = Placement(
                        decision.request, None, RefusalCode.NO_VALID_HOST, reason, attempt
                    )
                else:
                    to_commit.append((index, decision))
            if atomic and min_count is not None and len(to_commit) < min_count:
                # The plan took room in the view that no claim will fill: read those hosts again.
                planned = {d.claim.host_id for _, d in to_commit if d.claim is not None}
                self.ledger.refresh(view, host_ids=planned, defer=self._elsewhere)
                return self._short(requests, results, len(to_commit), min_count, attempt)
            claims = [d.claim for _, d in to_commit if d.claim is not None]
            outcomes = self._commit(claims, also, atomic=atomic)
            retry: list[tuple[int, Request]] = []
            stale_hosts: set[int] = set()
            for (index, decision), outcome in zip(to_commit, outcomes, strict=True):
                if outcome.ok:
                    results[index] = Placement(decision.request, decision.claim, attempts=attempt)
                    continue
                if outcome.code is RefusalCode.CONSUMER_GONE:
                    # What the claim was for is gone: no other host would do better.
                    results[index] = Placement(
                        decision.request, None, outcome.code, outcome.reason, attempt
                    )
                    continue
                self.conflicts += 1
                SCHEDULER_CONFLICTS.inc()
                stale_hosts.add(outcome.host_id)
                if attempt == self.retries_max:
                    results[index] = Placement(
                        decision.request, None, outcome.code, outcome.reason, attempt
                    )
                else:
                    retry.append((index, decision.request))
            if not retry:
                break
            # Re-pick from a fresher view: the hosts that refused, and whatever else changed.
            self.ledger.refresh(view, host_ids=stale_hosts, defer=self._elsewhere)
            if atomic:  # all or nothing: the whole set is planned again
                pending = list(enumerate(requests))
                results.clear()
            else:
                pending = retry
        placements = [results[i] for i in range(len(requests))]
        if min_count is not None and sum(p.ok for p in placements) < min_count:
            return self._short(requests, results, sum(p.ok for p in placements), min_count, 0)
        return placements

    def _commit(
        self, claims: list[Claim], also: CommitClaim | None, *, atomic: bool
    ) -> list[ClaimOutcome]:
        self._claims_since_freeze += len(claims)
        if atomic:  # one transaction for the whole set, whatever its size
            if claims:
                CLAIM_BATCH.observe(len(claims))
            return self.ledger.claim(claims, writer=self.writer, also=also, atomic=True)
        out: list[ClaimOutcome] = []
        for start in range(0, len(claims), self.batch_max):
            batch = claims[start : start + self.batch_max]
            CLAIM_BATCH.observe(len(batch))
            out.extend(self.ledger.claim(batch, writer=self.writer, also=also))
        return out

    def _short(
        self,
        requests: Sequence[Request],
        results: dict[int, Placement],
        placed: int,
        min_count: int,
        attempt: int,
    ) -> list[Placement]:
        """Fewer than `min_count` fit: none is placed, each says why."""
        reason = next((p.reason for p in results.values() if not p.ok), "")
        return [
            Placement(
                request,
                None,
                RefusalCode.NO_VALID_HOST,
                f"only {placed} of the minimum {min_count} instances fit. {reason}".strip(),
                max(attempt, 1),
            )
            for request in requests
        ]
