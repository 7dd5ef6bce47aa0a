"""Rescue, unrescue, changePassword and trigger_crash_dump: each one durable operation on the
server's host, committed with the server's task state and its instance action (one unit of
work), then driven by the conductor through the host's agent. No claim moves: the server
stays where it is.

Secrets (a rescue's or a new admin password) travel in the operation's payload only while
it runs: the commit that ends it drops them (`scrub`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stowage.domain.errors import ConflictError, InvalidSpec
from stowage.services.cloud import Cloud
from stowage.services.compute import record_action, take_instance

__all__ = [
    "CRASH_DUMPABLE",
    "RESCUABLE",
    "change_password",
    "rescue_server",
    "scrub",
    "trigger_crash_dump",
    "unrescue_server",
]

# Nova's check_instance_state of each action, as statuses.
RESCUABLE = frozenset({"ACTIVE", "SHUTOFF", "ERROR"})
CRASH_DUMPABLE = frozenset({"ACTIVE", "ERROR"})
_SECRETS = ("admin_password", "password")


def scrub(payload: Mapping[str, Any]) -> dict[str, Any]:
    """The payload without the passwords it carried."""
    return {k: v for k, v in payload.items() if k not in _SECRETS}


def ready_on_its_host(
    cloud: Cloud,
    caller: Any,
    instance_id: str,
    stored: Mapping[str, Any],
    action: str,
    allowed: frozenset[str],
) -> dict[str, Any]:
    """A copy of the server's document if `action` may start on it now (Nova's 409s: a lock
    of an admin's, a state not in `allowed`, a task or an operation in flight, no host)."""
    body = dict(stored)
    if body.get("locked") and not caller.is_admin:
        raise ConflictError(f"Instance {instance_id} is locked")
    if body.get("status") not in allowed:
        raise ConflictError(
            f"Cannot '{action}' instance {instance_id} while it is in vm_state "
            f"{body.get('vm_state')}"
        )
    if body.get("task_state") is not None or cloud.operations.active(instance_id=instance_id):
        raise ConflictError(
            f"Cannot '{action}' instance {instance_id} while it is in task_state "
            f"{body.get('task_state')}"
        )
    if not body.get("host"):
        raise ConflictError(f"Instance {instance_id} has no host to '{action}' on.")
    return body


def _start(
    cloud: Cloud,
    caller: Any,
    instance_id: str,
    *,
    action: str,
    kind: str,
    allowed: frozenset[str],
    task_state: str | None,
    payload: dict[str, Any],
    request_id: str,
) -> str:
    """Check the server (its lock, its state, no operation in flight, a host), then commit
    its task state, the instance action and the operation together; returns the op id."""
    doc = cloud.objects.get("instance", instance_id)
    body = ready_on_its_host(cloud, caller, instance_id, doc.body, action, allowed)
    host = body["host"]
    before = {k: body.get(k) for k in ("status", "vm_state", "power_state")}
    with cloud.ledger.engine.begin() as conn:
        if task_state is not None:
            body["task_state"] = task_state
            take_instance(cloud, conn, instance_id, doc.body, body, action)
        record_action(
            cloud, instance_id, action, caller.user_id, caller.project_id, request_id, conn=conn
        )
        op_id = cloud.operations.enqueue(
            kind,
            instance_id,
            str(host),
            step=kind.replace("-", "_"),
            payload={**payload, "request_id": request_id, "before": before},
            conn=conn,
        ).id
    cloud.kick()
    return op_id


def rescue_server(
    cloud: Cloud,
    caller: Any,
    instance_id: str,
    *,
    image_id: str | None,
    password: str,
    request_id: str,
) -> str:
    """Nova's rescue: the guest boots `image_id` (its own image when None) with its disk
    second. A volume-backed server is refused (Nova's legacy rescue, before 2.87 and on a
    host without stable-device rescue)."""
    body = cloud.objects.get("instance", instance_id).body
    if body.get("boot_from_volume"):
        raise InvalidSpec("Cannot rescue a volume-backed instance")
    image = image_id or body.get("image_id")
    if not image:
        raise InvalidSpec(f"Instance {instance_id} has no image to rescue it with")
    return _start(
        cloud,
        caller,
        instance_id,
        action="rescue",
        kind="rescue",
        allowed=RESCUABLE,
        task_state="rescuing",
        payload={"image_id": image, "admin_password": password},
        request_id=request_id,
    )


def unrescue_server(cloud: Cloud, caller: Any, instance_id: str, *, request_id: str) -> str:
    return _start(
        cloud,
        caller,
        instance_id,
        action="unrescue",
        kind="unrescue",
        allowed=frozenset({"RESCUE"}),
        task_state="unrescuing",
        payload={},
        request_id=request_id,
    )


def change_password(
    cloud: Cloud, caller: Any, instance_id: str, password: str, *, request_id: str
) -> str:
    """changePassword: the guest's agent is told the password (Nova's task state
    updating_password meanwhile)."""
    return _start(
        cloud,
        caller,
        instance_id,
        action="changePassword",
        kind="set-password",
        allowed=frozenset({"ACTIVE"}),
        task_state="updating_password",
        payload={"password": password},
        request_id=request_id,
    )


def trigger_crash_dump(cloud: Cloud, caller: Any, instance_id: str, *, request_id: str) -> str:
    """An NMI into the guest; Nova sets no task state for it."""
    return _start(
        cloud,
        caller,
        instance_id,
        action="trigger_crash_dump",
        kind="inject-nmi",
        allowed=CRASH_DUMPABLE,
        task_state=None,
        payload={},
        request_id=request_id,
    )
