"""The decision cycle: filter, weigh, pick, and turn the pick into a claim; explain refusals.

The scan stops after `candidates_max` hosts pass (Nomad's limit on feasible nodes), so a
decision costs about the same at 100 hosts as at 100,000 while the cloud has room; when few
hosts fit, it scans them all. Hosts are visited in an order of shuffled blocks of
`block_hosts` neighbouring ids, from a cursor that each decision leaves just past its first
passing host (the Kubernetes scheduler's `nextStartNodeIndex`): consecutive requests see
overlapping windows and the cloud fills round robin. Neighbouring requests then land on
neighbouring host ids, so a batch's claim touches a few pages of every table keyed by host
instead of one page per claim; the shuffled blocks keep a label domain that follows the ids
(a rack) from holding a scan up for more than a block.

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
        block_hosts: int = 32,
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
        if block_hosts < 1:
            raise ValueError("block_hosts must be at least 1")
        self.block_hosts = block_hosts
        self._order: list[list[int]] = []
        self._cursors: list[int] = []
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
        # Bound methods with their names: the scan below is the hot loop of a decision.
        active = [(f.filter, f.name) for f in self.filters if f.prefilter(request, view, state)]
        parts = self._host_order(view)
        diagnosis = Diagnosis(len(view.hosts))
        candidates: list[HostState] = []
        hosts = view.hosts
        want = self.candidates_max
        cursors = self._cursors
        for part, order in enumerate(parts):
            n = len(order)
            start = cursors[part]
            first = -1
            for i in range(n):
                host = hosts[order[(start + i) % n]]
                for check, name in active:
                    reason = check(request, host, state)
                    if reason is not None:
                        diagnosis.note(name, reason)
                        break
                else:
                    candidates.append(host)
                    if first < 0:
                        first = i
                    if len(candidates) >= want:
                        break
            if first >= 0:
                cursors[part] = (start + first + 1) % n
            if len(candidates) >= want:
                break
        for host in self._ranked(request, candidates, state):
            claim = self._claim(request, host, state)
            if isinstance(claim, str):
                diagnosis.note("numa_topology", claim)
                continue
            return Decision(request, claim)
        return Decision(request, None, diagnosis)

    def _ranked(
        self, request: Request, candidates: list[HostState], state: CycleState
    ) -> list[HostState]:
        """Candidates by descending weighted score; ties keep the scan's order."""
        weighers = [(w.weigh, w.multiplier) for w in self.weighers if w.active(request, state)]
        if len(candidates) < 2 or not weighers:
            return candidates
        scores: list[float] = []
        for host in candidates:
            score = 0.0  # negated, so that an ascending sort ranks the best first
            for weigh, multiplier in weighers:
                score -= multiplier * weigh(request, host, state)
            scores.append(score)
        order = sorted(range(len(candidates)), key=scores.__getitem__)
        return [candidates[i] for i in order]

    def _host_order(self, view: View) -> list[list[int]]:
        """Host ids in shuffled blocks of neighbours: this worker's shard first when sharded."""
        if self._order_view is not view or self._order_len != len(view.hosts):
            ids = sorted(view.hosts)
            if self.shard is None:
                parts = [ids]
            else:
                index, count = self.shard
                parts = [
                    [h for h in ids if h % count == index],
                    [h for h in ids if h % count != index],
                ]
            self._order = [self._blocks(part) for part in parts]
            self._cursors = [self.rng.randrange(len(o)) if o else 0 for o in self._order]
            self._order_view = view
            self._order_len = len(view.hosts)
        return self._order

    def _blocks(self, ids: list[int]) -> list[int]:
        size = self.block_hosts
        blocks = [ids[i : i + size] for i in range(0, len(ids), size)]
        self.rng.shuffle(blocks)
        return [h for block in blocks for h in block]

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
