"""Capacity what-if: if a host failed, would its instances find a place, and what room is left.

Everything happens in memory, on a view read from the ledger and never written back. The
failed host leaves the view with what it contributes to groups (its instances' claims are
released there), its instances are planned together as an evacuation would plan them (groups
and pinning honoured, one plan), that plan is applied to the view, and then each public
flavor is placed on a copy of the result, greedily, until a host refuses or a bound is hit.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from stowage.domain.claims import ConsumerKind
from stowage.domain.errors import NotFound, StowageError
from stowage.ledger.ledger import Ledger
from stowage.scheduling.framework import Request
from stowage.scheduling.pipeline import Pipeline
from stowage.scheduling.view import View
from stowage.services.cloud import Cloud
from stowage.services.compute import shape_of_flavor
from stowage.services.dashboard import host_labels

__all__ = [
    "CapacityReport",
    "FlavorRoom",
    "InstancePlan",
    "capacity_if_domain_fails",
    "capacity_if_host_fails",
    "evacuation_request",
    "what_if_host_fails",
    "what_if_hosts_fail",
]

# At most this many more instances are counted per flavor; more is reported as `capped`.
FLAVOR_COUNT_MAX = 1000
_CONSUMER_PREFIX = "what-if:"


@dataclass(frozen=True, slots=True)
class InstancePlan:
    """One instance of the failed host: where it would go, or why it could not."""

    instance_id: str
    name: str
    flavor: str
    host: str | None
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.host is not None


@dataclass(frozen=True, slots=True)
class FlavorRoom:
    """How many more instances of a flavor fit once the failed host's instances are placed."""

    flavor_id: str
    name: str
    count: int
    capped: bool = False  # the count stopped at the bound; more may fit
    reason: str = ""  # why one more does not fit (empty when capped)


@dataclass(frozen=True, slots=True)
class CapacityReport:
    host: str
    instances: tuple[InstancePlan, ...]
    flavors: tuple[FlavorRoom, ...]

    @property
    def fits(self) -> bool:
        """True when every instance of the failed host would find a place."""
        return all(p.ok for p in self.instances)

    def to_dict(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "fits": self.fits,
            "instances": [
                {
                    "server_id": p.instance_id,
                    "name": p.name,
                    "flavor": p.flavor,
                    "host": p.host,
                    "reason": p.reason,
                }
                for p in self.instances
            ],
            "flavors": [
                {
                    "id": f.flavor_id,
                    "name": f.name,
                    "count": f.count,
                    "capped": f.capped,
                    "reason": f.reason,
                }
                for f in self.flavors
            ],
        }


def evacuation_request(body: Mapping[str, Any], source_id: int) -> Request:
    """The request an evacuation makes for an instance document (see `migrations._start`)."""
    flavor = body["flavor"]
    return Request(
        consumer_id=_CONSUMER_PREFIX + body["id"],
        instance_id=body["id"],
        shape=shape_of_flavor(flavor),
        kind=ConsumerKind.MIGRATION,
        project_id=body.get("project_id", ""),
        user_id=body.get("user_id", ""),
        group_id=body.get("group_id"),
        ignore_hosts=frozenset({source_id}),
        extra_specs=dict(flavor.get("extra_specs") or {}),
    )


def what_if_host_fails(
    ledger: Ledger,
    host: str,
    instances: Sequence[Mapping[str, Any]],
    flavors: Sequence[Mapping[str, Any]],
    *,
    now: float,
    pipeline: Pipeline | None = None,
    count_max: int = FLAVOR_COUNT_MAX,
) -> CapacityReport:
    """Plan `instances` (documents of the instances on `host`) as if `host` were gone, then
    count the room left per flavor (compute API flavor documents). Reads the ledger only."""
    return what_if_hosts_fail(
        ledger, host, [host], instances, flavors, now=now, pipeline=pipeline, count_max=count_max
    )


def what_if_hosts_fail(
    ledger: Ledger,
    label: str,
    failed: Sequence[str],
    instances: Sequence[Mapping[str, Any]],
    flavors: Sequence[Mapping[str, Any]],
    *,
    now: float,
    pipeline: Pipeline | None = None,
    count_max: int = FLAVOR_COUNT_MAX,
) -> CapacityReport:
    """`what_if_host_fails` for several hosts at once (a rack): all of them leave the view,
    and all their instances are planned together; the report is named `label`."""
    source_ids = {name: ledger.host_id(name) for name in failed}  # NotFound for an unknown one
    pipeline = pipeline or Pipeline(rng=random.Random(0))
    view = ledger.load_view()
    for host_id in source_ids.values():
        view.remove_host(host_id)
    plans = _plan_instances(pipeline, view, source_ids, instances, now)
    rooms = tuple(_room_for(pipeline, view, flavor, now, count_max) for flavor in flavors)
    return CapacityReport(label, plans, rooms)


def capacity_if_host_fails(cloud: Cloud, host: str) -> CapacityReport:
    """The what-if for a running cloud: its instances on `host`, its public flavors."""
    try:
        cloud.ledger.host_id(host)
    except NotFound:
        raise NotFound(f"Compute host {host} could not be found.") from None
    return _what_if(cloud, host, [host])


def capacity_if_domain_fails(cloud: Cloud, label: str, value: str) -> CapacityReport:
    """The what-if of a whole failure domain: every host whose `label` is `value` (a rack,
    say: `rack`, `r1`), named `label=value` in the report."""
    failed = [
        name for name, labels in sorted(host_labels(cloud).items()) if labels.get(label) == value
    ]
    if not failed:
        raise NotFound(f"No compute host has {label}={value}.")
    return _what_if(cloud, f"{label}={value}", failed)


def _what_if(cloud: Cloud, label: str, failed: Sequence[str]) -> CapacityReport:
    gone = set(failed)
    instances = [d.body for d in cloud.objects.list("instance") if d.body.get("host") in gone]
    flavors = sorted(
        (d.body for d in cloud.objects.list("flavor") if d.body.get("is_public", True)),
        key=lambda f: (int(f.get("ram", 0)), int(f.get("vcpus", 0)), str(f.get("name", ""))),
    )
    live = cloud.scheduler.pipeline
    # Same filters and weighers as the scheduler, with a generator of its own.
    pipeline = Pipeline(live.filters, live.weighers, rng=random.Random(0))
    return what_if_hosts_fail(
        cloud.ledger, label, failed, instances, flavors, now=cloud.clock(), pipeline=pipeline
    )


def _plan_instances(
    pipeline: Pipeline,
    view: View,
    source_ids: Mapping[str, int],
    instances: Sequence[Mapping[str, Any]],
    now: float,
) -> tuple[InstancePlan, ...]:
    """One plan for all the instances, applied to `view`, as an evacuation would make it."""
    requests: list[Request] = []
    plans: dict[int, InstancePlan] = {}
    index_of: list[int] = []
    for index, body in enumerate(instances):
        try:
            # Its own failed host (the first when the document names none of them).
            source_id = source_ids.get(str(body.get("host")), next(iter(source_ids.values())))
            request = evacuation_request(body, source_id)
        except StowageError as exc:
            plans[index] = _plan(body, None, f"its flavor cannot be scheduled: {exc}")
            continue
        if request.group_id is not None and request.group_id not in view.groups:
            plans[index] = _plan(body, None, f"its server group {request.group_id} is gone")
            continue
        requests.append(request)
        index_of.append(index)
    names = {h.id: h.name for h in view.hosts.values()}
    for index, decision in zip(index_of, pipeline.plan(view, requests, now), strict=True):
        body = instances[index]
        if decision.claim is not None:
            plans[index] = _plan(body, names[decision.claim.host_id])
        else:
            diagnosis = decision.diagnosis
            reason = diagnosis.explain() if diagnosis else "No valid host was found."
            plans[index] = _plan(body, None, reason)
    return tuple(plans[i] for i in range(len(instances)))


def _plan(body: Mapping[str, Any], host: str | None, reason: str = "") -> InstancePlan:
    flavor = body.get("flavor") or {}
    name = str(flavor.get("original_name") or flavor.get("name") or "")
    return InstancePlan(str(body["id"]), str(body.get("name", "")), name, host, reason)


def _room_for(
    pipeline: Pipeline, view: View, flavor: Mapping[str, Any], now: float, count_max: int
) -> FlavorRoom:
    """Greedy place-until-refused of one flavor on a copy of `view`, host by host.

    Without groups, a host's refusal depends on that host alone, so filling each host in turn
    ends where a cloud-wide greedy fill ends, at a cost per placement that does not grow with
    the number of hosts.
    """
    flavor_id, name = str(flavor.get("id", "")), str(flavor.get("name", ""))
    try:
        shape = shape_of_flavor(flavor)
    except StowageError as exc:
        return FlavorRoom(flavor_id, name, 0, reason=f"the flavor cannot be scheduled: {exc}")
    request = Request(
        consumer_id=f"{_CONSUMER_PREFIX}flavor:{flavor_id}",
        instance_id=f"{_CONSUMER_PREFIX}flavor:{flavor_id}",
        shape=shape,
        extra_specs=dict(flavor.get("extra_specs") or {}),
    )
    room = _copy_hosts(view)
    count = 0
    for host_id in sorted(room.hosts):
        single = View()
        single.hosts[host_id] = room.hosts[host_id]  # shared: claims here show in `room`
        while count < count_max:
            decision = pipeline.decide(single, request, now)
            if decision.claim is None:
                break
            single.apply_claim(decision.claim)
            count += 1
    if count >= count_max:
        return FlavorRoom(flavor_id, name, count, capped=True)
    last = pipeline.decide(room, request, now)
    reason = last.diagnosis.explain() if last.diagnosis else ""
    return FlavorRoom(flavor_id, name, count, reason=reason)


def _copy_hosts(view: View) -> View:
    """The view's hosts, each copied where a claim changes it in place; no groups."""
    copy = View()
    for host_id, host in view.hosts.items():
        copy.hosts[host_id] = dataclasses.replace(host, used=dict(host.used))
    return copy
