"""The fault classes a run can inject, each behind its own switch, and the seed's schedule."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from enum import StrEnum

__all__ = [
    "ALL_FAULTS",
    "DEFAULT_FAULTS",
    "Crash",
    "Fault",
    "FaultKind",
    "Schedule",
    "parse_faults",
]


class Crash(BaseException):
    """A process dies here. A BaseException, so that no `except Exception` survives it."""


class FaultKind(StrEnum):
    API_CRASH = "api-crash"  # the API process dies before its k-th commit (between two)
    CONDUCTOR_CRASH = "conductor-crash"  # the conductor dies before its k-th commit
    BUS_LOSS = "bus-loss"  # a request or its reply is lost
    BUS_DUPLICATE = "bus-duplicate"  # a request is delivered twice, the copy later
    BUS_REORDER = "bus-reorder"  # a request is held back, so later ones overtake it
    BUS_LATE = "bus-late"  # held back or duplicated past the caller's timeout (stale delivery)
    AGENT_CRASH = "agent-crash"  # an agent process dies and restarts (its guests stay)
    # An agent process restarts with an empty hypervisor view, as `stowage agent --driver sim`
    # does: its guests are gone, and it restores them from the ledger before it serves.
    AGENT_FORGETS = "agent-forgets"
    HOST_DOWN = "host-down"  # an agent stops (no heartbeat, no work) past service_down_time
    DRIVER_FAULT = "driver-fault"  # a hypervisor step fails or crashes the agent
    SLOW_DISK = "slow-disk"  # hypervisor steps and disk reads take (virtual) seconds
    CONCURRENT = "concurrent"  # conflicting requests on one instance, interleaved
    QUOTA_RACE = "quota-race"  # many creates (and large max_count) near a project's quota
    DELETE_MOVING = "delete-moving"  # deletes racing a move, a create or another request
    EVACUATE = "evacuate"  # clients evacuate a host that is down (with host-down)
    # Not a fault of the system: a record written behind its back, for the checkers' tests.
    SABOTAGE = "sabotage"


ALL_FAULTS = frozenset(FaultKind) - {FaultKind.SABOTAGE}

# Every fault class: each finding the simulation made is fixed (tests/sim/test_findings.py).
DEFAULT_FAULTS = ALL_FAULTS


def parse_faults(text: str) -> frozenset[FaultKind]:
    """`default`, `all`, `none`, or a comma list; `default,-bus-loss,+api-crash` edits a set."""
    chosen: set[FaultKind] = set()
    for raw in (t.strip() for t in text.split(",")):
        if not raw:
            continue
        if raw == "default":
            chosen |= DEFAULT_FAULTS
        elif raw == "all":
            chosen |= ALL_FAULTS
        elif raw == "none":
            chosen.clear()
        elif raw.startswith("-"):
            chosen.discard(FaultKind(raw[1:]))
        else:
            chosen.add(FaultKind(raw.removeprefix("+")))
    return frozenset(chosen)


@dataclass(frozen=True, slots=True)
class Fault:
    """One injected fault: when (virtual seconds into the run, or a commit number) and what."""

    kind: FaultKind
    detail: str

    def __str__(self) -> str:
        return f"{self.kind.value}: {self.detail}"


@dataclass(slots=True)
class Schedule:
    """What the seed enabled, with its probabilities, and the faults that actually happened."""

    enabled: frozenset[FaultKind]
    rng: random.Random
    api_crash_at: list[int] = field(default_factory=list)  # api commit numbers
    conductor_crash_at: list[int] = field(default_factory=list)  # conductor commit numbers
    bus_loss_p: float = 0.0
    bus_duplicate_p: float = 0.0
    bus_reorder_p: float = 0.0
    injected: list[Fault] = field(default_factory=list)

    @classmethod
    def draw(cls, enabled: frozenset[FaultKind], rng: random.Random) -> Schedule:
        s = cls(enabled, rng)
        if FaultKind.API_CRASH in enabled:
            s.api_crash_at = sorted(rng.sample(range(1, 80), rng.choice((1, 1, 2))))
        if FaultKind.CONDUCTOR_CRASH in enabled:
            s.conductor_crash_at = sorted(rng.sample(range(1, 60), rng.choice((1, 2))))
        if FaultKind.BUS_LOSS in enabled:
            s.bus_loss_p = rng.choice((0.0, 0.05, 0.15))
        if FaultKind.BUS_DUPLICATE in enabled:
            s.bus_duplicate_p = rng.choice((0.0, 0.1, 0.3))
        if FaultKind.BUS_REORDER in enabled:
            s.bus_reorder_p = rng.choice((0.0, 0.1, 0.3))
        return s

    def on(self, kind: FaultKind) -> bool:
        return kind in self.enabled

    def note(self, kind: FaultKind, detail: str) -> Fault:
        fault = Fault(kind, detail)
        self.injected.append(fault)
        return fault
