"""Filter plugins, each small: a host passes or is rejected with a reason."""

from __future__ import annotations

from stowage.domain.groups import HOST_DOMAIN, GroupPolicy, domain_of, group_allows
from stowage.domain.numa import NoFit, exact_by_precheck, fit_instance, precheck
from stowage.domain.topology import ResourceClass
from stowage.scheduling.framework import CycleState, Filter, Request
from stowage.scheduling.view import HostState, View

__all__ = [
    "AggregateExtraSpecsFilter",
    "AvailabilityZoneFilter",
    "ComputeFilter",
    "CpuFilter",
    "DifferentHostFilter",
    "DiskFilter",
    "FailureDomainFilter",
    "ImagePropertiesFilter",
    "NumaTopologyFilter",
    "RamFilter",
    "SameHostFilter",
    "ServerGroupFilter",
    "default_filters",
]


class ComputeFilter:
    """The host's service is up (heartbeat recent, not forced down) and enabled."""

    name = "compute"

    def __init__(self, service_down_time_s: float = 60.0) -> None:
        self.service_down_time_s = service_down_time_s

    def prefilter(self, request: Request, view: View, state: CycleState) -> bool:
        return True

    def filter(self, request: Request, host: HostState, state: CycleState) -> str | None:
        if host.disabled:
            return "compute service is disabled"
        if host.forced_down:
            return "compute service is forced down"
        if host.last_seen is None or state.now - host.last_seen > self.service_down_time_s:
            return "compute service is down (no recent heartbeat)"
        return None


class AvailabilityZoneFilter:
    name = "availability_zone"

    def prefilter(self, request: Request, view: View, state: CycleState) -> bool:
        return request.availability_zone is not None or request.force_host is not None

    def filter(self, request: Request, host: HostState, state: CycleState) -> str | None:
        if request.force_host is not None and host.name != request.force_host:
            return f"not the requested host {request.force_host}"
        zone = request.availability_zone
        if zone and host.availability_zone != zone:
            return f"in zone {host.availability_zone}, not {zone}"
        return None


_MEMORY_MB = ResourceClass.MEMORY_MB
_VCPU = ResourceClass.VCPU
_PCPU = ResourceClass.PCPU
_DISK_GB = ResourceClass.DISK_GB


def _lacks(host: HostState, rc: ResourceClass, amount: int) -> str | None:
    # The common case (room, within max_unit) in one expression; the reason only on a miss.
    if amount <= 0 or (
        host.capacity.get(rc, 0) - host.used.get(rc, 0) >= amount
        and amount <= host.max_unit.get(rc, 0)
    ):
        return None
    free = host.capacity.get(rc, 0) - host.used.get(rc, 0)
    if free < amount:
        return f"need {amount} {rc.value}, {max(free, 0)} free"
    return f"need {amount} {rc.value}, host allows at most {host.max_unit.get(rc, 0)} each"


class RamFilter:
    name = "ram"

    def prefilter(self, request: Request, view: View, state: CycleState) -> bool:
        return True

    def filter(self, request: Request, host: HostState, state: CycleState) -> str | None:
        return _lacks(host, _MEMORY_MB, request.shape.memory_mb)


class CpuFilter:
    """Shared vCPUs against VCPU (with overcommit); dedicated ones against PCPU."""

    name = "cpu"

    def prefilter(self, request: Request, view: View, state: CycleState) -> bool:
        return True

    def filter(self, request: Request, host: HostState, state: CycleState) -> str | None:
        shape = request.shape
        dedicated = len(shape.dedicated_vcpus)
        if dedicated:
            return _lacks(host, _VCPU, shape.vcpus - dedicated) or _lacks(host, _PCPU, dedicated)
        return _lacks(host, _VCPU, shape.vcpus)


class DiskFilter:
    name = "disk"

    def prefilter(self, request: Request, view: View, state: CycleState) -> bool:
        return request.shape.disk_gb > 0

    def filter(self, request: Request, host: HostState, state: CycleState) -> str | None:
        return _lacks(host, _DISK_GB, request.shape.disk_gb)


class NumaTopologyFilter:
    """Finds exact cells and pCPUs; the fit is kept so the claim commits what was checked.

    Where a cheap count is exact (one guest cell, prefer policy), the exact fit waits for
    the host the pipeline picks.
    """

    name = "numa_topology"

    def prefilter(self, request: Request, view: View, state: CycleState) -> bool:
        state.values["numa_deferred"] = exact_by_precheck(request.shape)
        return request.shape.numa

    def filter(self, request: Request, host: HostState, state: CycleState) -> str | None:
        reason = precheck(request.shape, host.topology, host.free)
        if reason is not None or state.values["numa_deferred"]:
            return reason
        fit = fit_instance(request.shape, host.topology, host.free)
        if isinstance(fit, NoFit):
            return fit.reason
        if len(fit.cpus) > host.free_amount(ResourceClass.PCPU):
            return f"need {len(fit.cpus)} PCPU with withheld siblings, fewer free"
        state.fits[host.id] = fit
        return None


class ServerGroupFilter:
    """Nova's affinity and anti-affinity (per host, with max_server_per_host)."""

    name = "server_group"

    def prefilter(self, request: Request, view: View, state: CycleState) -> bool:
        group = state.group
        if group is None:
            return False
        policy = group.group.policy
        if policy is GroupPolicy.AFFINITY:
            # Members' hosts by name, so a rejection names where the members run.
            state.values["affinity_hosts"] = {
                view.hosts[h].name: n for h, n in group.per_host.items() if h in view.hosts
            }
            return True
        return policy is GroupPolicy.ANTI_AFFINITY and group.group.failure_domain == HOST_DOMAIN

    def filter(self, request: Request, host: HostState, state: CycleState) -> str | None:
        group = state.group
        assert group is not None
        if group.group.policy is GroupPolicy.AFFINITY:
            names: dict[str, int] = state.values["affinity_hosts"]  # type: ignore[assignment]
            return group_allows(group.group, host.name, None, names, {})
        domain = domain_of(group.group, host.name, host.labels)
        return group_allows(group.group, host.id, domain, group.per_host, group.per_domain)


class FailureDomainFilter:
    """Anti-affinity over a host label (racks, rows, power feeds): a Stowage extension."""

    name = "failure_domain"

    def prefilter(self, request: Request, view: View, state: CycleState) -> bool:
        group = state.group
        return (
            group is not None
            and group.group.policy is GroupPolicy.ANTI_AFFINITY
            and group.group.failure_domain != HOST_DOMAIN
        )

    def filter(self, request: Request, host: HostState, state: CycleState) -> str | None:
        group = state.group
        assert group is not None
        domain = domain_of(group.group, host.name, host.labels)
        return group_allows(group.group, host.name, domain, {}, group.per_domain)


class SameHostFilter:
    name = "same_host"

    def prefilter(self, request: Request, view: View, state: CycleState) -> bool:
        return bool(request.same_host)

    def filter(self, request: Request, host: HostState, state: CycleState) -> str | None:
        return None if host.id in request.same_host else "not a host of the same_host instances"


class DifferentHostFilter:
    name = "different_host"

    def prefilter(self, request: Request, view: View, state: CycleState) -> bool:
        return bool(request.different_host) or bool(request.ignore_hosts)

    def filter(self, request: Request, host: HostState, state: CycleState) -> str | None:
        if host.id in request.ignore_hosts:
            return "the instance's current host"
        if host.id in request.different_host:
            return "runs one of the different_host instances"
        return None


# Image property -> host attribute it must match (Nova's ImagePropertiesFilter).
_IMAGE_PROPS = {
    "hw_architecture": "architecture",
    "architecture": "architecture",
    "img_hv_type": "hypervisor_type",
    "hypervisor_type": "hypervisor_type",
}


class ImagePropertiesFilter:
    name = "image_properties"

    def prefilter(self, request: Request, view: View, state: CycleState) -> bool:
        return any(k in _IMAGE_PROPS for k in request.image_properties)

    def filter(self, request: Request, host: HostState, state: CycleState) -> str | None:
        for prop, attr in _IMAGE_PROPS.items():
            wanted = request.image_properties.get(prop)
            if wanted is None:
                continue
            have = getattr(host, attr)
            if wanted.lower() != have.lower():
                return f"image wants {prop}={wanted}, host has {have}"
        return None


_AGG_PREFIX = "aggregate_instance_extra_specs:"


class AggregateExtraSpecsFilter:
    """Flavor specs scoped `aggregate_instance_extra_specs:` must match aggregate metadata."""

    name = "aggregate_extra_specs"

    def prefilter(self, request: Request, view: View, state: CycleState) -> bool:
        return any(k.startswith(_AGG_PREFIX) for k in request.extra_specs)

    def filter(self, request: Request, host: HostState, state: CycleState) -> str | None:
        for key, wanted in request.extra_specs.items():
            if not key.startswith(_AGG_PREFIX):
                continue
            name = key[len(_AGG_PREFIX) :]
            values = host.aggregate_metadata.get(name, frozenset())
            if wanted not in values:
                return f"no aggregate of the host has {name}={wanted}"
        return None


def default_filters(service_down_time_s: float = 60.0) -> list[Filter]:
    """Cheap, selective filters first; the NUMA fit last, on the few hosts left."""
    return [
        ComputeFilter(service_down_time_s),
        AvailabilityZoneFilter(),
        SameHostFilter(),
        DifferentHostFilter(),
        RamFilter(),
        CpuFilter(),
        DiskFilter(),
        ImagePropertiesFilter(),
        AggregateExtraSpecsFilter(),
        ServerGroupFilter(),
        FailureDomainFilter(),
        NumaTopologyFilter(),
    ]
