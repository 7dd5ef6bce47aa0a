"""Flavors and the instance shape their extra specs describe (Nova's hw: keys)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TypeVar

from stowage.domain.errors import InvalidSpec
from stowage.domain.topology import ResourceClass, parse_cpu_set

__all__ = [
    "CpuPolicy",
    "Flavor",
    "GuestCell",
    "InstanceShape",
    "ThreadPolicy",
    "shape_of",
]


E = TypeVar("E", bound=StrEnum)


class CpuPolicy(StrEnum):
    SHARED = "shared"
    DEDICATED = "dedicated"
    MIXED = "mixed"


class ThreadPolicy(StrEnum):
    PREFER = "prefer"
    ISOLATE = "isolate"
    REQUIRE = "require"


# hw: keys Stowage acts on; the others Nova accepts are listed so they pass validation.
_HW_ACTED = {
    "hw:cpu_policy",
    "hw:cpu_thread_policy",
    "hw:cpu_dedicated_mask",
    "hw:numa_nodes",
}
_HW_ACTED_PREFIXES = ("hw:numa_cpus.", "hw:numa_mem.")
_HW_ACCEPTED = {
    "hw:boot_menu",
    "hw:cpu_cores",
    "hw:cpu_max_cores",
    "hw:cpu_max_sockets",
    "hw:cpu_max_threads",
    "hw:cpu_realtime",
    "hw:cpu_realtime_mask",
    "hw:cpu_sockets",
    "hw:cpu_threads",
    "hw:emulator_threads_policy",
    "hw:hide_hypervisor_id",
    "hw:machine_type",
    "hw:mem_encryption",
    "hw:mem_page_size",
    "hw:pmu",
    "hw:serial_port_count",
    "hw:tpm_model",
    "hw:tpm_version",
    "hw:vif_multiqueue_enabled",
    "hw:watchdog_action",
}
# Namespaces other services or filters own; Stowage passes them through.
_FOREIGN_NAMESPACES = (
    "aggregate_instance_extra_specs:",
    "capabilities:",
    "hw_rng:",
    "hw_video:",
    "os:",
    "pci_passthrough:",
    "quota:",
    "resources",
    "trait:",
    "accel:",
    "vmware:",
    "group_policy",
)


@dataclass(frozen=True, slots=True)
class Flavor:
    """A flavor as the compute API defines it."""

    name: str
    vcpus: int
    memory_mb: int
    disk_gb: int = 0
    extra_specs: Mapping[str, str] = field(default_factory=dict)
    id: str = ""
    ephemeral_gb: int = 0
    swap_mb: int = 0


@dataclass(frozen=True, slots=True)
class GuestCell:
    """One guest NUMA cell: which guest vCPUs it holds, which of them are dedicated, its memory."""

    id: int
    vcpus: frozenset[int]
    dedicated: frozenset[int]
    memory_mb: int

    @property
    def shared(self) -> frozenset[int]:
        return self.vcpus - self.dedicated


@dataclass(frozen=True, slots=True)
class InstanceShape:
    """What an instance needs from a host, parsed once from its flavor."""

    vcpus: int
    memory_mb: int
    disk_gb: int
    cpu_policy: CpuPolicy = CpuPolicy.SHARED
    thread_policy: ThreadPolicy = ThreadPolicy.PREFER
    dedicated_vcpus: frozenset[int] = frozenset()
    cells: tuple[GuestCell, ...] = ()

    @property
    def numa(self) -> bool:
        """True when the instance is bound to host NUMA cells (pinned or hw:numa_nodes)."""
        return bool(self.cells)

    def amounts(self) -> dict[ResourceClass, int]:
        """Non-zero amounts before pinning. PCPU is a lower bound: isolate adds siblings."""
        out = {ResourceClass.MEMORY_MB: self.memory_mb}
        if self.disk_gb:
            out[ResourceClass.DISK_GB] = self.disk_gb
        shared = self.vcpus - len(self.dedicated_vcpus)
        if shared:
            out[ResourceClass.VCPU] = shared
        if self.dedicated_vcpus:
            out[ResourceClass.PCPU] = len(self.dedicated_vcpus)
        return out


def shape_of(flavor: Flavor) -> InstanceShape:
    """Validate a flavor's extra specs and derive the instance shape, naming any bad key."""
    if flavor.vcpus < 1:
        raise InvalidSpec(f"flavor {flavor.name!r}: vcpus must be at least 1")
    if flavor.memory_mb < 1:
        raise InvalidSpec(f"flavor {flavor.name!r}: ram must be at least 1 MB")
    if flavor.disk_gb < 0:
        raise InvalidSpec(f"flavor {flavor.name!r}: disk must not be negative")
    specs = flavor.extra_specs
    _reject_unknown_keys(specs)
    policy = _enum(specs, "hw:cpu_policy", CpuPolicy, CpuPolicy.SHARED)
    threads = _enum(specs, "hw:cpu_thread_policy", ThreadPolicy, ThreadPolicy.PREFER)
    if "hw:cpu_thread_policy" in specs and policy is CpuPolicy.SHARED:
        raise InvalidSpec(
            "hw:cpu_thread_policy: a thread policy needs hw:cpu_policy dedicated or mixed"
        )
    all_vcpus = frozenset(range(flavor.vcpus))
    dedicated = _dedicated_vcpus(specs, policy, all_vcpus)
    cells = _guest_cells(flavor, specs, dedicated)
    if not cells and policy is not CpuPolicy.SHARED:
        # Nova gives every pinned instance an implicit single NUMA cell.
        cells = (GuestCell(0, all_vcpus, dedicated, flavor.memory_mb),)
    return InstanceShape(
        vcpus=flavor.vcpus,
        memory_mb=flavor.memory_mb,
        disk_gb=flavor.disk_gb + flavor.ephemeral_gb,
        cpu_policy=policy,
        thread_policy=threads,
        dedicated_vcpus=dedicated,
        cells=cells,
    )


def _reject_unknown_keys(specs: Mapping[str, str]) -> None:
    for key in specs:
        if key.startswith("hw:"):
            if key in _HW_ACTED or key in _HW_ACCEPTED or key.startswith(_HW_ACTED_PREFIXES):
                continue
            raise InvalidSpec(f"{key}: unknown extra spec in the hw: namespace")
        if key.startswith("hw_") and not key.startswith(("hw_rng:", "hw_video:")):
            raise InvalidSpec(f"{key}: looks like an image property; flavor extra specs use hw:")


def _enum(specs: Mapping[str, str], key: str, kind: type[E], default: E) -> E:
    raw = specs.get(key)
    if raw is None:
        return default
    try:
        return kind(raw.strip().lower())
    except ValueError:
        allowed = ", ".join(m.value for m in kind)
        raise InvalidSpec(f"{key}: {raw!r} is not one of {allowed}") from None


def _int(specs: Mapping[str, str], key: str, *, minimum: int) -> int:
    raw = specs[key]
    try:
        value = int(raw)
    except ValueError:
        raise InvalidSpec(f"{key}: {raw!r} is not a whole number") from None
    if value < minimum:
        raise InvalidSpec(f"{key}: must be at least {minimum}, got {value}")
    return value


def _dedicated_vcpus(
    specs: Mapping[str, str], policy: CpuPolicy, all_vcpus: frozenset[int]
) -> frozenset[int]:
    mask = specs.get("hw:cpu_dedicated_mask")
    if policy is CpuPolicy.SHARED:
        if mask is not None:
            raise InvalidSpec("hw:cpu_dedicated_mask: only valid with hw:cpu_policy=mixed")
        return frozenset()
    if policy is CpuPolicy.DEDICATED:
        if mask is not None:
            raise InvalidSpec("hw:cpu_dedicated_mask: only valid with hw:cpu_policy=mixed")
        return all_vcpus
    if mask is None:
        raise InvalidSpec("hw:cpu_dedicated_mask: required with hw:cpu_policy=mixed")
    dedicated = parse_cpu_set(mask, what="hw:cpu_dedicated_mask", universe=all_vcpus)
    if not dedicated <= all_vcpus:
        raise InvalidSpec(f"hw:cpu_dedicated_mask: {mask!r} names vCPUs the flavor does not have")
    if not dedicated or dedicated == all_vcpus:
        raise InvalidSpec(
            f"hw:cpu_dedicated_mask: {mask!r} must leave at least one dedicated and one shared vCPU"
        )
    return dedicated


def _guest_cells(
    flavor: Flavor, specs: Mapping[str, str], dedicated: frozenset[int]
) -> tuple[GuestCell, ...]:
    explicit_cpus = {k for k in specs if k.startswith("hw:numa_cpus.")}
    explicit_mem = {k for k in specs if k.startswith("hw:numa_mem.")}
    if "hw:numa_nodes" not in specs:
        stray = sorted(explicit_cpus | explicit_mem)
        if stray:
            raise InvalidSpec(f"{stray[0]}: needs hw:numa_nodes")
        return ()
    nodes = _int(specs, "hw:numa_nodes", minimum=1)
    if nodes > flavor.vcpus:
        raise InvalidSpec(f"hw:numa_nodes: {nodes} cells for only {flavor.vcpus} vCPUs")
    for key in sorted(explicit_cpus | explicit_mem):
        index = key.rsplit(".", 1)[1]
        # ASCII digits in canonical form only: "01" or "²" would name no cell or crash int().
        canonical = index.isascii() and index.isdigit() and str(int(index)) == index
        if not canonical or int(index) >= nodes:
            raise InvalidSpec(f"{key}: no such guest cell with hw:numa_nodes={nodes}")
    if explicit_cpus or explicit_mem:
        cpu_sets, mems = _explicit_cells(flavor, specs, nodes)
    else:
        if flavor.vcpus % nodes or flavor.memory_mb % nodes:
            raise InvalidSpec(
                f"hw:numa_nodes: {flavor.vcpus} vCPUs and {flavor.memory_mb} MB do not split "
                f"evenly over {nodes} cells; give hw:numa_cpus.N and hw:numa_mem.N"
            )
        per_cell = flavor.vcpus // nodes
        cpu_sets = [frozenset(range(i * per_cell, (i + 1) * per_cell)) for i in range(nodes)]
        mems = [flavor.memory_mb // nodes] * nodes
    return tuple(
        GuestCell(i, cpus, cpus & dedicated, mem)
        for i, (cpus, mem) in enumerate(zip(cpu_sets, mems, strict=True))
    )


def _explicit_cells(
    flavor: Flavor, specs: Mapping[str, str], nodes: int
) -> tuple[list[frozenset[int]], list[int]]:
    cpu_sets: list[frozenset[int]] = []
    mems: list[int] = []
    seen: set[int] = set()
    for i in range(nodes):
        cpus_key, mem_key = f"hw:numa_cpus.{i}", f"hw:numa_mem.{i}"
        if cpus_key not in specs:
            raise InvalidSpec(f"{cpus_key}: missing; every guest cell needs its CPUs")
        if mem_key not in specs:
            raise InvalidSpec(f"{mem_key}: missing; every guest cell needs its memory")
        cpus = parse_cpu_set(specs[cpus_key], what=cpus_key)
        if not cpus:
            raise InvalidSpec(f"{cpus_key}: a guest cell needs at least one vCPU")
        if max(cpus) >= flavor.vcpus:
            raise InvalidSpec(f"{cpus_key}: names vCPU {max(cpus)}, flavor has {flavor.vcpus}")
        if cpus & seen:
            raise InvalidSpec(f"{cpus_key}: vCPUs {sorted(cpus & seen)} are in another cell too")
        seen |= cpus
        cpu_sets.append(cpus)
        mems.append(_int(specs, mem_key, minimum=1))
    if len(seen) != flavor.vcpus:
        missing = sorted(set(range(flavor.vcpus)) - seen)
        raise InvalidSpec(f"hw:numa_cpus.N: vCPUs {missing} are in no guest cell")
    if sum(mems) != flavor.memory_mb:
        raise InvalidSpec(
            f"hw:numa_mem.N: cells add up to {sum(mems)} MB, the flavor has {flavor.memory_mb} MB"
        )
    return cpu_sets, mems
