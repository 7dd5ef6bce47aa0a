"""The scheduler's extension points: one small interface per step, results as values."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from stowage.domain.claims import ConsumerKind
from stowage.domain.flavor import InstanceShape
from stowage.domain.numa import Fit
from stowage.scheduling.view import GroupState, HostState, View

__all__ = [
    "CycleState",
    "Filter",
    "Request",
    "Weigher",
]


@dataclass(frozen=True, slots=True)
class Request:
    """One instance (or one migration's destination) to place."""

    consumer_id: str
    instance_id: str
    shape: InstanceShape
    kind: ConsumerKind = ConsumerKind.INSTANCE
    project_id: str = ""
    user_id: str = ""
    group_id: str | None = None
    availability_zone: str | None = None
    force_host: str | None = None  # the host of an admin's "zone:host"
    same_host: frozenset[int] = frozenset()  # host ids of the instances named in the hint
    different_host: frozenset[int] = frozenset()
    ignore_hosts: frozenset[int] = frozenset()  # a move's source host
    image_properties: Mapping[str, str] = field(default_factory=dict)
    extra_specs: Mapping[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class CycleState:
    """What pre-filters compute once per request and filters read per host."""

    now: float
    group: GroupState | None = None
    fits: dict[int, Fit] = field(default_factory=dict)
    values: dict[str, object] = field(default_factory=dict)


class Filter(Protocol):
    """Decides whether a host can take a request. `prefilter` returns False to sit out."""

    name: str

    def prefilter(self, request: Request, view: View, state: CycleState) -> bool: ...

    def filter(self, request: Request, host: HostState, state: CycleState) -> str | None:
        """None to pass the host, or the reason it is rejected."""
        ...


class Weigher(Protocol):
    """Scores a candidate in 0..1; the pipeline scales it by `multiplier`."""

    name: str
    multiplier: float

    def active(self, request: Request, state: CycleState) -> bool:
        """False when the weigher would score every host the same for this request."""
        ...

    def weigh(self, request: Request, host: HostState, state: CycleState) -> float: ...
