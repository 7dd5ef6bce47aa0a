"""Hosts as the ledger knows them: NUMA cells, pCPUs with thread siblings, CPU sets, inventories."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from stowage.domain.errors import InvalidSpec

__all__ = [
    "DEFAULT_ALLOCATION_RATIOS",
    "Cell",
    "HostSpec",
    "HostTopology",
    "ResourceClass",
    "format_cpu_set",
    "parse_cpu_set",
]


class ResourceClass(StrEnum):
    """Placement's standard resource classes that Stowage accounts for."""

    VCPU = "VCPU"
    PCPU = "PCPU"
    MEMORY_MB = "MEMORY_MB"
    DISK_GB = "DISK_GB"


# Nova's initial_*_allocation_ratio defaults; PCPU is never overcommitted.
DEFAULT_ALLOCATION_RATIOS: Mapping[ResourceClass, float] = {
    ResourceClass.VCPU: 4.0,
    ResourceClass.PCPU: 1.0,
    ResourceClass.MEMORY_MB: 1.0,
    ResourceClass.DISK_GB: 1.0,
}


@dataclass(frozen=True, slots=True)
class Cell:
    """One NUMA cell: its logical CPUs and its memory."""

    id: int
    cpus: frozenset[int]
    memory_mb: int


@dataclass(frozen=True, slots=True)
class HostTopology:
    """The physical layout of one host and how its CPUs are split between dedicated and shared."""

    cells: tuple[Cell, ...]
    siblings: Mapping[int, frozenset[int]]
    cpu_dedicated_set: frozenset[int]
    cpu_shared_set: frozenset[int]
    # Derived once: per cell, its cores (a CPU with its siblings), sorted by lowest id.
    cores_by_cell: Mapping[int, tuple[frozenset[int], ...]] = field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        all_cpus: set[int] = set()
        for cell in self.cells:
            if all_cpus & cell.cpus:
                raise InvalidSpec(f"cell {cell.id} repeats CPUs of another cell")
            all_cpus |= cell.cpus
        if self.cpu_dedicated_set & self.cpu_shared_set:
            overlap = format_cpu_set(self.cpu_dedicated_set & self.cpu_shared_set)
            raise InvalidSpec(f"cpu_dedicated_set and cpu_shared_set overlap on {overlap}")
        unknown = (self.cpu_dedicated_set | self.cpu_shared_set) - all_cpus
        if unknown:
            raise InvalidSpec(
                f"CPU sets name CPUs the host does not have: {format_cpu_set(unknown)}"
            )
        cores: dict[int, tuple[frozenset[int], ...]] = {}
        for cell in self.cells:
            seen: set[frozenset[int]] = set()
            for cpu in sorted(cell.cpus):
                seen.add(self.core_of(cpu))
            cores[cell.id] = tuple(sorted(seen, key=min))
        object.__setattr__(self, "cores_by_cell", cores)

    @classmethod
    def uniform(
        cls,
        *,
        cells: int = 2,
        cores_per_cell: int = 16,
        threads_per_core: int = 2,
        memory_mb_per_cell: int = 65536,
        dedicated_cores_per_cell: int | None = None,
    ) -> HostTopology:
        """A symmetric host numbered the way Linux numbers Intel CPUs (siblings N apart).

        The first `dedicated_cores_per_cell` cores of each cell (default: half) go to
        `cpu_dedicated_set`, the rest to `cpu_shared_set`.
        """
        if cells < 1 or cores_per_cell < 1 or threads_per_core < 1:
            raise InvalidSpec("a host needs at least one cell, core and thread")
        if dedicated_cores_per_cell is None:
            dedicated_cores_per_cell = cores_per_cell // 2
        stride = cells * cores_per_cell
        cell_list: list[Cell] = []
        siblings: dict[int, frozenset[int]] = {}
        dedicated: set[int] = set()
        shared: set[int] = set()
        for c in range(cells):
            cell_cpus: set[int] = set()
            for k in range(cores_per_cell):
                core = frozenset(
                    t * stride + c * cores_per_cell + k for t in range(threads_per_core)
                )
                for cpu in core:
                    siblings[cpu] = core - {cpu}
                cell_cpus |= core
                (dedicated if k < dedicated_cores_per_cell else shared).update(core)
            cell_list.append(Cell(c, frozenset(cell_cpus), memory_mb_per_cell))
        return cls(tuple(cell_list), siblings, frozenset(dedicated), frozenset(shared))

    @property
    def memory_mb(self) -> int:
        return sum(cell.memory_mb for cell in self.cells)

    def cell_of(self, cpu: int) -> int:
        for cell in self.cells:
            if cpu in cell.cpus:
                return cell.id
        raise InvalidSpec(f"CPU {cpu} is in no cell")

    def core_of(self, cpu: int) -> frozenset[int]:
        """The CPU and its thread siblings."""
        return self.siblings.get(cpu, frozenset()) | {cpu}

    @property
    def threads_per_core(self) -> int:
        return max((len(s) + 1 for s in self.siblings.values()), default=1)


@dataclass(frozen=True, slots=True)
class HostSpec:
    """Everything the ledger records about a host when it registers."""

    name: str
    topology: HostTopology
    disk_gb: int = 1000
    reserved: Mapping[ResourceClass, int] = field(default_factory=dict)
    allocation_ratios: Mapping[ResourceClass, float] = field(
        default_factory=lambda: dict(DEFAULT_ALLOCATION_RATIOS)
    )
    availability_zone: str = "nova"
    labels: Mapping[str, str] = field(default_factory=dict)
    hypervisor_type: str = "sim"
    architecture: str = "x86_64"

    def totals(self) -> dict[ResourceClass, int]:
        """Inventory totals before reservation and overcommit."""
        return {
            ResourceClass.VCPU: len(self.topology.cpu_shared_set),
            ResourceClass.PCPU: len(self.topology.cpu_dedicated_set),
            ResourceClass.MEMORY_MB: self.topology.memory_mb,
            ResourceClass.DISK_GB: self.disk_gb,
        }

    def capacity(self, rc: ResourceClass) -> int:
        """(total - reserved) x ratio: the most that claims on `rc` may add up to."""
        total = self.totals()[rc]
        ratio = self.allocation_ratios.get(rc, DEFAULT_ALLOCATION_RATIOS[rc])
        return int((total - self.reserved.get(rc, 0)) * ratio)


def parse_cpu_set(
    text: str, *, what: str = "CPU set", universe: frozenset[int] | None = None
) -> frozenset[int]:
    """Parse Nova's CPU set syntax ("0-3,8,^2") into ids.

    A set that only excludes ("^0-1") means `universe` less those, where a universe is given.
    """
    include: set[int] = set()
    exclude: set[int] = set()
    for raw in text.split(","):
        part = raw.strip()
        if not part:
            continue
        target = include
        if part.startswith("^"):
            target = exclude
            part = part[1:].strip()
        try:
            if "-" in part:
                lo_s, hi_s = part.split("-", 1)
                lo, hi = int(lo_s), int(hi_s)
                if lo > hi or lo < 0:
                    raise ValueError(part)
                target.update(range(lo, hi + 1))
            else:
                value = int(part)
                if value < 0:
                    raise ValueError(part)
                target.add(value)
        except ValueError:
            raise InvalidSpec(f"{what}: cannot read {raw.strip()!r} as a CPU id or range") from None
    if not include and exclude:
        if universe is None:
            raise InvalidSpec(f"{what}: {text!r} only excludes CPUs")
        include = set(universe)
    return frozenset(include - exclude)


def format_cpu_set(cpus: frozenset[int] | set[int]) -> str:
    """The inverse of parse_cpu_set, with ranges collapsed."""
    out: list[str] = []
    ordered = sorted(cpus)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(out)
