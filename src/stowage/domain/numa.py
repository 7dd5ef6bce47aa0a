"""NUMA fitting: the exact host cells and pCPU ids for an instance, honouring thread policies."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from stowage.domain.flavor import GuestCell, InstanceShape, ThreadPolicy
from stowage.domain.topology import HostTopology

__all__ = [
    "CellFit",
    "Fit",
    "HostFree",
    "NoFit",
    "apply_fit",
    "exact_by_precheck",
    "fit_instance",
    "precheck",
]


@dataclass(frozen=True, slots=True)
class HostFree:
    """What a host still has free for NUMA-bound claims."""

    cpus: frozenset[int]  # dedicated pCPUs neither pinned nor withheld
    cell_memory_mb: Mapping[int, int]  # memory per cell not claimed by NUMA-bound instances
    # (topology, free pCPUs per cell in the topology's order), computed by `precheck` the
    # first time it sees this state: a scheduler prechecks a host many times between claims.
    _cell_cpus: tuple[HostTopology, tuple[int, ...]] | None = field(
        default=None, init=False, compare=False, repr=False
    )

    def cell_cpus_free(self, topology: HostTopology) -> tuple[int, ...]:
        """Free dedicated pCPUs of each of the topology's cells, in its order."""
        cached = self._cell_cpus
        if cached is not None and cached[0] is topology:
            return cached[1]
        counts = tuple(len(cell.cpus & self.cpus) for cell in topology.cells)
        object.__setattr__(self, "_cell_cpus", (topology, counts))
        return counts


@dataclass(frozen=True, slots=True)
class CellFit:
    """One guest cell placed on one host cell."""

    guest_cell: int
    host_cell: int
    memory_mb: int
    pins: Mapping[int, int]  # guest vCPU -> host pCPU
    withheld: frozenset[int]  # sibling pCPUs kept idle by the isolate policy

    @property
    def cpus(self) -> frozenset[int]:
        return frozenset(self.pins.values()) | self.withheld


@dataclass(frozen=True, slots=True)
class Fit:
    """Where each guest cell goes; empty for an instance with no NUMA constraints."""

    cells: tuple[CellFit, ...]

    @property
    def cpus(self) -> frozenset[int]:
        """Every pCPU the claim takes: pins and withheld siblings."""
        out: frozenset[int] = frozenset()
        for cell in self.cells:
            out |= cell.cpus
        return out

    @property
    def pins(self) -> dict[int, int]:
        return {v: p for cell in self.cells for v, p in cell.pins.items()}


@dataclass(frozen=True, slots=True)
class NoFit:
    """Why an instance does not fit a host, in words an operator can act on."""

    reason: str


NO_NUMA = Fit(())


def fit_instance(shape: InstanceShape, topology: HostTopology, free: HostFree) -> Fit | NoFit:
    """Place each guest cell on a distinct host cell, choosing exact pCPUs.

    Host cells are tried in id order with backtracking, so the answer is deterministic.
    """
    if not shape.cells:
        return NO_NUMA
    if len(shape.cells) > len(topology.cells):
        return NoFit(f"need {len(shape.cells)} NUMA cells, host has {len(topology.cells)}")
    needs_smt = shape.thread_policy is ThreadPolicy.REQUIRE and shape.dedicated_vcpus
    if needs_smt and topology.threads_per_core < 2:
        return NoFit("thread policy require needs SMT, host has one thread per core")
    reasons: list[str] = []
    placed = _place(shape, topology, free, list(shape.cells), set(), reasons)
    if placed is None:
        return NoFit(reasons[0] if reasons else "no NUMA cell arrangement fits")
    return Fit(tuple(sorted(placed, key=lambda c: c.guest_cell)))


def precheck(shape: InstanceShape, topology: HostTopology, free: HostFree) -> str | None:
    """A cheap test that rejects most hosts that cannot fit; None means "maybe".

    For one guest cell with the prefer policy the answer is exact: `fit_instance` succeeds
    whenever this passes, so a scheduler may defer the exact fit to the host it picks.
    """
    need_cpus = max((len(c.dedicated) for c in shape.cells), default=0)
    need_mb = max((c.memory_mb for c in shape.cells), default=0)
    best_cpus = 0
    best_mb = 0
    free_cpus = free.cell_cpus_free(topology) if need_cpus else None
    memory_free = free.cell_memory_mb
    for i, cell in enumerate(topology.cells):
        memory = memory_free.get(cell.id, 0)
        cpus = free_cpus[i] if free_cpus is not None else 0
        if memory >= need_mb and cpus >= need_cpus:
            return None
        best_cpus = max(best_cpus, cpus)
        best_mb = max(best_mb, memory)
    if best_mb < need_mb:
        return f"need {need_mb} MB on one NUMA cell, largest free is {best_mb} MB"
    return f"need {need_cpus} dedicated CPUs on one NUMA cell, largest free is {best_cpus}"


def exact_by_precheck(shape: InstanceShape) -> bool:
    """True when `precheck` passing guarantees `fit_instance` succeeds."""
    return (
        len(shape.cells) == 1
        and (shape.thread_policy is ThreadPolicy.PREFER or not shape.dedicated_vcpus)
        and not shape.cells[0].shared
    )


def apply_fit(free: HostFree, fit: Fit) -> HostFree:
    """The free state after a claim with this fit."""
    if not fit.cells:
        return free
    memory = dict(free.cell_memory_mb)
    for cell in fit.cells:
        memory[cell.host_cell] -= cell.memory_mb
    return HostFree(free.cpus - fit.cpus, memory)


def _place(
    shape: InstanceShape,
    topology: HostTopology,
    free: HostFree,
    pending: list[GuestCell],
    used_cells: set[int],
    reasons: list[str],
) -> list[CellFit] | None:
    if not pending:
        return []
    guest, rest = pending[0], pending[1:]
    for host_cell in topology.cells:
        if host_cell.id in used_cells:
            continue
        placed = _fit_cell(shape, topology, free, guest, host_cell.id, reasons)
        if placed is None:
            continue
        others = _place(shape, topology, free, rest, used_cells | {host_cell.id}, reasons)
        if others is not None:
            return [placed, *others]
    return None


def _fit_cell(
    shape: InstanceShape,
    topology: HostTopology,
    free: HostFree,
    guest: GuestCell,
    host_cell: int,
    reasons: list[str],
) -> CellFit | None:
    memory_free = free.cell_memory_mb.get(host_cell, 0)
    if memory_free < guest.memory_mb:
        largest = max(free.cell_memory_mb.values(), default=0)
        reasons.append(f"need {guest.memory_mb} MB on one NUMA cell, largest free is {largest} MB")
        return None
    if guest.shared:
        # Look the cell up by id: cell ids need not match positions (NUMA nodes 0 and 2).
        cell_cpus = next(c.cpus for c in topology.cells if c.id == host_cell)
        shared_here = len(cell_cpus & topology.cpu_shared_set)
        if shared_here < len(guest.shared):
            reasons.append(
                f"need {len(guest.shared)} shared CPUs on one NUMA cell, cell {host_cell} "
                f"has {shared_here}"
            )
            return None
    if not guest.dedicated:
        return CellFit(guest.id, host_cell, guest.memory_mb, {}, frozenset())
    cores = topology.cores_by_cell[host_cell]
    picked = _pick_cpus(shape.thread_policy, cores, free.cpus, len(guest.dedicated))
    if isinstance(picked, str):
        reasons.append(picked + _largest_free(topology, free, shape.thread_policy))
        return None
    chosen, withheld = picked
    pins = dict(zip(sorted(guest.dedicated), chosen, strict=True))
    return CellFit(guest.id, host_cell, guest.memory_mb, pins, withheld)


def _pick_cpus(
    policy: ThreadPolicy, cores: Sequence[frozenset[int]], free: frozenset[int], count: int
) -> tuple[list[int], frozenset[int]] | str:
    """Choose `count` pCPUs among a cell's cores; a string says why it cannot."""
    if policy is ThreadPolicy.PREFER:
        return _pick_prefer(cores, free, count)
    whole = [core for core in cores if core <= free]
    if policy is ThreadPolicy.ISOLATE:
        if len(whole) < count:
            return f"need {count} whole free cores (isolate) on one NUMA cell"
        taken = whole[:count]
        chosen = [min(core) for core in taken]
        withheld = frozenset().union(*taken) - set(chosen)
        return chosen, withheld
    threads = max((len(core) for core in cores), default=1)  # a memory-only cell has none
    needed = -(-count // threads)
    if len(whole) < needed:
        return f"need {needed} whole free cores (require) on one NUMA cell"
    chosen = [cpu for core in whole[:needed] for cpu in sorted(core)][:count]
    return chosen, frozenset()


def _pick_prefer(
    cores: Sequence[frozenset[int]], free: frozenset[int], count: int
) -> tuple[list[int], frozenset[int]] | str:
    free_by_core = [core & free for core in cores]
    if sum(map(len, free_by_core)) < count:
        return f"need {count} dedicated CPUs on one NUMA cell"
    # Fill whole sibling sets first, so the guest's threads share cores as on real hardware,
    # then take the remainder from the core that fits it most tightly.
    order = sorted(
        (i for i, f in enumerate(free_by_core) if f), key=lambda i: (-len(free_by_core[i]), i)
    )
    chosen: list[int] = []
    used: set[int] = set()
    need = count
    for i in order:
        threads = free_by_core[i]
        if len(threads) <= need:
            chosen.extend(threads)
            used.add(i)
            need -= len(threads)
            if not need:
                break
    if need:
        best = min(
            (i for i in order if i not in used and len(free_by_core[i]) >= need),
            key=lambda i: (len(free_by_core[i]), i),
        )
        chosen.extend(sorted(free_by_core[best])[:need])
    return sorted(chosen), frozenset()


def _largest_free(topology: HostTopology, free: HostFree, policy: ThreadPolicy) -> str:
    counts = []
    for cell in topology.cells:
        cores = topology.cores_by_cell[cell.id]
        if policy is ThreadPolicy.PREFER:
            counts.append(len(cell.cpus & free.cpus))
        else:
            counts.append(sum(1 for core in cores if core <= free.cpus))
    unit = "" if policy is ThreadPolicy.PREFER else " whole cores"
    return f", largest free is {max(counts, default=0)}{unit}"
