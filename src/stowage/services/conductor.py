"""The conductor: drives every long operation through the agents, one durable step at a time.

An operation (a row of `operations`) names the agent its next step talks to. The conductor
leases due operations, calls the agent with the step's op id (`<op>:<step>`, so a repeated call
is answered from the agent's memory, or re-run harmlessly), and commits what the answer means
in one transaction: the operation's new step, the instance's and the migration's documents,
and the claims that change hands.

Three answers are possible: done, failed (the agent says it did not happen), or unknown (no
answer in time: the agent is stopped, slow or gone). Unknown never guesses: the step is tried
again later with the same op id, and both ends of a move stay held meanwhile. A move whose
preparation on the destination cannot be confirmed goes to `error` and is then undone on the
destination (`abort_dest`) as soon as that agent answers, ending `failed`: no status means
"maybe" for long, and nothing of a failed attempt stays behind.

Steps per kind (the host each talks to in brackets):

    build          spawn [dest]   (its new volumes driven first, each attached after)
    delete         destroy [host] -> claims released, instance gone
    cleanup        destroy [host]               (what is left on a host after a move or a
                                                 delete while that host was down)
    power          power [host]
    rebuild        destroy [host] -> spawn [host]
    snapshot       snapshot [host]
    shelve         destroy [host] -> claims released, SHELVED_OFFLOADED (volume-backed;
                   also shelveOffload of a SHELVED server), or with a shelved_offload_time
                   snapshot [host] -> SHELVED (image-backed), power [host] -> SHELVED
    unshelve       power [host] -> ACTIVE, the shelve image gone (a SHELVED server)
    volume-attach  attach_volume [host] -> attachment completed, or undone
    volume-detach  detach_volume [host] -> attachment ended, or the volume in-use again
    rescue         rescue [host] -> RESCUE (or as it was)
    unrescue       unrescue [host] -> ACTIVE (or RESCUE still)
    set-password   set_password [host] (the password dropped from the payload as it ends)
    inject-nmi     inject_nmi [host]
    interface-attach  interface_port (made or bound) -> attach_interface [host] -> addresses, or
                      the port let go again
    interface-detach  detach_interface [host] -> the port let go, addresses
    live-migration prepare [dest] -> source_cleanup [source] -> completed
    evacuation     prepare [dest] -> done; a cleanup op for the (down) source
    migration      prepare [dest] -> finished (VERIFY_RESIZE)
    resize         prepare [dest] -> finished (VERIFY_RESIZE)
    confirm        source_cleanup [source] -> confirmed
    revert         abort_dest [dest] -> reverted
    any move       abort_dest [dest] -> failed (or cancelled when aborted)
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from sqlalchemy import Connection, String, bindparam, cast, func, select

from stowage.bus.base import BusError, RemoteError, Transport, compute_topic
from stowage.domain.errors import NotFound
from stowage.domain.topology import ResourceClass
from stowage.ledger.db import READONLY
from stowage.ledger.objects import Document
from stowage.ledger.operations import TERMINAL_STATES, Operation, OperationEnded, Operations
from stowage.ledger.schema import (
    allocations,
    consumers,
    hosts,
    numa_claims,
    pins,
)
from stowage.services.cloud import Cloud
from stowage.services.guest_spec import guest_payload
from stowage.services.instances import write_instance
from stowage.services.migrations import REQUESTS, settled_status
from stowage.services.volumes import server_volumes
from stowage.services.volumes import volumes as volume_service
from stowage.telemetry import bind, logger
from stowage.telemetry.metrics import OPERATION_SECONDS, OPERATION_STEP_SECONDS

__all__ = ["Conductor", "ConductorConfig", "claim_of", "conductor_config"]

log = logging.getLogger(__name__)
steps = logger("stowage.services.conductor.steps")

Reply = dict[str, Any]
# A spawn's claim, the volumes to attach, why it cannot run (if it cannot) and its guest.
_SpawnInputs = tuple[dict[str, Any], list[dict[str, Any]], str | None, dict[str, Any]]
A = TypeVar("A")
R = TypeVar("R")

POWER_METHODS = {
    "os-stop": "power_off",
    "os-start": "power_on",
    "reboot": "reboot",
    "pause": "pause",
    "unpause": "unpause",
    "suspend": "suspend",
    "resume": "resume",
}
MOVE_KINDS = ("live-migration", "evacuation", "migration", "resize")
COLD_MOVES = ("migration", "resize")  # the destination takes the source's disk
_AFTER_POWER = {
    "os-stop": ("SHUTOFF", "stopped", 4),
    "os-start": ("ACTIVE", "active", 1),
    "reboot": ("ACTIVE", "active", 1),
    "pause": ("PAUSED", "paused", 3),
    "unpause": ("ACTIVE", "active", 1),
    "suspend": ("SUSPENDED", "suspended", 7),
    "resume": ("ACTIVE", "active", 1),
}


@dataclass(frozen=True, slots=True)
class ConductorConfig:
    call_timeout_s: float = 10.0  # one agent call; past it the step's outcome is unknown
    poll_s: float = 0.2
    lease_s: float = 60.0
    retry_s: float = 0.5  # first retry of an unknown step; doubles up to retry_max_s
    retry_max_s: float = 10.0
    concurrency_max: int = 64
    resize_confirm_window_s: float = 0.0  # 0: never confirm a resize automatically
    reclaim_instance_interval_s: float = 0.0  # 0: deletes are immediate (no soft delete)
    shelved_offload_time_s: float = 0.0  # > 0: SHELVED servers offloaded after this long
    live_migration_transfer_s: float = 0.0  # the simulated memory copy of a live migration


def conductor_config(cloud: Cloud) -> ConductorConfig:
    """The conductor's settings from the cloud's (the same for `stowage up` and production)."""
    config = cloud.config
    return ConductorConfig(
        call_timeout_s=config.op_timeout_s,
        lease_s=config.lease_s,
        resize_confirm_window_s=config.resize_confirm_window_s,
        reclaim_instance_interval_s=config.reclaim_instance_interval_s,
        shelved_offload_time_s=config.shelved_offload_time_s,
        live_migration_transfer_s=config.live_migration_s,
    )


def claim_of(cloud: Cloud, consumer_id: str) -> dict[str, Any] | None:
    """What the ledger gives a consumer: its host, guest vCPU -> pCPU pins, cells, memory."""
    with cloud.ledger.engine.connect().execution_options(**READONLY) as conn:
        return claim_in(conn, consumer_id)


# `claim_in`'s read, built once (every spawn and move makes it: docs/performance.md, session
# 8), and one statement (four before: 2026-12-05, session 13): the memory, the pins and the
# cells come as scalar subqueries of the consumer's row, the lists as "key:value" strings.
def _pairs(key: Any, value: Any) -> Any:
    return func.aggregate_strings(cast(key, String) + ":" + cast(value, String), ",")


_CLAIM = (
    select(
        hosts.c.name,
        select(allocations.c.amount)
        .where(
            allocations.c.consumer_seq == consumers.c.seq,
            allocations.c.resource_class == ResourceClass.MEMORY_MB.value,
        )
        .limit(1)
        .scalar_subquery(),
        select(_pairs(pins.c.guest_vcpu, pins.c.cpu_id))
        .where(pins.c.consumer_seq == consumers.c.seq, pins.c.guest_vcpu.is_not(None))
        .scalar_subquery(),
        select(_pairs(numa_claims.c.guest_cell, numa_claims.c.cell_id))
        .where(numa_claims.c.consumer_seq == consumers.c.seq)
        .scalar_subquery(),
    )
    .select_from(consumers.join(hosts, hosts.c.id == consumers.c.host_id))
    .where(consumers.c.id == bindparam("consumer"))
)


def _split_pairs(text: str | None) -> list[tuple[int, int]]:
    if not text:
        return []
    return [(int(k), int(v)) for k, _, v in (pair.partition(":") for pair in text.split(","))]


def claim_in(conn: Connection, consumer_id: str) -> dict[str, Any] | None:
    """`claim_of` inside a transaction the caller holds."""
    found = conn.execute(_CLAIM, {"consumer": consumer_id}).first()
    if found is None:
        return None
    host, memory, pinned, cells = found
    return {
        "host": host,
        "pins": {str(v): c for v, c in _split_pairs(pinned)},
        # The host cell of each guest cell, in the guest cells' order.
        "cells": [c for _, c in sorted(_split_pairs(cells))],
        "memory_mb": int(memory or 0),
    }


def _monotonic() -> float:
    """The running loop's clock: time.monotonic() on asyncio's loops, virtual in the simulation."""
    return asyncio.get_running_loop().time()


class _Wait(Exception):
    """Try the step again later, holding everything: its outcome is unknown, or (`failed`)
    the agent said it failed and the next try is a new call."""

    def __init__(self, message: str, *, failed: bool = False) -> None:
        super().__init__(message)
        self.failed = failed


class Conductor:
    """Leases due operations and drives each in a task of its own."""

    def __init__(
        self,
        cloud: Cloud,
        bus: Transport,
        config: ConductorConfig | None = None,
        *,
        owner: str | None = None,
    ) -> None:
        self.cloud = cloud
        self.bus = bus
        self.config = config or ConductorConfig()
        self.owner = owner or "conductor-" + uuid.uuid4().hex[:12]
        self.ops = Operations(cloud.ledger.engine, clock=cloud.clock, guarded=True)
        self._active: dict[str, asyncio.Task[None]] = {}
        # Operations a step of this conductor ended in its commit (id: state), so that the
        # drive loop does not read them again to learn it.
        self._ended_here: dict[str, str] = {}
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._full = False  # the last lease took all it had room for
        # The spawns due together (a scheduled batch's, whose tasks start in one turn of the
        # loop) read their inputs in one thread and one transaction.
        self._spawn_inputs_together = _Together(self._spawn_inputs_each)

    # -- the loop --------------------------------------------------------------------

    def kick(self) -> None:
        """Look for due work now (safe from any thread)."""
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            loop.call_soon_threadsafe(wake.set)

    async def run(self, *, take_over: bool = True) -> None:
        """Drive operations until cancelled; `take_over` voids leases of a previous run."""
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        await asyncio.to_thread(self.cloud.scheduler.warm)
        if take_over:
            taken = await asyncio.to_thread(self.ops.take_over, self.owner)
            if taken:
                log.info("conductor %s resumes %d operation(s)", self.owner, taken)
        renewed_at = _monotonic()
        confirmed_at = _monotonic()
        reclaimed_at = offloaded_at = confirmed_at
        try:
            while True:
                await self._lease_and_start()
                now = _monotonic()
                if now - renewed_at > self.config.lease_s / 3:
                    renewed_at = now
                    await asyncio.to_thread(
                        self.ops.renew, self.owner, list(self._active), lease_s=self.config.lease_s
                    )
                if self.config.resize_confirm_window_s > 0 and now - confirmed_at > 1.0:
                    confirmed_at = now
                    await asyncio.to_thread(self._auto_confirm)
                if self.config.reclaim_instance_interval_s > 0 and now - reclaimed_at > 1.0:
                    reclaimed_at = now
                    await asyncio.to_thread(self._reclaim)
                if self.config.shelved_offload_time_s > 0 and now - offloaded_at > 1.0:
                    offloaded_at = now
                    await asyncio.to_thread(self._offload_shelved)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.config.poll_s):
                        await self._wake.wait()
                self._wake.clear()
        finally:
            for task in self._active.values():
                task.cancel()
            await asyncio.gather(*self._active.values(), return_exceptions=True)

    async def _lease_and_start(self) -> None:
        room = self.config.concurrency_max - len(self._active)
        if room <= 0:
            self._full = True
            return
        leased = await asyncio.to_thread(
            functools.partial(
                self.ops.lease,
                self.owner,
                lease_s=self.config.lease_s,
                limit=room,
                exclude=frozenset(self._active),
            )
        )
        # As many as there was room for: more may be due, and the next task to end makes room
        # for them at once, not at the next poll (a backlog waited out a poll every
        # `concurrency_max` operations).
        self._full = len(leased) >= room
        if not leased:
            return
        # Scheduling steps talk to no agent: the due ones are planned together, in one task.
        planning = [op for op in leased if op.step == "schedule" and op.id not in self._active]
        if planning:
            task = asyncio.create_task(self._schedule(planning), name="schedule")
            for op in planning:
                self._active[op.id] = task
            task.add_done_callback(self._forget_task)
        await self._start_each(leased)

    async def _start_each(self, ops: list[Operation]) -> None:
        """Drive each of `ops`, leased to this conductor, in a task of its own; or let it go
        where its host has an older clean-up to run first (a host's clean-ups run before
        anything new starts there, so a new instance never lands on pCPUs that an instance
        being cleaned up still runs on). Those this conductor drives already are left: a
        lease and a schedule step that inserts the same next step leased to this conductor
        can cross (the lease reads an operation this conductor owns as its own to take)."""
        ops = [op for op in ops if op.id not in self._active]
        if not ops:
            return
        blocked = await asyncio.to_thread(self._hosts_with_cleanups, ops)
        for op in ops:
            if op.id in self._active:  # started meanwhile, while the clean-ups were read
                continue
            if op.kind not in ("cleanup", "delete") and op.host in blocked.get(op.id, set()):
                await asyncio.to_thread(self.ops.let_go, self.owner, op.id)
                continue
            task = asyncio.create_task(self._drive(op), name=f"op:{op.id}")
            self._active[op.id] = task
            task.add_done_callback(self._forget_task)

    def _forget_task(self, task: asyncio.Task[None]) -> None:
        for op_id, known in list(self._active.items()):
            if known is task:
                del self._active[op_id]
        if self._full and self._wake is not None:
            self._full = False
            self._wake.set()

    def _hosts_with_cleanups(self, ops: list[Operation]) -> dict[str, set[str]]:
        """For each of `ops`: the hosts with an older (in the order operations are listed,
        created_at then id), unfinished clean-up or delete."""
        cleanups = self.ops.active_cleanups()
        return {
            op.id: {
                host
                for created, op_id, host in cleanups
                if (created, op_id) < (op.created_at, op.id)
            }
            for op in ops
        }

    async def drain(self, timeout_s: float) -> bool:
        """Wait until no operation is active (tests and shutdown); True when drained."""
        deadline = _monotonic() + timeout_s
        while _monotonic() < deadline:
            if not await asyncio.to_thread(self.ops.active):
                return True
            self.kick()
            await asyncio.sleep(0.05)
        return False

    # -- one operation -----------------------------------------------------------------

    async def _drive(self, op: Operation) -> None:
        # Every line of this operation's work, here and (over the bus) in the agents, carries
        # the request id of the API request that started it.
        with _bound(op):
            await self._drive_bound(op)

    async def _drive_bound(self, op: Operation) -> None:
        try:
            current: Operation | None = op
            while current is not None and not current.finished:
                try:
                    await self._timed_step(current)
                except _Wait as why:
                    await asyncio.to_thread(self._retry_later, current, str(why), why.failed)
                    return
                except NotFound as exc:
                    # The instance (or its migration) is gone: a delete overtook this op.
                    await asyncio.to_thread(self._give_up, current, str(exc))
                    return
                ended = self._ended_here.pop(current.id, None)
                if ended is not None:
                    # The step ended it in its own commit: nothing to read again.
                    current = dataclasses.replace(current, state=ended)
                    break
                current = await asyncio.to_thread(self.ops.find, current.id)
            if current is not None and current.finished:
                age_s = max(0.0, self.cloud.clock() - current.created_at)
                OPERATION_SECONDS.labels(current.kind, current.state).observe(age_s)
                steps.info("operation ended", state=current.state, age_s=round(age_s, 3))
        except OperationEnded as exc:
            # Another writer (a delete) ended it meanwhile: nothing of this step committed.
            log.info("operation %s (%s) ended elsewhere: %s", op.id, op.kind, exc)
            await asyncio.to_thread(self.ops.let_go, self.owner, op.id)
        except Exception:
            log.exception("operation %s (%s) failed in the conductor", op.id, op.kind)
            await asyncio.to_thread(self._retry_later, op, "conductor error")
        finally:
            self._ended_here.pop(op.id, None)

    def _retry_later(self, op: Operation, why: str, failed: bool = False) -> None:
        attempts = op.attempts + 1
        delay_s = min(self.config.retry_max_s, self.config.retry_s * 2 ** min(attempts - 1, 8))
        log.info("op %s %s/%s waits %.1f s: %s", op.id, op.kind, op.step, delay_s, why)
        current = self.ops.find(op.id) or op  # a step may have moved it on before waiting
        payload = dict(current.payload)
        if failed:
            payload["retry"] = int(payload.get("retry", 0)) + 1
        with contextlib.suppress(OperationEnded), self.cloud.ledger.engine.begin() as conn:
            # Never brings back an operation another writer ended meanwhile.
            self.ops.advance(
                conn,
                op.id,
                state="unknown",
                attempts=attempts,
                retry_in_s=delay_s,
                payload=payload,
                result={"waiting": why},
            )
        self.ops.let_go(self.owner, op.id)

    def _give_up(self, op: Operation, why: str) -> None:
        from stowage.services.guest_actions import scrub
        from stowage.services.images import end_snapshot_in

        with contextlib.suppress(OperationEnded), self.cloud.ledger.engine.begin() as conn:
            self.ops.advance(
                conn, op.id, state="failed", result={"error": why}, payload=scrub(op.payload)
            )
            end_snapshot_in(self.cloud, conn, op)

    async def _call(
        self,
        op: Operation,
        method: str,
        payload: dict[str, Any],
        *,
        suffix: str = "",
        checked: bool = False,
    ) -> Reply:
        """The agent's answer to this step; `_Wait` when there is none in time. `checked`:
        the caller read, right before, that the operation is still active."""
        # Checked right before the call: an operation a delete (or any writer) ended while
        # this step ran sends nothing more to the agent (a spawn after the delete's destroy
        # would run a guest the ledger no longer places).
        if not checked:
            current = await asyncio.to_thread(self.ops.find, op.id)
            if current is None or current.finished:
                raise NotFound(f"operation {op.id} ended before its {method} was sent")
        try:
            reply = await self.bus.call(
                compute_topic(op.host),
                method,
                # `issued_at`: the agent's fence against a call the bus delivers late.
                {
                    "instance_id": op.instance_id,
                    "issued_at": self.cloud.clock(),
                    **payload,
                },
                op_id=op.call_id + suffix,
                timeout_s=self.config.call_timeout_s,
            )
        except RemoteError as exc:
            return {"ok": False, "code": exc.kind, "error": exc.message}
        except BusError as exc:
            raise _Wait(f"{op.host}: {exc}") from None
        if reply.get("code") == "agent.call.stale":
            # The agent ran a newer call for the instance, or restarted after this one was
            # issued: nothing ran; the step is tried again as a new call.
            raise _Wait(f"{op.host}: {reply.get('error')}", failed=True)
        return reply

    async def _step(self, op: Operation) -> None:
        handler = getattr(self, "_step_" + op.step)
        await handler(op)

    async def _timed_step(self, op: Operation) -> None:
        started = time.perf_counter()
        outcome = "error"
        try:
            await self._step(op)
            outcome = "done"
        except _Wait:
            outcome = "wait"
            raise
        finally:
            elapsed_s = time.perf_counter() - started
            OPERATION_STEP_SECONDS.labels(op.kind, op.step).observe(elapsed_s)
            steps.info(
                "step", step=op.step, outcome=outcome, duration_ms=round(elapsed_s * 1000, 1)
            )

    # -- steps ---------------------------------------------------------------------------

    async def _schedule(self, ops: list[Operation]) -> None:
        """The `schedule` step of creates and moves: one plan, each claim committed with
        its next step (services/compute.py schedule_builds, services/migrations.py
        schedule_moves). The moves' next steps are this conductor's to lease again."""
        from stowage.services.compute import schedule_builds
        from stowage.services.migrations import schedule_moves

        builds = [op for op in ops if op.kind == "build"]
        moves = [op for op in ops if op.kind in MOVE_KINDS]
        placed: list[Operation] = []
        try:
            if builds:
                # The builds' next steps are leased to this conductor as they commit, and
                # driven here at once: no poll and no lease of their own.
                placed = await asyncio.to_thread(
                    functools.partial(
                        schedule_builds,
                        self.cloud,
                        builds,
                        owner=self.owner,
                        lease_s=self.config.lease_s,
                    )
                )
            if moves:
                await asyncio.to_thread(schedule_moves, self.cloud, moves)
        except Exception:
            log.exception("scheduling %d operation(s) failed in the conductor", len(ops))
            for op in ops:
                await asyncio.to_thread(self._retry_later, op, "conductor error")
            return
        for op in moves:
            await asyncio.to_thread(self.ops.let_go, self.owner, op.id)
        await self._start_each(placed)
        self.kick()

    async def _step_ports(self, op: Operation) -> None:
        """A placed build's NICs: ports and addresses, then the spawn on its host."""
        await asyncio.to_thread(self._ports, op)

    def _ports(self, op: Operation) -> None:
        from stowage.domain.errors import StowageError
        from stowage.services import networks
        from stowage.services.compute import allocate_ports

        cloud = self.cloud
        try:
            # The ports, the server's addresses and the next step: one commit, or none.
            doc = cloud.objects.get("instance", op.instance_id)
            with networks.ports_in_one_commit(cloud, str(doc.body["project_id"])) as conn:
                doc = cloud.objects.get("instance", op.instance_id)  # as of the lock
                addresses = allocate_ports(cloud, doc.body)
                body = dict(doc.body)
                body.update(addresses=addresses, task_state="spawning")
                if not cloud.objects.swap_in(conn, "instance", op.instance_id, doc.body, body):
                    raise _Wait(f"instance {op.instance_id} changed while its ports were made")
                self.ops.advance(conn, op.id, step="spawn")
        except NotFound:
            raise
        except StowageError as exc:
            # No half-built server: without its ports it holds no claim either.
            doc = cloud.objects.get("instance", op.instance_id)
            body = dict(doc.body)
            before = doc.body
            message = f"Build of instance {op.instance_id} aborted: {exc}"
            body.update(status="ERROR", vm_state="error", power_state=0, task_state=None)
            body["host"] = None
            body["fault"] = {
                "code": 500,
                "message": message,
                "created": cloud.clock(),
                "details": exc.code,
            }

            def write(conn: Connection) -> None:
                write_instance(cloud, op.instance_id, before, body, conn=conn)
                self.ops.advance(conn, op.id, state="failed", result={"error": message})

            cloud.ledger.release(op.instance_id, forget=False, also=write)
            networks.release_ports(cloud, op.instance_id)
            _event(cloud, op, body, "Error", message)

    async def _step_spawn(self, op: Operation) -> None:
        # The instance's volumes first (a boot volume made from its image, ...), then the
        # guest, then each volume given to it: as Nova's build, one failure fails the build.
        claim, devices, why, guest = await self._spawn_inputs_together(op)
        if why is not None:
            await asyncio.to_thread(self._spawned, op, {"ok": False, "error": why})
            return
        reply = await self._call(op, "spawn", {**guest, **claim}, checked=True)
        for device in devices if reply.get("ok") else []:
            reply = await self._call(
                op,
                "attach_volume",
                {"device": device["device"], "connection": device["connection"]},
                suffix=":" + device["volume_id"],
            )
            if not reply.get("ok"):
                break
        await self._commit_spawn(op, reply)

    def _spawn_inputs(self, op: Operation) -> _SpawnInputs:
        """A spawn's claim, volumes and guest, and the check that its operation is still
        active (`_call`'s), read in one transaction; volumes still being created are driven
        after it, and everything is read again."""
        driven = False
        while True:
            with self.cloud.objects.reading() as conn:
                state = self.ops.state_in(conn, op.id)
                found = self.cloud.objects.find_each_in(conn, _spawn_input_keys(op))
                inputs = self._spawn_inputs_in(conn, op, state, found, driven=driven)
            if not isinstance(inputs, list):
                return inputs
            for volume_id in inputs:
                volume_service.drive(self.cloud, "volume", volume_id)
            driven = True

    def _spawn_inputs_each(self, ops: list[Operation]) -> list[_SpawnInputs | Exception]:
        """`_spawn_inputs` of the spawns due together (a scheduled batch's), in one
        transaction: their operations' states in one statement, their instances and images
        in another. A spawn whose volumes must be made first is read again alone after."""
        cloud = self.cloud
        keys = list(dict.fromkeys(key for op in ops for key in _spawn_input_keys(op)))
        out: list[_SpawnInputs | list[str] | Exception] = []
        with cloud.objects.reading() as conn:
            states = self.ops.states_in(conn, [op.id for op in ops])
            found = cloud.objects.find_each_in(conn, keys)
            for op in ops:
                with _bound(op):
                    try:
                        out.append(self._spawn_inputs_in(conn, op, states.get(op.id), found))
                    except Exception as exc:
                        out.append(exc)
        answers: list[_SpawnInputs | Exception] = []
        for op, read in zip(ops, out, strict=True):
            if not isinstance(read, list):
                answers.append(read)
                continue
            with _bound(op):  # volumes to make first: as a spawn alone does
                try:
                    answers.append(self._spawn_inputs(op))
                except Exception as exc:
                    answers.append(exc)
        return answers

    def _spawn_inputs_in(
        self,
        conn: Connection,
        op: Operation,
        state: str | None,
        found: dict[tuple[str, str], Document],
        *,
        driven: bool = False,
    ) -> _SpawnInputs | list[str]:
        """`_spawn_inputs` from what was read in `conn` (the operation's `state`, and `found`,
        its instance and image among others); the volumes to drive first, if any are still
        being created and they were not `driven` yet."""
        if state is None or state in TERMINAL_STATES:
            raise NotFound(f"operation {op.id} ended before its spawn was sent")
        claim = claim_in(conn, op.instance_id)
        if claim is None:
            raise NotFound(f"instance {op.instance_id} holds no claim")
        doc = found.get(("instance", op.instance_id))
        if doc is None:
            raise NotFound(f"instance {op.instance_id} is gone")
        new: list[str] = []
        devices, why = server_volumes.spawn_volumes(
            self.cloud, op.instance_id, new=new, body=doc.body
        )
        if new and not driven:
            return new
        images: dict[str, dict[str, Any] | None] = {}
        image_id = op.payload.get("image_id")
        if image_id:  # read: the image, or None where there is none
            image = found.get(("image", str(image_id)))
            images[str(image_id)] = None if image is None else image.body
        guest = (
            {} if why else guest_payload(self.cloud, op.instance_id, body=doc.body, images=images)
        )
        return claim, devices, why, guest

    async def _step_attach_volume(self, op: Operation) -> None:
        payload = {"device": op.payload["device"], "connection": op.payload["connection"]}
        reply = await self._call(op, "attach_volume", payload)
        await asyncio.to_thread(self._volume_answered, op, reply, server_volumes.attach_answered)

    async def _step_detach_volume(self, op: Operation) -> None:
        reply = await self._call(op, "detach_volume", {"device": op.payload["device"]})
        await asyncio.to_thread(self._volume_answered, op, reply, server_volumes.detached)

    def _volume_answered(self, op: Operation, reply: Reply, then: Any) -> None:
        """The host's answer to an attach or detach, with the volume's and the instance's
        documents in one commit."""
        ok = bool(reply.get("ok"))
        with self.cloud.ledger.engine.begin() as conn:
            then(self.cloud, conn, op.instance_id, op.payload, ok)
            self.ops.advance(conn, op.id, state="done" if ok else "failed", result=reply)
        action = "attach_volume" if op.step == "attach_volume" else "detach_volume"
        body = self.cloud.objects.find("instance", op.instance_id)
        if body is not None:
            _event(
                self.cloud,
                dataclasses.replace(op, kind=action),
                body.body,
                "Success" if ok else "Error",
                None if ok else reply.get("error"),
            )

    def _active_in(self, conn: Connection, *, op: Operation, reply: Reply) -> str | None:
        """A spawned instance ACTIVE, its operation done and its action's event, in `conn`:
        the shelved image it leaves behind, if any, for the caller to drop after the commit.
        The instance and its action are read in one statement; the three writes are held to
        the end of the group (`later`), where each is one statement for the group's spawns."""
        from stowage.services.shelve import drop_shelved_image_in

        cloud = self.cloud
        instance_key, action_key = ("instance", op.instance_id), _action_key(op)
        read = cloud.objects.find_each_in(conn, _spawn_reads(op))
        found = read.get(instance_key)
        if found is None:
            raise NotFound(f"instance {op.instance_id} is gone")
        before = found.body
        body = dict(before)
        body.update(status="ACTIVE", vm_state="active", power_state=1, task_state=None)
        if op.kind == "build":
            body["launched_at"] = cloud.clock()
        else:
            body["fault"] = None
        body.pop("shelved_image_id", None)  # unshelved: its image goes (Nova's)
        body = write_instance(
            cloud, op.instance_id, before, body, conn=conn, current=before, later=True
        )
        server_volumes.attached_ended(cloud, conn, body, True)
        self.ops.advance(conn, op.id, state="done", result=reply, later=True)
        shelved = drop_shelved_image_in(cloud, conn, before)
        action = None if action_key is None else read.get(action_key)
        _event_on(cloud, op, action, body, "Success", None, conn=conn)
        return shelved

    async def _commit_spawn(self, op: Operation, reply: Reply) -> None:
        """`_spawned`; a spawn that made its instance ACTIVE is awaited here, in its group on
        the store's writer thread (`write_together_soon`), without a thread of the loop's
        executor waiting for it (a hand-off there and back a boot)."""
        if reply.get("ok") and not self._stays_stopped(op):
            soon = self.cloud.objects.write_together_soon(
                functools.partial(self._active_in, op=op, reply=reply), reads=_spawn_reads(op)
            )
            if soon is not None:
                shelved = await asyncio.wrap_future(soon)
                self._ended_here[op.id] = "done"
                if shelved:
                    from stowage.services.shelve import drop_image_data

                    await asyncio.to_thread(drop_image_data, self.cloud, shelved)
                return
        await asyncio.to_thread(self._spawned, op, reply)

    @staticmethod
    def _stays_stopped(op: Operation) -> bool:
        # Nova keeps a stopped server stopped through a rebuild: power it off again.
        return op.kind == "rebuild" and bool(op.payload.get("stopped"))

    def _spawned(self, op: Operation, reply: Reply) -> None:
        cloud = self.cloud
        if reply.get("ok") and self._stays_stopped(op):
            cloud.objects.get("instance", op.instance_id)  # gone: NotFound, as any spawn
            with cloud.ledger.engine.begin() as conn:
                self.ops.advance(
                    conn, op.id, step="power", payload={**op.payload, "action": "os-stop"}
                )
            return
        if reply.get("ok"):
            from stowage.services.shelve import drop_image_data

            # The instance is read in the commit that writes it (one transaction, and the
            # swap needs no second read of it); on `stowage up`, one with the other spawns
            # that ended at the same moment (`ObjectStore.write_together`), whose instances
            # and actions are read together.
            active = functools.partial(self._active_in, op=op, reply=reply)
            shelved = cloud.objects.write_together(active, reads=_spawn_reads(op))
            self._ended_here[op.id] = "done"
            drop_image_data(cloud, shelved)
            return
        before = cloud.objects.get("instance", op.instance_id).body
        body = dict(before)
        message = f"Build of instance {op.instance_id} aborted: {reply.get('error')}"
        body.update(status="ERROR", vm_state="error", power_state=0, task_state=None)
        body["fault"] = {
            "code": 500,
            "message": message,
            "created": cloud.clock(),
            "details": str(reply.get("code") or ""),
        }
        if op.kind == "build":
            # A failed build holds nothing: its claim and its ports go with the error.
            from stowage.services import networks

            body["host"] = None

            def write(conn: Connection) -> None:
                write_instance(cloud, op.instance_id, before, body, conn=conn)
                self.ops.advance(conn, op.id, state="failed", result=reply)
                # What the failed spawn left on the host goes in the same commit.
                self.ops.enqueue("cleanup", op.instance_id, op.host, step="destroy", conn=conn)

            cloud.ledger.release(op.instance_id, forget=False, also=write)
            networks.release_ports(cloud, op.instance_id)
        else:
            with cloud.ledger.engine.begin() as conn:
                write_instance(cloud, op.instance_id, before, body, conn=conn)
                self.ops.advance(conn, op.id, state="failed", result=reply)
        _event(cloud, op, body, "Error", message)

    async def _step_destroy(self, op: Operation) -> None:
        reply = await self._call(op, "destroy", {})
        if not reply.get("ok"):
            # An orderly failure to destroy: the hypervisor still has it. Try again later.
            raise _Wait(f"destroy on {op.host} failed: {reply.get('error')}", failed=True)
        await asyncio.to_thread(self._destroyed, op, reply)

    def _destroyed(self, op: Operation, reply: Reply) -> None:
        cloud = self.cloud
        if op.kind == "delete":
            from stowage.services import networks
            from stowage.services.shelve import drop_image_data, drop_shelved_image_in

            doomed: list[str] = []
            shelved_images: list[str | None] = []

            def gone(conn: Connection) -> None:
                found = cloud.objects.find_in(conn, "instance", op.instance_id)
                if found is not None:
                    # Its volumes are let go (and those to delete on termination marked so)
                    # in the commit that forgets it, and the image a shelve left for it.
                    doomed.extend(server_volumes.release_server_volumes(cloud, conn, found.body))
                    shelved_images.append(drop_shelved_image_in(cloud, conn, found.body))
                cloud.objects.delete_in(conn, "instance", op.instance_id)
                self.ops.advance(conn, op.id, state="done", result=reply)

            # Ports first: a crash between the two leaves the delete to be driven again
            # (the ports are gone, the rest is repeatable), never a port of no server.
            networks.release_ports(cloud, op.instance_id)
            cloud.ledger.release(op.instance_id, also=gone)
            for image_id in shelved_images:
                drop_image_data(cloud, image_id)
            for volume_id in doomed:
                volume_service.drive(cloud, "volume", volume_id)
        elif op.kind == "shelve":
            from stowage.services.shelve import offloaded

            # Offloaded: every claim of the server goes with the document that says so.
            def shelved(conn: Connection) -> None:
                found = cloud.objects.find_in(conn, "instance", op.instance_id)
                if found is not None:
                    after = offloaded(found.body, op.payload.get("image_id"))
                    write_instance(cloud, op.instance_id, found.body, after, conn=conn)
                self.ops.advance(conn, op.id, state="done", result=reply)

            cloud.ledger.release(op.instance_id, forget=False, also=shelved)
            doc = cloud.objects.find("instance", op.instance_id)
            if doc is not None:
                _event(cloud, op, doc.body, "Success", None)
        elif op.kind == "rebuild":
            self.ops.update(op.id, step="spawn")
        elif op.migration_id is not None:
            # The destination of a deleted instance's move is clean: its claims go now.
            migration_id = op.migration_id

            def ended(conn: Connection) -> None:
                doc = cloud.objects.find_in(conn, "migration", migration_id)
                if doc is not None:
                    record = {**doc.body, "status": "failed"}
                    cloud.objects.update_in(conn, "migration", migration_id, record)
                self.ops.advance(conn, op.id, state="done", result=reply)

            cloud.ledger.fail_migration(migration_id, also=ended)
        else:  # cleanup
            self.ops.update(op.id, state="done", result=reply)

    async def _step_power(self, op: Operation) -> None:
        action = str(op.payload["action"])
        reply = await self._call(op, POWER_METHODS[action], {})
        if (
            action in ("os-start", "reboot")
            and not reply.get("ok")
            and reply.get("code") == "virt.instance.not_found"
        ):
            # The guest vanished (the reconciler stopped the server): as Nova's hard reboot
            # does, starting it defines it again from what the ledger gives it.
            claim = await asyncio.to_thread(claim_of, self.cloud, op.instance_id)
            if claim is not None and claim["host"] == op.host:
                reply = await self._call(op, "spawn", claim, suffix=":respawn")
        await asyncio.to_thread(self._powered, op, action, reply)

    def _powered(self, op: Operation, action: str, reply: Reply) -> None:
        cloud = self.cloud
        before = cloud.objects.get("instance", op.instance_id).body
        body = dict(before)
        if reply.get("ok"):
            status, vm_state, power = _AFTER_POWER[action]
            body.update(status=status, vm_state=vm_state, power_state=power, task_state=None)
            if op.kind == "soft-delete":
                from stowage.services.soft_delete import soft_deleted

                body = soft_deleted(body, cloud.clock())
            elif op.kind == "shelve":  # a volume-backed server SHELVED where it is
                from stowage.services.shelve import kept

                body = kept(body, cloud.clock())
            elif op.kind == "unshelve":  # a SHELVED server runs again: its image goes
                body.pop("shelved_image_id", None)
                body.pop("shelved_at", None)
            if (body.get("fault") or {}).get("error_code") == "reconcile.missing_instance":
                body["fault"] = None  # the vanished guest runs again
            state = "done"
        elif op.kind == "rebuild":
            # The stop after a stopped server's rebuild failed: the new guest runs (its spawn
            # answered), so the server is ACTIVE, as Nova's failed stop leaves it, not REBUILD.
            body.update(status="ACTIVE", vm_state="active", power_state=1, task_state=None)
            state = "failed"
        else:
            body.update(task_state=None)  # the instance is as it was
            state = "failed"
        shelved = None
        with cloud.ledger.engine.begin() as conn:
            write_instance(cloud, op.instance_id, before, body, conn=conn)
            self.ops.advance(conn, op.id, state=state, result=reply)
            if op.kind == "unshelve" and reply.get("ok"):
                from stowage.services.shelve import drop_shelved_image_in

                shelved = drop_shelved_image_in(cloud, conn, before)
        if shelved is not None:
            from stowage.services.shelve import drop_image_data

            drop_image_data(cloud, shelved)
        _event(cloud, op, body, "Success" if reply.get("ok") else "Error", reply.get("error"))

    # -- guest actions (services/guest_actions.py) --------------------------------------

    async def _step_rescue(self, op: Operation) -> None:
        from stowage.services.guest_spec import image_spec

        image = await asyncio.to_thread(image_spec, self.cloud, str(op.payload["image_id"]))
        if image is None:
            reply: Reply = {
                "ok": False,
                "code": "image.not_found",
                "error": f"rescue image {op.payload['image_id']} is not an active image",
            }
        else:
            payload = {"image": image, "admin_password": op.payload.get("admin_password")}
            reply = await self._call(op, "rescue", payload)
        await asyncio.to_thread(self._guest_answered, op, reply)

    async def _step_unrescue(self, op: Operation) -> None:
        reply = await self._call(op, "unrescue", {})
        await asyncio.to_thread(self._guest_answered, op, reply)

    async def _step_set_password(self, op: Operation) -> None:
        reply = await self._call(op, "set_admin_password", {"password": op.payload["password"]})
        await asyncio.to_thread(self._guest_answered, op, reply)

    async def _step_inject_nmi(self, op: Operation) -> None:
        reply = await self._call(op, "inject_nmi", {})
        await asyncio.to_thread(self._guest_answered, op, reply)

    async def _step_interface_port(self, op: Operation) -> None:
        """An interface attach's port: made or bound, then hot-plugged on the host."""
        await asyncio.to_thread(self._interface_port, op)

    def _interface_port(self, op: Operation) -> None:
        from stowage.services.interfaces import interface_port
        from stowage.services.networks import NetworkError

        try:
            port = interface_port(self.cloud, op)
        except NetworkError as exc:
            reply = {"ok": False, "code": exc.code, "status": exc.status, "error": exc.message}
            with self.cloud.ledger.engine.begin() as conn:
                self.ops.advance(conn, op.id, state="failed", result=reply)
            body = self.cloud.objects.get("instance", op.instance_id).body
            _event(self.cloud, op, dict(body), "Error", exc.message)
            return
        payload = {**op.payload, "port_id": port["id"], "made": not op.payload.get("port_id")}
        with self.cloud.ledger.engine.begin() as conn:
            self.ops.advance(conn, op.id, step="attach_interface", payload=payload)

    async def _step_attach_interface(self, op: Operation) -> None:
        from stowage.services.interfaces import attached_port, nic_of

        port = await asyncio.to_thread(
            attached_port, self.cloud, op.instance_id, str(op.payload["port_id"])
        )
        reply = await self._call(op, "attach_interface", {"nic": nic_of(port)})
        await asyncio.to_thread(self._interface_answered, op, reply, port)

    async def _step_detach_interface(self, op: Operation) -> None:
        reply = await self._call(op, "detach_interface", {"mac": op.payload["mac"]})
        port = await asyncio.to_thread(self.cloud.objects.find, "port", str(op.payload["port_id"]))
        body = None if port is None else dict(port.body)
        await asyncio.to_thread(self._interface_answered, op, reply, body)

    def _interface_answered(self, op: Operation, reply: Reply, port: dict[str, Any] | None) -> None:
        """The host plugged or unplugged the NIC: the port is kept (attached) or let go
        (detached, or a failed attach), and the server's addresses follow."""
        from stowage.services import networks

        cloud = self.cloud
        ok = bool(reply.get("ok"))
        attach = op.kind == "interface-attach"
        if port is not None and (ok != attach) and port.get("device_id") == op.instance_id:
            networks.release_port(cloud, port)
        networks.refresh_server_addresses(cloud, op.instance_id)
        result = {**reply, "port_id": op.payload.get("port_id")}
        with cloud.ledger.engine.begin() as conn:
            self.ops.advance(conn, op.id, state="done" if ok else "failed", result=result)
        body = cloud.objects.get("instance", op.instance_id).body
        _event(cloud, op, dict(body), "Success" if ok else "Error", reply.get("error"))

    def _guest_answered(self, op: Operation, reply: Reply) -> None:
        """The host's answer to a guest action, with the server's state in one commit: a
        rescue that failed leaves the server as it was, an unrescue that failed RESCUE."""
        from stowage.services.guest_actions import scrub

        cloud = self.cloud
        ok = bool(reply.get("ok"))
        before = cloud.objects.get("instance", op.instance_id).body
        body = dict(before)
        if ok and op.kind == "rescue":
            body.update(status="RESCUE", vm_state="rescued", power_state=1)
            # Kept so that a hypervisor that forgets its guests boots it rescued again.
            body["rescue_image_id"] = op.payload.get("image_id")
        elif ok and op.kind == "unrescue":
            body.update(status="ACTIVE", vm_state="active", power_state=1)
            body.pop("rescue_image_id", None)
        elif op.kind == "rescue":
            body.update(dict(op.payload.get("before") or {}))
        if op.kind != "inject-nmi":
            body["task_state"] = None
        with cloud.ledger.engine.begin() as conn:
            if body != before:
                write_instance(cloud, op.instance_id, before, body, conn=conn)
            self.ops.advance(
                conn,
                op.id,
                state="done" if ok else "failed",
                result=reply,
                payload=scrub(op.payload),
            )
        _event(cloud, op, body, "Success" if ok else "Error", None if ok else reply.get("error"))

    async def _step_snapshot(self, op: Operation) -> None:
        reply = await self._call(op, "snapshot", dict(op.payload))
        await asyncio.to_thread(self._snapshotted, op, reply)

    def _snapshotted(self, op: Operation, reply: Reply) -> None:
        from stowage.services.images import end_snapshot_in

        cloud = self.cloud
        doc = cloud.objects.find("instance", op.instance_id)
        shelving = op.kind == "shelve" and bool(reply.get("ok"))
        keep = shelving and bool(op.payload.get("keep"))
        with cloud.ledger.engine.begin() as conn:
            if doc is not None:
                body = dict(doc.body)
                before = doc.body
                # A shelve goes on to offload the guest once its disk is in the image, or
                # (a shelved_offload_time) leaves it SHELVED, stopped where it is.
                body["task_state"] = "shelving_offloading" if shelving else None
                if keep:
                    from stowage.services.shelve import kept

                    body = kept(body, cloud.clock(), op.payload.get("image_id"))
                write_instance(cloud, op.instance_id, before, body, conn=conn)
            if keep:
                self.ops.advance(conn, op.id, state="done", result=reply)
                if doc is not None:
                    _event(cloud, op, body, "Success", None, conn=conn)
                return
            if shelving:
                self.ops.advance(conn, op.id, step="destroy")
                return
            self.ops.advance(
                conn, op.id, state="done" if reply.get("ok") else "failed", result=reply
            )
            if not reply.get("ok"):
                # Never a half-written snapshot: the image goes with the failed upload, in the
                # commit that ends the operation.
                end_snapshot_in(cloud, conn, op)

    # -- moves ---------------------------------------------------------------------------

    async def _step_prepare(self, op: Operation) -> None:
        """The destination defines the instance with the migration's claim."""
        assert op.migration_id is not None
        record = await asyncio.to_thread(self._record, op)
        if record.get("abort"):
            await asyncio.to_thread(self._to_abort, op, "cancelled", "aborted by request")
            return
        claim = await asyncio.to_thread(claim_of, self.cloud, op.migration_id)
        if claim is None:
            raise NotFound(f"migration {op.migration_id} holds no claim")
        guest = {
            **await asyncio.to_thread(
                guest_payload, self.cloud, op.instance_id, flavor=record.get("new_flavor")
            ),
            **claim,
        }
        # A live migration's destination only makes room (the disk on its cached image): the
        # guest itself arrives with its memory. Every other move builds it there: a cold
        # migration or a resize on the source's disk, moved (its data kept, as in Nova); an
        # evacuation (the source is down) from the image.
        live = op.kind == "live-migration"
        if op.kind in COLD_MOVES:
            at_source = dataclasses.replace(op, host=str(record["source_compute"]))
            try:
                # As Nova's migrate_disk_and_power_off: the guest stops before its disk is
                # copied (a running guest's disk is not a consistent copy); a revert or a
                # failed move starts it again (`_step_abort_dest`).
                stopped = await self._call(at_source, "power_off", {}, suffix=":stop-source")
                if stopped.get("ok"):
                    exported = await self._call(at_source, "export_disk", {}, suffix=":export")
                else:
                    exported = {"ok": False, "error": f"not stopped: {stopped.get('error')}"}
            except _Wait as why:
                exported = {"ok": False, "error": f"no answer: {why}"}
            if not exported.get("ok"):
                reason = f"the source could not hand over the disk: {exported.get('error')}"
                await asyncio.to_thread(self._to_abort, op, "failed", reason)
                return
            guest["disk_source"] = dict(exported.get("handle") or {})
        try:
            reply = await self._call(op, "prepare_migration" if live else "spawn", guest)
        except _Wait as why:
            # Unknown on the destination: the record says so (error), both ends stay held,
            # and the destination is cleaned up as soon as it answers again.
            await asyncio.to_thread(self._to_abort, op, "error", f"no answer: {why}")
            raise
        if reply.get("ok") and _rests_stopped(record):
            # A stopped server moves stopped: its new copy is powered off before it is used.
            reply = await self._call(op, "power_off", {}, suffix=":off")
        if not reply.get("ok"):
            await asyncio.to_thread(self._to_abort, op, "failed", str(reply.get("error")))
            return
        if live:
            payload = {**op.payload, "dest_handle": reply.get("handle") or {}, "dest_guest": guest}
            await asyncio.to_thread(self.ops.update, op.id, payload=payload)
            op = dataclasses.replace(op, payload=payload)
        await asyncio.to_thread(self._prepared, op)

    def _record(self, op: Operation) -> dict[str, Any]:
        assert op.migration_id is not None
        return dict(self.cloud.objects.get("migration", op.migration_id).body)

    def _to_abort(self, op: Operation, outcome: str, reason: str) -> None:
        """Undo the destination next; the record shows `error` while that is unconfirmed."""
        assert op.migration_id is not None
        cloud = self.cloud
        record = self._record(op)
        record["status"] = "error" if outcome == "error" else record["status"]
        record["reason"] = reason
        with cloud.ledger.engine.begin() as conn:
            cloud.objects.update_in(conn, "migration", op.migration_id, record, keep=REQUESTS)
            self.ops.advance(
                conn,
                op.id,
                step="abort_dest",
                host=record["dest_compute"],
                payload={
                    **op.payload,
                    "outcome": "cancelled" if outcome == "cancelled" else "failed",
                },
                retry_in_s=self.config.retry_s if outcome == "error" else 0.0,
            )

    def _prepared(self, op: Operation) -> None:
        assert op.migration_id is not None
        cloud = self.cloud
        record = self._record(op)
        before = cloud.objects.get("instance", op.instance_id).body
        body = dict(before)
        kind = op.kind
        if kind == "live-migration":
            record["status"] = "running"
            with cloud.ledger.engine.begin() as conn:
                cloud.objects.update_in(conn, "migration", op.migration_id, record, keep=REQUESTS)
                self.ops.advance(conn, op.id, step="transfer", host=record["source_compute"])
            return
        if kind == "evacuation":
            body.update(
                host=record["dest_compute"], task_state=None, fault=None, **_resting(record)
            )
            record["status"] = "done"

            def evacuated(conn: Connection) -> None:
                cloud.objects.update_in(
                    conn, "migration", op.migration_id or "", record, keep=REQUESTS
                )
                write_instance(cloud, op.instance_id, before, body, conn=conn)
                self.ops.advance(conn, op.id, state="done")
                # The source is down: what runs there is destroyed when it comes back.
                self.ops.enqueue(
                    "cleanup", op.instance_id, record["source_compute"], step="destroy", conn=conn
                )

            cloud.ledger.complete_migration(op.migration_id, also=evacuated)
            _event(cloud, op, body, "Success", None)
            return
        # Cold migration and resize wait in VERIFY_RESIZE, both ends held, until confirmed.
        body.update(status="VERIFY_RESIZE", vm_state="resized", task_state=None)
        record["status"] = "finished"
        record["finished_at"] = cloud.clock()
        with cloud.ledger.engine.begin() as conn:
            cloud.objects.update_in(conn, "migration", op.migration_id, record, keep=REQUESTS)
            write_instance(cloud, op.instance_id, before, body, conn=conn)
            self.ops.advance(conn, op.id, state="done")

    async def _step_transfer(self, op: Operation) -> None:
        """A live migration's memory copy: `live_migration_transfer_s` on the simulated
        hypervisor, ended early by force-complete (2.22) or by an abort (2.24)."""
        deadline = _monotonic() + self.config.live_migration_transfer_s
        while True:
            record = await asyncio.to_thread(self._record, op)
            if record.get("abort"):
                await asyncio.to_thread(self._to_abort, op, "cancelled", "aborted by request")
                return
            if record.get("force_complete") or _monotonic() >= deadline:
                break
            await asyncio.sleep(min(0.1, max(0.0, deadline - _monotonic())))
        if not await self._migrate_live(op):
            return
        await asyncio.to_thread(self._transferred, op)

    def _transferred(self, op: Operation) -> None:
        record = self._record(op)
        record["status"] = "post-migrating"
        with self.cloud.ledger.engine.begin() as conn:
            self.cloud.objects.update_in(
                conn, "migration", op.migration_id or "", record, keep=REQUESTS
            )
            self.ops.advance(conn, op.id, step="source_cleanup")

    async def _migrate_live(self, op: Operation) -> bool:
        """The source's hypervisor moves the guest to the destination prepared for it, while
        its progress goes into the record and an abort (2.24) or a force-complete (2.22)
        acts on the running job; then the destination takes the guest. False when the
        migration did not happen (the destination is undone next, the source keeps it)."""
        handle = op.payload.get("dest_handle")
        if handle is None:
            return True  # prepared by an agent that built the guest there already
        record = await asyncio.to_thread(self._record, op)
        dest = str(record["dest_compute"])
        moving = asyncio.create_task(
            self._call(
                op,
                "live_migrate",
                {"dest": dest, "dest_guest": op.payload.get("dest_guest") or {}, "handle": handle},
            )
        )
        acted: set[str] = set()
        polls = 0
        while not moving.done():
            await asyncio.wait({moving}, timeout=1.0)
            if moving.done():
                break
            record = await asyncio.to_thread(self._record, op)
            for flag, method in (
                ("abort", "abort_migration"),
                ("force_complete", "force_complete_migration"),
            ):
                if record.get(flag) and flag not in acted:
                    acted.add(flag)
                    with contextlib.suppress(_Wait):
                        await self._call(op, method, {}, suffix=f":{flag}")
            polls += 1
            with contextlib.suppress(_Wait):
                seen = await self._call(op, "migration_progress", {}, suffix=f":p{polls}")
                if seen.get("ok") and seen.get("progress"):
                    await asyncio.to_thread(self._progressed, op, dict(seen["progress"]))
        reply = moving.result()  # no answer: _Wait, and the step runs again (same call id)
        at_dest = dataclasses.replace(op, host=dest)
        if not reply.get("ok") and reply.get("code") == "virt.instance.not_found":
            # The source no longer has it: a repeated call after the guest left (an agent
            # that restarted forgot the first answer). Where it runs decides, not the error.
            there = await self._call(at_dest, "running", {}, suffix=f":where{op.attempts}")
            if op.instance_id in (there.get("instances") or {}):
                reply = {"ok": True, "already": True}
        if not reply.get("ok"):
            outcome = "cancelled" if "abort" in acted else "failed"
            await asyncio.to_thread(self._to_abort, op, outcome, str(reply.get("error")))
            return False
        done = await self._call(at_dest, "finish_migration", {}, suffix=":finish")
        if not done.get("ok"):
            raise _Wait(f"{dest} did not take the guest: {done.get('error')}", failed=True)
        return True

    def _progressed(self, op: Operation, progress: dict[str, Any]) -> None:
        record = self._record(op)
        record.update({k: int(v) for k, v in progress.items()})
        with self.cloud.ledger.engine.begin() as conn:
            self.cloud.objects.update_in(
                conn, "migration", op.migration_id or "", record, keep=REQUESTS
            )

    async def _step_source_cleanup(self, op: Operation) -> None:
        """The source lets the instance go; then the destination's claims become its own."""
        assert op.migration_id is not None
        reply = await self._call(op, "destroy", {})
        if not reply.get("ok"):
            raise _Wait(f"source clean-up on {op.host} failed: {reply.get('error')}", failed=True)
        await asyncio.to_thread(self._completed, op)

    def _completed(self, op: Operation) -> None:
        assert op.migration_id is not None
        cloud = self.cloud
        record = self._record(op)
        before = cloud.objects.get("instance", op.instance_id).body
        body = dict(before)
        body.update(
            host=record["dest_compute"], flavor=record["new_flavor"], task_state=None, fault=None
        )
        if op.kind == "confirm":
            body.update(**_resting(record))
            record["status"] = "confirmed"
        else:
            body.update(status=settled_status(body))
            record["status"] = "completed"

        def write(conn: Connection) -> None:
            cloud.objects.update_in(conn, "migration", op.migration_id or "", record, keep=REQUESTS)
            write_instance(cloud, op.instance_id, before, body, conn=conn)
            self.ops.advance(conn, op.id, state="done")

        cloud.ledger.complete_migration(op.migration_id, also=write)
        _event(cloud, op, body, "Success", None)

    async def _step_abort_dest(self, op: Operation) -> None:
        """Undo the destination; then its claims go with the record's end."""
        assert op.migration_id is not None
        reply = await self._call(op, "destroy", {})
        if not reply.get("ok"):
            raise _Wait(f"clean-up on {op.host} failed: {reply.get('error')}", failed=True)
        record = await asyncio.to_thread(self._record, op)
        if record.get("migration_type") in COLD_MOVES and not _rests_stopped(record):
            await self._restart_source(op, record)
        await asyncio.to_thread(self._undone, op)

    async def _restart_source(self, op: Operation, record: dict[str, Any]) -> None:
        """A cold move's source guest, stopped for the disk copy, runs again when the move is
        reverted or fails (a guest the source no longer has is the reconciler's to mend)."""
        at_source = dataclasses.replace(op, host=str(record["source_compute"]))
        started = await self._call(at_source, "power_on", {}, suffix=":start-source")
        if not started.get("ok") and started.get("code") != "virt.instance.not_found":
            raise _Wait(f"restart on {at_source.host} failed: {started.get('error')}", failed=True)

    def _undone(self, op: Operation) -> None:
        assert op.migration_id is not None
        cloud = self.cloud
        record = self._record(op)
        before = cloud.objects.get("instance", op.instance_id).body
        body = dict(before)
        reason = str(record.get("reason") or "")
        if op.kind == "revert":
            record["status"] = "reverted"
            body.update(task_state=None, **_resting(record))
        else:
            record["status"] = str(op.payload.get("outcome") or "failed")
            if op.kind == "evacuation":
                # The source is down and the destination could not take it: ERROR, as in Nova.
                body.update(status="ERROR", vm_state="error", task_state=None)
                body["fault"] = {
                    "code": 500,
                    "message": reason,
                    "created": cloud.clock(),
                    "details": "",
                }
            elif body.get("task_state") is not None or body["status"] in (
                "MIGRATING",
                "RESIZE",
                "REBUILD",
            ):
                body.update(status=settled_status(body), task_state=None)

        def write(conn: Connection) -> None:
            cloud.objects.update_in(conn, "migration", op.migration_id or "", record, keep=REQUESTS)
            write_instance(cloud, op.instance_id, before, body, conn=conn)
            self.ops.advance(
                conn,
                op.id,
                state="done" if op.kind == "revert" else "failed",
                result={"status": record["status"], "reason": reason},
            )

        cloud.ledger.fail_migration(op.migration_id, also=write)
        _event(cloud, op, body, "Success" if op.kind == "revert" else "Error", reason or None)

    # -- periodic ------------------------------------------------------------------------

    def _offload_shelved(self) -> None:
        """SHELVED servers past shelved_offload_time are offloaded (their claims go)."""
        from stowage.services.shelve import offload_due

        try:
            offload_due(self.cloud, self.config.shelved_offload_time_s)
        except Exception:
            log.exception("offloading shelved servers failed")

    def _reclaim(self) -> None:
        """Soft-deleted servers past reclaim_instance_interval are deleted for good."""
        from stowage.services.soft_delete import reclaim

        try:
            reclaim(self.cloud, self.config.reclaim_instance_interval_s)
        except Exception:
            log.exception("reclaiming soft-deleted servers failed")

    def _auto_confirm(self) -> None:
        """Resizes left in VERIFY_RESIZE longer than the window are confirmed, as Nova does."""
        from stowage.services.migrations import confirm_resize

        window_s = self.config.resize_confirm_window_s
        now = self.cloud.clock()
        for doc in self.cloud.objects.list("migration"):
            record = doc.body
            if (
                record.get("status") == "finished"
                and now - float(record.get("finished_at") or now) >= window_s
            ):
                try:
                    confirm_resize(self.cloud, record["instance_uuid"])
                except Exception as exc:
                    log.warning("auto-confirm of %s failed: %s", record["instance_uuid"], exc)
                else:
                    log.info("resize of %s confirmed automatically", record["instance_uuid"])


def _rests_stopped(record: dict[str, Any]) -> bool:
    """A move ends stopped when the server was stopped, or (an evacuation at 2.95+) when
    the request said so."""
    return record.get("old_vm_state") == "stopped" or record.get("target_state") == "stopped"


def _resting(record: dict[str, Any]) -> dict[str, Any]:
    """How a moved server rests: stopped if it was stopped when the move began, as in Nova."""
    if _rests_stopped(record):
        return {"status": "SHUTOFF", "vm_state": "stopped", "power_state": 4}
    return {"status": "ACTIVE", "vm_state": "active", "power_state": 1}


def _event(
    cloud: Cloud,
    op: Operation,
    body: dict[str, Any],
    result: str,
    message: str | None,
    *,
    conn: Connection | None = None,
) -> None:
    """The step's event on the instance action that started the operation; in the
    transaction `conn` where the step's outcome commits, if given."""
    key = _action_key(op)
    if key is None:
        return
    doc = cloud.objects.find(*key) if conn is None else cloud.objects.find_in(conn, *key)
    _event_on(cloud, op, doc, body, result, message, conn=conn)


def _bound(op: Operation) -> contextlib.AbstractContextManager[None]:
    """The operation's request id, id and kind bound to every log line of the work inside."""
    return bind(request_id=op.payload.get("request_id"), op_id=op.id, op_kind=op.kind)


def _spawn_input_keys(op: Operation) -> list[tuple[str, str]]:
    """What a spawn's inputs read: its instance, and the image a build's spawn names
    (`_place`; a rebuild's or an unshelve's names none, and its guest reads it)."""
    image_id = op.payload.get("image_id")
    return [("instance", op.instance_id), *([("image", str(image_id))] if image_id else [])]


class _Together(Generic[A, R]):
    """Calls made in one turn of the event loop, answered by one call of `each` in a thread:
    `each(args)` gives, for each argument in order, its answer or the exception to raise.
    One thread hand-off for a batch instead of one for each call."""

    def __init__(self, each: Callable[[list[A]], list[R | Exception]]) -> None:
        self._each = each
        self._due: list[tuple[A, asyncio.Future[R]]] = []
        self._running: set[asyncio.Task[None]] = set()

    async def __call__(self, arg: A) -> R:
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[R] = loop.create_future()
        self._due.append((arg, answer))
        if len(self._due) == 1:
            # After the callbacks ready now: the other tasks started in this turn ask too.
            # An empty context: the batch is no one caller's work (each is bound in `each`).
            loop.call_soon(self._start, context=contextvars.Context())
        return await answer

    def _start(self) -> None:
        due, self._due = self._due, []
        task = asyncio.get_running_loop().create_task(self._answer(due))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _answer(self, due: list[tuple[A, asyncio.Future[R]]]) -> None:
        try:
            answers = await asyncio.to_thread(self._each, [arg for arg, _ in due])
        except Exception as exc:  # every caller hears of it
            answers = [exc] * len(due)
        for (_, answer), value in zip(due, answers, strict=True):
            if answer.done():  # its caller was cancelled meanwhile
                continue
            if isinstance(value, Exception):
                answer.set_exception(value)
            else:
                answer.set_result(value)


def _spawn_reads(op: Operation) -> list[tuple[str, str]]:
    """What a spawn's commit reads: its instance, and its action if it has one."""
    action_key = _action_key(op)
    return [("instance", op.instance_id), *([] if action_key is None else [action_key])]


def _action_key(op: Operation) -> tuple[str, str] | None:
    """The instance action that started the operation, if its request said which."""
    request_id = op.payload.get("request_id")
    return ("instance_action", f"{request_id}:{op.instance_id}") if request_id else None


def _event_on(
    cloud: Cloud,
    op: Operation,
    doc: Document | None,
    body: dict[str, Any],
    result: str,
    message: str | None,
    *,
    conn: Connection | None = None,
) -> None:
    """`_event` on the action document `doc` its caller read (None: there is none)."""
    if doc is None:
        return
    action = dict(doc.body)
    now = time.time()
    action["events"] = [
        *action.get("events", []),
        {
            "event": f"compute_{op.kind.replace('-', '_')}_{op.step}",
            "start_time": now,
            "finish_time": now,
            "result": result,
            "traceback": None,
            "host": body.get("host"),
            "hostId": None,
            "details": message,
        },
    ]
    if result == "Error":
        action["message"] = message
    if conn is not None:
        # Held to the end of a group write on `conn` where there is one (a spawn's commit).
        cloud.objects.update_in(conn, "instance_action", doc.id, action, later=True)
        return
    with contextlib.suppress(NotFound):
        cloud.objects.update("instance_action", doc.id, action)
