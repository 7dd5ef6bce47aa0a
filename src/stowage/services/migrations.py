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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, select

from stowage.domain.claims import ConsumerKind
from stowage.domain.errors import ConflictError, InvalidSpec, NotFound, StowageError
from stowage.domain.ids import new_id, new_request_id
from stowage.ledger.db import READONLY
from stowage.ledger.ledger import ClaimRefused
from stowage.ledger.operations import Operation
from stowage.ledger.schema import hosts
from stowage.scheduling.framework import Request
from stowage.services.cloud import Cloud
from stowage.services.compute import (
    claimed_host_name,
    record_action,
    shape_of_flavor,
    take_instance,
)

__all__ = [
    "MoveResult",
    "abort_live_migration",
    "confirm_resize",
    "evacuate_host",
    "force_complete_live_migration",
    "move",
    "outcome",
    "planned",
    "revert_resize",
    "schedule_moves",
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


def _start(
    cloud: Cloud,
    instance_id: str,
    migration_type: str,
    *,
    user_id: str,
    project_id: str,
    dest: str | None,
    new_flavor: dict[str, Any] | None,
    request_id: str,
    target_state: str | None = None,
) -> tuple[str, str, Callable[[Connection], None]]:
    """Check the source and plan the move; returns the migration's id, its status, and the
    writes that start it, for the caller's transaction: mark the instance moving
    (compare-and-swap: one request wins), record the migration and its instance action, and
    hand the move to the conductor (an operation at its `schedule` step). Claims nothing:
    the conductor plans the destination (schedule_moves). Every read happens here, before
    the transaction opens: none takes a second connection while the first holds a lock."""
    doc = cloud.objects.get("instance", instance_id)
    body = dict(doc.body)
    source = body.get("host")
    if source is None:
        raise ConflictError(f"Instance {instance_id} has no host to move from.")
    source_up = host_is_up(cloud, source)
    if migration_type == "evacuation" and source_up:
        raise ConflictError(f"Compute service of {source} is still in use.")
    pending = cloud.operations.active(instance_id=instance_id)
    stale = []
    if migration_type == "evacuation" and not source_up:
        # What waits for the dead source is superseded: the evacuation cleans it up there.
        stale = [op for op in pending if op.host == source and op.kind in _SUPERSEDED]
        pending = [op for op in pending if op not in stale]
        if stale:
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
    migration_id = new_id()
    status = _FIRST_STATUS[migration_type]
    record = {
        "number": _number(cloud),  # its own commit: a crash after it only leaves a gap
        "instance_uuid": instance_id,
        "migration_type": migration_type,
        "status": status,
        "source_compute": source,
        "dest_compute": dest,
        "dest_host": dest,
        "old_flavor_id": body["flavor"]["id"],
        "new_flavor_id": flavor["id"],
        "new_flavor": flavor,
        "user_id": user_id,
        "project_id": project_id,
        "old_vm_state": body.get("vm_state"),
        "request_id": request_id,
        # 2.95: an evacuated server rests stopped whatever it was ("stopped"), as in Nova.
        "target_state": target_state,
    }
    moving_status, task = _MOVING[migration_type]
    body.update(status=moving_status, task_state=task)

    def write(conn: Connection) -> None:
        from stowage.services.images import end_snapshot_in

        for op in stale:
            cloud.operations.advance(
                conn, op.id, state="failed", result={"error": "superseded by evacuation"}
            )
            end_snapshot_in(cloud, conn, op)
        take_instance(cloud, conn, instance_id, doc.body, body, migration_type)
        cloud.objects.create_in(conn, "migration", migration_id, record, project_id=project_id)
        record_action(
            cloud, instance_id, _ACTION[migration_type], user_id, project_id, request_id, conn=conn
        )
        cloud.operations.enqueue(
            migration_type,
            instance_id,
            "",
            step="schedule",
            payload={"request_id": request_id},
            migration_id=migration_id,
            conn=conn,
        )

    return migration_id, status, write


ENDED = frozenset({"completed", "confirmed", "reverted", "failed", "cancelled", "done"})
"""Migration statuses that hold nothing: the move is over one way or the other."""
# A finished resize (VERIFY_RESIZE) still holds both ends, but waits on its own action.
_SETTLED = ENDED | {"finished"}
_SUPERSEDED = frozenset({"build", "power", "rebuild", "snapshot"})
# The status a move is recorded with while its destination is being planned (Nova's).
_FIRST_STATUS = {
    "evacuation": "accepted",
    "live-migration": "accepted",
    "migration": "pre-migrating",
    "resize": "pre-migrating",
}
_ACTION = {
    "evacuation": "evacuate",
    "live-migration": "live-migration",
    "migration": "migrate",
    "resize": "resize",
}


def _request_of(cloud: Cloud, record: dict[str, Any], migration_id: str) -> Request | None:
    doc = cloud.objects.find("instance", record["instance_uuid"])
    if doc is None:
        return None
    body = doc.body
    flavor = record["new_flavor"]
    return Request(
        consumer_id=migration_id,
        instance_id=record["instance_uuid"],
        shape=shape_of_flavor({**flavor, "disk": 0} if body.get("boot_from_volume") else flavor),
        kind=ConsumerKind.MIGRATION,
        project_id=body["project_id"],
        user_id=body["user_id"],
        group_id=body.get("group_id"),
        force_host=record.get("dest_compute"),
        ignore_hosts=frozenset({cloud.ledger.host_id(record["source_compute"])}),
        extra_specs=dict(flavor.get("extra_specs") or {}),
    )


def schedule_moves(cloud: Cloud, ops: Sequence[Operation]) -> None:
    """The conductor's `schedule` step of moves: every due move planned together as one plan
    (a host's evacuation is one plan), each destination claim committed with the migration's
    destination and status and the operation's next step, or not at all. Safe to repeat: a
    move whose operation has moved on claims nothing."""
    if not ops:
        return
    by_migration: dict[str, Operation] = {}
    requests: list[Request] = []
    for op in ops:
        assert op.migration_id is not None
        record = cloud.objects.find("migration", op.migration_id)
        request = None if record is None else _request_of(cloud, record.body, op.migration_id)
        if request is None:
            with cloud.ledger.engine.begin() as conn:
                cloud.operations.advance(conn, op.id, state="failed", result={"error": "gone"})
            continue
        by_migration[op.migration_id] = op
        requests.append(request)

    def placed(conn: Connection, claim: Any) -> None:
        op = by_migration[claim.consumer_id]
        current = cloud.operations.find_in(conn, op.id)
        doc = cloud.objects.find_in(conn, "migration", claim.consumer_id)
        # Ended (a delete fails a move that holds no destination yet before it fails the
        # move's operation, in a commit of its own): a migration that ended stays ended.
        if (
            current is None
            or current.finished
            or current.step != "schedule"
            or doc is None
            or doc.body.get("status") in ENDED
        ):
            raise ClaimRefused(f"migration {claim.consumer_id} no longer waits for a destination")
        record = dict(doc.body)
        dest = claimed_host_name(cloud, conn, claim.host_id)
        status = "preparing" if record["migration_type"] == "live-migration" else "pre-migrating"
        record.update(status=status, dest_compute=dest, dest_host=dest)
        if not cloud.objects.swap_in(conn, "migration", claim.consumer_id, doc.body, record):
            raise ClaimRefused(f"migration {claim.consumer_id} changed while it was scheduled")
        cloud.operations.advance(conn, op.id, step="prepare", host=dest)

    with cloud.schedule_lock:
        placements = cloud.scheduler.schedule(requests, also=placed)
    for placement in placements:
        if placement.claim is None:
            op = by_migration[placement.request.consumer_id]
            _fail_start(cloud, op, placement.reason)


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
    """Start a move as one unit of work (the instance marked moving, the migration record,
    its action and the conductor's operation commit together); the conductor plans the
    destination and drives the move to its end."""
    migration_id, status, write = _start(
        cloud,
        instance_id,
        migration_type,
        user_id=user_id,
        project_id=project_id,
        dest=dest,
        new_flavor=new_flavor,
        request_id=request_id,
        target_state=target_state,
    )
    with cloud.ledger.engine.begin() as conn:
        write(conn)
    cloud.kick()
    return MoveResult(migration_id, status, dest)


def evacuate_host(
    cloud: Cloud, host: str, *, user_id: str, project_id: str, request_id: str = ""
) -> dict[str, MoveResult]:
    """Every instance of a down host, re-planned together as one plan: per instance, the
    started evacuation, or (status `refused`) why it cannot start. One instance that cannot
    move never stops the others. Nova only has a client-side loop for this."""
    if _host_row(cloud, host) is None:
        raise NotFound(f"Compute host {host} could not be found.")
    if host_is_up(cloud, host):
        raise ConflictError(f"Compute service of {host} is still in use.")
    instances = [d.id for d in cloud.objects.list("instance") if d.body.get("host") == host]
    out: dict[str, MoveResult] = {}
    starts: list[tuple[str, str, str, Callable[[Connection], None]]] = []
    for instance_id in instances:
        try:
            migration_id, status, write = _start(
                cloud,
                instance_id,
                "evacuation",
                user_id=user_id,
                project_id=project_id,
                dest=None,
                new_flavor=None,
                request_id=request_id or new_request_id(),
            )
        except StowageError as exc:
            out[instance_id] = MoveResult("", "refused", None, str(exc))
        else:
            starts.append((instance_id, migration_id, status, write))
    # One transaction: the conductor leases the evacuations together and plans them as one.
    with cloud.ledger.engine.begin() as conn:
        for instance_id, migration_id, status, write in starts:
            try:
                with conn.begin_nested():
                    write(conn)
            except StowageError as exc:
                out[instance_id] = MoveResult("", "refused", None, str(exc))
            else:
                out[instance_id] = MoveResult(migration_id, status, None)
    cloud.kick()
    return out


def outcome(cloud: Cloud, result: MoveResult, timeout_s: float) -> MoveResult:
    """A started move's result once its operation ended (or as it stands after `timeout_s`)."""
    if not result.migration_id:
        return result
    doc = cloud.objects.find("migration", result.migration_id)
    if doc is None:
        return result
    # The move's own operations, not the instance's: an evacuation's clean-up of its down
    # source waits for that host to come back, and is no part of the answer.
    ops = cloud.operations
    open_ids = [op.id for op in ops.of_migration(result.migration_id) if not op.finished]
    ops.wait(open_ids, timeout_s)
    record = cloud.objects.get("migration", result.migration_id).body
    return MoveResult(
        result.migration_id,
        str(record["status"]),
        record.get("dest_compute"),
        str(record.get("reason") or ""),
    )


def planned(cloud: Cloud, result: MoveResult, timeout_s: float) -> MoveResult:
    """A started move once its destination is planned (or it failed), bounded by
    `timeout_s`: Nova answers a cold migration or resize with no valid host with a 400."""
    deadline = time.monotonic() + timeout_s
    while True:
        doc = cloud.objects.find("migration", result.migration_id) if result.migration_id else None
        if doc is None:
            return result
        record = doc.body
        now = MoveResult(
            result.migration_id,
            str(record["status"]),
            record.get("dest_compute"),
            str(record.get("reason") or ""),
        )
        if record.get("dest_compute") or record["status"] in ENDED or time.monotonic() > deadline:
            return now
        time.sleep(0.01)


def _fail_start(cloud: Cloud, op: Operation, reason: str) -> None:
    """No destination was found: in one commit the record ends `failed`, the operation too,
    and the instance is as it was (an evacuated one, whose host is down, is ERROR)."""
    assert op.migration_id is not None
    migration_id = op.migration_id

    def write(conn: Connection) -> None:
        doc = cloud.objects.find_in(conn, "migration", migration_id)
        current = cloud.operations.find_in(conn, op.id)
        if doc is None or current is None or current.finished or current.step != "schedule":
            return  # someone else settled it meanwhile
        record = dict(doc.body)
        instance = cloud.objects.find_in(conn, "instance", record["instance_uuid"])
        if record.get("status") not in ENDED:  # else it keeps how and why it ended
            record.update(status="failed", reason=reason)
            cloud.objects.update_in(conn, "migration", migration_id, record)
        cloud.operations.advance(conn, op.id, state="failed", result={"error": reason})
        if instance is None:
            return
        body = dict(instance.body)
        if record["migration_type"] == "evacuation":
            # The host is down and nowhere could take the instance: it is in error, as in Nova.
            body.update(status="ERROR", vm_state="error", task_state=None)
            body["fault"] = {"code": 500, "message": reason, "created": time.time(), "details": ""}
        else:
            body.update(status=settled_status(body), task_state=None)
        cloud.objects.swap_in(conn, "instance", instance.id, instance.body, body)
        action = cloud.objects.find_in(
            conn, "instance_action", f"{record.get('request_id', '')}:{instance.id}"
        )
        if action is not None:
            entry = dict(action.body)
            entry["message"] = reason
            entry["events"] = [
                {**e, "result": "Error", "details": reason} for e in entry.get("events", [])
            ]
            cloud.objects.update_in(conn, "instance_action", action.id, entry)

    cloud.ledger.fail_migration(migration_id, also=write)


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
