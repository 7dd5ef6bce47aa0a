"""The scheduler's in-memory view of hosts and groups, updated incrementally."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from stowage.domain.claims import Claim
from stowage.domain.groups import ServerGroup
from stowage.domain.numa import HostFree, apply_fit
from stowage.domain.topology import HostTopology, ResourceClass

__all__ = ["GroupState", "HostState", "View"]


@dataclass(slots=True)
class HostState:
    """One host as the scheduler sees it: capacity, usage, free pCPUs and NUMA memory."""

    id: int
    name: str
    topology: HostTopology
    capacity: dict[ResourceClass, int]
    used: dict[ResourceClass, int]
    max_unit: dict[ResourceClass, int]
    free: HostFree
    availability_zone: str = "nova"
    labels: Mapping[str, str] = field(default_factory=dict)
    hypervisor_type: str = "sim"
    architecture: str = "x86_64"
    disabled: bool = False
    forced_down: bool = False
    last_seen: float | None = None
    generation: int = 0
    build_failures: int = 0
    aggregate_metadata: Mapping[str, frozenset[str]] = field(default_factory=dict)

    def free_amount(self, rc: ResourceClass) -> int:
        return self.capacity.get(rc, 0) - self.used.get(rc, 0)


@dataclass(slots=True)
class GroupState:
    """Where a group's members sit, both ends of in-flight migrations counted."""

    group: ServerGroup
    per_host: Counter[int] = field(default_factory=Counter)
    per_domain: Counter[str] = field(default_factory=Counter)
    slots: set[tuple[str, int]] = field(default_factory=set)

    def free_slot(self, domain: str) -> int | None:
        for slot in range(self.group.max_per_domain):
            if (domain, slot) not in self.slots:
                return slot
        return None


@dataclass(slots=True)
class HostGroups:
    """What one host contributes to groups, so a refresh can subtract it before re-adding."""

    members: Counter[str] = field(default_factory=Counter)  # group id -> consumers here
    slots: list[tuple[str, str, int]] = field(default_factory=list)  # (group, domain, slot)


class View:
    """Hosts and groups, with the ledger sequence they are current to."""

    def __init__(self, writer: str = "") -> None:
        self.hosts: dict[int, HostState] = {}
        self.groups: dict[str, GroupState] = {}
        self.host_groups: dict[int, HostGroups] = {}
        self.seq = 0
        # How many times every host was read (a first load, a reload after a pruned log).
        self.loads = 0
        # Ledger change rows already applied, kept for a window behind `seq` because
        # sequence numbers may commit out of order.
        self.seen: set[int] = set()
        # Changes this view's owner committed and applied itself carry this token.
        self.writer = writer
        # Hosts known to have changed but not read again yet (other workers' shards).
        self.stale: set[int] = set()

    def add_group(self, group: ServerGroup) -> GroupState:
        state = self.groups.get(group.id)
        if state is None:
            state = self.groups[group.id] = GroupState(group)
        return state

    def replace_host(self, host: HostState, contribution: HostGroups) -> None:
        """Swap in a fresher copy of one host and its group contributions."""
        old = self.host_groups.get(host.id)
        if old is not None:
            self._apply_groups(host.id, old, -1)
        self.hosts[host.id] = host
        self.host_groups[host.id] = contribution
        self._apply_groups(host.id, contribution, +1)

    def remove_host(self, host_id: int) -> None:
        """Forget a host and what it contributes to groups (a what-if of its failure)."""
        old = self.host_groups.pop(host_id, None)
        if old is not None:
            self._apply_groups(host_id, old, -1)
        self.hosts.pop(host_id, None)

    def _apply_groups(self, host_id: int, part: HostGroups, sign: int) -> None:
        for group_id, count in part.members.items():
            state = self.groups.get(group_id)
            if state is not None:
                state.per_host[host_id] += sign * count
                if state.per_host[host_id] <= 0:
                    del state.per_host[host_id]
        for group_id, domain, slot in part.slots:
            state = self.groups.get(group_id)
            if state is None:
                continue
            state.per_domain[domain] += sign
            if state.per_domain[domain] <= 0:
                del state.per_domain[domain]
            if sign > 0:
                state.slots.add((domain, slot))
            else:
                state.slots.discard((domain, slot))

    def apply_claim(self, claim: Claim) -> None:
        """Reflect a committed claim at once, before the ledger's change log says so."""
        host = self.hosts.get(claim.host_id)
        if host is None:
            return
        for rc, amount in claim.amounts.items():
            host.used[rc] = host.used.get(rc, 0) + amount
        host.free = apply_fit(host.free, claim.fit)
        host.generation += 1
        if not claim.member_of and not claim.slots:
            return
        contribution = self.host_groups.get(host.id)
        if contribution is None:
            contribution = self.host_groups[host.id] = HostGroups()
        delta = HostGroups()
        groups = set(claim.member_of)
        groups.update(slot.group_id for slot in claim.slots)
        for group_id in groups:
            delta.members[group_id] += 1
        delta.slots.extend((s.group_id, s.domain, s.slot) for s in claim.slots)
        contribution.members.update(delta.members)
        contribution.slots.extend(delta.slots)
        self._apply_groups(host.id, delta, +1)

    def member_hosts(self, group_id: str) -> Mapping[int, int]:
        state = self.groups.get(group_id)
        return state.per_host if state is not None else {}

    def host_ids(self) -> Iterable[int]:
        return self.hosts.keys()
