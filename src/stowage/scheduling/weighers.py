"""Weigher plugins: each scores a candidate in 0..1; a configured multiplier scales it.

A positive multiplier on the RAM and CPU weighers spreads instances, a negative one packs.
"""

from __future__ import annotations

from stowage.domain.groups import GroupPolicy
from stowage.domain.topology import ResourceClass
from stowage.scheduling.framework import CycleState, Request, Weigher
from stowage.scheduling.view import HostState

__all__ = [
    "BuildFailureWeigher",
    "CpuWeigher",
    "RamWeigher",
    "SoftAffinityWeigher",
    "SoftAntiAffinityWeigher",
    "default_weighers",
]


_MEMORY_MB = ResourceClass.MEMORY_MB
_VCPU = ResourceClass.VCPU
_PCPU = ResourceClass.PCPU


class RamWeigher:
    name = "ram"

    def __init__(self, multiplier: float = 1.0) -> None:
        self.multiplier = multiplier

    def active(self, request: Request, state: CycleState) -> bool:
        return self.multiplier != 0

    def weigh(self, request: Request, host: HostState, state: CycleState) -> float:
        # The free share, inline: this runs for every candidate of every decision.
        capacity = host.capacity.get(_MEMORY_MB, 0)
        return (capacity - host.used.get(_MEMORY_MB, 0)) / capacity if capacity > 0 else 0.0


class CpuWeigher:
    """Free share of the CPUs the request uses: PCPU for pinned requests, else VCPU."""

    name = "cpu"

    def __init__(self, multiplier: float = 1.0) -> None:
        self.multiplier = multiplier

    def active(self, request: Request, state: CycleState) -> bool:
        return self.multiplier != 0

    def weigh(self, request: Request, host: HostState, state: CycleState) -> float:
        rc = _PCPU if request.shape.dedicated_vcpus else _VCPU
        capacity = host.capacity.get(rc, 0)
        return (capacity - host.used.get(rc, 0)) / capacity if capacity > 0 else 0.0


class SoftAffinityWeigher:
    """More of the group's members on the host scores higher."""

    name = "soft_affinity"

    def __init__(self, multiplier: float = 1.0) -> None:
        self.multiplier = multiplier

    def active(self, request: Request, state: CycleState) -> bool:
        group = state.group
        return group is not None and group.group.policy is GroupPolicy.SOFT_AFFINITY

    def weigh(self, request: Request, host: HostState, state: CycleState) -> float:
        group = state.group
        if group is None or group.group.policy is not GroupPolicy.SOFT_AFFINITY:
            return 0.0
        total = sum(group.per_host.values())
        return group.per_host.get(host.id, 0) / total if total else 0.0


class SoftAntiAffinityWeigher:
    """Fewer of the group's members on the host scores higher."""

    name = "soft_anti_affinity"

    def __init__(self, multiplier: float = 1.0) -> None:
        self.multiplier = multiplier

    def active(self, request: Request, state: CycleState) -> bool:
        group = state.group
        return group is not None and group.group.policy is GroupPolicy.SOFT_ANTI_AFFINITY

    def weigh(self, request: Request, host: HostState, state: CycleState) -> float:
        group = state.group
        if group is None or group.group.policy is not GroupPolicy.SOFT_ANTI_AFFINITY:
            return 0.0
        total = sum(group.per_host.values())
        return 1.0 - group.per_host.get(host.id, 0) / total if total else 1.0


class BuildFailureWeigher:
    """Hosts that recently failed builds sink, as Nova's build_failure_weight_multiplier."""

    name = "build_failure"

    def __init__(self, multiplier: float = 1000.0) -> None:
        self.multiplier = multiplier

    def active(self, request: Request, state: CycleState) -> bool:
        return self.multiplier != 0

    def weigh(self, request: Request, host: HostState, state: CycleState) -> float:
        return 1.0 / (1 + host.build_failures)


def default_weighers() -> list[Weigher]:
    return [
        RamWeigher(1.0),
        CpuWeigher(1.0),
        SoftAffinityWeigher(1.0),
        SoftAntiAffinityWeigher(1.0),
        BuildFailureWeigher(1000.0),
    ]
