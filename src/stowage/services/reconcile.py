"""The reconciler's ledger side: what one host should run, and how a divergence is recorded.

Reading only: nothing here writes a claim. A divergence is evidence (a fault document, an
instance action event, a log line); settling it is a decision for an operator or a
workflow that holds a fresh view, never for a pass that compared two snapshots.
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from sqlalchemy import and_, exists, select

from stowage.domain.claims import ConsumerKind
from stowage.ledger.db import READONLY
from stowage.ledger.schema import consumers, pins

if TYPE_CHECKING:
    from stowage.ledger.ledger import Ledger
    from stowage.services.cloud import Cloud

__all__ = [
    "Divergence",
    "DivergenceKind",
    "End",
    "Expected",
    "Role",
    "expected_on_host",
    "record_divergence",
]

log = logging.getLogger(__name__)


class Role(StrEnum):
    """Which end of an instance's life on a host the ledger records."""

    HOME = "home"  # the instance's own claim, no move in flight
    OUTGOING = "outgoing"  # the instance's own claim while a migration holds a destination
    INCOMING = "incoming"  # a migration consumer's claim: this host is the destination


class DivergenceKind(StrEnum):
    """Stable names (the metric label and the fault's code suffix); never reused."""

    UNKNOWN_INSTANCE = "unknown_instance"  # running here, the ledger places nothing here
    MISSING_INSTANCE = "missing_instance"  # the ledger places it here, the hypervisor lacks it
    PINS_DIFFER = "pins_differ"  # running with pins that match no claim here
    CHECK_FAILED = "check_failed"  # comparing this instance raised

    @property
    def code(self) -> str:
        return f"reconcile.{self.value}"


@dataclass(frozen=True, slots=True)
class End:
    """One consumer's claim on the host: guest vCPU -> host pCPU (empty for shared CPUs)."""

    role: Role
    consumer_id: str
    pins: Mapping[int, int]


@dataclass(frozen=True, slots=True)
class Expected:
    """What the ledger says about one instance on one host: one end, or two for a move here."""

    instance_id: str
    ends: tuple[End, ...]

    @property
    def in_flight(self) -> bool:
        """A migration is in flight: the instance may legitimately run at the other end."""
        return any(end.role is not Role.HOME for end in self.ends)

    def accepts(self, running_pins: Mapping[int, int]) -> bool:
        """Running pins match the claim of some end (either end of an in-flight move)."""
        actual = dict(running_pins)
        return any(dict(end.pins) == actual for end in self.ends)


@dataclass(frozen=True, slots=True)
class Divergence:
    """One instance whose hypervisor state disagrees with the ledger; `detail` says how."""

    kind: DivergenceKind
    instance_id: str
    detail: str
    expected: dict[str, dict[int, int]] = field(default_factory=dict)  # role -> pins
    actual: dict[int, int] | None = None  # pins on the hypervisor, when it runs there

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "code": self.kind.code,
            "instance_id": self.instance_id,
            "detail": self.detail,
            "expected": {
                role: {str(v): c for v, c in sorted(p.items())}
                for role, p in sorted(self.expected.items())
            },
            "actual": None
            if self.actual is None
            else {str(v): c for v, c in sorted(self.actual.items())},
        }


def expected_on_host(ledger: Ledger, host_name: str) -> dict[str, Expected]:
    """Every instance the ledger places on `host_name`, with the pins each end claims.

    One statement, so the answer is one consistent snapshot on every backend. Withheld
    siblings (pins without a guest vCPU) are claimed but never pinned, so they are left out.
    """
    host_id = ledger.host_id(host_name)
    other = consumers.alias("other")
    moving = (
        exists()
        .where(
            other.c.kind == ConsumerKind.MIGRATION.value,
            other.c.instance_id == consumers.c.instance_id,
            other.c.id != consumers.c.id,
        )
        .label("moving")
    )
    query = (
        select(
            consumers.c.id,
            consumers.c.kind,
            consumers.c.instance_id,
            moving,
            pins.c.guest_vcpu,
            pins.c.cpu_id,
        )
        .select_from(
            consumers.outerjoin(
                pins,
                and_(
                    pins.c.consumer_id == consumers.c.id,
                    pins.c.host_id == consumers.c.host_id,
                    pins.c.guest_vcpu.is_not(None),
                ),
            )
        )
        .where(consumers.c.host_id == host_id)
        .order_by(consumers.c.instance_id, consumers.c.id)
    )
    with ledger.engine.connect().execution_options(**READONLY) as conn:
        rows = conn.execute(query).all()
    ends: dict[str, dict[str, tuple[Role, dict[int, int]]]] = {}
    for consumer_id, kind, instance_id, is_moving, vcpu, cpu in rows:
        per_instance = ends.setdefault(instance_id, {})
        if consumer_id not in per_instance:
            per_instance[consumer_id] = (_role(kind, bool(is_moving)), {})
        if vcpu is not None:
            per_instance[consumer_id][1][int(vcpu)] = int(cpu)
    return {
        instance_id: Expected(
            instance_id,
            tuple(End(role, cid, pinned) for cid, (role, pinned) in sorted(by_consumer.items())),
        )
        for instance_id, by_consumer in ends.items()
    }


def _role(kind: str, moving: bool) -> Role:
    if kind == ConsumerKind.MIGRATION.value:
        return Role.INCOMING
    return Role.OUTGOING if moving else Role.HOME


def record_divergence(cloud: Cloud, host: str, divergence: Divergence) -> None:
    """A log line always, an `instance_fault` document, and for an instance the cloud
    knows, an instance action whose `compute_reconcile` event failed with the details.

    Never touches a claim: the ledger is not rewritten from what one pass saw.
    """
    details = divergence.as_dict()
    log.warning(
        "reconcile divergence on %s: %s %s: %s",
        host,
        divergence.kind.value,
        divergence.instance_id,
        divergence.detail,
        extra={
            "host": host,
            "instance_id": divergence.instance_id,
            "divergence_kind": divergence.kind.value,
            "divergence_code": divergence.kind.code,
            "detail": divergence.detail,
        },
    )
    now = time.time()
    cloud.objects.create(
        "instance_fault",
        uuid.uuid4().hex,
        {
            "instance_uuid": divergence.instance_id,
            "host": host,
            "code": 500,
            "error_code": divergence.kind.code,
            "message": divergence.detail,
            "details": details,
            "created": now,
        },
        project_id=divergence.instance_id,  # as instance actions do: listed per instance
        name=divergence.kind.value,
    )
    instance = cloud.objects.find("instance", divergence.instance_id)
    if instance is None:
        return
    project_id = str(instance.body.get("project_id") or "")
    # Short enough that "request_id:instance_id" fits the 64-character document id.
    request_id = "req-" + uuid.uuid4().hex[:20]
    cloud.objects.create(
        "instance_action",
        f"{request_id}:{divergence.instance_id}",
        {
            "action": "reconcile",
            "instance_uuid": divergence.instance_id,
            "request_id": request_id,
            "user_id": None,  # no user asked: the host's periodic audit found it
            "project_id": project_id,
            "start_time": now,
            "updated_at": now,
            "message": divergence.detail,
            "events": [
                {
                    "event": "compute_reconcile",
                    "start_time": now,
                    "finish_time": now,
                    "result": "Error",
                    "traceback": None,
                    "host": host,
                    "hostId": hashlib.sha224((project_id + host).encode()).hexdigest(),
                    "details": divergence.detail,
                    "divergence": details,
                }
            ],
        },
        project_id=divergence.instance_id,
        name="reconcile",
    )
