"""Moves as records whose every status change commits with the ownership it implies.

Evacuation, live migration, cold migration and resize each get a migration record and a
migration consumer in the ledger. The destination is claimed by the scheduler like any
placement (group slots and pCPUs included, both ends counting while the move is in flight);
`completed` and `confirmed` hand the destination to the instance and release the source in
the transaction that writes the status; `failed` and `reverted` release the destination in
the transaction that writes theirs. No status means "maybe held somewhere".

Once the destination is claimed, the conductor (services/conductor.py) drives the move
through the agents: live migrations go preparing -> running -> post-migrating -> completed,
evacuations pre-migrating -> done, cold migrations and resizes wait in `finished`
(VERIFY_RESIZE) for a confirm (or the auto-confirm window) or a revert. A move whose
destination cannot confirm its part goes to `error`, both ends held, until that agent answers
and the destination is undone: then `failed`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, select

from stowage.domain.claims import ConsumerKind
from stowage.domain.errors import ConflictError, InvalidSpec, NotFound
from stowage.ledger.db import READONLY
from stowage.ledger.schema import hosts
from stowage.scheduling.framework import Request
from stowage.services.cloud import Cloud
from stowage.services.compute import shape_of_flavor, take_instance
from stowage.services.scheduler import Placement

__all__ = [
    "MoveResult",
    "abort_live_migration",
    "confirm_resize",
    "evacuate_host",
    "force_complete_live_migration",
    "move",
    "outcome",
    "revert_resize",
]

# migration_type -> (instance status while moving, task_state)
_MOVING = {
    "evacuation": ("REBUILD", "rebuilding"),
    "live-migration": ("MIGRATING", "migrating"),
    "migration": ("RESIZE", "resize_migrating"),
    "resize": ("RESIZE", "resize_migrating"),
}
_STARTABLE = {
    "evacuation": {"ACTIVE", "SHUTOFF", "ERROR"},
    "live-migration": {"ACTIVE", "PAUSED"},
    "migration": {"ACTIVE", "SHUTOFF"},
    "resize": {"ACTIVE", "SHUTOFF"},
}


@dataclass(frozen=True, slots=True)
class MoveResult:
    migration_id: str
    status: str
    dest: str | None
    reason: str = ""


def _host_row(cloud: Cloud, name: str) -> Any:
    with cloud.ledger.engine.connect().execution_options(**READONLY) as conn:
        return conn.execute(select(hosts).where(hosts.c.name == name)).first()


def host_is_up(cloud: Cloud, name: str) -> bool:
    row = _host_row(cloud, name)
    if row is None:
        return False
    fresh = row.last_seen is not None and (
        cloud.clock() - row.last_seen <= cloud.config.service_down_time_s
    )
    return fresh and not row.forced_down


def _number(cloud: Cloud) -> int:
    def first() -> int:  # a ledger from before the counter: go on from its records
        return 1 + max((int(d.body["number"]) for d in cloud.objects.list("migration")), default=0)

    return cloud.objects.next_number("migration", first)


@dataclass(slots=True)
class _Started:
    migration_id: str
    record: dict[str, Any]
    instance_id: str
    flavor: dict[str, Any]
    request: Request


def _start(
    cloud: Cloud,
    instance_id: str,
    migration_type: str,
    *,
    user_id: str,
    project_id: str,
    dest: str | None,
    new_flavor: dict[str, Any] | None,
    target_state: str | None = None,
) -> _Started:
    """Check the source, record the migration, mark the instance moving; claim nothing yet."""
    doc = cloud.objects.get("instance", instance_id)
    body = dict(doc.body)
    source = body.get("host")
    if source is None:
        raise ConflictError(f"Instance {instance_id} has no host to move from.")
    source_up = host_is_up(cloud, source)
    if migration_type == "evacuation" and source_up:
        raise ConflictError(f"Compute service of {source} is still in use.")
    pending = cloud.operations.active(instance_id=instance_id)
    if migration_type == "evacuation" and not source_up:
        # What waits for the dead source is superseded: the evacuation cleans it up there.
        stale = [op for op in pending if op.host == source and op.kind in _SUPERSEDED]
        with cloud.ledger.engine.begin() as conn:
            for op in stale:
                cloud.operations.advance(
                    conn, op.id, state="failed", result={"error": "superseded by evacuation"}
                )
        pending = [op for op in pending if op not in stale]
        body["task_state"] = None
    if body.get("task_state") is not None or pending:
        raise ConflictError(
            f"Cannot '{migration_type}' instance {instance_id} while it is in task_state "
            f"{body.get('task_state')}"
        )
    unsettled = [
        d.id
        for d in cloud.objects.list("migration")
        if d.body.get("instance_uuid") == instance_id and d.body.get("status") not in _SETTLED
    ]
    if unsettled:
        raise ConflictError(
            f"Instance {instance_id} has a migration that is not settled yet "
            f"({', '.join(unsettled)}); it ends as soon as its hosts answer."
        )
    if body["status"] not in _STARTABLE[migration_type]:
        raise ConflictError(
            f"Cannot '{migration_type}' instance {instance_id} while it is in vm_state "
            f"{body['vm_state']}"
        )
    if migration_type != "evacuation" and not source_up:
        raise ConflictError(f"Compute service of {source} is unavailable at this time.")
    if dest is not None:
        if _host_row(cloud, dest) is None:
            raise InvalidSpec(f"Compute host {dest} could not be found.")
        if dest == source:
            raise InvalidSpec(f"The target host {dest} is the instance's current host.")
    flavor = new_flavor or body["flavor"]
    migration_id = str(uuid.uuid4())
    record = {
        "number": _number(cloud),
        "instance_uuid": instance_id,
        "migration_type": migration_type,
        "status": "pre-migrating",
        "source_compute": source,
        "dest_compute": dest,
        "dest_host": dest,
        "old_flavor_id": body["flavor"]["id"],
        "new_flavor_id": flavor["id"],
        "new_flavor": flavor,
        "user_id": user_id,
        "project_id": project_id,
        "old_vm_state": body.get("vm_state"),
        # 2.95: an evacuated server rests stopped whatever it was ("stopped"), as in Nova.
        "target_state": target_state,
    }
    moving_status, task = _MOVING[migration_type]
    body.update(status=moving_status, task_state=task)
    # Whoever marks the instance moving first owns the move; a concurrent request is refused.
    with cloud.ledger.engine.begin() as conn:
        take_instance(cloud, conn, instance_id, doc.body, body, migration_type)
    cloud.objects.create("migration", migration_id, record, project_id=project_id)
    request = Request(
        consumer_id=migration_id,
        instance_id=instance_id,
        shape=shape_of_flavor(flavor),
        kind=ConsumerKind.MIGRATION,
        project_id=body["project_id"],
        user_id=body["user_id"],
        group_id=body.get("group_id"),
        force_host=dest,
        ignore_hosts=frozenset({cloud.ledger.host_id(source)}),
        extra_specs=dict(flavor.get("extra_specs") or {}),
    )
    return _Started(migration_id, record, instance_id, flavor, request)


ENDED = frozenset({"completed", "confirmed", "reverted", "failed", "cancelled", "done"})
"""Migration statuses that hold nothing: the move is over one way or the other."""
# A finished resize (VERIFY_RESIZE) still holds both ends, but waits on its own action.
_SETTLED = ENDED | {"finished"}
_SUPERSEDED = frozenset({"build", "power", "rebuild", "snapshot"})


def _settle(
    cloud: Cloud, started: _Started, placement: Placement, request_id: str = ""
) -> MoveResult:
    """Fail a started move that found no destination, or hand it to the conductor."""
    migration_id, record, instance_id = started.migration_id, started.record, started.instance_id
    if placement.claim is None:
        return _fail_start(cloud, migration_id, record, instance_id, placement.reason)
    dest_name = _name_of(cloud, placement.claim.host_id)
    status = "preparing" if record["migration_type"] == "live-migration" else "pre-migrating"
    record.update(status=status, dest_compute=dest_name, dest_host=dest_name)
    with cloud.ledger.engine.begin() as conn:
        cloud.objects.update_in(conn, "migration", migration_id, record)
        cloud.operations.enqueue(
            record["migration_type"],
            instance_id,
            dest_name,
            step="prepare",
            payload={"request_id": request_id},
            migration_id=migration_id,
            conn=conn,
        )
    cloud.kick()
    return MoveResult(migration_id, status, dest_name)


def move(
    cloud: Cloud,
    instance_id: str,
    migration_type: str,
    *,
    user_id: str,
    project_id: str,
    dest: str | None = None,
    new_flavor: dict[str, Any] | None = None,
    request_id: str = "",
    target_state: str | None = None,
) -> MoveResult:
    """Start a move: check the source, record the migration, claim a destination."""
    started = _start(
        cloud,
        instance_id,
        migration_type,
        user_id=user_id,
        project_id=project_id,
        dest=dest,
        new_flavor=new_flavor,
        target_state=target_state,
    )
    with cloud.schedule_lock:
        placement = cloud.scheduler.schedule([started.request])[0]
    return _settle(cloud, started, placement, request_id)


def evacuate_host(
    cloud: Cloud, host: str, *, user_id: str, project_id: str
) -> dict[str, MoveResult]:
    """Every instance of a down host re-planned together, as one plan: per instance, where it
    went or why it could not. Nova only has a client-side loop for this."""
    if _host_row(cloud, host) is None:
        raise NotFound(f"Compute host {host} could not be found.")
    if host_is_up(cloud, host):
        raise ConflictError(f"Compute service of {host} is still in use.")
    instances = [d.id for d in cloud.objects.list("instance") if d.body.get("host") == host]
    started = [
        _start(
            cloud,
            instance_id,
            "evacuation",
            user_id=user_id,
            project_id=project_id,
            dest=None,
            new_flavor=None,
        )
        for instance_id in instances
    ]
    with cloud.schedule_lock:
        placements = cloud.scheduler.schedule([s.request for s in started])
    return {s.instance_id: _settle(cloud, s, p) for s, p in zip(started, placements, strict=True)}


def outcome(cloud: Cloud, result: MoveResult, timeout_s: float) -> MoveResult:
    """A started move's result once its operation ended (or as it stands after `timeout_s`)."""
    doc = cloud.objects.find("migration", result.migration_id)
    if doc is None:
        return result
    cloud.operations.wait_instances([doc.body["instance_uuid"]], timeout_s)
    record = cloud.objects.get("migration", result.migration_id).body
    return MoveResult(
        result.migration_id,
        str(record["status"]),
        record.get("dest_compute"),
        str(record.get("reason") or ""),
    )


def _writer(
    cloud: Cloud,
    migration_id: str,
    record: dict[str, Any],
    instance_id: str,
    body: dict[str, Any],
) -> Callable[[Connection], None]:
    """Write the record and the instance inside the ledger transaction that moves the claims."""

    def write(conn: Connection) -> None:
        cloud.objects.update_in(conn, "migration", migration_id, record)
        cloud.objects.update_in(conn, "instance", instance_id, body)

    return write


def _name_of(cloud: Cloud, host_id: int) -> str:
    with cloud.ledger.engine.connect().execution_options(**READONLY) as conn:
        return str(conn.execute(select(hosts.c.name).where(hosts.c.id == host_id)).scalar_one())


def _fail_start(
    cloud: Cloud, migration_id: str, record: dict[str, Any], instance_id: str, reason: str
) -> MoveResult:
    """Nothing was claimed: the record ends `failed` and the instance is as it was."""
    body = dict(cloud.objects.get("instance", instance_id).body)
    evacuating = record["migration_type"] == "evacuation"
    if evacuating:
        # The host is down and nowhere could take the instance: it is in error, as in Nova.
        body.update(status="ERROR", vm_state="error", task_state=None)
        body["fault"] = {"code": 500, "message": reason, "created": time.time(), "details": ""}
    else:
        body.update(status=settled_status(body), task_state=None)
    record.update(status="failed", reason=reason)

    write = _writer(cloud, migration_id, record, instance_id, body)
    cloud.ledger.fail_migration(migration_id, also=write)
    return MoveResult(migration_id, "failed", None, reason)


def settled_status(body: dict[str, Any]) -> str:
    """The status an instance rests in once nothing is happening to it, from its vm_state."""
    return {
        "active": "ACTIVE",
        "stopped": "SHUTOFF",
        "paused": "PAUSED",
        "error": "ERROR",
        "suspended": "SUSPENDED",
    }.get(body.get("vm_state", "active"), "ACTIVE")


def _resizing(
    cloud: Cloud, instance_id: str, action: str
) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """The instance waiting in VERIFY_RESIZE and its `finished` migration record."""
    body = dict(cloud.objects.get("instance", instance_id).body)
    if body["status"] != "VERIFY_RESIZE":
        raise ConflictError(
            f"Cannot '{action}' instance {instance_id} while it is in vm_state {body['vm_state']}"
        )
    for doc in cloud.objects.list("migration"):
        record = doc.body
        if record["instance_uuid"] == instance_id and record["status"] == "finished":
            return body, doc.id, dict(record)
    raise ConflictError(f"Instance {instance_id} has no resize or migration to confirm.")


def confirm_resize(cloud: Cloud, instance_id: str) -> None:
    """VERIFY_RESIZE -> confirming: the source destroys its copy, then (one commit) its
    claims go and the instance is ACTIVE on the destination."""
    _end_resize(cloud, instance_id, "confirmResize", "confirm", "confirming", "source_compute")


def revert_resize(cloud: Cloud, instance_id: str) -> None:
    """VERIFY_RESIZE -> reverting: the destination destroys its copy, then (one commit) its
    claims go and the instance is ACTIVE on the source."""
    _end_resize(cloud, instance_id, "revertResize", "revert", "reverting", "dest_compute")


def _end_resize(
    cloud: Cloud, instance_id: str, action: str, kind: str, status: str, host_field: str
) -> None:
    body, migration_id, record = _resizing(cloud, instance_id, action)
    before = dict(body)
    if cloud.operations.active(instance_id=instance_id):
        raise ConflictError(f"Instance {instance_id} is already being {status[:-3]}ed.")
    body.update(task_state="resize_" + ("confirming" if kind == "confirm" else "reverting"))
    record["status"] = status
    step = "source_cleanup" if kind == "confirm" else "abort_dest"
    with cloud.ledger.engine.begin() as conn:
        take_instance(cloud, conn, instance_id, before, body, action)
        cloud.objects.update_in(conn, "migration", migration_id, record)
        cloud.operations.enqueue(
            kind, instance_id, record[host_field], step=step, migration_id=migration_id, conn=conn
        )
    cloud.kick()


def abort_live_migration(cloud: Cloud, instance_id: str, migration_id: str) -> None:
    """DELETE .../migrations/{id} (2.24): a live migration still queued, preparing or running
    is cancelled; the destination is undone and its claims go with the record."""
    _request(cloud, instance_id, migration_id, "abort", ("queued", "preparing", "running"))


def force_complete_live_migration(cloud: Cloud, instance_id: str, migration_id: str) -> None:
    """POST .../migrations/{id}/action force_complete (2.22): end the memory copy now."""
    _request(cloud, instance_id, migration_id, "force_complete", ("running",))


REQUESTS = ("abort", "force_complete")
"""Flags an API request sets on a migration in flight; the conductor's writes keep them."""


def _request(
    cloud: Cloud, instance_id: str, migration_id: str, flag: str, statuses: tuple[str, ...]
) -> None:
    what = flag.replace("_", " ")
    while True:
        doc = cloud.objects.find("migration", migration_id)
        record = _live(cloud, instance_id, migration_id, what)
        if record["status"] not in statuses:
            raise ConflictError(
                f"Migration {migration_id} state of instance {instance_id} is "
                f"{record['status']}. Cannot {what} live migration while the migration is in "
                "this state."
            )
        assert doc is not None
        if cloud.objects.swap("migration", migration_id, doc.body, {**record, flag: True}):
            break
    cloud.kick()


def _live(cloud: Cloud, instance_id: str, migration_id: str, what: str) -> dict[str, Any]:
    doc = cloud.objects.find("migration", migration_id)
    if doc is None or doc.body.get("instance_uuid") != instance_id:
        raise NotFound(f"Migration {migration_id} for instance {instance_id} could not be found.")
    record = dict(doc.body)
    if record.get("migration_type") != "live-migration":
        raise InvalidSpec(f"Migration {migration_id} is not a live migration; cannot {what}.")
    return record
