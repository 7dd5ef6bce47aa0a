"""Claims: what a committed scheduling decision owns, down to each pCPU and group slot."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from stowage.domain.numa import Fit
from stowage.domain.topology import ResourceClass

__all__ = ["Claim", "ClaimOutcome", "ConsumerKind", "GroupSlot", "RefusalCode"]


class ConsumerKind(StrEnum):
    INSTANCE = "instance"
    MIGRATION = "migration"


class RefusalCode(StrEnum):
    """Stable codes for a refused claim; never reused for another meaning."""

    CAPACITY = "placement.capacity.exceeded"
    PCPU_TAKEN = "placement.pcpu.taken"
    NUMA_MEMORY = "placement.numa_memory.exceeded"
    ANTI_AFFINITY = "group.anti_affinity.violated"
    AFFINITY = "group.affinity.violated"
    CONSUMER_PLACED = "placement.consumer.already_placed"
    UNKNOWN_RESOURCE = "placement.resource.unknown"
    NO_VALID_HOST = "scheduler.no_valid_host"
    CONSUMER_GONE = "placement.consumer.gone"  # what the claim was for was deleted or moved on


@dataclass(frozen=True, slots=True)
class GroupSlot:
    """One of the `max_per_domain` places a strict anti-affinity group has in a domain."""

    group_id: str
    domain: str
    slot: int
    max_per_domain: int


@dataclass(frozen=True, slots=True)
class Claim:
    """Everything one placement takes on one host, committed all or nothing.

    An instance consumer's claim also sets the instance's host; a migration consumer holds
    the destination's side while the instance keeps its source claim, so both count.
    """

    consumer_id: str
    instance_id: str
    host_id: int
    amounts: Mapping[ResourceClass, int]
    fit: Fit
    slots: tuple[GroupSlot, ...] = ()
    affinity_groups: tuple[str, ...] = ()
    member_of: tuple[str, ...] = ()
    kind: ConsumerKind = ConsumerKind.INSTANCE
    project_id: str = ""
    user_id: str = ""


@dataclass(frozen=True, slots=True)
class ClaimOutcome:
    """A committed claim (`ok`) or the reason the ledger refused it."""

    consumer_id: str
    host_id: int
    ok: bool
    code: RefusalCode | None = None
    reason: str = ""
    extra: Mapping[str, object] = field(default_factory=dict)
