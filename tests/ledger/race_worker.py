"""One racer in the ledger race suite, run as a child process by `test_races.py`.

    python race_worker.py CONFIG.json

The config names the ledger URL, the role, a seed and where to write the log. Every claim
attempt is logged (consumer, ok or refused with code and reason, what the consumer holds
right after a refusal), and so is every release, so the parent can check each attempt
against the ledger once all racers are done. Racers start together: each one touches
`ready-PHASE-NAME` in the barrier directory once it is set up, then spins until the parent
creates `go-PHASE`.

Roles:

- ``scheduler``: a `Scheduler` with its own in-memory view and seed places small batches
  of requests (pinned and shared flavors, group members), releases some of what it placed
  and places those consumers again.
- ``raw``: loads a view once and never refreshes it, builds claims (exact pCPUs, NUMA
  cells, group slots) from that stale picture and calls `Ledger.claim` itself, so only the
  database stands between it and a double pin or a broken group. It also releases and
  re-claims, and sometimes claims a consumer that already holds a claim.
- ``contend``: builds one claim per phase from the same fresh view as every other
  contender (the same pCPUs, the same last group slot) and fires it when the phase opens.
"""

from __future__ import annotations

import json
import random
import sys
import time
import traceback
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from stowage.domain.claims import Claim, ClaimOutcome, GroupSlot
from stowage.domain.flavor import Flavor, InstanceShape, shape_of
from stowage.domain.groups import GroupPolicy, domain_of
from stowage.domain.numa import Fit, HostFree, NoFit, apply_fit, fit_instance
from stowage.domain.topology import ResourceClass
from stowage.ledger.db import READONLY
from stowage.ledger.ledger import Ledger
from stowage.ledger.schema import (
    allocations,
    consumer_key,
    consumers,
    group_slots,
    numa_claims,
    pins,
)
from stowage.scheduling.framework import Request
from stowage.scheduling.view import HostState, View
from stowage.services.scheduler import Scheduler

THREAD_POLICIES = ("prefer", "isolate", "require")
BARRIER_TIMEOUT_S = 180.0


# -- shared helpers ---------------------------------------------------------------------


def wait_for_go(barrier: Path, phase: str, name: str) -> None:
    """Say this racer is ready for `phase`, then spin until the parent opens it."""
    (barrier / f"ready-{phase}-{name}").touch()
    go = barrier / f"go-{phase}"
    deadline = time.monotonic() + BARRIER_TIMEOUT_S
    while not go.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name}: phase {phase} never opened")
        time.sleep(0.0005)


def new_consumer_id(rng: random.Random) -> str:
    """A UUID from the racer's seeded generator (consumer ids are 36 characters at most)."""
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def flavor_from(spec: Mapping[str, Any]) -> Flavor:
    return Flavor(
        name=str(spec["name"]),
        vcpus=int(spec["vcpus"]),
        memory_mb=int(spec["memory_mb"]),
        disk_gb=int(spec.get("disk_gb", 1)),
        extra_specs=dict(spec.get("extra_specs", {})),
    )


def random_flavor(rng: random.Random, *, pinned: bool) -> dict[str, Any]:
    """A pinned flavor (1-4 dedicated vCPUs, any thread policy) or a shared one, as JSON."""
    vcpus = rng.randint(1, 4)
    if pinned:
        policy = rng.choice(THREAD_POLICIES)
        return {
            "name": f"pinned.{vcpus}.{policy}",
            "vcpus": vcpus,
            "memory_mb": rng.choice((512, 1024, 1536, 2048)),
            "disk_gb": rng.randint(1, 5),
            "extra_specs": {"hw:cpu_policy": "dedicated", "hw:cpu_thread_policy": policy},
        }
    return {
        "name": f"shared.{vcpus}",
        "vcpus": vcpus,
        "memory_mb": rng.choice((256, 512, 1024)),
        "disk_gb": rng.randint(1, 5),
        "extra_specs": {},
    }


def build_claim(
    consumer_id: str,
    shape: InstanceShape,
    host: HostState,
    fit: Fit,
    view: View,
    group_id: str | None,
    slot: int | None = None,
) -> Claim:
    """A claim shaped exactly as the scheduler's pipeline shapes one (amounts, pins, slots)."""
    amounts = shape.amounts()
    if fit.cells and ResourceClass.PCPU in amounts:
        amounts[ResourceClass.PCPU] = len(fit.cpus)  # isolate's withheld siblings count
    slots: tuple[GroupSlot, ...] = ()
    affinity: tuple[str, ...] = ()
    member_of: tuple[str, ...] = ()
    if group_id is not None:
        group = view.groups[group_id].group
        member_of = (group_id,)
        if group.policy is GroupPolicy.AFFINITY:
            affinity = (group_id,)
        elif group.policy is GroupPolicy.ANTI_AFFINITY:
            domain = domain_of(group, host.name, host.labels)
            if domain is None:
                raise AssertionError(f"host {host.name} lacks the {group.failure_domain} label")
            if slot is None:
                slot = view.groups[group_id].free_slot(domain)
            if slot is None:
                slot = 0
            slots = (GroupSlot(group_id, domain, slot, group.max_per_domain),)
    return Claim(
        consumer_id=consumer_id,
        instance_id=consumer_id,
        host_id=host.id,
        amounts=amounts,
        fit=fit,
        slots=slots,
        affinity_groups=affinity,
        member_of=member_of,
    )


def holdings(ledger: Ledger, consumer_id: str) -> dict[str, Any]:
    """What a consumer holds right now: its host and how many rows of each kind of claim."""

    def count(table: Any) -> Any:
        return (
            select(func.count())
            .select_from(table)
            .where(table.c.consumer_seq == consumer_key(consumer_id))
            .scalar_subquery()
        )

    query = select(
        count(allocations),
        count(numa_claims),
        count(pins),
        count(group_slots),
        select(consumers.c.host_id).where(consumers.c.id == consumer_id).scalar_subquery(),
    )
    with ledger.engine.connect().execution_options(**READONLY) as conn, conn.begin():
        alloc, numa, pinned, slotted, host = conn.execute(query).one()
    return {
        "allocations": int(alloc),
        "numa_claims": int(numa),
        "pins": int(pinned),
        "slots": int(slotted),
        "host": host,
    }


class Log:
    """Every attempt and release, in the order this racer made them."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.events: list[dict[str, Any]] = []

    def outcome(self, claim: Claim, outcome: ClaimOutcome, **details: Any) -> dict[str, Any]:
        """Log the ledger's answer to one claim it was handed directly."""
        return self.claim(
            claim.consumer_id,
            ok=outcome.ok,
            host=claim.host_id if outcome.ok else None,
            code=outcome.code.value if outcome.code is not None else None,
            reason=outcome.reason,
            pcpus=len(claim.fit.cpus),
            **details,
        )

    def claim(
        self,
        consumer_id: str,
        *,
        ok: bool,
        host: int | None,
        code: str | None,
        reason: str,
        pcpus: int,
        via: str,
        what: str,
        group: str | None,
        double: bool = False,
        retries: int = 1,
    ) -> dict[str, Any]:
        event: dict[str, Any] = {
            "op": "claim",
            "consumer": consumer_id,
            "ok": ok,
            "host": host,
            "code": code,
            "reason": reason,
            "via": via,
            "what": what,
            "group": group,
            "pcpus": pcpus,
            "double": double,
            "attempts": retries,
            "t": time.time(),
        }
        if not ok:
            # Owned by this racer alone, so nobody else can change it before we look.
            event["held_after"] = holdings(self.ledger, consumer_id)
        self.events.append(event)
        return event

    def release(self, consumer_id: str, *, forget: bool, released: bool) -> None:
        self.events.append(
            {
                "op": "release",
                "consumer": consumer_id,
                "forget": forget,
                "released": released,
                "t": time.time(),
            }
        )

    def error(self, consumer_ids: list[str], exc: BaseException) -> None:
        self.events.append(
            {
                "op": "error",
                "consumers": consumer_ids,
                "error": "".join(traceback.format_exception(exc)),
                "t": time.time(),
            }
        )


# -- the scheduler racer -----------------------------------------------------------------


def run_scheduler(
    cfg: Mapping[str, Any], ledger: Ledger, log: Log, rng: random.Random
) -> dict[str, Any]:
    scheduler = Scheduler(ledger, seed=int(cfg["seed"]))
    scheduler.current_view()  # everyone starts from the same picture
    group_ids = [g["id"] for g in cfg["groups"]]
    held: dict[str, tuple[dict[str, Any], str | None]] = {}  # consumer -> (flavor, group)
    released: list[tuple[str, dict[str, Any], str | None]] = []
    wait_for_go(Path(cfg["barrier"]), "main", cfg["name"])
    go_at, started = time.time(), time.perf_counter()
    attempts = 0
    while attempts < cfg["attempts"]:
        batch: list[tuple[str, dict[str, Any], str | None]] = []
        for _ in range(min(rng.randint(1, cfg["batch_max"]), cfg["attempts"] - attempts)):
            if released and rng.random() < 0.5:
                batch.append(released.pop(rng.randrange(len(released))))
                continue
            group = rng.choice(group_ids) if rng.random() < cfg["group_share"] else None
            flavor = random_flavor(rng, pinned=rng.random() < cfg["pinned_share"])
            batch.append((new_consumer_id(rng), flavor, group))
        requests = [
            Request(consumer_id=c, instance_id=c, shape=shape_of(flavor_from(f)), group_id=g)
            for c, f, g in batch
        ]
        attempts += len(requests)
        try:
            placements = scheduler.schedule(requests)
        except Exception as exc:
            log.error([c for c, _, _ in batch], exc)
            continue
        for (consumer, flavor, group), placement in zip(batch, placements, strict=True):
            claim = placement.claim
            log.claim(
                consumer,
                ok=placement.ok,
                host=claim.host_id if claim is not None else None,
                code=placement.code.value if placement.code is not None else None,
                reason=placement.reason,
                pcpus=len(claim.fit.cpus) if claim is not None else 0,
                via="scheduler",
                what=flavor["name"],
                group=group,
                retries=placement.attempts,
            )
            if claim is not None:
                held[consumer] = (flavor, group)
        # Churn: give some capacity back, to be claimed again by someone, maybe us.
        while held and rng.random() < cfg["release_p"]:
            consumer = rng.choice(sorted(held))
            flavor, group = held.pop(consumer)
            forget = rng.random() < 0.5
            try:
                gone = ledger.release(consumer, forget=forget)
            except Exception as exc:
                log.error([consumer], exc)
                continue
            log.release(consumer, forget=forget, released=gone)
            released.append((consumer, flavor, group))
    return {
        "elapsed_s": time.perf_counter() - started,
        "go_at": go_at,
        "done_at": time.time(),
        "conflicts": scheduler.conflicts,
        "attempts": attempts,
    }


# -- the stale, raw racer ----------------------------------------------------------------


class StaleBelief:
    """The racer's picture of free pCPUs and cell memory: the view it loaded at start, less
    what it claimed itself, plus what it released itself. Others' claims stay invisible."""

    def __init__(self, view: View) -> None:
        self.view = view
        self.free: dict[int, HostFree] = {h.id: h.free for h in view.hosts.values()}
        self.fits: dict[str, tuple[int, Fit]] = {}

    def took(self, consumer_id: str, host_id: int, fit: Fit) -> None:
        self.free[host_id] = apply_fit(self.free[host_id], fit)
        self.fits[consumer_id] = (host_id, fit)

    def gave_back(self, consumer_id: str) -> None:
        host_id, fit = self.fits.pop(consumer_id)
        free = self.free[host_id]
        memory = dict(free.cell_memory_mb)
        for cell in fit.cells:
            memory[cell.host_cell] += cell.memory_mb
        self.free[host_id] = HostFree(free.cpus | fit.cpus, memory)


def pick_fit(
    rng: random.Random, shape: InstanceShape, host: HostState, believed: HostFree
) -> Fit | None:
    """A fit on this host: usually from the stale belief with some pCPUs randomly skipped,
    so racers pick different ones; failing that, from the host as it was at start."""
    for free in (
        HostFree(
            frozenset(c for c in believed.cpus if rng.random() < 0.7), believed.cell_memory_mb
        ),
        believed,
        host.free,
    ):
        fit = fit_instance(shape, host.topology, free)
        if not isinstance(fit, NoFit):
            return fit
    return None


def run_raw(cfg: Mapping[str, Any], ledger: Ledger, log: Log, rng: random.Random) -> dict[str, Any]:
    view = ledger.load_view()  # once: never refreshed
    belief = StaleBelief(view)
    hosts = sorted(view.hosts.values(), key=lambda h: h.id)
    group_ids = [g["id"] for g in cfg["groups"]]
    held: dict[str, tuple[dict[str, Any], str | None, int]] = {}  # consumer -> (..., host)
    released: list[tuple[str, dict[str, Any], str | None]] = []
    wait_for_go(Path(cfg["barrier"]), "main", cfg["name"])
    go_at, started = time.time(), time.perf_counter()
    attempts = calls = 0
    while attempts < cfg["attempts"]:
        planned: list[tuple[Claim, dict[str, Any], str | None, bool]] = []
        for _ in range(min(rng.randint(1, cfg["batch_max"]), cfg["attempts"] - attempts)):
            double = bool(held) and rng.random() < cfg["double_p"]
            if double:
                consumer = rng.choice(sorted(held))
                flavor, group, _ = held[consumer]
            elif released and rng.random() < 0.5:
                consumer, flavor, group = released.pop(rng.randrange(len(released)))
            else:
                consumer = new_consumer_id(rng)
                group = rng.choice(group_ids) if rng.random() < cfg["group_share"] else None
                flavor = random_flavor(rng, pinned=rng.random() < cfg["pinned_share"])
            shape = shape_of(flavor_from(flavor))
            if any(c.consumer_id == consumer for c, _, _, _ in planned):
                continue
            for host in rng.sample(hosts, len(hosts)):
                fit = pick_fit(rng, shape, host, belief.free[host.id])
                if fit is None:
                    continue
                slot = None
                if group is not None:
                    state = view.groups[group]
                    slot = rng.randrange(state.group.max_per_domain)
                claim = build_claim(consumer, shape, host, fit, view, group, slot)
                planned.append((claim, flavor, group, double))
                break
            # else: nothing fits even on an empty host (isolate with 4 vCPUs); drop it.
        if not planned:
            continue
        attempts += len(planned)
        calls += 1
        try:
            outcomes = ledger.claim([c for c, _, _, _ in planned])
        except Exception as exc:
            log.error([c.consumer_id for c, _, _, _ in planned], exc)
            continue
        for (claim, flavor, group, double), outcome in zip(planned, outcomes, strict=True):
            log.outcome(claim, outcome, via="raw", what=flavor["name"], group=group, double=double)
            if double:
                continue  # refused, or let through: the parent fails the run on that
            if outcome.ok:
                belief.took(claim.consumer_id, claim.host_id, claim.fit)
                held[claim.consumer_id] = (flavor, group, claim.host_id)
            else:
                released.append((claim.consumer_id, flavor, group))
        while held and rng.random() < cfg["release_p"]:
            consumer = rng.choice(sorted(held))
            flavor, group, _ = held.pop(consumer)
            forget = rng.random() < 0.5
            try:
                gone = ledger.release(consumer, forget=forget)
            except Exception as exc:
                log.error([consumer], exc)
                continue
            belief.gave_back(consumer)
            log.release(consumer, forget=forget, released=gone)
            released.append((consumer, flavor, group))
    return {
        "elapsed_s": time.perf_counter() - started,
        "go_at": go_at,
        "done_at": time.time(),
        "claim_calls": calls,
        "attempts": attempts,
    }


# -- the contender ------------------------------------------------------------------------


def run_contend(
    cfg: Mapping[str, Any], ledger: Ledger, log: Log, rng: random.Random
) -> dict[str, Any]:
    view = ledger.load_view()
    by_name = {h.name: h for h in view.hosts.values()}
    planned = []
    for phase in cfg["phases"]:
        host = by_name[phase["host"]]
        shape = shape_of(flavor_from(phase["flavor"]))
        fit = fit_instance(shape, host.topology, host.free)
        if isinstance(fit, NoFit):
            raise AssertionError(f"phase {phase['name']}: {fit.reason}")
        claim = build_claim(new_consumer_id(rng), shape, host, fit, view, phase.get("group"))
        planned.append((phase, claim))
    for phase, claim in planned:
        wait_for_go(Path(cfg["barrier"]), phase["name"], cfg["name"])
        go_at = time.time()
        try:
            [outcome] = ledger.claim([claim])
        except Exception as exc:
            log.error([claim.consumer_id], exc)
            continue
        answered_at = time.time()
        event = log.outcome(
            claim,
            outcome,
            via=f"contend:{phase['name']}",
            what=phase["flavor"]["name"],
            group=phase.get("group"),
        )
        event["pins"] = sorted(claim.fit.cpus)
        event["slots"] = [[s.group_id, s.domain, s.slot] for s in claim.slots]
        event["go_at"] = go_at
        event["answered_at"] = answered_at
    return {}


ROLES = {"scheduler": run_scheduler, "raw": run_raw, "contend": run_contend}


def main(config_path: str) -> int:
    cfg = json.loads(Path(config_path).read_text())
    rng = random.Random(cfg["seed"])
    ledger = Ledger.open(cfg["url"], upgrade=False)
    log = Log(ledger)
    try:
        stats = ROLES[cfg["role"]](cfg, ledger, log, rng)
    finally:
        ledger.close()
    out = {"name": cfg["name"], "role": cfg["role"], "stats": stats, "events": log.events}
    tmp = Path(cfg["out"]).with_suffix(".part")
    tmp.write_text(json.dumps(out))
    tmp.rename(cfg["out"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
