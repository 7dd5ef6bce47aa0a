"""Moves as records whose every status change commits with the ownership it implies.

Evacuation, live migration, cold migration and resize each get a migration record and a
migration consumer in the ledger. The destination is claimed by the scheduler like any
placement (group slots and pCPUs included, both ends counting while the move is in flight);
`completed` and `confirmed` hand the destination to the instance and release the source in
the transaction that writes the status; `failed` and `reverted` release the destination in
the transaction that writes theirs. No status means "maybe held somewhere".

The simulated hypervisor finishes a move at once, so live migrations and evacuations pass
through `running` to `completed` within the request; resizes and cold migrations wait in
`finished` (VERIFY_RESIZE) for a confirm or a revert.
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
from stowage.services.compute import shape_of_flavor
from stowage.services.scheduler import Placement

__all__ = ["MoveResult", "confirm_resize", "evacuate_host", "move", "revert_resize"]

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
    return len(cloud.objects.list("migration")) + 1


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
) -> _Started:
    """Check the source, record the migration, mark the instance moving; claim nothing yet."""
    doc = cloud.objects.get("instance", instance_id)
    body = dict(doc.body)
    source = body.get("host")
    if source is None:
        raise ConflictError(f"Instance {instance_id} has no host to move from.")
    if body["status"] not in _STARTABLE[migration_type]:
        raise ConflictError(
            f"Cannot '{migration_type}' instance {instance_id} while it is in vm_state "
            f"{body['vm_state']}"
        )
    source_up = host_is_up(cloud, source)
    if migration_type == "evacuation" and source_up:
        raise ConflictError(f"Compute service of {source} is still in use.")
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
    }
    cloud.objects.create("migration", migration_id, record, project_id=project_id)
    moving_status, task = _MOVING[migration_type]
    body.update(status=moving_status, task_state=task)
    cloud.objects.update("instance", instance_id, body)
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
    )
    return _Started(migration_id, record, instance_id, flavor, request)


def _settle(cloud: Cloud, started: _Started, placement: Placement) -> MoveResult:
    """Finish or fail a started move according to its placement."""
    migration_id, record, instance_id = started.migration_id, started.record, started.instance_id
    if placement.claim is None:
        return _fail_start(cloud, migration_id, record, instance_id, placement.reason)
    dest_name = _name_of(cloud, placement.claim.host_id)
    record.update(status="running", dest_compute=dest_name, dest_host=dest_name)
    cloud.objects.update("migration", migration_id, record)
    if record["migration_type"] in ("evacuation", "live-migration"):
        return _finish(cloud, migration_id, record, instance_id, dest_name, started.flavor)
    # Cold migration and resize rest in VERIFY_RESIZE, both ends held, until confirmed.
    body = dict(cloud.objects.get("instance", instance_id).body)
    body.update(status="VERIFY_RESIZE", vm_state="resized", task_state=None)
    record["status"] = "finished"
    with cloud.ledger.engine.begin() as conn:
        _writer(cloud, migration_id, record, instance_id, body)(conn)
    return MoveResult(migration_id, "finished", dest_name)


def move(
    cloud: Cloud,
    instance_id: str,
    migration_type: str,
    *,
    user_id: str,
    project_id: str,
    dest: str | None = None,
    new_flavor: dict[str, Any] | None = None,
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
    )
    with cloud.schedule_lock:
        placement = cloud.scheduler.schedule([started.request])[0]
    return _settle(cloud, started, placement)


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
        body.update(status=_settled_status(body), task_state=None)
    record.update(status="failed", reason=reason)

    write = _writer(cloud, migration_id, record, instance_id, body)
    cloud.ledger.fail_migration(migration_id, also=write)
    return MoveResult(migration_id, "failed", None, reason)


def _settled_status(body: dict[str, Any]) -> str:
    return {"active": "ACTIVE", "stopped": "SHUTOFF", "paused": "PAUSED", "error": "ERROR"}.get(
        body["vm_state"], "ACTIVE"
    )


def _finish(
    cloud: Cloud,
    migration_id: str,
    record: dict[str, Any],
    instance_id: str,
    dest: str,
    flavor: dict[str, Any],
) -> MoveResult:
    body = dict(cloud.objects.get("instance", instance_id).body)
    body.update(host=dest, flavor=flavor, task_state=None, fault=None)
    if record["migration_type"] == "evacuation":
        body.update(status="ACTIVE", vm_state="active", power_state=1)
    else:
        body.update(status=_settled_status(body))
    record["status"] = "completed"

    write = _writer(cloud, migration_id, record, instance_id, body)
    cloud.ledger.complete_migration(migration_id, also=write)
    return MoveResult(migration_id, "completed", dest)


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
    """VERIFY_RESIZE -> ACTIVE on the destination; the source's claims go in the same commit."""
    body, migration_id, record = _resizing(cloud, instance_id, "confirmResize")
    body.update(
        status="ACTIVE",
        vm_state="active",
        task_state=None,
        host=record["dest_compute"],
        flavor=record["new_flavor"],
    )
    record["status"] = "confirmed"

    write = _writer(cloud, migration_id, record, instance_id, body)
    cloud.ledger.complete_migration(migration_id, also=write)


def revert_resize(cloud: Cloud, instance_id: str) -> None:
    """VERIFY_RESIZE -> ACTIVE on the source; the destination's claims go in the same commit."""
    body, migration_id, record = _resizing(cloud, instance_id, "revertResize")
    body.update(status="ACTIVE", vm_state="active", task_state=None)
    record["status"] = "reverted"

    write = _writer(cloud, migration_id, record, instance_id, body)
    cloud.ledger.fail_migration(migration_id, also=write)
