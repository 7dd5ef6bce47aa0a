"""Instances: build (schedule, claim, spawn), delete, and the power-state actions."""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, select

from stowage.domain.claims import RefusalCode
from stowage.domain.errors import ConflictError, InvalidSpec, NotFound, StowageError
from stowage.domain.flavor import Flavor, InstanceShape, shape_of
from stowage.domain.ids import new_id, random_bits
from stowage.ledger.db import READONLY
from stowage.ledger.ledger import ClaimRefused
from stowage.ledger.objects import Document, NewDocument
from stowage.ledger.operations import Operation
from stowage.ledger.schema import consumer_key, consumers, hosts, numa_claims, pins
from stowage.scheduling.framework import Request
from stowage.services import networks, quotas
from stowage.services.cloud import Cloud
from stowage.services.instances import write_instance
from stowage.services.volumes import server_volumes
from stowage.services.volumes import volumes as volume_service

__all__ = [
    "BuildRequest",
    "InstanceState",
    "allocate_ports",
    "build_servers",
    "claimed_host_name",
    "delete_server",
    "instance_topology",
    "power_action",
    "rebuild_server",
    "record_action",
    "schedule_builds",
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
    user_data: str | None = None  # base64, as given; the driver port passes it to the guest
    hostname: str | None = None  # 2.90; None: derived from the name
    access_ipv4: str = ""
    access_ipv6: str = ""
    disk_config: str = "MANUAL"
    config_drive: bool = False  # the guest gets a config drive (guest_spec.guest_payload)
    # block_device_mapping_v2's volume mappings (server_volumes.parse_block_devices).
    block_devices: list[dict[str, Any]] = field(default_factory=list)


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
    conn: Connection | None = None,
) -> None:
    """An instance action with one event, as `openstack server event list` shows them;
    inside `conn`'s transaction when given."""
    new = _action_document(
        instance_id, action, ctx_user, ctx_project, request_id, result=result, message=message
    )
    if conn is not None:
        cloud.objects.create_in(
            conn, new.kind, new.id, new.body, project_id=new.project_id, name=action
        )
    else:
        cloud.objects.create(new.kind, new.id, new.body, project_id=new.project_id, name=action)


def _action_document(
    instance_id: str,
    action: str,
    ctx_user: str,
    ctx_project: str,
    request_id: str,
    *,
    result: str = "Success",
    message: str | None = None,
) -> NewDocument:
    """The document `record_action` writes (for a caller that writes it with others)."""
    now = time.time()
    body = {
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
    }
    key = request_id + ":" + instance_id
    return NewDocument("instance_action", key, body, project_id=instance_id, name=action)


def change_instance(
    cloud: Cloud,
    instance_id: str,
    before: Mapping[str, Any],
    after: Mapping[str, Any],
    *,
    action: str,
    user_id: str,
    project_id: str,
    request_id: str,
) -> dict[str, Any]:
    """A change a request makes to the instance record (lock, unlock, reset state) and the
    action event that tells of it, in one transaction: never one without the other."""
    with cloud.ledger.engine.begin() as conn:
        written = write_instance(cloud, instance_id, before, after, conn=conn)
        record_action(cloud, instance_id, action, user_id, project_id, request_id, conn=conn)
    return written


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
    """POST /servers as one unit of work: the quota, the instances (BUILD, scheduling), their
    create actions and the operation that schedules them commit together, or nothing does.

    The conductor owns the rest (services/conductor.py): it plans the request set as one
    plan, commits each claim with the instance's host and its next step, and marks what
    cannot be placed ERROR with a fault that says why, as Nova does. `max_count` is cut to
    what the quotas allow, down to `min_count` (QuotaExceeded below that).
    """
    check_build(cloud, build)
    return commit_build(cloud, build, request_id)


def check_build(cloud: Cloud, build: BuildRequest) -> None:
    """What `build_servers` refuses before anything exists: an unusable flavor, a same_host
    hint that names no placed instance (InvalidSpec), a missing group (NotFound)."""
    shape_of_flavor(build.flavor)
    if build.same_host and not _host_ids_of(cloud, build.same_host):
        raise InvalidSpec("same_host: none of the named instances has a host")
    if build.group_id is not None:
        cloud.ledger.get_group(build.group_id)


def commit_build(cloud: Cloud, build: BuildRequest, request_id: str) -> list[dict[str, Any]]:
    """`build_servers` of a request already checked (`check_build`)."""
    try:
        docs = _build_in_one_commit(cloud, build, request_id, exclusive=False)
    except quotas.LimitsChanged:
        # A limit came to apply while the create held the quota lock shared: nothing was
        # written; counted this time, under the lock held exclusively.
        docs = _build_in_one_commit(cloud, build, request_id, exclusive=True)
    cloud.kick()
    return docs


def build_servers_soon(
    cloud: Cloud, build: BuildRequest, request_id: str
) -> Future[list[dict[str, Any]]] | None:
    """`commit_build` joined to the store's next group write (`stowage up`): the future of
    its instances, which an event loop awaits without a thread waiting for it (a handler
    thread held through the commit was one less for every other request, and the creates
    that could share a group were as many as the threads); None where writes are not
    grouped (call `commit_build` from a thread). A grouped write is on SQLite, where the
    quota lock is no lock to choose (no `LimitsChanged`)."""
    soon = cloud.objects.write_together_soon(
        functools.partial(_build_in, cloud, build=build, request_id=request_id, exclusive=False)
    )
    if soon is not None:
        soon.add_done_callback(lambda _: cloud.kick())  # the kick is safe from any thread
    return soon


def _build_in_one_commit(
    cloud: Cloud, build: BuildRequest, request_id: str, *, exclusive: bool
) -> list[dict[str, Any]]:
    # One write transaction whose store reads (a volume's image or snapshot, its type) join
    # it rather than take a second connection while it holds the write; on `stowage up`, one
    # with the other creates of the moment (`ObjectStore.write_together`).
    return cloud.objects.write_together(
        lambda conn: _build_in(cloud, conn, build, request_id, exclusive=exclusive)
    )


def _build_in(
    cloud: Cloud, conn: Connection, build: BuildRequest, request_id: str, *, exclusive: bool
) -> list[dict[str, Any]]:
    reservation = f"r-{random_bits(32):08x}"
    docs: list[dict[str, Any]] = []
    made: list[NewDocument] = []
    count = quotas.reserve_instances(
        cloud,
        conn,
        project_id=build.project_id,
        user_id=build.user_id,
        flavor=build.flavor,
        min_count=build.min_count,
        max_count=build.max_count,
        group_id=build.group_id,
        exclusive=exclusive,
    )
    for index in range(count):
        body = _new_instance(build, reservation, index, count)
        if build.block_devices:
            # The instance's volumes (made, or reserved) commit with it: quota, storage
            # claim and attachment; the conductor's spawn drives the new ones first.
            devices = server_volumes.prepare_block_devices(
                cloud, conn, _BuildCaller(build), body["id"], build.block_devices
            )
            body["block_devices"] = devices
            if server_volumes.boots_from_volume(devices):
                body["boot_from_volume"] = True
                body["image_id"] = ""
        made.append(NewDocument("instance", body["id"], body, build.project_id, body["name"]))
        made.append(
            _action_document(body["id"], "create", build.user_id, build.project_id, request_id)
        )
        docs.append(body)
    # The instances, their actions and the operation: inserted with the other creates of the
    # group write they commit in, in one statement a table (`insert_rows`).
    cloud.objects.create_each_in(conn, made, later=True)
    cloud.operations.enqueue(
        "build",
        docs[0]["id"],
        "",
        step="schedule",
        payload={
            "instances": [d["id"] for d in docs],
            "min_count": min(build.min_count, count),
            "request_id": request_id,
            "force_host": build.force_host,
            "same_host": build.same_host,
            "different_host": build.different_host,
            "image_properties": build.image_properties,
            "is_admin": build.is_admin,
        },
        conn=conn,
        later=True,
    )
    return docs


@dataclass(frozen=True, slots=True)
class _BuildCaller:
    """The build's requester, as the volume use cases see a caller."""

    build: BuildRequest

    @property
    def project_id(self) -> str:
        return self.build.project_id

    @property
    def user_id(self) -> str:
        return self.build.user_id

    @property
    def is_admin(self) -> bool:
        return self.build.is_admin


def _new_instance(build: BuildRequest, reservation: str, index: int, count: int) -> dict[str, Any]:
    instance_id = new_id()
    return {
        "id": instance_id,
        "name": build.name if count == 1 else f"{build.name}-{index + 1}",
        "project_id": build.project_id,
        "user_id": build.user_id,
        "flavor": build.flavor,
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
        "user_data": build.user_data,
        "hostname": build.hostname,
        "access_ipv4": build.access_ipv4,
        "access_ipv6": build.access_ipv6,
        "disk_config": build.disk_config,
        **({"config_drive": True} if build.config_drive else {}),
    }


def schedule_builds(
    cloud: Cloud, ops: Sequence[Operation], *, owner: str | None = None, lease_s: float = 0.0
) -> list[Operation]:
    """The conductor's `schedule` step of build operations, planned together as one plan.

    Each claim commits with its instance's host, task state and next operation (ports, then
    spawn), and only while the instance still waits to be scheduled: a deleted one refuses
    its claim. Safe to repeat after a crash: instances already placed are skipped. Returns
    the next operations committed; with `owner`, each is leased to it for `lease_s` as it is
    inserted (the conductor drives them at once, without a lease of its own).
    """
    lease = None if owner is None else (owner, lease_s)
    made: list[Operation] = []
    request_ids = {
        instance_id: str(op.payload.get("request_id") or "")
        for op in ops
        for instance_id in _instance_ids(op)
    }
    free: list[Request] = []
    # A create of one server (the most) ends with its claim, in its commit, where the store
    # can hold the end to the batch's one statement (SQLite): no commit of its own after.
    ends: dict[str, str] = {}
    instances = _instances_of(cloud, ops)
    for op in ops:
        requests = _waiting_requests(cloud, op, instances)
        if int(op.payload.get("min_count", 1)) > 1:
            count = int(op.payload["min_count"])
            made += _place(cloud, requests, request_ids, min_count=count, lease=lease)
        else:
            free.extend(requests)
            own = _instance_ids(op)
            if len(own) == 1:
                ends[own[0]] = op.id
    # Requests of several creates (min_count 1) share one plan and one claim commit.
    ended: set[str] = set()
    made += _place(cloud, free, request_ids, min_count=None, lease=lease, ends=ends, ended=ended)
    # And the batch's other operations end in one commit (a crash before it schedules them
    # again: the instances placed meanwhile no longer wait, and are skipped).
    rest = [op.id for op in ops if op.id not in ended]
    if rest:
        with cloud.ledger.engine.begin() as conn:
            cloud.operations.end_each(conn, rest, state="done")
    return made


_READ_AT_ONCE = 500
"""Instances read by one statement (two bound values each: a batch of creates of up to 1,000
servers each stays under the databases' limits on bound values)."""


def _instance_ids(op: Operation) -> list[str]:
    return op.payload.get("instances") or [op.instance_id]


def _instances_of(cloud: Cloud, ops: Sequence[Operation]) -> dict[tuple[str, str], Document]:
    """The instances of every operation of a batch, read in one transaction, a statement per
    `_READ_AT_ONCE` (before: a statement per instance, and a transaction per operation)."""
    keys = [("instance", instance_id) for op in ops for instance_id in _instance_ids(op)]
    found: dict[tuple[str, str], Document] = {}
    with cloud.objects.reading():
        for start in range(0, len(keys), _READ_AT_ONCE):
            found.update(cloud.objects.find_each(keys[start : start + _READ_AT_ONCE]))
    return found


def _waiting_requests(
    cloud: Cloud, op: Operation, instances: Mapping[tuple[str, str], Document]
) -> list[Request]:
    """Scheduler requests for the op's instances (read as `_instances_of`) that still wait to
    be placed."""
    payload = op.payload
    same = _host_ids_of(cloud, payload.get("same_host") or [])
    different = _host_ids_of(cloud, payload.get("different_host") or [])
    out = []
    for instance_id in _instance_ids(op):
        doc = instances.get(("instance", instance_id))
        if doc is None or doc.body.get("task_state") != "scheduling":
            continue
        body = doc.body
        flavor = body["flavor"]
        out.append(
            Request(
                consumer_id=instance_id,
                instance_id=instance_id,
                # Booted from a volume, the root disk is the volume's, not the host's.
                shape=shape_of_flavor(
                    {**flavor, "disk": 0} if body.get("boot_from_volume") else flavor
                ),
                project_id=body["project_id"],
                user_id=body["user_id"],
                group_id=body.get("group_id"),
                availability_zone=body.get("availability_zone"),
                force_host=payload.get("force_host"),
                same_host=same,
                different_host=different,
                image_properties=dict(payload.get("image_properties") or {}),
                extra_specs=dict(flavor.get("extra_specs") or {}),
            )
        )
    return out


def _place(
    cloud: Cloud,
    requests: list[Request],
    request_ids: Mapping[str, str],
    *,
    min_count: int | None,
    lease: tuple[str, float] | None = None,
    ends: Mapping[str, str] | None = None,
    ended: set[str] | None = None,
) -> list[Operation]:
    """The claims of `requests`, each committed with its instance and its next operation
    (leased to `lease`'s owner when given); the next operations of those that committed.
    `ends` names, by instance, an operation to end (done) with the instance's claim where
    the claim's commit can hold it (`Operations.end_later`); those ended so are added to
    `ended`."""
    if not requests:
        return []
    nexts: dict[str, Operation] = {}  # by instance: a batch replayed claim by claim rewrites
    held_ends: dict[str, str] = {}  # likewise: the operation ended with the instance's claim

    position = {r.instance_id: i for i, r in enumerate(requests)}
    read: dict[str, Any] = {"conn": None, "docs": {}}

    def instance_in(conn: Connection, instance_id: str) -> Document | None:
        # A batch of claims shares a transaction: its instances are read in one statement,
        # this one's and the next requests' (a batch's claims follow the requests' order).
        if read["conn"] is not conn:
            read.update(conn=conn, docs={})
        docs: dict[str, Document | None] = read["docs"]
        if instance_id not in docs:
            start = position.get(instance_id, 0)
            ahead = requests[start : start + cloud.scheduler.batch_max]
            ids = {instance_id, *(r.instance_id for r in ahead)}
            found = cloud.objects.find_each_in(conn, [("instance", i) for i in ids])
            docs.update({i: found.get(("instance", i)) for i in ids})
        return docs[instance_id]

    def placed(conn: Connection, claim: Any) -> None:
        # The claim commits with the instance's host and its next step, or not at all; the
        # step inserted and the instance swapped with the batch's others (`held_inserts`).
        doc = instance_in(conn, claim.instance_id)
        if doc is None or doc.body.get("task_state") != "scheduling":
            raise ClaimRefused(f"instance {claim.instance_id} no longer waits to be scheduled")
        body = dict(doc.body)
        host = claimed_host_name(cloud, conn, claim.host_id)
        body["host"] = host
        wants_ports = isinstance(body.get("networks"), list) and bool(body["networks"])
        body["task_state"] = "networking" if wants_ports else "spawning"
        swapped = cloud.objects.swap_in(
            conn, "instance", claim.instance_id, doc.body, body, later=True
        )
        if not swapped:
            raise ClaimRefused(f"instance {claim.instance_id} changed while it was scheduled")
        nexts[claim.instance_id] = cloud.operations.enqueue(
            "build",
            claim.instance_id,
            host,
            step="ports" if wants_ports else "spawn",
            # The image, for the spawn to read with its instance (`Conductor._spawn_inputs`).
            payload={
                "request_id": request_ids.get(claim.instance_id, ""),
                **({"image_id": body["image_id"]} if body.get("image_id") else {}),
            },
            conn=conn,
            later=True,
            owner=None if lease is None else lease[0],
            lease_s=0.0 if lease is None else lease[1],
        )
        held_ends.pop(claim.instance_id, None)
        op_id = (ends or {}).get(claim.instance_id)
        if op_id is not None and cloud.operations.end_later(conn, op_id, state="done"):
            held_ends[claim.instance_id] = op_id

    with cloud.schedule_lock:
        placements = cloud.scheduler.schedule(requests, min_count=min_count, also=placed)
    committed = [
        nexts[p.request.instance_id]
        for p in placements
        if p.claim is not None and p.request.instance_id in nexts
    ]
    if ended is not None:
        ended.update(
            held_ends[p.request.instance_id]
            for p in placements
            if p.claim is not None and p.request.instance_id in held_ends
        )
    for placement in placements:
        if placement.claim is None and placement.code is not RefusalCode.CONSUMER_GONE:
            _build_failed(
                cloud,
                placement.request.instance_id,
                request_ids.get(placement.request.instance_id, ""),
                placement.reason or "No valid host was found.",
                placement.code.value if placement.code else "",
            )
    return committed


def claimed_host_name(cloud: Cloud, conn: Connection, host_id: int) -> str:
    """The name of the host a claim was just placed on (a build's or a move's), as the
    scheduler's view holds it (it planned the claim there), else read by its key. Each batch
    read every host's name before (a scan of the hosts: 10,000 rows a batch at 10,000 hosts)."""
    view = cloud.scheduler.view
    state = view.hosts.get(host_id) if view is not None else None
    if state is not None:
        return state.name
    return str(conn.execute(select(hosts.c.name).where(hosts.c.id == host_id)).scalar_one())


def _build_failed(
    cloud: Cloud, instance_id: str, request_id: str, message: str, details: str
) -> None:
    """An instance that found no place: ERROR with a fault, holding nothing (one commit).
    An unshelve that found none stays SHELVED_OFFLOADED, to be unshelved again (Nova)."""
    with cloud.ledger.engine.begin() as conn:
        doc = cloud.objects.find_in(conn, "instance", instance_id)
        if doc is None or doc.body.get("task_state") != "scheduling":
            return
        body = dict(doc.body)
        if body.get("vm_state") == "shelved_offloaded":
            body["task_state"] = None
        else:
            _set_state(body, ERROR, task_state=None)
            body["fault"] = {
                "code": 500,
                "message": message,
                "created": time.time(),
                "details": details,
            }
        cloud.objects.swap_in(conn, "instance", instance_id, doc.body, body)
        action = cloud.objects.find_in(conn, "instance_action", f"{request_id}:{instance_id}")
        if action is not None:
            record = dict(action.body)
            record["message"] = message
            record["events"] = [
                {**e, "result": "Error", "details": message} for e in record.get("events", [])
            ]
            cloud.objects.update_in(conn, "instance_action", action.id, record)


def allocate_ports(
    cloud: Cloud, body: Mapping[str, Any], *, is_admin: bool = True
) -> dict[str, Any]:
    """The conductor's `ports` step for the server `body`: one port per NIC it asked for
    (new ones on networks, or given ports), then its addresses.

    Repeatable: the k-th NIC on a network is made only if the server has fewer than k ports
    there already (a step that crashed after making some ports makes only the rest).
    """
    wanted = body.get("networks")
    if not isinstance(wanted, list):
        return {}  # "auto" or "none": no network is asked for by id
    have: dict[str, int] = {}
    for port in networks.ports_of(cloud, body["id"]):
        have[port["network_id"]] = have.get(port["network_id"], 0) + 1
    asked: dict[str, int] = {}
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
            asked[nic["uuid"]] = asked.get(nic["uuid"], 0) + 1
            if have.get(nic["uuid"], 0) >= asked[nic["uuid"]]:
                continue
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
    """Destroy on every host the instance may run on, then release every claim and forget
    it. Safe to repeat.

    The hosts are its own and both ends of every move not yet over: the source and the
    destination of a live migration in flight, the destination of a resize waiting in
    VERIFY_RESIZE. Each gets an operation the conductor drives to the end: `delete` on the
    instance's host (its claims go once the guest is destroyed there), `cleanup` elsewhere;
    a destination's claims stay with its migration until its clean-up confirms the guest is
    gone there, so nothing is handed out again while a guest may still run on it.

    An instance with no host, or on a host whose service is down, is deleted at once (Nova's
    "local delete"), and its host destroys it when it comes back: its clean-up runs there
    before anything new does. One transaction per attempt, compare-and-swap on the instance.
    """
    for _attempt in range(_DELETE_ATTEMPTS):
        if _delete_once(cloud, instance_id):
            cloud.kick()
            return
    raise ConflictError(
        f"Cannot 'delete' instance {instance_id}: it kept changing while it was deleted"
    )


_DELETE_ATTEMPTS = 5


class _Changed(Exception):
    """The instance changed between the read and the write: read again."""


def _delete_once(cloud: Cloud, instance_id: str) -> bool:
    """One attempt of `delete_server`; False when another writer changed the instance."""
    from stowage.services.migrations import host_is_up

    doc = cloud.objects.find("instance", instance_id)
    if doc is None:
        raise NotFound(f"Instance {instance_id} could not be found.")
    if doc.body.get("locked"):
        raise ConflictError(f"Instance {instance_id} is locked")
    ops = cloud.operations
    pending = ops.active(instance_id=instance_id)
    if any(op.kind == "delete" for op in pending):
        return True  # already being deleted
    host = doc.body.get("host")
    # A create's scheduling serves its other instances too: it skips this one once it is
    # gone (its claim would be refused), so it is left to run.
    pending = [op for op in pending if not (op.kind == "build" and op.step == "schedule")]
    moves = _moves_in_flight(cloud, instance_id)
    for move in [m for m in moves if m.dest is None]:
        _fail_unclaimed_move(cloud, move.migration_id)
    moves = [m for m in moves if m.dest is not None]
    hosts_touched = {op.host for op in pending if op.host} | ({host} if host else set())
    for move in moves:
        hosts_touched |= {h for h in (move.source, move.dest) if h}

    def overtake(conn: Connection) -> None:
        # A delete overtakes the instance's other operations; each place it might be is
        # cleaned, a destination with its migration's claims.
        from stowage.services.images import end_snapshot_in

        for op in pending:
            ops.advance(conn, op.id, state="failed", result={"error": "deleted"})
            end_snapshot_in(cloud, conn, op)
        for move in moves:
            _end_move_on_delete(cloud, conn, instance_id, move)
        for other in sorted(hosts_touched - {host} - {m.dest for m in moves if m.dest}):
            ops.enqueue("cleanup", instance_id, other, step="destroy", conn=conn)

    if host and host_is_up(cloud, host):
        body = dict(doc.body)
        body["task_state"] = "deleting"
        with cloud.ledger.engine.begin() as conn:
            if not cloud.objects.swap_in(conn, "instance", instance_id, doc.body, body):
                return False
            overtake(conn)
            ops.enqueue("delete", instance_id, host, step="destroy", conn=conn)
        return True

    from stowage.services.shelve import drop_image_data, drop_shelved_image_in

    doomed: list[str] = []
    shelved: list[str | None] = []

    def gone(conn: Connection) -> None:
        if not cloud.objects.swap_in(conn, "instance", instance_id, doc.body, doc.body):
            raise _Changed
        doomed.extend(server_volumes.release_server_volumes(cloud, conn, doc.body))
        shelved.append(drop_shelved_image_in(cloud, conn, doc.body))
        cloud.objects.delete_in(conn, "instance", instance_id)
        overtake(conn)
        if host and host not in {m.dest for m in moves}:
            ops.enqueue("cleanup", instance_id, host, step="destroy", conn=conn)

    # Ports first: a crash between the two leaves a server to delete again, never a port
    # of a server that is gone.
    networks.release_ports(cloud, instance_id)
    try:
        cloud.ledger.release(instance_id, also=gone)
    except _Changed:
        return False
    for image_id in shelved:
        drop_image_data(cloud, image_id)
    for volume_id in doomed:
        volume_service.drive(cloud, "volume", volume_id)
    return True


@dataclass(frozen=True, slots=True)
class _Move:
    migration_id: str
    source: str | None
    dest: str | None  # the host the migration's claims are on (None: it holds none)


def _moves_in_flight(cloud: Cloud, instance_id: str) -> list[_Move]:
    """The instance's migrations that are not over, with where each one's claims are."""
    from stowage.services.migrations import ENDED

    found = []
    for doc in cloud.objects.list("migration"):
        record = doc.body
        if record.get("instance_uuid") != instance_id or record.get("status") in ENDED:
            continue
        with cloud.ledger.engine.connect().execution_options(**READONLY) as conn:
            dest = conn.execute(
                select(hosts.c.name)
                .select_from(consumers.join(hosts, hosts.c.id == consumers.c.host_id))
                .where(consumers.c.id == doc.id)
            ).scalar()
        found.append(_Move(doc.id, record.get("source_compute"), dest))
    return found


def _fail_unclaimed_move(cloud: Cloud, migration_id: str) -> None:
    """A move of a deleted instance that holds no destination is over at once."""

    def write(conn: Connection) -> None:
        doc = cloud.objects.find_in(conn, "migration", migration_id)
        if doc is not None:
            record = {**doc.body, "status": "failed", "reason": "the instance was deleted"}
            cloud.objects.update_in(conn, "migration", migration_id, record)

    cloud.ledger.fail_migration(migration_id, also=write)


def _end_move_on_delete(cloud: Cloud, conn: Connection, instance_id: str, move: _Move) -> None:
    """A deleted instance's move ends with it: its destination is cleaned up first, and the
    conductor releases the destination's claims once the guest is gone there, in the commit
    that says `failed`."""
    doc = cloud.objects.find_in(conn, "migration", move.migration_id)
    if doc is None:
        return
    record = dict(doc.body)
    record["reason"] = "the instance was deleted"
    assert move.dest is not None
    # Unknown until the destination answers: both "error" and a live clean-up say so.
    record["status"] = "error"
    cloud.objects.update_in(conn, "migration", move.migration_id, record)
    cloud.operations.enqueue(
        "cleanup",
        instance_id,
        move.dest,
        step="destroy",
        migration_id=move.migration_id,
        conn=conn,
    )


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
    write_instance(cloud, instance_id, doc.body, body)
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
            .where(numa_claims.c.consumer_seq == consumer_key(instance_id))
            .order_by(numa_claims.c.guest_cell)
        ).all()
        pinned = conn.execute(
            select(pins.c.cpu_id, pins.c.guest_vcpu).where(
                pins.c.consumer_seq == consumer_key(instance_id), pins.c.guest_vcpu.is_not(None)
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


def queued_snapshot(
    cloud: Cloud,
    caller: Any,
    conn: Connection,
    body: Mapping[str, Any],
    name: str,
    metadata: Mapping[str, str],
) -> dict[str, Any]:
    """The queued image a snapshot of the instance `body` fills, in the base image's
    formats, created inside `conn`'s transaction."""
    from stowage.services import images

    base = images.find_image(cloud, body.get("image_id") or "") or {}
    return images.create_image(
        cloud,
        caller,
        {
            "name": name,
            "disk_format": base.get("disk_format") or "raw",
            "container_format": base.get("container_format") or "bare",
            "visibility": "private",
            "image_type": "snapshot",
            "instance_uuid": body["id"],
            "base_image_ref": body.get("image_id") or "",
            "owner_project_name": "",
            **{k: str(v) for k, v in metadata.items()},
        },
        conn=conn,
    )


def snapshot_payload(image: Mapping[str, Any], caller: Any, request_id: str) -> dict[str, Any]:
    """What the conductor's `snapshot` step sends the agent: the image to fill and its format."""
    return {
        "image_id": image["id"],
        "disk_format": image.get("disk_format"),
        "project_id": caller.project_id,
        "request_id": request_id,
    }


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
    body = dict(cloud.objects.get("instance", instance_id).body)
    if body["status"] not in _SNAPSHOTTABLE or body.get("task_state") is not None:
        raise ConflictError(
            f"Cannot 'createImage' instance {instance_id} while it is in vm_state "
            f"{body['vm_state']}"
        )
    if not body.get("host"):
        raise ConflictError(f"Instance {instance_id} has no host to take a snapshot on.")
    before = dict(body)
    body["task_state"] = "image_uploading"
    # One unit of work: the queued image, the instance's task state and the operation that
    # fills the image commit together, so a refused request or a crash leaves no image that
    # nothing will ever fill. Its reads are in the same transaction (the base image's).
    with cloud.objects.writing() as conn:
        created = queued_snapshot(cloud, caller, conn, body, name, metadata)
        take_instance(cloud, conn, instance_id, before, body, "createImage")
        cloud.operations.enqueue(
            "snapshot",
            instance_id,
            body["host"],
            step="snapshot",
            payload=snapshot_payload(created, caller, request_id),
            conn=conn,
        )
    cloud.kick()
    return str(created["id"])


def rebuild_server(
    cloud: Cloud,
    instance_id: str,
    image_id: str,
    name: str | None,
    *,
    changes: Mapping[str, Any] | None = None,
) -> None:
    """Rebuild in place on the same host and claims, from another image; `changes` are the
    other fields the rebuild sets (metadata, key, user data, hostname, ...)."""
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
    body.update(changes or {})
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
