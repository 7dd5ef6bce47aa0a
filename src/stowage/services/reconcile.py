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

from sqlalchemy import and_, exists, literal_column, select

from stowage.domain.claims import ConsumerKind
from stowage.ledger.db import READONLY
from stowage.ledger.operations import ACTIVE_STATES
from stowage.ledger.schema import consumers, host_generations, operations, pins

if TYPE_CHECKING:
    from stowage.ledger.ledger import Ledger
    from stowage.services.cloud import Cloud

__all__ = [
    "RUNNING_DELETED_ACTIONS",
    "Divergence",
    "DivergenceKind",
    "End",
    "Expected",
    "Role",
    "expected_on_host",
    "reap_unknown",
    "record_divergence",
    "settle_vanished",
]

# Nova's `running_deleted_instance_action`: what to do with a guest that runs on a host where
# the ledger places no instance (its instance is deleted, or lives elsewhere).
RUNNING_DELETED_ACTIONS = ("reap", "log", "noop")

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
            # A literal, so the partial index of moves serves it.
            other.c.kind == literal_column("'migration'"),
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
                    pins.c.consumer_seq == consumers.c.seq,
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

    Then what Nova does about it: an instance whose guest vanished is put into Nova's state
    for it (`settle_vanished`), and a guest that runs here while the ledger places its
    instance nowhere here is reaped, logged or left alone as `running_deleted_instance_action`
    says (`reap_unknown`). Never touches a claim: the ledger is not rewritten from what one
    pass saw.
    """
    if divergence.kind is DivergenceKind.UNKNOWN_INSTANCE:
        action = cloud.config.running_deleted_instance_action
        if action == "noop":
            log.debug("running_deleted_instance_action=noop: %s left alone", divergence.instance_id)
            return
        _record(cloud, host, divergence)
        if action == "reap":
            reap_unknown(cloud, host, divergence.instance_id)
        return
    if divergence.kind is DivergenceKind.MISSING_INSTANCE and _already_vanished(
        cloud, divergence.instance_id
    ):
        # Recorded and settled by an earlier pass: the server shows SHUTOFF with no power
        # state, as Nova leaves it; a new fault every pass would say nothing new.
        log.info("instance %s on %s still has no guest", divergence.instance_id, host)
        return
    _record(cloud, host, divergence)
    if divergence.kind is DivergenceKind.MISSING_INSTANCE:
        settle_vanished(cloud, host, divergence)


def _record(cloud: Cloud, host: str, divergence: Divergence) -> None:
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


# Nova's power states (nova/compute/power_state.py).
NOSTATE = 0
SHUTDOWN = 4
# vm_states Nova's _sync_instance_power_state stops when the guest is gone; a stopped or
# errored instance keeps its vm_state and only learns the power state.
_STOPPED_WHEN_GONE = frozenset({"active", "paused", "suspended", "rescued"})


def _already_vanished(cloud: Cloud, instance_id: str) -> bool:
    doc = cloud.objects.find("instance", instance_id)
    if doc is None:
        return False
    fault = doc.body.get("fault") or {}
    return bool(
        doc.body.get("power_state") == NOSTATE
        and fault.get("error_code") == DivergenceKind.MISSING_INSTANCE.code
    )


def settle_vanished(cloud: Cloud, host: str, divergence: Divergence) -> bool:
    """The guest of an instance the ledger places on `host` is gone: as Nova's
    `_sync_instance_power_state` does, the instance learns power state NOSTATE and, if it
    was running (or paused, suspended, rescued), is stopped: status SHUTOFF, vm_state
    stopped, with the reason as its fault. `openstack server start` spawns it again.

    Compare-and-swap on the instance, and only while no operation of it is in flight (an
    operation that started since the pass read its views owns the instance). True when the
    instance changed.
    """
    doc = cloud.objects.find("instance", divergence.instance_id)
    if doc is None:
        return False
    before = doc.body
    if before.get("host") != host or before.get("task_state") is not None:
        return False
    after = dict(before)
    after["power_state"] = NOSTATE
    if before.get("vm_state") in _STOPPED_WHEN_GONE:
        after.update(status="SHUTOFF", vm_state="stopped")
    after["fault"] = {
        "code": 500,
        "message": f"The guest of instance {divergence.instance_id} vanished from {host}",
        "details": divergence.detail,
        "created": cloud.clock(),
        "error_code": divergence.kind.code,
    }
    with cloud.ledger.engine.begin() as conn:
        busy = conn.execute(
            select(operations.c.id)
            .where(
                operations.c.instance_id == divergence.instance_id,
                operations.c.state.in_(ACTIVE_STATES),
            )
            .limit(1)
        ).first()
        if busy is not None:
            return False
        changed = cloud.objects.swap_in(conn, "instance", divergence.instance_id, before, after)
    if changed:
        log.warning(
            "instance %s has no guest on %s: now %s, power state NOSTATE",
            divergence.instance_id,
            host,
            after["status"],
            extra={"host": host, "instance_id": divergence.instance_id},
        )
    return changed


def reap_unknown(cloud: Cloud, host: str, instance_id: str) -> str | None:
    """Destroy a guest that runs on `host` although its instance is deleted or lives on
    another host (Nova's `running_deleted_instance_action = reap`): a clean-up operation
    the conductor drives, so it runs before anything new starts on the host.

    Checked again in the transaction that enqueues it, with the host's generation row (the
    lock every claim takes first) locked against claims: if the ledger now places the
    instance (or a migration of it) here, or any operation of the instance is in flight
    here, nothing is reaped. An instance whose document says it lives here without a claim
    here is left to an operator. Returns the clean-up operation's id, or None.
    """
    doc = cloud.objects.find("instance", instance_id)
    if doc is not None and doc.body.get("host") in (host, None):
        log.warning(
            "guest %s runs on %s, where its instance has no claim: not reaped", instance_id, host
        )
        return None
    host_id = cloud.ledger.host_id(host)
    with cloud.ledger.engine.begin() as conn:
        conn.execute(
            select(host_generations.c.host_id)
            .where(host_generations.c.host_id == host_id)
            .with_for_update()
        ).first()
        placed = conn.execute(
            select(consumers.c.id)
            .where(consumers.c.instance_id == instance_id, consumers.c.host_id == host_id)
            .limit(1)
        ).first()
        busy = conn.execute(
            select(operations.c.id)
            .where(
                operations.c.instance_id == instance_id,
                operations.c.host == host,
                operations.c.state.in_(ACTIVE_STATES),
            )
            .limit(1)
        ).first()
        if placed is not None or busy is not None:
            return None
        op_id = cloud.operations.enqueue(
            "cleanup",
            instance_id,
            host,
            step="destroy",
            payload={"reason": "running_deleted_instance_action=reap"},
            conn=conn,
        ).id
    log.warning(
        "reaping guest %s on %s: its instance is %s",
        instance_id,
        host,
        "deleted" if doc is None else f"on {doc.body.get('host')}",
        extra={"host": host, "instance_id": instance_id, "operation": op_id},
    )
    cloud.kick()
    return op_id
