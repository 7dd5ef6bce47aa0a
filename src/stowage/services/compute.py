"""Instances: build (schedule, claim, spawn), delete, and the power-state actions."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, select

from stowage.domain.errors import ConflictError, InvalidSpec, NotFound, StowageError
from stowage.domain.flavor import Flavor, InstanceShape, shape_of
from stowage.ledger.db import READONLY
from stowage.ledger.schema import consumers, hosts, numa_claims, pins
from stowage.scheduling.framework import Request
from stowage.services import networks
from stowage.services.cloud import Cloud

__all__ = [
    "BuildRequest",
    "InstanceState",
    "build_servers",
    "delete_server",
    "instance_topology",
    "power_action",
    "rebuild_server",
    "record_action",
    "snapshot_server",
    "take_instance",
]


class Forbidden(StowageError):
    code = "policy.forbidden"


@dataclass(frozen=True, slots=True)
class InstanceState:
    """Nova's status with the vm_state, task_state and power_state it stands for."""

    status: str
    vm_state: str
    power_state: int  # 0 NOSTATE, 1 RUNNING, 3 PAUSED, 4 SHUTDOWN, 7 SUSPENDED


ACTIVE = InstanceState("ACTIVE", "active", 1)
SHUTOFF = InstanceState("SHUTOFF", "stopped", 4)
PAUSED = InstanceState("PAUSED", "paused", 3)
SUSPENDED = InstanceState("SUSPENDED", "suspended", 7)
ERROR = InstanceState("ERROR", "error", 0)
BUILD = InstanceState("BUILD", "building", 0)

# action -> (allowed current statuses, state afterwards)
_POWER: dict[str, tuple[frozenset[str], InstanceState | None]] = {
    "os-stop": (frozenset({"ACTIVE", "ERROR"}), SHUTOFF),
    "os-start": (frozenset({"SHUTOFF"}), ACTIVE),
    "reboot": (frozenset({"ACTIVE", "SHUTOFF", "PAUSED", "SUSPENDED", "ERROR"}), ACTIVE),
    "pause": (frozenset({"ACTIVE"}), PAUSED),
    "unpause": (frozenset({"PAUSED"}), ACTIVE),
    "suspend": (frozenset({"ACTIVE"}), SUSPENDED),
    "resume": (frozenset({"SUSPENDED"}), ACTIVE),
}
_ACTION_NAMES = {
    "os-stop": "stop",
    "os-start": "start",
    "reboot": "reboot",
    "pause": "pause",
    "unpause": "unpause",
    "suspend": "suspend",
    "resume": "resume",
}


@dataclass(slots=True)
class BuildRequest:
    """A validated `POST /servers`."""

    name: str
    flavor: dict[str, Any]
    image_id: str
    project_id: str
    user_id: str
    min_count: int = 1
    max_count: int = 1
    availability_zone: str | None = None
    force_host: str | None = None
    group_id: str | None = None
    same_host: list[str] = field(default_factory=list)
    different_host: list[str] = field(default_factory=list)
    networks: Any = "auto"
    metadata: dict[str, str] = field(default_factory=dict)
    key_name: str | None = None
    description: str | None = None
    security_groups: list[str] = field(default_factory=lambda: ["default"])
    hints: dict[str, Any] = field(default_factory=dict)
    image_properties: dict[str, str] = field(default_factory=dict)
    tags: list[str] = field(default_factory=list)
    is_admin: bool = False


def record_action(
    cloud: Cloud,
    instance_id: str,
    action: str,
    ctx_user: str,
    ctx_project: str,
    request_id: str,
    *,
    result: str = "Success",
    message: str | None = None,
) -> None:
    """An instance action with one event, as `openstack server event list` shows them."""
    now = time.time()
    cloud.objects.create(
        "instance_action",
        request_id + ":" + instance_id,
        {
            "action": action,
            "instance_uuid": instance_id,
            "request_id": request_id,
            "user_id": ctx_user,
            "project_id": ctx_project,
            "start_time": now,
            "updated_at": now,
            "message": message,
            "events": [
                {
                    "event": f"compute_{action.replace('-', '_')}",
                    "start_time": now,
                    "finish_time": now,
                    "result": result,
                    "traceback": None,
                    "host": None,
                    "hostId": None,
                    "details": message,
                }
            ],
        },
        project_id=instance_id,
        name=action,
    )


def shape_of_flavor(flavor: Mapping[str, Any]) -> InstanceShape:
    """The instance shape of a flavor document (the compute API's flavor fields)."""
    return shape_of(
        Flavor(
            name=flavor["name"],
            vcpus=int(flavor["vcpus"]),
            memory_mb=int(flavor["ram"]),
            disk_gb=int(flavor["disk"]),
            extra_specs=dict(flavor.get("extra_specs") or {}),
            ephemeral_gb=int(flavor.get("ephemeral") or 0),
        )
    )


def _host_names(cloud: Cloud) -> dict[int, str]:
    with cloud.ledger.engine.connect().execution_options(**READONLY) as conn:
        return {row.id: row.name for row in conn.execute(select(hosts.c.id, hosts.c.name))}


def _host_ids_of(cloud: Cloud, instance_ids: Sequence[str]) -> frozenset[int]:
    found = set()
    for instance_id in instance_ids:
        host = cloud.ledger.consumer_host(instance_id)
        if host is not None:
            found.add(host)
    return frozenset(found)


def build_servers(cloud: Cloud, build: BuildRequest, request_id: str) -> list[dict[str, Any]]:
    """Create the instances, plan them together, commit their claims, and start them.

    Instances that cannot be placed go to ERROR with a fault that says why, as Nova's do.
    """
    flavor = build.flavor
    shape = shape_of_flavor(flavor)
    same = _host_ids_of(cloud, build.same_host)
    if build.same_host and not same:
        raise InvalidSpec("same_host: none of the named instances has a host")
    different = _host_ids_of(cloud, build.different_host)
    if build.group_id is not None:
        cloud.ledger.get_group(build.group_id)  # a missing group is a 404 before anything exists
    count = build.max_count
    reservation = "r-" + uuid.uuid4().hex[:8]
    docs: list[dict[str, Any]] = []
    requests: list[Request] = []
    for index in range(count):
        instance_id = str(uuid.uuid4())
        name = build.name if count == 1 else f"{build.name}-{index + 1}"
        body = {
            "id": instance_id,
            "name": name,
            "project_id": build.project_id,
            "user_id": build.user_id,
            "flavor": flavor,
            "image_id": build.image_id,
            "status": BUILD.status,
            "vm_state": BUILD.vm_state,
            "task_state": "scheduling",
            "power_state": BUILD.power_state,
            "host": None,
            "availability_zone": build.availability_zone,
            "metadata": build.metadata,
            "key_name": build.key_name,
            "description": build.description,
            "security_groups": build.security_groups,
            "addresses": {},
            "launched_at": None,
            "fault": None,
            "locked": False,
            "locked_reason": None,
            "tags": build.tags,
            "group_id": build.group_id,
            "hints": build.hints,
            "reservation_id": reservation,
            "launch_index": index,
            "networks": build.networks,
        }
        cloud.objects.create("instance", instance_id, body, project_id=build.project_id, name=name)
        docs.append(body)
        requests.append(
            Request(
                consumer_id=instance_id,
                instance_id=instance_id,
                shape=shape,
                project_id=build.project_id,
                user_id=build.user_id,
                group_id=build.group_id,
                availability_zone=build.availability_zone,
                force_host=build.force_host,
                same_host=same,
                different_host=different,
                image_properties=build.image_properties,
                extra_specs=dict(flavor.get("extra_specs") or {}),
            )
        )
    with cloud.schedule_lock:
        placements = cloud.scheduler.schedule(requests, min_count=build.min_count)
    names = _host_names(cloud)
    for body, placement in zip(docs, placements, strict=True):
        if placement.claim is None:
            _set_state(body, ERROR, task_state=None)
            body["fault"] = {
                "code": 500,
                "message": placement.reason or "No valid host was found.",
                "created": time.time(),
                "details": placement.code.value if placement.code else "",
            }
        else:
            body["host"] = names.get(placement.claim.host_id)
            try:
                body["addresses"] = _allocate_addresses(cloud, body, is_admin=build.is_admin)
            except StowageError as exc:
                # No half-built server: without its ports it holds no claim either.
                networks.release_ports(cloud, body["id"])
                cloud.ledger.release(body["id"], forget=False)
                body["host"] = None
                _set_state(body, ERROR, task_state=None)
                body["fault"] = {
                    "code": 500,
                    "message": f"Build of instance {body['id']} aborted: {exc}",
                    "created": time.time(),
                    "details": exc.code,
                }
            else:
                # The claim is committed; the host's agent spawns it (the conductor drives it).
                _set_state(body, BUILD, task_state="spawning")
        with cloud.ledger.engine.begin() as conn:
            cloud.objects.update_in(conn, "instance", body["id"], body)
            if body["status"] == BUILD.status:
                cloud.operations.enqueue(
                    "build",
                    body["id"],
                    body["host"],
                    step="spawn",
                    payload={"request_id": request_id},
                    conn=conn,
                )
        record_action(
            cloud,
            body["id"],
            "create",
            build.user_id,
            build.project_id,
            request_id,
            result="Error" if body["status"] == ERROR.status else "Success",
            message=body["fault"]["message"] if body.get("fault") else None,
        )
    cloud.kick()
    return docs


def _allocate_addresses(cloud: Cloud, body: dict[str, Any], *, is_admin: bool) -> dict[str, Any]:
    """Ports for the server's NICs (new ones on networks, or given ports), then its addresses."""
    from stowage.services import networks

    wanted = body.get("networks")
    if not isinstance(wanted, list):
        return {}  # "auto" or "none": no network is asked for by id
    for nic in wanted:
        if not isinstance(nic, dict):
            continue
        if nic.get("port"):
            networks.attach_port(
                cloud,
                nic["port"],
                body["project_id"],
                body["id"],
                is_admin=is_admin,
                host=body.get("host"),
            )
        elif nic.get("uuid"):
            networks.allocate_port(
                cloud,
                nic["uuid"],
                body["project_id"],
                body["id"],
                is_admin=is_admin,
                host=body.get("host"),
                fixed_ip=nic.get("fixed_ip"),
            )
    return networks.addresses_of(cloud, body["id"])


def take_instance(
    cloud: Cloud,
    conn: Connection,
    instance_id: str,
    before: Mapping[str, Any],
    after: Mapping[str, Any],
    action: str,
) -> None:
    """Mark the instance busy only if nobody changed it since it was read (one request wins)."""
    if not cloud.objects.swap_in(conn, "instance", instance_id, before, after):
        raise ConflictError(
            f"Cannot '{action}' instance {instance_id}: another request changed it at the "
            "same moment"
        )


def _set_state(body: dict[str, Any], state: InstanceState, *, task_state: str | None) -> None:
    body["status"] = state.status
    body["vm_state"] = state.vm_state
    body["power_state"] = state.power_state
    body["task_state"] = task_state


def delete_server(cloud: Cloud, instance_id: str) -> None:
    """Destroy on the host's agent, then release every claim and forget it. Safe to repeat.

    An instance with no host, or on a host whose service is down, is deleted at once (Nova's
    "local delete"), and its host destroys it when it comes back: its clean-up runs there
    before anything new does.
    """
    from stowage.services.migrations import host_is_up

    doc = cloud.objects.find("instance", instance_id)
    if doc is None:
        raise NotFound(f"Instance {instance_id} could not be found.")
    if doc.body.get("locked"):
        raise ConflictError(f"Instance {instance_id} is locked")
    ops = cloud.operations
    pending = ops.active(instance_id=instance_id)
    if any(op.kind == "delete" for op in pending):
        return  # already being deleted
    host = doc.body.get("host")
    hosts_touched = {op.host for op in pending} | ({host} if host else set())
    # A delete overtakes the instance's other operations; each place it might be is cleaned.
    with cloud.ledger.engine.begin() as conn:
        for op in pending:
            ops.advance(conn, op.id, state="failed", result={"error": "deleted"})
    if host and host_is_up(cloud, host):
        body = dict(doc.body)
        body["task_state"] = "deleting"
        with cloud.ledger.engine.begin() as conn:
            cloud.objects.update_in(conn, "instance", instance_id, body)
            ops.enqueue("delete", instance_id, host, step="destroy", conn=conn)
            for other in sorted(hosts_touched - {host}):
                ops.enqueue("cleanup", instance_id, other, step="destroy", conn=conn)
        _release_migrations(cloud, instance_id)
        cloud.kick()
        return

    def gone(conn: Connection) -> None:
        cloud.objects.delete_in(conn, "instance", instance_id)
        for other in sorted(hosts_touched):
            ops.enqueue("cleanup", instance_id, other, step="destroy", conn=conn)

    _release_migrations(cloud, instance_id)
    cloud.ledger.release(instance_id, also=gone)
    networks.release_ports(cloud, instance_id)
    cloud.kick()


def _release_migrations(cloud: Cloud, instance_id: str) -> None:
    """A deleted instance's moves end with it: their claims go, their records say so."""
    from stowage.services.migrations import ENDED

    for doc in cloud.objects.list("migration"):
        record = dict(doc.body)
        if record.get("instance_uuid") != instance_id or record.get("status") in ENDED:
            continue
        record["status"] = "failed"
        record["reason"] = "the instance was deleted"

        def write(conn: Connection, mid: str = doc.id, rec: dict[str, Any] = record) -> None:
            cloud.objects.update_in(conn, "migration", mid, rec)

        cloud.ledger.fail_migration(doc.id, also=write)


def power_action(
    cloud: Cloud, instance_id: str, action: str, *, is_admin: bool, request_id: str = ""
) -> str:
    """Apply a power action if the current status allows it; returns the action's name."""
    doc = cloud.objects.get("instance", instance_id)
    body = dict(doc.body)
    allowed, after = _POWER[action]
    if body.get("locked") and not is_admin:
        raise ConflictError(f"Instance {instance_id} is locked")
    if body["status"] not in allowed:
        raise ConflictError(
            f"Cannot '{_ACTION_NAMES[action]}' instance {instance_id} while it is in "
            f"vm_state {body['vm_state']}"
        )
    if cloud.operations.active(instance_id=instance_id):
        raise ConflictError(
            f"Cannot '{_ACTION_NAMES[action]}' instance {instance_id} while it is in "
            f"task_state {body.get('task_state')}"
        )
    host = body.get("host")
    if action in _ON_AGENT and host:
        body["task_state"] = _ON_AGENT[action]
        with cloud.ledger.engine.begin() as conn:
            take_instance(cloud, conn, instance_id, doc.body, body, _ACTION_NAMES[action])
            cloud.operations.enqueue(
                "power",
                instance_id,
                host,
                step="power",
                payload={"action": action, "request_id": request_id},
                conn=conn,
            )
        cloud.kick()
        return _ACTION_NAMES[action]
    if after is not None:
        _set_state(body, after, task_state=None)
    cloud.objects.update("instance", instance_id, body)
    return _ACTION_NAMES[action]


# Power actions the host's agent carries out, with the task_state shown meanwhile.
_ON_AGENT = {
    "os-stop": "powering-off",
    "os-start": "powering-on",
    "reboot": "rebooting",
    "pause": "pausing",
    "unpause": "unpausing",
    "suspend": "suspending",
    "resume": "resuming",
}


def instance_topology(cloud: Cloud, instance_id: str) -> list[dict[str, Any]]:
    """The NUMA cells and pCPUs the ledger holds for an instance (servers/{id}/topology)."""
    with cloud.ledger.engine.connect().execution_options(**READONLY) as conn:
        cells = conn.execute(
            select(numa_claims.c.cell_id, numa_claims.c.guest_cell, numa_claims.c.memory_mb)
            .where(numa_claims.c.consumer_id == instance_id)
            .order_by(numa_claims.c.guest_cell)
        ).all()
        pinned = conn.execute(
            select(pins.c.cpu_id, pins.c.guest_vcpu).where(
                pins.c.consumer_id == instance_id, pins.c.guest_vcpu.is_not(None)
            )
        ).all()
        host_row = conn.execute(
            select(hosts.c.topology)
            .select_from(consumers.join(hosts, hosts.c.id == consumers.c.host_id))
            .where(consumers.c.id == instance_id)
        ).first()
    if not cells or host_row is None:
        return []
    from stowage.ledger.ledger import topology_from_json

    topology = topology_from_json(host_row.topology)
    nodes = []
    for cell_id, _guest, memory_mb in cells:
        cell_cpus = next(c.cpus for c in topology.cells if c.id == cell_id)
        mapping = {vcpu: cpu for cpu, vcpu in pinned if cpu in cell_cpus}
        siblings = sorted(
            {
                tuple(sorted(topology.core_of(cpu) & set(mapping.values())))
                for cpu in mapping.values()
            }
        )
        nodes.append(
            {
                "host_node": cell_id,
                "memory_mb": memory_mb,
                "cpu_pinning": {str(v): c for v, c in sorted(mapping.items())},
                "vcpu_set": sorted(mapping),
                "siblings": [list(s) for s in siblings if len(s) > 1],
            }
        )
    return nodes


def instance_hosts(cloud: Cloud) -> Mapping[int, str]:
    return _host_names(cloud)


_SNAPSHOTTABLE = frozenset({"ACTIVE", "SHUTOFF", "PAUSED", "SUSPENDED"})


def snapshot_server(
    cloud: Cloud,
    caller: Any,
    instance_id: str,
    name: str,
    metadata: Mapping[str, str],
    request_id: str = "",
) -> str:
    """createImage: a queued image at once; the host's agent streams the disk into it.

    All or nothing: the image becomes active when every byte arrived, and is deleted when
    the upload fails.
    """
    from stowage.services import images

    body = dict(cloud.objects.get("instance", instance_id).body)
    if body["status"] not in _SNAPSHOTTABLE or body.get("task_state") is not None:
        raise ConflictError(
            f"Cannot 'createImage' instance {instance_id} while it is in vm_state "
            f"{body['vm_state']}"
        )
    if not body.get("host"):
        raise ConflictError(f"Instance {instance_id} has no host to take a snapshot on.")
    base = images.find_image(cloud, body.get("image_id") or "") or {}
    created = images.create_image(
        cloud,
        caller,
        {
            "name": name,
            "disk_format": base.get("disk_format") or "raw",
            "container_format": base.get("container_format") or "bare",
            "visibility": "private",
            "image_type": "snapshot",
            "instance_uuid": instance_id,
            "base_image_ref": body.get("image_id") or "",
            "owner_project_name": "",
            **{k: str(v) for k, v in metadata.items()},
        },
    )
    before = dict(body)
    body["task_state"] = "image_uploading"
    with cloud.ledger.engine.begin() as conn:
        take_instance(cloud, conn, instance_id, before, body, "createImage")
        cloud.operations.enqueue(
            "snapshot",
            instance_id,
            body["host"],
            step="snapshot",
            payload={
                "image_id": created["id"],
                "disk_format": created.get("disk_format"),
                "project_id": caller.project_id,
                "request_id": request_id,
            },
            conn=conn,
        )
    cloud.kick()
    return str(created["id"])


def rebuild_server(cloud: Cloud, instance_id: str, image_id: str, name: str | None) -> None:
    """Rebuild in place on the same host and claims, from another image."""
    before = cloud.objects.get("instance", instance_id).body
    body = dict(before)
    if body["status"] not in {"ACTIVE", "SHUTOFF", "ERROR"}:
        raise ConflictError(
            f"Cannot 'rebuild' instance {instance_id} while it is in vm_state {body['vm_state']}"
        )
    if body.get("host") is None:
        raise ConflictError(f"Instance {instance_id} has no host to rebuild on.")
    if cloud.operations.active(instance_id=instance_id):
        raise ConflictError(
            f"Cannot 'rebuild' instance {instance_id} while it is in task_state "
            f"{body.get('task_state')}"
        )
    body["image_id"] = image_id
    if name:
        body["name"] = name
    body.update(status="REBUILD", task_state="rebuilding")
    with cloud.ledger.engine.begin() as conn:
        take_instance(cloud, conn, instance_id, before, body, "rebuild")
        if name:
            cloud.objects.rename_in(conn, "instance", instance_id, name)
        cloud.operations.enqueue(
            "rebuild",
            instance_id,
            body["host"],
            step="destroy",
            payload={"stopped": before.get("vm_state") == "stopped"},
            conn=conn,
        )
    cloud.kick()
