"""The libvirt hypervisor driver: pinned, NUMA-placed domains from a claim, via libvirt-python."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import threading
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import libvirt

from stowage.domain.topology import HostTopology, format_cpu_set, parse_cpu_set
from stowage.virt.driver import (
    DriverCrashed,
    DriverError,
    InstanceNotFound,
    InstanceState,
    RunningInstance,
)

__all__ = ["DOMAIN_PREFIX", "LibvirtDriver", "LifecycleCallback", "domain_xml", "parse_pins"]

DOMAIN_PREFIX = "instance-"

# Instance ids become a domain name and a file name: keep them to a safe alphabet.
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

# Errors that mean the connection (not the request) failed: whether the step happened is unknown.
_CRASH_CODES = frozenset(
    {
        libvirt.VIR_ERR_SYSTEM_ERROR,
        libvirt.VIR_ERR_RPC,
        libvirt.VIR_ERR_NO_CONNECT,
        libvirt.VIR_ERR_INVALID_CONN,
        libvirt.VIR_ERR_OPERATION_TIMEOUT,
    }
)
_CRASH_DOMAINS = frozenset({libvirt.VIR_FROM_RPC, libvirt.VIR_FROM_REMOTE})

_LIFECYCLE_EVENTS = (
    "defined",
    "undefined",
    "started",
    "suspended",
    "resumed",
    "stopped",
    "shutdown",
    "pmsuspended",
    "crashed",
)

_T = TypeVar("_T")

# Called from the libvirt event thread with (instance_id, event name from _LIFECYCLE_EVENTS).
LifecycleCallback = Callable[[str, str], None]


# -- pure helpers: domain XML ----------------------------------------------------------


def domain_xml(
    *,
    instance_id: str,
    domain_type: str,
    arch: str,
    pins: dict[int, int],
    cells: list[int],
    guest_cell_vcpus: list[list[int]],
    memory_mb: int,
    disk: Path,
) -> str:
    """The domain definition: vCPU and emulator pins, strict NUMA memory, guest cells, one disk.

    Guest cell i is backed by host cell `cells[i]` and holds `guest_cell_vcpus[i]`; memory
    is split evenly between the guest cells (the remainder goes to the first ones).
    """
    root = ET.Element("domain", type=domain_type)
    ET.SubElement(root, "name").text = DOMAIN_PREFIX + instance_id
    ET.SubElement(root, "uuid").text = _domain_uuid(instance_id)
    ET.SubElement(root, "memory", unit="MiB").text = str(memory_mb)
    ET.SubElement(root, "vcpu", placement="static").text = str(len(pins))

    cputune = ET.SubElement(root, "cputune")
    for vcpu in sorted(pins):
        ET.SubElement(cputune, "vcpupin", vcpu=str(vcpu), cpuset=str(pins[vcpu]))
    ET.SubElement(cputune, "emulatorpin", cpuset=format_cpu_set(set(pins.values())))

    numatune = ET.SubElement(root, "numatune")
    ET.SubElement(numatune, "memory", mode="strict", nodeset=format_cpu_set(set(cells)))
    for guest_cell, host_cell in enumerate(cells):
        ET.SubElement(
            numatune, "memnode", cellid=str(guest_cell), mode="strict", nodeset=str(host_cell)
        )

    cpu = ET.SubElement(root, "cpu")
    numa = ET.SubElement(cpu, "numa")
    for guest_cell, cell_mb in enumerate(_split_memory(memory_mb, len(cells))):
        attrs = {"id": str(guest_cell), "memory": str(cell_mb), "unit": "MiB"}
        if guest_cell_vcpus[guest_cell]:
            attrs["cpus"] = format_cpu_set(set(guest_cell_vcpus[guest_cell]))
        ET.SubElement(numa, "cell", attrs)

    os_el = ET.SubElement(root, "os")
    ET.SubElement(os_el, "type", arch=arch).text = "hvm"
    ET.SubElement(os_el, "boot", dev="hd")
    ET.SubElement(root, "on_poweroff").text = "destroy"
    ET.SubElement(root, "on_reboot").text = "restart"
    ET.SubElement(root, "on_crash").text = "destroy"

    devices = ET.SubElement(root, "devices")
    disk_el = ET.SubElement(devices, "disk", type="file", device="disk")
    ET.SubElement(disk_el, "driver", name="qemu", type="raw")
    ET.SubElement(disk_el, "source", file=str(disk))
    ET.SubElement(disk_el, "target", dev="vda", bus="virtio")
    return ET.tostring(root, encoding="unicode")


def parse_pins(xml: str) -> dict[int, int]:
    """Guest vCPU -> host CPU from a domain's `<cputune><vcpupin>` elements.

    A vcpupin naming several CPUs (not something this driver writes) maps to the lowest.
    """
    root = ET.fromstring(xml)
    pins: dict[int, int] = {}
    for pin in root.findall("./cputune/vcpupin"):
        vcpu, cpuset = pin.get("vcpu"), pin.get("cpuset")
        if vcpu is None or cpuset is None:
            continue
        cpus = parse_cpu_set(cpuset, what="vcpupin cpuset")
        if cpus:
            pins[int(vcpu)] = min(cpus)
    return pins


def pinned_cpus(xml: str) -> frozenset[int]:
    """Every host CPU some vCPU of this domain is pinned to."""
    root = ET.fromstring(xml)
    out: set[int] = set()
    for pin in root.findall("./cputune/vcpupin"):
        cpuset = pin.get("cpuset")
        if cpuset:
            out |= parse_cpu_set(cpuset, what="vcpupin cpuset")
    return frozenset(out)


def _split_memory(memory_mb: int, parts: int) -> list[int]:
    base, extra = divmod(memory_mb, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def _domain_uuid(instance_id: str) -> str:
    """The instance id itself when it is a UUID (Nova's ids are), else a stable UUID from it."""
    try:
        return str(uuid.UUID(instance_id))
    except ValueError:
        return str(uuid.uuid5(uuid.NAMESPACE_URL, f"stowage:instance:{instance_id}"))


def check_claim(
    topology: HostTopology,
    pins: dict[int, int],
    cells: list[int],
    memory_mb: int,
    taken: dict[int, str],
) -> list[list[int]]:
    """Check a claim against the host before defining anything; the vCPUs of each guest cell.

    `taken` maps host CPUs already pinned by other domains to their domain names. libvirt's
    test driver (and QEMU, until the guest starts) checks none of this, so we do.
    """
    if not pins:
        raise DriverError("an instance needs at least one pinned vCPU", code="virt.libvirt.no_pins")
    if sorted(pins) != list(range(len(pins))):
        raise DriverError(
            f"guest vCPUs must be numbered 0..{len(pins) - 1}, got {sorted(pins)}",
            code="virt.libvirt.bad_vcpus",
        )
    if memory_mb <= 0:
        raise DriverError("memory_mb must be positive", code="virt.libvirt.bad_memory")
    if not cells or len(set(cells)) != len(cells):
        raise DriverError(
            f"cells must name distinct host NUMA cells, got {cells}", code="virt.libvirt.bad_cells"
        )
    if memory_mb < len(cells):
        raise DriverError(
            f"{memory_mb} MiB cannot be split over {len(cells)} cells",
            code="virt.libvirt.bad_memory",
        )
    host_cells = {cell.id: cell for cell in topology.cells}
    unknown_cells = [c for c in cells if c not in host_cells]
    if unknown_cells:
        raise DriverError(
            f"host has no NUMA cell {unknown_cells}", code="virt.libvirt.cell_not_on_host"
        )
    host_cpus = frozenset().union(*(cell.cpus for cell in topology.cells))
    if len(set(pins.values())) != len(pins):
        raise DriverError(
            "two guest vCPUs are pinned to the same host CPU", code="virt.libvirt.pin_conflict"
        )
    guest_cell_vcpus: list[list[int]] = [[] for _ in cells]
    for vcpu, cpu in sorted(pins.items()):
        if cpu not in host_cpus:
            raise DriverError(
                f"vCPU {vcpu} is pinned to CPU {cpu}, which this host does not have",
                code="virt.libvirt.pin_not_on_host",
            )
        if cpu in taken:
            raise DriverError(
                f"vCPU {vcpu} is pinned to CPU {cpu}, already pinned by {taken[cpu]}",
                code="virt.libvirt.pin_conflict",
            )
        cell = topology.cell_of(cpu)
        if cell not in cells:
            raise DriverError(
                f"vCPU {vcpu} is pinned to CPU {cpu} in cell {cell}, outside cells {cells}",
                code="virt.libvirt.pin_outside_cells",
            )
        guest_cell_vcpus[cells.index(cell)].append(vcpu)
    return guest_cell_vcpus


# -- the driver ----------------------------------------------------------------------------


class LibvirtDriver:
    """A `Driver` over one libvirt connection (`qemu:///system`, `test:///default`, ...).

    Thread-safe: libvirt connections are, and `_define_lock` makes "check the pins, then
    define" atomic among this driver's callers. Disks are raw files in `disk_dir`.
    """

    def __init__(
        self,
        uri: str,
        topology: HostTopology,
        disk_dir: Path,
        *,
        disk_bytes: int = 1024 * 1024,
        on_lifecycle: LifecycleCallback | None = None,
    ) -> None:
        self.uri = uri
        self.topology = topology
        self.disk_dir = Path(disk_dir)
        self.disk_dir.mkdir(parents=True, exist_ok=True)
        self.disk_bytes = disk_bytes
        self._define_lock = threading.Lock()
        self._conn_lock = threading.Lock()
        self._on_lifecycle = on_lifecycle
        self._callback_id: int | None = None
        _silence_libvirt_stderr()
        # Before the first open: events and `qemu:///embed` need libvirt's event loop.
        _ensure_event_loop()
        self._conn: Any = self._open()
        self.domain_type, self.arch = _guest_type(_call(lambda: str(self._conn.getCapabilities())))
        if on_lifecycle is not None:
            self._register_events()

    # -- Driver ----------------------------------------------------------------------

    def spawn(
        self, instance_id: str, pins: dict[int, int], cells: list[int], memory_mb: int
    ) -> None:
        _check_id(instance_id)
        disk = self._disk_path(instance_id)
        with self._define_lock:
            if self._lookup(instance_id) is not None:
                raise DriverError(f"instance {instance_id} already exists", code="virt.exists")
            guest_cell_vcpus = check_claim(
                self.topology, pins, cells, memory_mb, self._pinned_by_others()
            )
            xml = domain_xml(
                instance_id=instance_id,
                domain_type=self.domain_type,
                arch=self.arch,
                pins=pins,
                cells=cells,
                guest_cell_vcpus=guest_cell_vcpus,
                memory_mb=memory_mb,
                disk=disk,
            )
            try:
                _write_disk(disk, self.disk_bytes)
            except OSError as exc:
                raise DriverError(
                    f"cannot create the disk {disk}: {exc}", code="virt.libvirt.disk"
                ) from None
            try:
                dom = _call(lambda: self._connection().defineXML(xml))
            except DriverError:
                disk.unlink(missing_ok=True)
                raise
        try:
            _call(dom.create)
        except DriverError:
            # Orderly failure: leave nothing behind, so "error" means "did not happen".
            # If the clean-up fails too, the start's error is the one worth reporting.
            with contextlib.suppress(DriverError):
                _call(lambda: _undefine(dom))
            disk.unlink(missing_ok=True)
            raise

    def destroy(self, instance_id: str) -> None:
        dom = self._get(instance_id)
        self._stop(dom)
        _call(lambda: _undefine(dom))
        # Only ever our own file, whatever a domain's XML may name.
        self._disk_path(instance_id).unlink(missing_ok=True)

    def reboot(self, instance_id: str) -> None:
        # A hard reboot: a guest without ACPI support ignores a soft one.
        dom = self._get(instance_id)
        self._stop(dom)
        _call(dom.create)

    def power_off(self, instance_id: str) -> None:
        self._stop(self._get(instance_id))

    def power_on(self, instance_id: str) -> None:
        dom = self._get(instance_id)
        if not _call(lambda: bool(dom.isActive())):
            _call(dom.create)

    def running(self) -> dict[str, RunningInstance]:
        out: dict[str, RunningInstance] = {}
        for name, xml, active in self._domains():
            if name.startswith(DOMAIN_PREFIX):
                state = InstanceState.RUNNING if active else InstanceState.SHUTOFF
                out[name.removeprefix(DOMAIN_PREFIX)] = RunningInstance(
                    pins=parse_pins(xml), state=state
                )
        return out

    def read_disk(self, instance_id: str, chunk_bytes: int) -> Iterator[bytes]:
        if chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be positive")
        self._get(instance_id)
        disk = self._disk_path(instance_id)
        try:
            f = disk.open("rb")
        except FileNotFoundError:
            raise DriverError(
                f"instance {instance_id} has no disk at {disk}", code="virt.libvirt.no_disk"
            ) from None
        # Opened here, not in a generator, so a missing disk fails at the call.
        return _chunks(f, chunk_bytes)

    # -- lifetime --------------------------------------------------------------------

    def close(self) -> None:
        """Deregister the lifecycle callback and close the connection."""
        with self._conn_lock:
            conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._callback_id is not None:
            with contextlib.suppress(libvirt.libvirtError):
                conn.domainEventDeregisterAny(self._callback_id)
            self._callback_id = None
        with contextlib.suppress(libvirt.libvirtError):
            conn.close()

    # -- helpers ---------------------------------------------------------------------

    def _open(self) -> Any:
        try:
            return libvirt.open(self.uri)
        except libvirt.libvirtError as exc:
            # Nothing was sent yet, so the outcome is known: nothing happened.
            raise DriverError(
                f"cannot connect to {self.uri}: {exc}", code="virt.libvirt.unreachable"
            ) from None

    def _connection(self) -> Any:
        """The connection, reopened if it died (a crash was already reported for it)."""
        with self._conn_lock:
            conn = self._conn
            alive = False
            if conn is not None:
                try:
                    alive = bool(conn.isAlive())
                except libvirt.libvirtError:
                    alive = False
            if not alive:
                self._conn = self._open()
                if self._on_lifecycle is not None:
                    self._callback_id = None
                    self._register_events_locked()
            return self._conn

    def _register_events(self) -> None:
        with self._conn_lock:
            self._register_events_locked()

    def _register_events_locked(self) -> None:
        callback = self._on_lifecycle
        if callback is None:
            return

        def on_event(_conn: Any, dom: Any, event: int, _detail: int, _opaque: Any) -> None:
            name = str(dom.name())
            if name.startswith(DOMAIN_PREFIX) and 0 <= event < len(_LIFECYCLE_EVENTS):
                callback(name.removeprefix(DOMAIN_PREFIX), _LIFECYCLE_EVENTS[event])

        try:
            self._callback_id = int(
                self._conn.domainEventRegisterAny(
                    None, libvirt.VIR_DOMAIN_EVENT_ID_LIFECYCLE, on_event, None
                )
            )
        except libvirt.libvirtError:
            self._callback_id = None  # the URI has no events: the reconciler still polls

    def _disk_path(self, instance_id: str) -> Path:
        return self.disk_dir / f"{instance_id}.img"

    def _lookup(self, instance_id: str) -> Any | None:
        conn = self._connection()
        try:
            return _call(lambda: conn.lookupByName(DOMAIN_PREFIX + instance_id))
        except InstanceNotFound:
            return None

    def _get(self, instance_id: str) -> Any:
        _check_id(instance_id)
        dom = self._lookup(instance_id)
        if dom is None:
            raise InstanceNotFound(f"instance {instance_id} is not on this host")
        return dom

    def _stop(self, dom: Any) -> None:
        if _call(lambda: bool(dom.isActive())):
            _call(dom.destroy)

    def _domains(self) -> list[tuple[str, str, bool]]:
        """(name, live XML, active) for every domain, skipping ones that vanish meanwhile."""
        conn = self._connection()
        out: list[tuple[str, str, bool]] = []
        for dom in _call(lambda: list(conn.listAllDomains(0))):
            try:
                out.append(_call(functools.partial(_describe, dom)))
            except InstanceNotFound:
                continue
        return out

    def _pinned_by_others(self) -> dict[int, str]:
        taken: dict[int, str] = {}
        for name, xml, _active in self._domains():
            for cpu in pinned_cpus(xml):
                taken.setdefault(cpu, name)
        return taken


def _describe(dom: Any) -> tuple[str, str, bool]:
    return str(dom.name()), str(dom.XMLDesc(0)), bool(dom.isActive())


def _chunks(f: Any, chunk_bytes: int) -> Iterator[bytes]:
    with f:
        while chunk := f.read(chunk_bytes):
            yield bytes(chunk)


def _write_disk(disk: Path, size_bytes: int) -> None:
    """A raw disk with real (random) bytes, so snapshot reads move real data."""
    tmp = disk.with_suffix(".img.part")
    with tmp.open("wb") as f:
        left = size_bytes
        while left > 0:
            n = min(left, 1024 * 1024)
            f.write(os.urandom(n))
            left -= n
    tmp.replace(disk)


def _check_id(instance_id: str) -> None:
    if not _ID_RE.match(instance_id):
        raise DriverError(
            f"instance id {instance_id!r} is not usable as a domain name",
            code="virt.libvirt.bad_instance_id",
        )


def _undefine(dom: Any) -> None:
    # No NVRAM flag: these domains boot without UEFI, and the test driver refuses the flag.
    dom.undefineFlags(
        libvirt.VIR_DOMAIN_UNDEFINE_MANAGED_SAVE | libvirt.VIR_DOMAIN_UNDEFINE_SNAPSHOTS_METADATA
    )


def _call(fn: Callable[[], _T]) -> _T:
    """Run one libvirt call, translating its errors into the driver's."""
    try:
        return fn()
    except libvirt.libvirtError as exc:
        raise _translate(exc) from None


def _translate(exc: Any) -> Exception:
    code = exc.get_error_code()
    message = str(exc.get_error_message() or exc)
    if code in _CRASH_CODES or exc.get_error_domain() in _CRASH_DOMAINS:
        return DriverCrashed(f"libvirt connection failed: {message}")
    if code == libvirt.VIR_ERR_NO_DOMAIN:
        return InstanceNotFound(message)
    if code == libvirt.VIR_ERR_DOM_EXIST:
        return DriverError(message, code="virt.exists")
    return DriverError(message, code=f"virt.libvirt.error.{code}")


def _guest_type(capabilities: str) -> tuple[str, str]:
    """The best domain type (kvm, then qemu, then test) for an hvm guest of the host's arch."""
    root = ET.fromstring(capabilities)
    host_arch = root.findtext("./host/cpu/arch") or ""
    best: tuple[int, str, str] | None = None
    preference = {"kvm": 0, "qemu": 1, "test": 2}
    for guest in root.findall("./guest"):
        if guest.findtext("os_type") != "hvm":
            continue
        arch_el = guest.find("arch")
        if arch_el is None:
            continue
        arch = arch_el.get("name", "")
        for dom in arch_el.findall("domain"):
            kind = dom.get("type", "")
            rank = preference.get(kind, 9) + (0 if arch == host_arch else 10)
            if best is None or rank < best[0]:
                best = (rank, kind, arch)
    if best is None:
        raise DriverError("the hypervisor offers no hvm guests", code="virt.libvirt.no_guest_type")
    return best[1], best[2]


_loop_lock = threading.Lock()
_loop_started = threading.Event()


def _ensure_event_loop() -> None:
    """libvirt's default event loop on one daemon thread, once per process."""
    with _loop_lock:
        if _loop_started.is_set():
            return
        libvirt.virEventRegisterDefaultImpl()
        thread = threading.Thread(target=_run_event_loop, name="libvirt-events", daemon=True)
        thread.start()
        _loop_started.set()


def _run_event_loop() -> None:
    while True:
        libvirt.virEventRunDefaultImpl()


def _silence_libvirt_stderr() -> None:
    """libvirt prints every error to stderr by default; ours are raised as exceptions."""

    def ignore(_ctx: Any, _err: Any) -> None:
        return None

    libvirt.registerErrorHandler(ignore, None)
