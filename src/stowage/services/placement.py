"""Placement over the ledger: hosts as root providers, their inventories, usages and traits.

The ledger stays the only writer of claims. Placement reads allocations, usages and
consumers straight from its tables; the only ledger rows it writes are inventories (a
generation compare-and-swap on the host, the inventories, and a change-log row, in one
transaction). Traits and custom classes are documents in the object store.
"""

from __future__ import annotations

import json
import re
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from sqlalchemy import Connection, Engine, delete, func, insert, select, update

from stowage.domain.errors import ConflictError, InvalidSpec, NotFound
from stowage.domain.topology import ResourceClass
from stowage.ledger.db import READONLY
from stowage.ledger.objects import ObjectStore
from stowage.ledger.schema import (
    allocations,
    changes,
    consumers,
    host_generations,
    hosts,
    hosts_and_generations,
    inventories,
    objects,
)

__all__ = [
    "CUSTOM_NAME",
    "LEDGER_CLASSES",
    "STANDARD_RESOURCE_CLASSES",
    "STANDARD_TRAITS",
    "Allocation",
    "Candidate",
    "GenerationConflict",
    "Inventory",
    "InventoryInUse",
    "LedgerManaged",
    "PlacementBadRequest",
    "PlacementConflict",
    "PlacementNotFound",
    "PlacementStore",
    "Provider",
    "ProviderInUse",
    "RequestGroup",
    "candidates",
]

# -- errors: placement's codes (placement/errors.py), never reused for another meaning ------

UNDEFINED_CODE = "placement.undefined_code"


class PlacementNotFound(NotFound):
    code = UNDEFINED_CODE


class PlacementBadRequest(InvalidSpec):
    code = UNDEFINED_CODE


class PlacementConflict(ConflictError):
    code = UNDEFINED_CODE


class GenerationConflict(PlacementConflict):
    code = "placement.concurrent_update"


class InventoryInUse(PlacementConflict):
    code = "placement.inventory.inuse"


class ProviderInUse(PlacementConflict):
    code = "placement.resource_provider.inuse"


class DuplicateName(PlacementConflict):
    code = "placement.duplicate_name"


class LedgerManaged(PlacementConflict):
    """Stowage's own code: the ledger, not Placement, owns what the request would change."""

    code = "placement.ledger_managed"


# -- the standard names (os-resource-classes, os-traits) ---------------------------------

STANDARD_RESOURCE_CLASSES: tuple[str, ...] = (
    "VCPU",
    "MEMORY_MB",
    "DISK_GB",
    "PCI_DEVICE",
    "SRIOV_NET_VF",
    "NUMA_SOCKET",
    "NUMA_CORE",
    "NUMA_THREAD",
    "NUMA_MEMORY_MB",
    "IPV4_ADDRESS",
    "VGPU",
    "VGPU_DISPLAY_HEAD",
    "NET_BW_EGR_KILOBIT_PER_SEC",
    "NET_BW_IGR_KILOBIT_PER_SEC",
    "PCPU",
    "MEM_ENCRYPTION_CONTEXT",
    "FPGA",
    "PGPU",
    "NET_PACKET_RATE_KILOPACKET_PER_SEC",
    "NET_PACKET_RATE_EGR_KILOPACKET_PER_SEC",
    "NET_PACKET_RATE_IGR_KILOPACKET_PER_SEC",
)

# The classes the ledger accounts for; inventory of any other class cannot be claimed here.
LEDGER_CLASSES: frozenset[str] = frozenset(rc.value for rc in ResourceClass)

_ARCHES = [
    "AARCH64",
    "ALPHA",
    "ARMV6",
    "ARMV7",
    "ARMV7B",
    "CRIS",
    "I686",
    "IA64",
    "LM32",
    "M68K",
    "MICROBLAZE",
    "MICROBLAZEEL",
    "MIPS",
    "MIPSEL",
    "MIPS64",
    "MIPS64EL",
    "OPENRISC",
    "PARISC",
    "PARISC64",
    "PPC",
    "PPCLE",
    "PPC64",
    "PPC64LE",
    "PPCEMB",
    "S390",
    "S390X",
    "SH4",
    "SH4EB",
    "SPARC",
    "SPARC64",
    "UNICORE32",
    "X86_64",
    "XTENSA",
    "XTENSAEB",
]
_X86 = [
    "3DNOW",
    "ABM",
    "AES",
    "AMD_SEV",
    "AMD_SVM",
    "AVX",
    "AVX2",
    "AVX512BW",
    "AVX512CD",
    "AVX512DQ",
    "AVX512ER",
    "AVX512F",
    "AVX512PF",
    "AVX512VL",
    "AVX512VNNI",
    "BMI",
    "BMI2",
    "CLMUL",
    "F16C",
    "FMA3",
    "FMA4",
    "INTEL_VMX",
    "MMX",
    "MPX",
    "SGX",
    "SHA",
    "SSE",
    "SSE2",
    "SSE3",
    "SSE41",
    "SSE42",
    "SSE4A",
    "SSSE3",
    "SVM",
    "TBM",
    "TSX",
    "VMX",
    "XOP",
]
_COMPUTE = [
    "NODE",
    "STATUS_DISABLED",
    "ACCELERATORS",
    "DEVICE_TAGGING",
    "NET_ATTACH_INTERFACE",
    "NET_ATTACH_INTERFACE_WITH_TAG",
    "VOLUME_ATTACH",
    "VOLUME_ATTACH_WITH_TAG",
    "VOLUME_EXTEND",
    "VOLUME_MULTI_ATTACH",
    "TRUSTED_CERTS",
    "SAME_HOST_COLD_MIGRATE",
    "RESCUE_BFV",
    "SOCKET_PCI_NUMA_AFFINITY",
    "REMOTE_MANAGED_PORTS",
    "EPHEMERAL_ENCRYPTION",
    "SECURITY_TPM_1_2",
    "SECURITY_TPM_2_0",
    "SECURITY_UEFI_SECURE_BOOT",
]
_IMAGE_TYPES = ["AKI", "AMI", "ARI", "ISO", "PLOOP", "QCOW2", "RAW", "VDI", "VHD", "VHDX", "VMDK"]
_GRAPHICS = ["BOCHS", "CIRRUS", "GOP", "NONE", "QXL", "VGA", "VIRTIO", "XEN"]
_VIFS = [
    "E1000",
    "E1000E",
    "LAN9118",
    "NETFRONT",
    "NE2K_PCI",
    "PCNET",
    "RTL8139",
    "SPAPR_VLAN",
    "SRIOV",
    "VIRTIO",
    "VMXNET",
    "VMXNET3",
]
_BUSES = ["FDC", "IDE", "LXC", "SATA", "SCSI", "UML", "USB", "VIRTIO", "XEN"]

STANDARD_TRAITS: frozenset[str] = frozenset(
    [f"HW_ARCH_{a}" for a in _ARCHES]
    + [f"HW_CPU_X86_{f}" for f in _X86]
    + [f"COMPUTE_{c}" for c in _COMPUTE]
    + [f"COMPUTE_IMAGE_TYPE_{t}" for t in _IMAGE_TYPES]
    + [f"COMPUTE_GRAPHICS_MODEL_{g}" for g in _GRAPHICS]
    + [f"COMPUTE_NET_VIF_MODEL_{v}" for v in _VIFS]
    + [f"COMPUTE_STORAGE_BUS_{b}" for b in _BUSES]
    + [
        "HW_CPU_HYPERTHREADING",
        "HW_NUMA_ROOT",
        "HW_NIC_SRIOV",
        "HW_GPU_API_VULKAN",
        "MISC_SHARES_VIA_AGGREGATE",
        "STORAGE_DISK_HDD",
        "STORAGE_DISK_SSD",
    ]
)

# Traits that follow the host's state in the ledger: always shown, never stored.
DISABLED_TRAIT = "COMPUTE_STATUS_DISABLED"

CUSTOM_NAME = re.compile(r"^CUSTOM_[A-Z0-9_]+$")
_NAME_MAX = 255

# Placement's default when an inventory leaves max_unit out (the database's MAX_INT).
_MAX_INT = 2147483647


def valid_custom_name(name: str) -> bool:
    return len(name) <= _NAME_MAX and CUSTOM_NAME.match(name) is not None


# -- what the ledger holds, as Placement shows it ---------------------------------------


@dataclass(frozen=True, slots=True)
class Inventory:
    resource_class: str
    total: int
    reserved: int = 0
    min_unit: int = 1
    max_unit: int = _MAX_INT
    step_size: int = 1
    allocation_ratio: float = 1.0
    used: int = 0

    @property
    def capacity(self) -> int:
        """(total - reserved) x allocation_ratio, as Placement rounds it."""
        return int((self.total - self.reserved) * self.allocation_ratio)

    def view(self) -> dict[str, Any]:
        return {
            "total": self.total,
            "reserved": self.reserved,
            "min_unit": self.min_unit,
            "max_unit": self.max_unit,
            "step_size": self.step_size,
            "allocation_ratio": self.allocation_ratio,
        }

    def fits(self, amount: int) -> bool:
        """One allocation of `amount` respects the units and the free capacity."""
        return (
            self.min_unit <= amount <= self.max_unit
            and amount % self.step_size == 0
            and self.used + amount <= self.capacity
        )


@dataclass(frozen=True, slots=True)
class Provider:
    """A ledger host as a root resource provider."""

    id: int
    uuid: str
    name: str
    generation: int
    disabled: bool = False
    architecture: str = "x86_64"
    hyperthreading: bool = False
    inventories: Mapping[str, Inventory] = field(default_factory=dict)

    def managed_traits(self) -> frozenset[str]:
        """The traits Nova's compute would report for this host, derived from the ledger."""
        out = {"COMPUTE_NODE"}
        arch = f"HW_ARCH_{self.architecture.upper()}"
        if arch in STANDARD_TRAITS:
            out.add(arch)
        if self.hyperthreading:
            out.add("HW_CPU_HYPERTHREADING")
        if self.disabled:
            out.add(DISABLED_TRAIT)
        return frozenset(out)


MANAGED_TRAITS: frozenset[str] = frozenset(
    {"COMPUTE_NODE", "HW_CPU_HYPERTHREADING", DISABLED_TRAIT} | {f"HW_ARCH_{a}" for a in _ARCHES}
)


@dataclass(frozen=True, slots=True)
class Allocation:
    consumer_id: str
    provider_uuid: str
    provider_generation: int
    resource_class: str
    amount: int
    project_id: str
    user_id: str
    consumer_generation: int
    consumer_type: str


def _consumer_type(kind: str) -> str:
    """Nova's consumer types: an instance, or the migration holding a move's other end."""
    return "MIGRATION" if kind == "migration" else "INSTANCE"


def _hyperthreaded(topology: str) -> bool:
    try:
        siblings = json.loads(topology).get("siblings", {})
    except ValueError:
        return False
    return any(siblings.values())


# -- allocation candidates: pure ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestGroup:
    """One request group of GET /allocation_candidates (suffix "" is the unnumbered one)."""

    suffix: str = ""
    resources: Mapping[str, int] = field(default_factory=dict)
    required: frozenset[str] = frozenset()
    forbidden: frozenset[str] = frozenset()
    any_of: tuple[frozenset[str], ...] = ()
    member_of: tuple[frozenset[str], ...] = ()
    forbidden_aggregates: frozenset[str] = frozenset()
    in_tree: str | None = None

    def traits_ok(self, traits: frozenset[str]) -> bool:
        return (
            self.required <= traits
            and not (self.forbidden & traits)
            and all(options & traits for options in self.any_of)
        )

    def aggregates_ok(self, aggregates: frozenset[str]) -> bool:
        return all(options & aggregates for options in self.member_of) and not (
            self.forbidden_aggregates & aggregates
        )


@dataclass(frozen=True, slots=True)
class Candidate:
    provider: Provider
    resources: Mapping[str, int]
    mappings: Mapping[str, list[str]]


def candidates(
    providers: Sequence[Provider],
    traits: Mapping[str, frozenset[str]],
    aggregates: Mapping[str, frozenset[str]],
    groups: Sequence[RequestGroup],
    *,
    isolate: bool = False,
    root_required: frozenset[str] = frozenset(),
    root_forbidden: frozenset[str] = frozenset(),
) -> list[Candidate]:
    """Every provider that can serve all groups at once, in provider id order.

    Each provider is a root with no children and no sharing providers, so every group
    lands on the same provider: each group's amounts must respect that inventory's
    units, and their sum must fit its free capacity. `isolate` asks numbered groups to
    land on different providers, which one provider cannot do when there are two or more.
    """
    numbered = [g for g in groups if g.suffix]
    if isolate and len(numbered) > 1:
        return []
    out: list[Candidate] = []
    for provider in providers:
        have = traits.get(provider.uuid, frozenset())
        if not root_required <= have or root_forbidden & have:
            continue
        merged = _serve(provider, have, aggregates.get(provider.uuid, frozenset()), groups)
        if merged is None:
            continue
        mappings = {g.suffix: [provider.uuid] for g in groups if g.resources}
        out.append(Candidate(provider, merged, mappings))
    return out


def _serve(
    provider: Provider,
    traits: frozenset[str],
    aggregates: frozenset[str],
    groups: Sequence[RequestGroup],
) -> dict[str, int] | None:
    merged: dict[str, int] = {}
    for group in groups:
        if group.in_tree is not None and group.in_tree != provider.uuid:
            return None
        if not group.traits_ok(traits) or not group.aggregates_ok(aggregates):
            return None
        for rc, amount in group.resources.items():
            inv = provider.inventories.get(rc)
            if inv is None or not inv.min_unit <= amount <= inv.max_unit:
                return None
            if amount % inv.step_size:
                return None
            merged[rc] = merged.get(rc, 0) + amount
    for rc, amount in merged.items():
        inv = provider.inventories[rc]
        if inv.used + amount > inv.capacity:
            return None
    return merged


# -- the store ------------------------------------------------------------------------------


class PlacementStore:
    """Reads of the ledger's tables and the few writes Placement may make to them."""

    def __init__(
        self, engine: Engine, objects_store: ObjectStore, *, clock: Callable[[], float] = time.time
    ) -> None:
        self.engine = engine
        self.objects = objects_store
        self.clock = clock

    # -- providers --------------------------------------------------------------------

    def providers(
        self, *, uuids: Collection[str] | None = None, name: str | None = None
    ) -> list[Provider]:
        with self.engine.connect().execution_options(**READONLY) as conn, conn.begin():
            return self._providers(conn, uuids=uuids, name=name)

    def provider(self, uuid: str) -> Provider:
        found = self.providers(uuids=[uuid])
        if not found:
            raise PlacementNotFound(f"No resource provider with uuid {uuid} found")
        return found[0]

    def _providers(
        self,
        conn: Connection,
        *,
        uuids: Collection[str] | None = None,
        name: str | None = None,
    ) -> list[Provider]:
        query = (
            select(
                hosts.c.id,
                hosts.c.uuid,
                hosts.c.name,
                host_generations.c.generation,
                hosts.c.disabled,
                hosts.c.architecture,
                hosts.c.topology,
                hosts.c.last_seen,
            )
            .select_from(hosts_and_generations)
            .order_by(hosts.c.id)
        )
        if uuids is not None:
            query = query.where(hosts.c.uuid.in_(list(uuids)))
        if name is not None:
            query = query.where(hosts.c.name == name)
        rows = conn.execute(query).all()
        if not rows:
            return []
        by_host: dict[int, dict[str, Inventory]] = defaultdict(dict)
        inv_query = select(inventories)
        if uuids is not None or name is not None:
            inv_query = inv_query.where(inventories.c.host_id.in_([r.id for r in rows]))
        for inv in conn.execute(inv_query):
            by_host[inv.host_id][inv.resource_class] = Inventory(
                resource_class=inv.resource_class,
                total=inv.total,
                reserved=inv.reserved,
                min_unit=inv.min_unit,
                max_unit=inv.max_unit,
                step_size=inv.step_size,
                allocation_ratio=float(inv.allocation_ratio),
                used=inv.used,
            )
        return [
            Provider(
                id=row.id,
                uuid=row.uuid,
                name=row.name,
                generation=row.generation,
                disabled=bool(row.disabled),
                architecture=row.architecture,
                hyperthreading=_hyperthreaded(row.topology),
                inventories=dict(sorted(by_host.get(row.id, {}).items())),
            )
            for row in rows
        ]

    # -- traits -----------------------------------------------------------------------

    def stored_traits(self, uuids: Iterable[str] | None = None) -> dict[str, frozenset[str]]:
        docs = self.objects.list("rp_traits", ids=None if uuids is None else list(uuids))
        return {doc.id: frozenset(doc.body.get("traits", [])) for doc in docs}

    def traits_of(self, providers: Sequence[Provider]) -> dict[str, frozenset[str]]:
        """Each provider's traits: those set through the API and those its state implies."""
        stored = self.stored_traits(p.uuid for p in providers)
        return {p.uuid: stored.get(p.uuid, frozenset()) | p.managed_traits() for p in providers}

    def custom_traits(self) -> list[str]:
        return [doc.id for doc in self.objects.list("trait")]

    def trait_exists(self, name: str) -> bool:
        return name in STANDARD_TRAITS or self.objects.find("trait", name) is not None

    def unknown_traits(self, names: Iterable[str]) -> list[str]:
        wanted = set(names) - STANDARD_TRAITS
        if not wanted:
            return []
        known = {doc.id for doc in self.objects.list("trait", ids=wanted)}
        return sorted(wanted - known)

    def all_traits(self) -> list[str]:
        return sorted(STANDARD_TRAITS | set(self.custom_traits()))

    def associated_traits(self) -> set[str]:
        """Traits some provider has: stored ones, and the ones its state implies."""
        out: set[str] = set()
        for traits in self.traits_of(self.providers()).values():
            out |= traits
        return out

    def create_trait(self, name: str) -> bool:
        """True when the trait is new."""
        if self.trait_exists(name):
            return False
        try:
            self.objects.create("trait", name, {"name": name}, name=name)
        except ConflictError:
            return False
        return True

    def delete_trait(self, name: str) -> None:
        if name in STANDARD_TRAITS:
            raise PlacementBadRequest(f"Cannot delete standard trait {name}.")
        if self.objects.find("trait", name) is None:
            raise PlacementNotFound(f"No such trait(s): {name}.")
        if any(name in traits for traits in self.stored_traits().values()):
            raise PlacementConflict(f"The trait {name} is in use by a resource provider.")
        self.objects.delete("trait", name)

    def set_traits(self, uuid: str, generation: int | None, traits: Iterable[str]) -> Provider:
        """Replace a provider's traits, bumping its generation (compare-and-swap when given)."""
        kept = sorted(set(traits) - MANAGED_TRAITS)
        now = self.clock()
        with self.engine.begin() as conn:
            host_id = self._bump(conn, uuid, generation)
            body = json.dumps({"traits": kept}, sort_keys=True)
            changed = conn.execute(
                update(objects)
                .where(objects.c.kind == "rp_traits", objects.c.id == uuid)
                .values(body=body, updated_at=now)
            ).rowcount
            if not changed:
                conn.execute(
                    insert(objects),
                    {
                        "kind": "rp_traits",
                        "id": uuid,
                        "project_id": None,
                        "name": None,
                        "created_at": now,
                        "updated_at": now,
                        "body": body,
                    },
                )
            conn.execute(insert(changes), {"host_id": host_id, "at": now, "writer": None})
            return self._providers(conn, uuids=[uuid])[0]

    # -- resource classes -----------------------------------------------------------------

    def resource_classes(self) -> list[str]:
        custom = sorted(doc.id for doc in self.objects.list("resource_class"))
        return [*STANDARD_RESOURCE_CLASSES, *custom]

    def resource_class_exists(self, name: str) -> bool:
        return (
            name in STANDARD_RESOURCE_CLASSES
            or self.objects.find("resource_class", name) is not None
        )

    def create_resource_class(self, name: str, *, exist_ok: bool) -> bool:
        """True when the class is new; a duplicate is a 409 unless `exist_ok`."""
        if self.resource_class_exists(name):
            if exist_ok:
                return False
            raise DuplicateName(f"Conflicting resource class already exists: {name}")
        try:
            self.objects.create("resource_class", name, {"name": name}, name=name)
        except ConflictError:
            if exist_ok:
                return False
            raise DuplicateName(f"Conflicting resource class already exists: {name}") from None
        return True

    def delete_resource_class(self, name: str) -> None:
        if name in STANDARD_RESOURCE_CLASSES:
            raise PlacementBadRequest(f"Cannot delete standard resource class {name}.")
        if self.objects.find("resource_class", name) is None:
            raise PlacementNotFound(f"No such resource class {name}.")
        with self.engine.connect().execution_options(**READONLY) as conn:
            held = conn.execute(
                select(func.count())
                .select_from(inventories)
                .where(inventories.c.resource_class == name)
            ).scalar_one()
        if held:
            raise PlacementConflict(
                f"Unable to delete resource class {name}. "
                "The resource class is in use in inventory."
            )
        self.objects.delete("resource_class", name)

    def rename_resource_class(self, name: str, new_name: str) -> None:
        """Placement below 1.7: rename a custom class that no inventory uses."""
        if name in STANDARD_RESOURCE_CLASSES:
            raise PlacementBadRequest(f"Cannot update standard resource class {name}")
        if self.objects.find("resource_class", name) is None:
            raise PlacementNotFound(f"No such resource class {name}.")
        if self.resource_class_exists(new_name):
            raise DuplicateName(f"Resource class already exists: {new_name}")
        self.objects.create("resource_class", new_name, {"name": new_name}, name=new_name)
        self.objects.delete("resource_class", name)

    # -- aggregates (Nova's host aggregates, by their uuid) -------------------------------

    def aggregates_of(self, providers: Sequence[Provider]) -> dict[str, frozenset[str]]:
        by_name: dict[str, set[str]] = defaultdict(set)
        for doc in self.objects.list("aggregate"):
            agg_uuid = doc.body.get("uuid") or doc.id
            for host in doc.body.get("hosts") or []:
                by_name[str(host)].add(str(agg_uuid))
        return {p.uuid: frozenset(by_name.get(p.name, set())) for p in providers}

    # -- inventories ------------------------------------------------------------------

    def write_inventories(
        self,
        uuid: str,
        generation: int | None,
        change: Callable[[Provider], Mapping[str, Inventory]],
    ) -> Provider:
        """Replace a provider's inventories with `change(current)`, all or nothing.

        The host's generation is compared and bumped first (the row every ledger writer
        locks first), so a claim in flight either lands before and is counted, or waits.
        `generation` None compares against the generation read in the same transaction.
        """
        with self.engine.begin() as conn:
            if generation is None:
                current = self._providers(conn, uuids=[uuid])
                if not current:
                    raise PlacementNotFound(f"No resource provider with uuid {uuid} found")
                generation = current[0].generation
            host_id = self._bump(conn, uuid, generation)
            # Read under the host's lock: what the change is checked against is current.
            provider = replace(self._providers(conn, uuids=[uuid])[0], generation=generation)
            wanted = change(provider)
            self._check_in_use(provider, wanted)
            self._apply(conn, host_id, provider.inventories, wanted)
            conn.execute(insert(changes), {"host_id": host_id, "at": self.clock(), "writer": None})
            return self._providers(conn, uuids=[uuid])[0]

    def _check_in_use(self, provider: Provider, wanted: Mapping[str, Inventory]) -> None:
        gone = sorted(
            rc for rc, inv in provider.inventories.items() if inv.used and rc not in wanted
        )
        if gone:
            raise InventoryInUse(
                f"Inventory for '{', '.join(gone)}' on resource provider '{provider.uuid}' in use."
            )
        for rc, inv in sorted(wanted.items()):
            held = provider.inventories.get(rc)
            if held is not None and held.used > inv.capacity:
                raise InventoryInUse(
                    f"Inventory for '{rc}' on resource provider '{provider.uuid}' in use: "
                    f"{held.used} allocated exceeds the new capacity {inv.capacity}."
                )

    def _apply(
        self,
        conn: Connection,
        host_id: int,
        held: Mapping[str, Inventory],
        wanted: Mapping[str, Inventory],
    ) -> None:
        for rc in sorted(set(held) - set(wanted)):
            conn.execute(
                delete(inventories).where(
                    inventories.c.host_id == host_id, inventories.c.resource_class == rc
                )
            )
        for rc, inv in sorted(wanted.items()):
            values = {
                "total": inv.total,
                "reserved": inv.reserved,
                "min_unit": inv.min_unit,
                "max_unit": inv.max_unit,
                "step_size": inv.step_size,
                "allocation_ratio": inv.allocation_ratio,
            }
            if rc in held:
                if replace(held[rc], used=0) == replace(inv, used=0):
                    continue
                conn.execute(
                    update(inventories)
                    .where(inventories.c.host_id == host_id, inventories.c.resource_class == rc)
                    .values(**values)
                )
            else:
                conn.execute(
                    insert(inventories),
                    {"host_id": host_id, "resource_class": rc, "used": 0, **values},
                )

    def _bump(self, conn: Connection, uuid: str, generation: int | None) -> int:
        """Compare-and-swap the provider generation; returns the host id."""
        of_host = host_generations.c.host_id == (
            select(hosts.c.id).where(hosts.c.uuid == uuid).scalar_subquery()
        )
        query = update(host_generations).where(of_host)
        if generation is not None:
            query = query.where(host_generations.c.generation == generation)
        host_id = conn.execute(
            query.values(generation=host_generations.c.generation + 1).returning(
                host_generations.c.host_id
            )
        ).scalar()
        if host_id is not None:
            return int(host_id)
        exists = conn.execute(select(hosts.c.id).where(hosts.c.uuid == uuid)).scalar()
        if exists is None:
            raise PlacementNotFound(f"No resource provider with uuid {uuid} found")
        raise GenerationConflict(
            "resource provider generation conflict: the provider changed since "
            f"generation {generation}; read it again and retry."
        )

    # -- usages and allocations -------------------------------------------------------

    def provider_allocations(self, uuid: str) -> tuple[Provider, list[Allocation]]:
        provider = self.provider(uuid)
        return provider, self._allocations(hosts.c.uuid == uuid)

    def consumer_allocations(self, consumer_id: str) -> list[Allocation]:
        return self._allocations(consumers.c.id == consumer_id)

    def project_allocations(self, project_id: str, user_id: str | None) -> list[Allocation]:
        where = consumers.c.project_id == project_id
        if user_id is not None:
            where = where & (consumers.c.user_id == user_id)
        return self._allocations(where)

    def _allocations(self, where: Any) -> list[Allocation]:
        query = (
            select(
                consumers.c.id.label("consumer_id"),
                hosts.c.uuid,
                host_generations.c.generation,
                allocations.c.resource_class,
                allocations.c.amount,
                consumers.c.project_id,
                consumers.c.user_id,
                consumers.c.generation.label("consumer_generation"),
                consumers.c.kind,
            )
            .select_from(
                allocations.join(hosts_and_generations, hosts.c.id == allocations.c.host_id).join(
                    consumers, consumers.c.seq == allocations.c.consumer_seq
                )
            )
            .where(where)
            .order_by(consumers.c.id, hosts.c.id, allocations.c.resource_class)
        )
        with self.engine.connect().execution_options(**READONLY) as conn, conn.begin():
            return [
                Allocation(
                    consumer_id=row.consumer_id,
                    provider_uuid=row.uuid,
                    provider_generation=row.generation,
                    resource_class=row.resource_class,
                    amount=row.amount,
                    project_id=row.project_id,
                    user_id=row.user_id,
                    consumer_generation=row.consumer_generation,
                    consumer_type=_consumer_type(row.kind),
                )
                for row in conn.execute(query)
            ]
