"""The decision cycle: filter, weigh, pick, and turn the pick into a claim; explain refusals.

Hosts are visited from a random offset in a shuffled order and the scan stops after
`candidates_max` hosts pass (Nomad's limit on feasible nodes), so a decision costs about the
same at 100 hosts as at 10,000 while the cloud has room. When few hosts fit, it scans them all.

With `shard=(index, count)`, a worker visits the hosts whose id is `index` modulo `count`
first and the others after: several workers then mostly claim on disjoint hosts, so their
commits neither wait on each other's host locks nor conflict, while any worker can still
use any host. Correctness never depends on it; the ledger decides.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from stowage.domain.claims import Claim, GroupSlot
from stowage.domain.groups import GroupPolicy, domain_of
from stowage.domain.numa import NO_NUMA, NoFit, fit_instance
from stowage.domain.topology import ResourceClass
from stowage.scheduling.filters import default_filters
from stowage.scheduling.framework import CycleState, Filter, Request, Weigher
from stowage.scheduling.view import HostState, View
from stowage.scheduling.weighers import default_weighers

__all__ = ["Decision", "Diagnosis", "Pipeline"]


@dataclass(slots=True)
class Diagnosis:
    """Per filter, how many hosts it rejected and one of its reasons."""

    hosts_total: int
    rejected: dict[str, int] = field(default_factory=dict)
    sample: dict[str, str] = field(default_factory=dict)

    def note(self, plugin: str, reason: str) -> None:
        self.rejected[plugin] = self.rejected.get(plugin, 0) + 1
        self.sample[plugin] = reason

    def explain(self) -> str:
        if self.hosts_total == 0:
            return "No valid host was found. There are no compute hosts."
        parts = [
            f"{count} host{'s' if count != 1 else ''} rejected by {plugin}: {self.sample[plugin]}"
            for plugin, count in sorted(self.rejected.items(), key=lambda kv: -kv[1])
        ]
        return "No valid host was found. " + "; ".join(parts)


@dataclass(frozen=True, slots=True)
class Decision:
    """A request with the claim chosen for it, or the diagnosis of why none fits."""

    request: Request
    claim: Claim | None
    diagnosis: Diagnosis | None = None


class Pipeline:
    def __init__(
        self,
        filters: Sequence[Filter] | None = None,
        weighers: Sequence[Weigher] | None = None,
        *,
        candidates_max: int = 8,
        rng: random.Random | None = None,
        shard: tuple[int, int] | None = None,
    ) -> None:
        self.filters: list[Filter] = list(filters if filters is not None else default_filters())
        self.weighers: list[Weigher] = list(
            weighers if weighers is not None else default_weighers()
        )
        self.candidates_max = candidates_max
        self.rng = rng or random.Random(0)
        if shard is not None and not 0 <= shard[0] < shard[1]:
            raise ValueError(f"shard index {shard[0]} is not in 0..{shard[1] - 1}")
        self.shard = shard
        self._order: list[list[int]] = []
        self._order_view: View | None = None
        self._order_len = -1

    def plan(self, view: View, requests: Sequence[Request], now: float) -> list[Decision]:
        """Decide each request in turn, each seeing the ones before it as already placed."""
        decisions = []
        for request in requests:
            decision = self.decide(view, request, now)
            if decision.claim is not None:
                view.apply_claim(decision.claim)
            decisions.append(decision)
        return decisions

    def decide(self, view: View, request: Request, now: float) -> Decision:
        state = CycleState(now=now, group=view.groups.get(request.group_id or ""))
        active = [f for f in self.filters if f.prefilter(request, view, state)]
        parts = self._host_order(view)
        diagnosis = Diagnosis(len(view.hosts))
        candidates: list[HostState] = []
        hosts = view.hosts
        want = self.candidates_max
        for order in parts:
            n = len(order)
            start = self.rng.randrange(n) if n else 0
            for i in range(n):
                host = hosts[order[(start + i) % n]]
                for plugin in active:
                    reason = plugin.filter(request, host, state)
                    if reason is not None:
                        diagnosis.note(plugin.name, reason)
                        break
                else:
                    candidates.append(host)
                    if len(candidates) >= want:
                        break
            if len(candidates) >= want:
                break
        weighers = [w for w in self.weighers if w.active(request, state)]
        ranked = sorted(
            candidates,
            key=lambda h: -sum(w.multiplier * w.weigh(request, h, state) for w in weighers),
        )
        for host in ranked:
            claim = self._claim(request, host, state)
            if isinstance(claim, str):
                diagnosis.note("numa_topology", claim)
                continue
            return Decision(request, claim)
        return Decision(request, None, diagnosis)

    def _host_order(self, view: View) -> list[list[int]]:
        """Host ids in a shuffled order: this worker's shard first when sharded."""
        if self._order_view is not view or self._order_len != len(view.hosts):
            order = sorted(view.hosts)
            self.rng.shuffle(order)
            if self.shard is None:
                self._order = [order]
            else:
                index, count = self.shard
                self._order = [
                    [h for h in order if h % count == index],
                    [h for h in order if h % count != index],
                ]
            self._order_view = view
            self._order_len = len(view.hosts)
        return self._order

    def _claim(self, request: Request, host: HostState, state: CycleState) -> Claim | str:
        fit = state.fits.get(host.id)
        if fit is None:
            if request.shape.numa:
                found = fit_instance(request.shape, host.topology, host.free)
                if isinstance(found, NoFit):
                    return found.reason
                fit = found
            else:
                fit = NO_NUMA
        amounts = request.shape.amounts()
        if fit.cells and ResourceClass.PCPU in amounts:
            amounts[ResourceClass.PCPU] = len(fit.cpus)
        slots: tuple[GroupSlot, ...] = ()
        affinity: tuple[str, ...] = ()
        member_of: tuple[str, ...] = ()
        group = state.group
        if group is not None:
            member_of = (group.group.id,)
            policy = group.group.policy
            if policy is GroupPolicy.AFFINITY:
                affinity = (group.group.id,)
            elif policy is GroupPolicy.ANTI_AFFINITY:
                domain = domain_of(group.group, host.name, host.labels)
                slot = group.free_slot(domain) if domain is not None else None
                if domain is None or slot is None:
                    raise AssertionError("a host that passed the group filter has no free slot")
                slots = (GroupSlot(group.group.id, domain, slot, group.group.max_per_domain),)
        return Claim(
            consumer_id=request.consumer_id,
            instance_id=request.instance_id,
            host_id=host.id,
            amounts=amounts,
            fit=fit,
            slots=slots,
            affinity_groups=affinity,
            member_of=member_of,
            kind=request.kind,
            project_id=request.project_id,
            user_id=request.user_id,
        )
