"""The libvirt hypervisor driver: real guests from the image API, placed by the claim.

Disks are qcow2 overlays on a per-host image cache; the serial console is a pty that libvirt
also logs to a file (os-getConsoleOutput reads the file, an interactive session opens the pty
through libvirt: `open_serial_console`);
dedicated vCPUs are pinned with strict NUMA memory, shared ones float over the host's shared
CPU set; live migration goes through libvirt with the destination's own pins in its XML.
Domains carry Stowage's metadata: any other domain on the host is left alone.

Volumes (os-brick's `local` connection info: a file or a block device this host opens) are
virtio disks of the guest, in its definition from the spawn on and hot-plugged into the
running guest and its persistent definition alike (so a reboot, a power cycle or an agent
restart keeps them); a volume with boot index 0 is the root disk itself (boot from volume),
no overlay. A config drive is an ISO 9660 file beside the disk, attached as a read-only
cdrom. A live migration copies the root disk only: a volume stays where it is, and must be
the very same file on the destination (two hypervisors on one machine); anything else is
refused before the migration starts.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import tempfile
import threading
import time
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import libvirt

from stowage.domain.topology import Cell, HostTopology, format_cpu_set, parse_cpu_set
from stowage.virt.config_drive import build_config_drive
from stowage.virt.driver import (
    DriverCrashed,
    DriverError,
    Guest,
    ImageSpec,
    InstanceNotFound,
    InstanceState,
    MigrationProgress,
    MigrationTarget,
    Nic,
    ProgressCallback,
    RunningInstance,
    SerialOutput,
    guest_for,
)
from stowage.virt.images import ImageCache, ImageFetcher, qemu_img, virtual_size

__all__ = [
    "DOMAIN_PREFIX",
    "METADATA_NS",
    "LibvirtDriver",
    "LifecycleCallback",
    "VolumeDisk",
    "domain_xml",
    "host_topology",
    "parse_pins",
    "rescue_xml",
    "volume_disk",
]

log = logging.getLogger(__name__)

DOMAIN_PREFIX = "instance-"
METADATA_NS = "https://stowage.dev/xmlns/libvirt/instance/1"
METADATA_KEY = "stowage"

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

ROOT_TARGET = "vda"
_VOLUME_TARGET_RE = re.compile(r"^vd[a-z]$")


class VolumeDisk(NamedTuple):
    """A volume as a disk of the domain: its target (`vdb`), its file or block device on
    this host, its format, and its volume id (the disk's serial, as Nova sets it)."""

    target: str
    path: Path
    disk_format: str = "raw"
    volume_id: str = ""
    block: bool = False


def volume_disk(device: str, connection: Mapping[str, Any]) -> VolumeDisk:
    """What `connection` (os-brick's connection info) names, as a disk at `device`; refused
    (a `DriverError`) when this host cannot open it."""
    kind = connection.get("driver_volume_type")
    if kind != "local":
        raise DriverError(
            f"volume type {kind!r} cannot be attached by the libvirt driver: only local files "
            "and block devices (the local-file backend)",
            code="virt.volume.unsupported",
        )
    data = dict(connection.get("data") or {})
    target = device.removeprefix("/dev/")
    if not _VOLUME_TARGET_RE.match(target):
        raise DriverError(
            f"device {device!r} is not a virtio disk name (/dev/vdb ... /dev/vdz)",
            code="virt.volume.bad_device",
        )
    disk_format = str(data.get("format") or "raw")
    if disk_format not in ("raw", "qcow2"):
        raise DriverError(
            f"volume format {disk_format!r} is not raw or qcow2", code="virt.volume.unsupported"
        )
    path = Path(str(data.get("device_path") or ""))
    try:
        mode = path.stat().st_mode if path.is_absolute() else None
    except OSError:
        mode = None
    if mode is None or not (stat.S_ISREG(mode) or stat.S_ISBLK(mode)):
        raise DriverError(
            f"volume {data.get('volume_id') or ''} at {path} is not a file or block device "
            "this host can open",
            code="virt.volume.open",
        )
    return VolumeDisk(
        target, path, disk_format, str(data.get("volume_id") or ""), stat.S_ISBLK(mode)
    )


def _disk_element(parent: ET.Element | None, disk: VolumeDisk) -> ET.Element:
    attrs = {"type": "block" if disk.block else "file", "device": "disk"}
    el = ET.Element("disk", attrs) if parent is None else ET.SubElement(parent, "disk", attrs)
    ET.SubElement(el, "driver", name="qemu", type=disk.disk_format)
    ET.SubElement(el, "source", {"dev" if disk.block else "file": str(disk.path)})
    ET.SubElement(el, "target", dev=disk.target, bus="virtio")
    if disk.volume_id:
        ET.SubElement(el, "serial").text = disk.volume_id[:20]  # as Nova: virtio's 20 bytes
    return el


def _interface_element(parent: ET.Element | None, mac: str) -> ET.Element:
    """A NIC: user-mode networking (no host bridge to plug into), virtio, the port's MAC."""
    attrs = {"type": "user"}
    el = (
        ET.Element("interface", attrs)
        if parent is None
        else ET.SubElement(parent, "interface", attrs)
    )
    ET.SubElement(el, "mac", address=mac)
    ET.SubElement(el, "model", type="virtio")
    return el


def _interfaces(xml: str) -> dict[str, str]:
    """MAC -> the interface element (XML) of every NIC of a domain's XML."""
    out: dict[str, str] = {}
    for el in ET.fromstring(xml).findall("./devices/interface"):
        mac = el.find("mac")
        if mac is not None and mac.get("address"):
            out[mac.get("address", "").lower()] = ET.tostring(el, encoding="unicode")
    return out


def rescue_xml(xml: str, rescue_disk: Path) -> str:
    """A domain's persistent XML as Nova's (legacy) rescue boots it: the rescue disk first
    (`vda`), the guest's own root disk second (`vdb`), its volumes left out; the rest (NICs,
    config drive, console, placement) as it was."""
    root = ET.fromstring(xml)
    devices = root.find("devices")
    if devices is None:
        raise DriverError("a domain without devices cannot be rescued", code="virt.rescue.xml")
    for el in devices.findall("disk"):
        target = el.find("target")
        if el.get("device") == "cdrom" or target is None:
            continue
        if target.get("dev") == ROOT_TARGET:
            target.set("dev", "vdb")
        else:
            devices.remove(el)
    rescue = _disk_element(None, VolumeDisk(ROOT_TARGET, rescue_disk, "qcow2"))
    devices.insert(0, rescue)
    return ET.tostring(root, encoding="unicode")


def _disks(xml: str) -> dict[str, tuple[str, str]]:
    """target -> (device kind, source path) of every disk of a domain's XML."""
    out: dict[str, tuple[str, str]] = {}
    for el in ET.fromstring(xml).findall("./devices/disk"):
        target = el.find("target")
        source = el.find("source")
        if target is None:
            continue
        path = "" if source is None else source.get("file") or source.get("dev") or ""
        out[target.get("dev", "")] = (el.get("device", "disk"), path)
    return out


def _disk_xml(xml: str, target: str) -> str | None:
    for el in ET.fromstring(xml).findall("./devices/disk"):
        found = el.find("target")
        if found is not None and found.get("dev") == target:
            return ET.tostring(el, encoding="unicode")
    return None


def domain_xml(
    *,
    instance_id: str,
    domain_type: str,
    arch: str,
    guest: Guest,
    guest_cell_vcpus: list[list[int]],
    shared_cpus: frozenset[int],
    disk: Path,
    disk_format: str = "raw",
    console_log: Path | None = None,
    volumes: Sequence[VolumeDisk] = (),
    config_drive: Path | None = None,
    cdrom_bus: str = "ide",
) -> str:
    """The domain definition from the whole guest.

    `disk` is the root disk (`vda`: an overlay, or the root volume's file, in which case it
    is not among `volumes` again); `volumes` are the other volumes' disks; `config_drive`
    an ISO attached read-only as a cdrom on `cdrom_bus` (IDE on the default x86 machine).
    ACPI is on, so that virtio disks can be hot-plugged and unplugged.

    Dedicated vCPUs get a `vcpupin` each, strict NUMA memory and guest cells (guest cell i on
    host cell `guest.cells[i]`, holding `guest_cell_vcpus[i]`, memory split evenly); shared
    vCPUs are pinned to the host's shared CPU set, as Nova does, and so is the emulator when
    there are any (else the emulator runs on the dedicated CPUs).
    """
    root = ET.Element("domain", type=domain_type)
    ET.SubElement(root, "name").text = DOMAIN_PREFIX + instance_id
    ET.SubElement(root, "uuid").text = _domain_uuid(instance_id)
    metadata = ET.SubElement(root, "metadata")
    tag = ET.SubElement(metadata, f"{{{METADATA_NS}}}instance")
    ET.SubElement(tag, f"{{{METADATA_NS}}}id").text = instance_id
    ET.SubElement(tag, f"{{{METADATA_NS}}}name").text = guest.name
    if guest.image is not None:
        ET.SubElement(tag, f"{{{METADATA_NS}}}image").text = guest.image.id
    ET.SubElement(tag, f"{{{METADATA_NS}}}shared-vcpus").text = format_cpu_set(
        set(guest.shared_vcpus)
    )
    ET.SubElement(root, "memory", unit="MiB").text = str(guest.memory_mb)
    shared_vcpus = guest.shared_vcpus
    vcpu_attrs = {"placement": "static"}
    if shared_vcpus and not guest.pins:
        vcpu_attrs["cpuset"] = format_cpu_set(set(shared_cpus))
    ET.SubElement(root, "vcpu", vcpu_attrs).text = str(guest.vcpus)

    _placement(root, guest, guest_cell_vcpus, shared_cpus)

    os_el = ET.SubElement(root, "os")
    ET.SubElement(os_el, "type", arch=arch).text = "hvm"
    ET.SubElement(os_el, "boot", dev="hd")
    features = ET.SubElement(root, "features")
    ET.SubElement(features, "acpi")  # PCI hotplug of volumes needs it
    ET.SubElement(features, "apic")
    ET.SubElement(root, "on_poweroff").text = "destroy"
    ET.SubElement(root, "on_reboot").text = "restart"
    ET.SubElement(root, "on_crash").text = "destroy"

    devices = ET.SubElement(root, "devices")
    root_volume = guest.root_volume
    _disk_element(
        devices,
        VolumeDisk(
            ROOT_TARGET,
            disk,
            disk_format,
            root_volume.volume_id if root_volume is not None else "",
            disk.is_block_device() if root_volume is not None else False,
        ),
    )
    for volume in volumes:
        _disk_element(devices, volume)
    if config_drive is not None:
        cdrom = ET.SubElement(devices, "disk", type="file", device="cdrom")
        ET.SubElement(cdrom, "driver", name="qemu", type="raw")
        ET.SubElement(cdrom, "source", file=str(config_drive))
        ET.SubElement(cdrom, "target", dev="hda" if cdrom_bus == "ide" else "sda", bus=cdrom_bus)
        ET.SubElement(cdrom, "readonly")
    for nic in guest.nics:
        _interface_element(devices, nic.mac)
    if console_log is not None:
        # A pty for interactive sessions (virDomainOpenConsole), everything it carries also
        # in the log file, read by console_output whether anyone is connected or not.
        serial = ET.SubElement(devices, "serial", type="pty")
        ET.SubElement(serial, "log", file=str(console_log), append="on")
        ET.SubElement(serial, "target", port="0")
        console = ET.SubElement(devices, "console", type="pty")
        ET.SubElement(console, "target", type="serial", port="0")
    return ET.tostring(root, encoding="unicode")


def _placement(
    root: ET.Element, guest: Guest, guest_cell_vcpus: list[list[int]], shared_cpus: frozenset[int]
) -> None:
    """`cputune`, `numatune` and the guest's NUMA cells."""
    shared_vcpus = guest.shared_vcpus
    cputune = ET.SubElement(root, "cputune")
    for vcpu in range(guest.vcpus):
        if vcpu in guest.pins:
            ET.SubElement(cputune, "vcpupin", vcpu=str(vcpu), cpuset=str(guest.pins[vcpu]))
        else:
            ET.SubElement(
                cputune, "vcpupin", vcpu=str(vcpu), cpuset=format_cpu_set(set(shared_cpus))
            )
    emulator = set(shared_cpus) if shared_vcpus else set(guest.pins.values())
    ET.SubElement(cputune, "emulatorpin", cpuset=format_cpu_set(emulator))

    if guest.cells:
        numatune = ET.SubElement(root, "numatune")
        ET.SubElement(numatune, "memory", mode="strict", nodeset=format_cpu_set(set(guest.cells)))
        for guest_cell, host_cell in enumerate(guest.cells):
            ET.SubElement(
                numatune, "memnode", cellid=str(guest_cell), mode="strict", nodeset=str(host_cell)
            )
        cpu = ET.SubElement(root, "cpu")
        numa = ET.SubElement(cpu, "numa")
        for guest_cell, cell_mb in enumerate(_split_memory(guest.memory_mb, len(guest.cells))):
            attrs = {"id": str(guest_cell), "memory": str(cell_mb), "unit": "MiB"}
            vcpus = set(guest_cell_vcpus[guest_cell])
            if guest_cell == 0:
                vcpus |= set(shared_vcpus)  # a mixed guest's shared vCPUs sit in its cell 0
            if vcpus:
                attrs["cpus"] = format_cpu_set(vcpus)
            ET.SubElement(numa, "cell", attrs)


def is_ours(xml: str) -> str | None:
    """The instance id in a domain's Stowage metadata; None for a domain Stowage did not make."""
    root = ET.fromstring(xml)
    return root.findtext(f"./metadata/{{{METADATA_NS}}}instance/{{{METADATA_NS}}}id")


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
    guest: Guest | None = None,
    shared_cpus: frozenset[int] = frozenset(),
) -> list[list[int]]:
    """Check a claim against the host before defining anything; the vCPUs of each guest cell.

    `taken` maps host CPUs already pinned by other Stowage domains to their domain names.
    libvirt's test driver (and QEMU, until the guest starts) checks none of this, so we do.
    """
    vcpus = guest.vcpus if guest is not None else len(pins)
    if vcpus < 1:
        raise DriverError("an instance needs at least one vCPU", code="virt.libvirt.no_pins")
    if any(v < 0 or v >= vcpus for v in pins) or (
        guest is None and sorted(pins) != list(range(len(pins)))
    ):
        raise DriverError(
            f"guest vCPUs must be numbered 0..{vcpus - 1}, got {sorted(pins)}",
            code="virt.libvirt.bad_vcpus",
        )
    if memory_mb <= 0:
        raise DriverError("memory_mb must be positive", code="virt.libvirt.bad_memory")
    host_cpus = frozenset().union(*(cell.cpus for cell in topology.cells))
    if len(pins) < vcpus:
        if not shared_cpus:
            raise DriverError(
                f"{vcpus - len(pins)} shared vCPUs, but this host has no cpu_shared_set",
                code="virt.libvirt.no_shared_cpus",
            )
        if not shared_cpus <= host_cpus:
            raise DriverError(
                f"shared CPUs {format_cpu_set(set(shared_cpus - host_cpus))} are not on this host",
                code="virt.libvirt.shared_not_on_host",
            )
    if not pins:
        if cells and len(set(cells)) != len(cells):
            raise DriverError(
                f"cells must name distinct host NUMA cells, got {cells}",
                code="virt.libvirt.bad_cells",
            )
        return [[] for _ in cells]
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


def host_topology(
    capabilities: str,
    *,
    cpu_dedicated_set: frozenset[int] | None = None,
    cpu_shared_set: frozenset[int] | None = None,
) -> HostTopology:
    """The host's NUMA cells, CPUs and thread siblings from libvirt's capabilities XML.

    Without `cpu_dedicated_set` and `cpu_shared_set`, every CPU is shared (Nova's default);
    with only one of them, the other is the rest of the host.
    """
    root = ET.fromstring(capabilities)
    cells: list[Cell] = []
    siblings: dict[int, frozenset[int]] = {}
    for cell_el in root.findall("./host/topology/cells/cell"):
        cpus: set[int] = set()
        for cpu_el in cell_el.findall("./cpus/cpu"):
            cpu = int(cpu_el.get("id", "0"))
            cpus.add(cpu)
            sib = parse_cpu_set(cpu_el.get("siblings") or str(cpu), what="siblings")
            if sib - {cpu}:
                siblings[cpu] = frozenset(sib - {cpu})
        memory_kib = int(cell_el.findtext("memory") or "0")
        cells.append(Cell(int(cell_el.get("id", "0")), frozenset(cpus), memory_kib // 1024))
    if not cells:
        raise DriverError("libvirt reports no NUMA topology", code="virt.libvirt.no_topology")
    all_cpus = frozenset().union(*(c.cpus for c in cells))
    if cpu_dedicated_set is None and cpu_shared_set is None:
        dedicated, shared = frozenset[int](), all_cpus
    elif cpu_dedicated_set is None:
        assert cpu_shared_set is not None
        shared, dedicated = cpu_shared_set, all_cpus - cpu_shared_set
    elif cpu_shared_set is None:
        dedicated, shared = cpu_dedicated_set, all_cpus - cpu_dedicated_set
    else:
        dedicated, shared = cpu_dedicated_set, cpu_shared_set
    return HostTopology(tuple(cells), siblings, frozenset(dedicated), frozenset(shared))


# -- the driver ----------------------------------------------------------------------------


class LibvirtDriver:
    """A `Driver` over one libvirt connection (`qemu:///system`, `test:///default`, ...).

    Thread-safe: libvirt connections are, and `_define_lock` makes "check the pins, then
    define" atomic among this driver's callers. `disk_dir` holds the instances' disks
    (`<id>.qcow2` overlays on `images/`, or a blank `<id>.img` for a guest with no image)
    and their serial console logs (`console/<id>.log`).
    """

    def __init__(
        self,
        uri: str,
        topology: HostTopology | None,
        disk_dir: Path,
        *,
        disk_bytes: int = 1024 * 1024,
        on_lifecycle: LifecycleCallback | None = None,
        virt_type: str | None = None,
        image_fetcher: ImageFetcher | None = None,
        image_dir: Path | None = None,
        cpu_dedicated_set: frozenset[int] | None = None,
        cpu_shared_set: frozenset[int] | None = None,
        migration_uri: str | None = None,
        detach_timeout_s: float = 20.0,
    ) -> None:
        self.uri = uri
        self.detach_timeout_s = detach_timeout_s
        self.disk_dir = Path(disk_dir)
        self.disk_dir.mkdir(parents=True, exist_ok=True)
        self.console_dir = self.disk_dir / "console"
        self.console_dir.mkdir(exist_ok=True)
        self.images = ImageCache(image_dir or self.disk_dir / "images", image_fetcher)
        self.disk_bytes = disk_bytes
        self.migration_uri = migration_uri  # where QEMU on this host takes incoming memory
        self._define_lock = threading.Lock()
        self._conn_lock = threading.Lock()
        self._on_lifecycle = on_lifecycle
        self._callback_id: int | None = None
        _silence_libvirt_stderr()
        # Before the first open: events and `qemu:///embed` need libvirt's event loop.
        _ensure_event_loop()
        self._conn: Any = self._open()
        capabilities = _call(lambda: str(self._conn.getCapabilities()))
        self.host_uuid = ET.fromstring(capabilities).findtext("./host/uuid") or ""
        self.topology = topology or host_topology(
            capabilities, cpu_dedicated_set=cpu_dedicated_set, cpu_shared_set=cpu_shared_set
        )
        best, self.arch = _guest_type(capabilities)
        if virt_type is None:
            virt_type = best
        elif virt_type not in _guest_types(capabilities, self.arch):
            raise DriverError(
                f"virt_type {virt_type!r} is not offered by {uri} "
                f"(offered: {sorted(_guest_types(capabilities, self.arch))})",
                code="virt.libvirt.bad_virt_type",
            )
        self.domain_type = virt_type
        # The default x86 machine (i440fx) has IDE; elsewhere a cdrom is not offered.
        self.cdrom_bus: str | None = "ide" if self.arch in ("x86_64", "i686") else None
        if on_lifecycle is not None:
            self._register_events()

    # -- Driver ----------------------------------------------------------------------

    def spawn(
        self,
        instance_id: str,
        pins: dict[int, int],
        cells: list[int],
        memory_mb: int,
        guest: Guest | None = None,
    ) -> None:
        _check_id(instance_id)
        legacy = guest is None
        guest = guest_for(pins, cells, memory_mb, guest)
        shared = guest.shared_cpus or self.topology.cpu_shared_set
        with self._define_lock:
            existing = self._lookup(instance_id)
            if existing is not None:
                xml = _call(lambda: str(existing.XMLDesc(0)))
                if is_ours(xml) != instance_id or dedicated_pins(xml) != dict(guest.pins):
                    raise DriverError(f"instance {instance_id} already exists", code="virt.exists")
                # The same guest, defined already (a daemon restarted, an agent restores
                # what the ledger places here): it only needs to run.
                if not _call(lambda: bool(existing.isActive())):
                    _call(existing.create)
                return
            guest_cell_vcpus = check_claim(
                self.topology,
                dict(guest.pins),
                list(guest.cells),
                guest.memory_mb,
                self._pinned_by_others(),
                None if legacy else guest,
                shared,
            )
            volumes = self._volume_disks(guest)  # refused before anything is made
            cdrom_bus = self._check_config_drive(guest)
            disk, disk_format = self._create_disk(instance_id, guest)
            try:
                config_drive = self._write_config_drive(instance_id, guest)
            except DriverError:
                self._delete_files(instance_id)
                raise
            console = self._console_path(instance_id)
            console.unlink(missing_ok=True)
            xml = domain_xml(
                instance_id=instance_id,
                domain_type=self.domain_type,
                arch=self.arch,
                guest=guest,
                guest_cell_vcpus=guest_cell_vcpus,
                shared_cpus=shared,
                disk=disk,
                disk_format=disk_format,
                console_log=console,
                volumes=volumes,
                config_drive=config_drive,
                cdrom_bus=cdrom_bus,
            )
            try:
                dom = _call(lambda: self._connection().defineXML(xml))
            except DriverError:
                self._delete_files(instance_id)
                raise
        try:
            _call(dom.create)
        except DriverError:
            # Orderly failure: leave nothing behind, so "error" means "did not happen".
            # If the clean-up fails too, the start's error is the one worth reporting.
            with contextlib.suppress(DriverError):
                _call(lambda: _undefine(dom))
            self._delete_files(instance_id)
            raise

    def destroy(self, instance_id: str) -> None:
        _check_id(instance_id)
        dom = self._lookup(instance_id)
        if dom is None:
            # Gone already (migrated away, or undefined behind our back): its files go too.
            self._delete_files(instance_id)
            raise InstanceNotFound(f"instance {instance_id} is not on this host")
        self._stop(dom)
        _call(lambda: _undefine(dom))
        # Only ever our own files, whatever a domain's XML may name.
        self._delete_files(instance_id)

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
        elif _call(lambda: int(dom.state()[0])) == libvirt.VIR_DOMAIN_PAUSED:
            _call(dom.resume)

    def running(self) -> dict[str, RunningInstance]:
        out: dict[str, RunningInstance] = {}
        for name, xml, active in self._domains():
            instance_id = is_ours(xml)
            if instance_id is None or name != DOMAIN_PREFIX + instance_id:
                continue  # not Stowage's: left alone
            state = InstanceState.RUNNING if active else InstanceState.SHUTOFF
            if active and self._state(name) == libvirt.VIR_DOMAIN_PAUSED:
                state = InstanceState.PAUSED
            if not active and self._has_managed_save(name):
                state = InstanceState.SUSPENDED
            pins = dedicated_pins(xml)
            out[instance_id] = RunningInstance(pins=pins, state=state)
        return out

    def read_disk(
        self, instance_id: str, chunk_bytes: int, disk_format: str | None = None
    ) -> Iterator[bytes]:
        """The disk as one standalone image: an overlay is flattened with `qemu-img convert`
        (in a subprocess) to `disk_format` (default: the base image's format)."""
        if chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be positive")
        dom = self._get(instance_id)
        overlay = self._overlay_path(instance_id)
        if not overlay.exists():
            self._refuse_volume_root(dom, instance_id, "snapshot")
            disk = self._disk_path(instance_id)
            try:
                f = disk.open("rb")
            except FileNotFoundError:
                raise DriverError(
                    f"instance {instance_id} has no disk at {disk}", code="virt.libvirt.no_disk"
                ) from None
            # Opened here, not in a generator, so a missing disk fails at the call.
            return _chunks(f, chunk_bytes)
        target = disk_format or self._base_format(instance_id)
        if target not in ("raw", "qcow2"):
            raise DriverError(
                f"cannot snapshot to disk_format {target!r}", code="virt.libvirt.snapshot_format"
            )
        out = Path(tempfile.mkdtemp(prefix="snap-", dir=self.disk_dir)) / f"disk.{target}"
        try:
            qemu_img("convert", "-U", "-f", "qcow2", "-O", target, str(overlay), str(out))
            f = out.open("rb")
        except BaseException:
            shutil.rmtree(out.parent, ignore_errors=True)
            raise
        return _chunks(f, chunk_bytes, cleanup=lambda: shutil.rmtree(out.parent, True))

    def attach_volume(self, instance_id: str, device: str, connection: dict[str, Any]) -> None:
        """The volume as a virtio disk at `device`: hot-plugged into the running guest and
        added to its persistent definition (whichever lacks it), so that it survives a
        restart of the domain. The same volume at the same device again is no change."""
        dom = self._get(instance_id)
        disk = volume_disk(device, connection)
        with self._define_lock:
            config, live = self._xml_pair(dom)
            if disk.target == ROOT_TARGET:
                if _disks(config).get(ROOT_TARGET, ("", ""))[1] == str(disk.path):
                    return  # the root volume: in the definition since the spawn
                raise DriverError(
                    f"{device} is the root disk of instance {instance_id}",
                    code="virt.volume.device_in_use",
                )
            if self._has_managed_save(DOMAIN_PREFIX + instance_id):
                raise DriverError(
                    f"instance {instance_id} is suspended: its saved memory names its disks, "
                    "resume it to attach a volume",
                    code="virt.volume.suspended",
                )
            flags = 0
            for xml, flag in (
                (config, libvirt.VIR_DOMAIN_AFFECT_CONFIG),
                (live, libvirt.VIR_DOMAIN_AFFECT_LIVE),
            ):
                if xml is None:
                    continue
                disks = _disks(xml)
                present = disks.get(disk.target)
                if present is None:
                    elsewhere = [t for t, (_k, p) in disks.items() if p == str(disk.path)]
                    if elsewhere:
                        raise DriverError(
                            f"volume {disk.path} is attached to instance {instance_id} at "
                            f"/dev/{elsewhere[0]} already",
                            code="virt.volume.already_attached",
                        )
                    flags |= flag
                elif present[1] != str(disk.path):
                    raise DriverError(
                        f"{device} of instance {instance_id} is another disk ({present[1]})",
                        code="virt.volume.device_in_use",
                    )
            if flags:
                element = ET.tostring(_disk_element(None, disk), encoding="unicode")
                _call(lambda: dom.attachDeviceFlags(element, flags))

    def detach_volume(self, instance_id: str, device: str) -> None:
        """The disk at `device` out of the persistent definition and out of the running
        guest, which must let it go (ACPI unplug) within `detach_timeout_s`; else an error,
        the disk still in the running guest (until a detach again, or its next start)."""
        dom = self._get(instance_id)
        target = device.removeprefix("/dev/")
        if target == ROOT_TARGET:
            raise DriverError(
                f"{device} is the root disk of instance {instance_id}", code="virt.volume.root"
            )
        with self._define_lock:
            config, live = self._xml_pair(dom)
            element = (live and _disk_xml(live, target)) or _disk_xml(config, target)
            if element is None:
                return
            if self._has_managed_save(DOMAIN_PREFIX + instance_id):
                raise DriverError(
                    f"instance {instance_id} is suspended: its saved memory names its disks, "
                    "resume it to detach a volume",
                    code="virt.volume.suspended",
                )
            flags = libvirt.VIR_DOMAIN_AFFECT_CONFIG if target in _disks(config) else 0
            if live is not None and target in _disks(live):
                flags |= libvirt.VIR_DOMAIN_AFFECT_LIVE
            _call(lambda: dom.detachDeviceFlags(element, flags))
        if flags & libvirt.VIR_DOMAIN_AFFECT_LIVE:
            self._wait_unplugged(dom, lambda xml: target in _disks(xml), device)

    def _wait_unplugged(self, dom: Any, present: Callable[[str], bool], what: str) -> None:
        """Until the running guest let the device go (ACPI unplug), or `detach_timeout_s`."""
        deadline = time.monotonic() + self.detach_timeout_s
        while True:
            if not _call(lambda: bool(dom.isActive())):
                return
            if not present(_call(lambda: str(dom.XMLDesc(0)))):
                return
            if time.monotonic() > deadline:
                raise DriverError(
                    f"{_call(dom.name)} did not release {what} within "
                    f"{self.detach_timeout_s:g} s (the guest must acknowledge the unplug); "
                    "it is out of the definition, still in the running guest",
                    code="virt.volume.detach_timeout"
                    if what.startswith("/dev/")
                    else "virt.interface.detach_timeout",
                )
            time.sleep(0.25)

    def console_output(self, instance_id: str, length: int | None = None) -> str:
        self._get(instance_id)
        try:
            text = self._console_path(instance_id).read_text(errors="replace")
        except FileNotFoundError:
            text = ""
        if length is not None:
            lines = text.splitlines(keepends=True)
            text = "".join(lines[-length:]) if length > 0 else ""
        return text

    def open_serial_console(self, instance_id: str, output: SerialOutput) -> _LibvirtSerial:
        """The domain's serial pty through libvirt (a stream, so this host's agent needs no
        access to the pty itself); FORCE takes it from an older session."""
        dom = self._get(instance_id)
        if not _call(lambda: bool(dom.isActive())):
            raise DriverError(
                f"instance {instance_id} is not running: no serial console to open",
                code="virt.console.not_running",
            )
        stream = _call(lambda: self._connection().newStream(libvirt.VIR_STREAM_NONBLOCK))
        try:
            _call(lambda: dom.openConsole(None, stream, libvirt.VIR_DOMAIN_CONSOLE_FORCE))
        except DriverError as exc:
            with contextlib.suppress(libvirt.libvirtError):
                stream.abort()
            raise DriverError(
                f"instance {instance_id} has no serial console to open: {exc.message}",
                code="virt.console.unavailable",
            ) from None
        return _LibvirtSerial(stream, output)

    def pause(self, instance_id: str) -> None:
        _call(self._get(instance_id).suspend)

    def unpause(self, instance_id: str) -> None:
        _call(self._get(instance_id).resume)

    def suspend(self, instance_id: str) -> None:
        _call(self._get(instance_id).managedSave)

    def resume(self, instance_id: str) -> None:
        _call(self._get(instance_id).create)

    def rescue(self, instance_id: str, image: ImageSpec | None, admin_password: str) -> None:
        """Nova's rescue: the guest boots again from a fresh overlay on the rescue image,
        with its own root disk second; the definition before it is kept beside the disk for
        `unrescue`. A failure on the way puts the old definition back. The password is not
        injected: as in Nova's libvirt driver without file injection, the rescue image's
        own credentials apply."""
        if image is None:
            raise DriverError(
                f"a rescue of instance {instance_id} needs an image", code="virt.rescue.no_image"
            )
        dom = self._get(instance_id)
        saved = self._unrescue_path(instance_id)
        with self._define_lock:
            if saved.exists():
                return  # rescued already
            self._refuse_volume_root(dom, instance_id, "rescue")
            if self._has_managed_save(DOMAIN_PREFIX + instance_id):
                raise DriverError(
                    f"instance {instance_id} is suspended: resume it to rescue it",
                    code="virt.rescue.suspended",
                )
            config = _call(lambda: str(dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)))
            disk = self._rescue_disk_path(instance_id)
            base = self.images.path(image)
            disk.unlink(missing_ok=True)
            qemu_img(
                "create", "-q", "-f", "qcow2", "-F", image.disk_format, "-b",
                str(base.resolve()), str(disk),
            )  # fmt: skip
            saved.write_text(config)
            try:
                self._stop(dom)
                conn = self._connection()
                _call(lambda: conn.defineXML(rescue_xml(config, disk)))
                _call(dom.create)
            except DriverError:
                with contextlib.suppress(DriverError):
                    self._stop(dom)
                    _call(lambda: self._connection().defineXML(config))
                saved.unlink(missing_ok=True)
                disk.unlink(missing_ok=True)
                raise

    def unrescue(self, instance_id: str) -> None:
        """The definition from before the rescue, booted again; the rescue disk goes."""
        dom = self._get(instance_id)
        saved = self._unrescue_path(instance_id)
        with self._define_lock:
            if not saved.exists():
                return
            config = saved.read_text()
            self._stop(dom)
            _call(lambda: self._connection().defineXML(config))
            _call(dom.create)
            saved.unlink(missing_ok=True)
            self._rescue_disk_path(instance_id).unlink(missing_ok=True)

    def attach_interface(self, instance_id: str, nic: Nic) -> None:
        """A virtio NIC with the port's MAC, hot-plugged into the running guest and added to
        its persistent definition (whichever lacks it)."""
        dom = self._get(instance_id)
        mac = nic.mac.lower()
        with self._define_lock:
            config, live = self._xml_pair(dom)
            flags = 0 if mac in _interfaces(config) else libvirt.VIR_DOMAIN_AFFECT_CONFIG
            if live is not None and mac not in _interfaces(live):
                flags |= libvirt.VIR_DOMAIN_AFFECT_LIVE
            if flags:
                element = ET.tostring(_interface_element(None, mac), encoding="unicode")
                _call(lambda: dom.attachDeviceFlags(element, flags))

    def detach_interface(self, instance_id: str, mac: str) -> None:
        """The NIC out of the persistent definition and out of the running guest, which
        must let it go (ACPI unplug) within `detach_timeout_s`."""
        dom = self._get(instance_id)
        mac = mac.lower()
        with self._define_lock:
            config, live = self._xml_pair(dom)
            element = (live and _interfaces(live).get(mac)) or _interfaces(config).get(mac)
            if element is None:
                return
            flags = libvirt.VIR_DOMAIN_AFFECT_CONFIG if mac in _interfaces(config) else 0
            if live is not None and mac in _interfaces(live):
                flags |= libvirt.VIR_DOMAIN_AFFECT_LIVE
            _call(lambda: dom.detachDeviceFlags(element, flags))
        if flags & libvirt.VIR_DOMAIN_AFFECT_LIVE:
            self._wait_unplugged(dom, lambda xml: mac in _interfaces(xml), f"NIC {mac}")

    def set_admin_password(self, instance_id: str, password: str) -> None:
        """Only a QEMU guest agent can set a password, and these guests have none (Nova's
        libvirt driver refuses the same way without `hw_qemu_guest_agent`)."""
        self._get(instance_id)
        raise DriverError(
            f"instance {instance_id} has no QEMU guest agent to set its password",
            code="virt.password.no_guest_agent",
        )

    def inject_nmi(self, instance_id: str) -> None:
        """virDomainInjectNMI: the guest kernel's NMI handler runs (kdump, or a panic)."""
        dom = self._get(instance_id)
        if not _call(lambda: bool(dom.isActive())):
            raise DriverError(f"instance {instance_id} is not running", code="virt.nmi.not_running")
        _call(lambda: dom.injectNMI(0))

    # -- live migration ----------------------------------------------------------------

    def prepare_migration(self, instance_id: str, guest: Guest) -> dict[str, Any]:
        """The incoming guest's disk (an overlay on this host's cached base), its config
        drive, and the identity of each volume's file as this host sees it."""
        _check_id(instance_id)
        with self._define_lock:
            if self._lookup(instance_id) is not None:
                raise DriverError(f"instance {instance_id} already exists", code="virt.exists")
            check_claim(
                self.topology,
                dict(guest.pins),
                list(guest.cells),
                guest.memory_mb,
                self._pinned_by_others(),
                guest,
                guest.shared_cpus or self.topology.cpu_shared_set,
            )
            volumes = self._volume_disks(guest)
            self._check_config_drive(guest)
            disk, disk_format = self._create_disk(instance_id, guest)
            try:
                config_drive = self._write_config_drive(instance_id, guest)
            except DriverError:
                self._delete_files(instance_id)
                raise
        console = self._console_path(instance_id)
        identities = {v.target: _file_identity(v.path) for v in volumes}
        if guest.root_volume is not None:
            identities[ROOT_TARGET] = _file_identity(disk)
        return {
            "uri": self.uri,
            "host_uuid": self.host_uuid,
            "migration_uri": self.migration_uri,
            "disk": str(disk),
            "disk_format": disk_format,
            "console": str(console),
            "shared_cpus": sorted(guest.shared_cpus or self.topology.cpu_shared_set),
            "config_drive": None if config_drive is None else str(config_drive),
            "machine_id": _machine_id(),
            "volumes": identities,
        }

    def migrate(
        self,
        instance_id: str,
        target: MigrationTarget,
        progress: ProgressCallback | None = None,
    ) -> None:
        """Peer-to-peer live migration with the root disk copied (no shared storage),
        defined on the destination with the destination's pins, cells, disk, config drive
        and console paths.

        A volume is not copied: it must be the very file the destination opens (the same
        machine, the same inode), else the migration is refused before it starts. libvirt
        cannot tell such a file from a local disk on another machine and calls the move
        unsafe, so VIR_MIGRATE_UNSAFE is passed then: one kernel's page cache serves both
        QEMUs, and the destination's opens the file only once the source's let it go."""
        dom = self._get(instance_id)
        handle = dict(target.handle)
        dest_uri = str(handle["uri"])
        if handle.get("host_uuid") and handle["host_uuid"] == self.host_uuid:
            raise DriverError(
                "the destination is this very hypervisor", code="virt.migrate.same_host"
            )
        xml = _call(lambda: str(dom.XMLDesc(libvirt.VIR_DOMAIN_XML_MIGRATABLE)))
        own = {str(self._overlay_path(instance_id)), str(self._disk_path(instance_id))}
        copied: list[str] = []
        shared: list[tuple[str, str]] = []
        config_drive: str | None = None
        for disk_target, (kind, path) in _disks(xml).items():
            if kind == "cdrom":
                config_drive = path or config_drive
            elif path in own:
                copied.append(disk_target)
            else:
                shared.append((disk_target, path))
        there = dict(handle.get("volumes") or {})
        machine = _machine_id()
        for disk_target, path in shared:
            same = bool(machine) and handle.get("machine_id") == machine
            if not same or there.get(disk_target) != _file_identity(Path(path)):
                raise DriverError(
                    f"the volume at /dev/{disk_target} ({path}) is not the same file on "
                    f"{target.host}: a volume's file is not copied, and only hypervisors on "
                    "one machine share it",
                    code="virt.migrate.volume_not_shared",
                )
        if config_drive and not handle.get("config_drive"):
            raise DriverError(
                f"instance {instance_id} has a config drive, {target.host} made none for it",
                code="virt.migrate.config_drive",
            )
        dest_xml = rewrite_for_destination(
            xml,
            target.guest,
            shared_cpus=frozenset(int(c) for c in handle.get("shared_cpus") or ()),
            disk=Path(str(handle["disk"])),
            console_log=Path(str(handle["console"])),
            config_drive=Path(str(handle["config_drive"])) if config_drive else None,
        )
        params: dict[str, Any] = {libvirt.VIR_MIGRATE_PARAM_DEST_XML: dest_xml}
        if handle.get("migration_uri"):
            params[libvirt.VIR_MIGRATE_PARAM_URI] = str(handle["migration_uri"])
        flags = (
            libvirt.VIR_MIGRATE_LIVE
            | libvirt.VIR_MIGRATE_PEER2PEER
            | libvirt.VIR_MIGRATE_PERSIST_DEST
            | libvirt.VIR_MIGRATE_UNDEFINE_SOURCE
        )
        if copied:
            flags |= libvirt.VIR_MIGRATE_NON_SHARED_INC
            params[libvirt.VIR_MIGRATE_PARAM_MIGRATE_DISKS] = copied
        if shared:
            flags |= libvirt.VIR_MIGRATE_UNSAFE
        done = threading.Event()
        watcher: threading.Thread | None = None
        if progress is not None:
            watcher = threading.Thread(
                target=self._watch_job,
                args=(instance_id, progress, done),
                name=f"migrate-{instance_id}",
                daemon=True,
            )
            watcher.start()
        try:
            _call(lambda: dom.migrateToURI3(dest_uri, params, flags))
        finally:
            done.set()
            if watcher is not None:
                watcher.join(timeout=5)
        # The source is undefined; the overlay and the console log here are ours to drop.
        self._delete_files(instance_id)

    def migration_progress(self, instance_id: str) -> MigrationProgress | None:
        dom = self._get(instance_id)
        stats = _call(lambda: dict(dom.jobStats(0)))
        if int(stats.get("type", libvirt.VIR_DOMAIN_JOB_NONE)) in (
            libvirt.VIR_DOMAIN_JOB_NONE,
            libvirt.VIR_DOMAIN_JOB_COMPLETED,
            libvirt.VIR_DOMAIN_JOB_FAILED,
            libvirt.VIR_DOMAIN_JOB_CANCELLED,
        ):
            return None
        return MigrationProgress(
            memory_total_bytes=int(stats.get("memory_total", 0)),
            memory_processed_bytes=int(stats.get("memory_processed", 0)),
            memory_remaining_bytes=int(stats.get("memory_remaining", 0)),
            disk_total_bytes=int(stats.get("disk_total", 0)),
            disk_processed_bytes=int(stats.get("disk_processed", 0)),
            disk_remaining_bytes=int(stats.get("disk_remaining", 0)),
        )

    def finish_migration(self, instance_id: str) -> None:
        dom = self._get(instance_id)
        if not _call(lambda: bool(dom.isActive())):
            raise DriverError(
                f"instance {instance_id} arrived but does not run", code="virt.migrate.not_running"
            )
        if _call(lambda: int(dom.state()[0])) == libvirt.VIR_DOMAIN_PAUSED:
            _call(dom.resume)  # force-complete paused it on the source

    def abort_migration(self, instance_id: str) -> None:
        dom = self._get(instance_id)
        if self.migration_progress(instance_id) is None:
            raise DriverError(
                f"instance {instance_id} has no migration job", code="virt.migrate.no_job"
            )
        _call(dom.abortJob)

    def force_complete_migration(self, instance_id: str) -> None:
        dom = self._get(instance_id)
        if self.migration_progress(instance_id) is None:
            raise DriverError(
                f"instance {instance_id} has no migration job", code="virt.migrate.no_job"
            )
        _call(dom.suspend)  # a paused guest dirties no memory: the copy converges

    def rollback_migration(self, instance_id: str) -> None:
        dom = self._lookup(instance_id)
        if dom is not None:
            if _call(lambda: bool(dom.isActive())) and not _incoming(dom):
                raise DriverError(
                    f"instance {instance_id} runs here: not an incoming migration",
                    code="virt.migrate.not_incoming",
                )
            self._stop(dom)
            with contextlib.suppress(InstanceNotFound):
                _call(lambda: _undefine(dom))
        self._delete_files(instance_id)

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

    def _create_disk(self, instance_id: str, guest: Guest) -> tuple[Path, str]:
        """A qcow2 overlay on the cached base image (root_gb big, if larger), or a blank raw
        disk for a guest with no image; the root volume's own file for a guest booting from a
        volume. Blocking: HTTP, disk and `qemu-img`."""
        root = guest.root_volume
        if root is not None:
            volume = volume_disk(root.device, root.connection)
            if volume.target != ROOT_TARGET:
                raise DriverError(
                    f"the root volume must be at /dev/{ROOT_TARGET}, not {root.device}",
                    code="virt.volume.bad_device",
                )
            return volume.path, volume.disk_format
        if guest.disk_source is not None:
            return self._take_disk(instance_id, guest, guest.disk_source)
        if guest.image is None:
            disk = self._disk_path(instance_id)
            try:
                _write_disk(disk, self.disk_bytes)
            except OSError as exc:
                raise DriverError(
                    f"cannot create the disk {disk}: {exc}", code="virt.libvirt.disk"
                ) from None
            return disk, "raw"
        base = self.images.path(guest.image)
        overlay = self._overlay_path(instance_id)
        size = max(virtual_size(base, guest.image.disk_format), guest.root_gb * 1024**3)
        overlay.unlink(missing_ok=True)
        qemu_img(
            "create",
            "-q",
            "-f",
            "qcow2",
            "-F",
            guest.image.disk_format,
            "-b",
            str(base.resolve()),
            str(overlay),
            str(size),
        )
        base_format = guest.image.disk_format
        if guest.rebase_image is not None:
            # A safe rebase: what differs between the two bases goes into the overlay.
            own = self.images.path(guest.rebase_image)
            base_format = guest.rebase_image.disk_format
            qemu_img(
                "rebase", "-q", "-f", "qcow2", "-F", base_format, "-b", str(own.resolve()),
                str(overlay),
            )  # fmt: skip
        elif guest.flatten_disk:
            qemu_img("rebase", "-q", "-f", "qcow2", "-b", "", str(overlay))
        (self.disk_dir / f"{instance_id}.base").write_text(base_format)
        return overlay, "qcow2"

    def _take_disk(
        self, instance_id: str, guest: Guest, source: Mapping[str, Any]
    ) -> tuple[Path, str]:
        """A cold move's destination: the disk the source staged (`export_disk`), streamed
        from the source's libvirt over its connection (no shared storage), the overlay put
        on this host's own cached base and grown to the flavor's root disk. Blocking."""
        disk_format = str(source.get("format") or "")
        if disk_format not in ("qcow2", "raw"):
            raise DriverError(
                f"a moved disk must be qcow2 or raw, not {disk_format!r}",
                code="virt.libvirt.disk_move",
            )
        if disk_format == "qcow2" and guest.image is None:
            raise DriverError(
                f"instance {instance_id}'s overlay needs its base image, which is gone",
                code="virt.libvirt.disk_move_no_base",
            )
        target = (
            self._overlay_path(instance_id)
            if disk_format == "qcow2"
            else (self._disk_path(instance_id))
        )
        part = target.with_name(target.name + ".part")
        try:
            _download_volume(str(source["uri"]), str(source["pool"]), str(source["volume"]), part)
            if disk_format == "qcow2":
                assert guest.image is not None
                base = self.images.path(guest.image)
                base_format = str(source.get("base_format") or guest.image.disk_format)
                qemu_img(
                    "rebase", "-u", "-f", "qcow2", "-F", base_format, "-b", str(base.resolve()),
                    str(part),
                )  # fmt: skip
                (self.disk_dir / f"{instance_id}.base").write_text(base_format)
            want = guest.root_gb * 1024**3
            if want > virtual_size(part, disk_format):
                qemu_img("resize", "-q", "-f", disk_format, str(part), str(want))
            part.replace(target)
        finally:
            part.unlink(missing_ok=True)
        return target, disk_format

    def export_disk(self, instance_id: str) -> dict[str, Any]:
        """The instance's disk staged for a cold move: its overlay copied with `qemu-img
        convert` (a consistent copy even while the guest runs, as a snapshot's), still on the
        same base, in a libvirt directory pool the destination streams it from. A guest
        booting from a volume has no disk of its own to move: the volume stays, and the
        destination boots from it (`format` "volume")."""
        dom = self._get(instance_id)
        if self._root_is_volume(dom, instance_id):
            return {"uri": self.uri, "host_uuid": self.host_uuid, "format": "volume"}
        outgoing = self.disk_dir / "outgoing"
        outgoing.mkdir(exist_ok=True)
        overlay = self._overlay_path(instance_id)
        base_format: str | None = None
        if overlay.exists():
            disk_format, source = "qcow2", overlay
            base_format = self._base_format(instance_id)
            info = json.loads(qemu_img("info", "-U", "--output=json", "-f", "qcow2", str(overlay)))
            base = str(info.get("full-backing-filename") or info.get("backing-filename") or "")
            backing = ["-B", base, "-F", base_format] if base else []
        else:
            disk_format, source, backing = "raw", self._disk_path(instance_id), []
        name = f"{instance_id}.{disk_format}"
        part = outgoing / f".{name}.part"
        try:
            qemu_img(
                "convert", "-U", "-f", disk_format, "-O", disk_format, *backing, str(source),
                str(part),
            )  # fmt: skip
            part.replace(outgoing / name)
        finally:
            part.unlink(missing_ok=True)
        pool = self._outgoing_pool(outgoing)
        _call(lambda: pool.refresh(0))
        return {
            "uri": self.uri,
            "host_uuid": self.host_uuid,
            "pool": str(_call(pool.name)),
            "volume": name,
            "format": disk_format,
            "base_format": base_format,
        }

    def _outgoing_pool(self, directory: Path) -> Any:
        """The (transient) libvirt directory pool over `directory`, started if need be."""
        name = "stowage-outgoing-" + hashlib.sha1(str(directory).encode()).hexdigest()[:12]
        conn = self._connection()
        with self._define_lock:
            try:
                return conn.storagePoolLookupByName(name)
            except libvirt.libvirtError:
                pass
            xml = (
                f"<pool type='dir'><name>{name}</name>"
                f"<target><path>{directory}</path></target></pool>"
            )
            return _call(lambda: conn.storagePoolCreateXML(xml, 0))

    def _base_format(self, instance_id: str) -> str:
        try:
            return (self.disk_dir / f"{instance_id}.base").read_text().strip() or "raw"
        except FileNotFoundError:
            return "raw"

    def _delete_files(self, instance_id: str) -> None:
        outgoing = self.disk_dir / "outgoing"
        for path in (
            outgoing / f"{instance_id}.qcow2",
            outgoing / f"{instance_id}.raw",
            self._disk_path(instance_id),
            self._overlay_path(instance_id),
            self.disk_dir / f"{instance_id}.base",
            self._config_drive_path(instance_id),
            self._console_path(instance_id),
            self._rescue_disk_path(instance_id),
            self._unrescue_path(instance_id),
        ):
            path.unlink(missing_ok=True)

    def _watch_job(
        self, instance_id: str, progress: ProgressCallback, done: threading.Event
    ) -> None:
        while not done.wait(0.5):
            try:
                seen = self.migration_progress(instance_id)
            except (DriverError, DriverCrashed):
                return
            if seen is not None:
                try:
                    progress(seen)
                except Exception:
                    log.exception("migration progress callback failed")

    def _state(self, name: str) -> int | None:
        try:
            return int(self._connection().lookupByName(name).state()[0])
        except libvirt.libvirtError:
            return None

    def _has_managed_save(self, name: str) -> bool:
        try:
            dom = self._connection().lookupByName(name)
            return bool(dom.hasManagedSaveImage(0))
        except libvirt.libvirtError:
            return False

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

    def _overlay_path(self, instance_id: str) -> Path:
        return self.disk_dir / f"{instance_id}.qcow2"

    def _rescue_disk_path(self, instance_id: str) -> Path:
        return self.disk_dir / f"{instance_id}.rescue.qcow2"

    def _unrescue_path(self, instance_id: str) -> Path:
        return self.disk_dir / f"{instance_id}.unrescue.xml"

    def _config_drive_path(self, instance_id: str) -> Path:
        return self.disk_dir / f"{instance_id}.config.iso"

    def _volume_disks(self, guest: Guest) -> list[VolumeDisk]:
        """The guest's volumes but its root one, as disks; refused (before anything is
        made) when one cannot be opened here, or two share a device."""
        out = [volume_disk(v.device, v.connection) for v in guest.volumes if v.boot_index != 0]
        targets = [ROOT_TARGET, *(v.target for v in out)]
        if len(set(targets)) != len(targets):
            raise DriverError(
                f"two disks at one device: {sorted(targets)}", code="virt.volume.device_in_use"
            )
        return out

    def _check_config_drive(self, guest: Guest) -> str:
        if guest.config_drive is not None and self.cdrom_bus is None:
            raise DriverError(
                f"a config drive needs a cdrom, which this driver offers on x86 only "
                f"(this host is {self.arch})",
                code="virt.config_drive.unsupported",
            )
        return self.cdrom_bus or "ide"

    def _write_config_drive(self, instance_id: str, guest: Guest) -> Path | None:
        if guest.config_drive is None:
            return None
        out = self._config_drive_path(instance_id)
        try:
            build_config_drive(dict(guest.config_drive), out)
        except OSError as exc:
            raise DriverError(
                f"cannot write the config drive {out}: {exc}", code="virt.config_drive.write"
            ) from None
        return out

    def _xml_pair(self, dom: Any) -> tuple[str, str | None]:
        """The persistent definition and, for a running domain, the live one."""
        config = _call(lambda: str(dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)))
        live = _call(lambda: str(dom.XMLDesc(0))) if _call(lambda: bool(dom.isActive())) else None
        return config, live

    def _root_is_volume(self, dom: Any, instance_id: str) -> bool:
        xml = _call(lambda: str(dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)))
        root = _disks(xml).get(ROOT_TARGET)
        own = {str(self._overlay_path(instance_id)), str(self._disk_path(instance_id))}
        return root is not None and root[1] not in own

    def _refuse_volume_root(self, dom: Any, instance_id: str, what: str) -> None:
        if self._root_is_volume(dom, instance_id):
            raise DriverError(
                f"instance {instance_id} boots from a volume: {what} the volume through the "
                "volume service",
                code="virt.libvirt.volume_root",
            )

    def _console_path(self, instance_id: str) -> Path:
        return self.console_dir / f"{instance_id}.log"

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
        """Host CPUs that Stowage's other domains hold as dedicated pins (foreign domains
        are not Stowage's business; shared vCPUs float and hold nothing)."""
        taken: dict[int, str] = {}
        for name, xml, _active in self._domains():
            if is_ours(xml) is None:
                continue
            for cpu in dedicated_pins(xml).values():
                taken.setdefault(cpu, name)
        return taken


_STREAM_READ = (
    libvirt.VIR_STREAM_EVENT_READABLE
    | libvirt.VIR_STREAM_EVENT_ERROR
    | libvirt.VIR_STREAM_EVENT_HANGUP
)
_STREAM_READ_WRITE = _STREAM_READ | libvirt.VIR_STREAM_EVENT_WRITABLE


class _LibvirtSerial:
    """One session on a domain's console: a non-blocking stream served by libvirt's event
    loop thread, which reads whatever the guest says and sends what `write` queued (the
    agent's loop never waits on libvirt)."""

    def __init__(self, stream: Any, output: SerialOutput) -> None:
        self._stream = stream
        self._output = output
        self._lock = threading.Lock()
        self._pending = bytearray()
        self._closed = False
        stream.eventAddCallback(_STREAM_READ, self._event, None)

    def write(self, data: bytes) -> None:
        with self._lock:
            if self._closed:
                return
            self._pending += data
        with contextlib.suppress(libvirt.libvirtError):
            self._stream.eventUpdateCallback(_STREAM_READ_WRITE)

    def close(self) -> None:
        self._end(tell=False)

    def _event(self, stream: Any, events: int, _opaque: Any) -> None:
        """In libvirt's event thread."""
        try:
            if events & libvirt.VIR_STREAM_EVENT_READABLE:
                while not self._closed:
                    data = stream.recv(16384)
                    if data == -2:  # nothing more for now
                        break
                    if not data:  # the guest's end closed
                        self._end(tell=True)
                        return
                    self._output(bytes(data))
            if events & libvirt.VIR_STREAM_EVENT_WRITABLE:
                self._flush()
        except libvirt.libvirtError:
            self._end(tell=True)
            return
        if events & (libvirt.VIR_STREAM_EVENT_ERROR | libvirt.VIR_STREAM_EVENT_HANGUP):
            self._end(tell=True)

    def _flush(self) -> None:
        with self._lock:
            while self._pending and not self._closed:
                sent = self._stream.send(bytes(self._pending))
                if sent == -2:  # the pty is full: wait for the next writable event
                    return
                del self._pending[:sent]
        self._stream.eventUpdateCallback(_STREAM_READ)

    def _end(self, *, tell: bool) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        with contextlib.suppress(libvirt.libvirtError):
            self._stream.eventRemoveCallback()
        with contextlib.suppress(libvirt.libvirtError):
            self._stream.abort()
        if tell:
            self._output(b"")


def _describe(dom: Any) -> tuple[str, str, bool]:
    return str(dom.name()), str(dom.XMLDesc(0)), bool(dom.isActive())


def _chunks(f: Any, chunk_bytes: int, cleanup: Callable[[], None] | None = None) -> Iterator[bytes]:
    try:
        with f:
            while chunk := f.read(chunk_bytes):
                yield bytes(chunk)
    finally:
        if cleanup is not None:
            cleanup()


def _incoming(dom: Any) -> bool:
    """A domain still receiving a migration (libvirt shows it paused, reason "migration")."""
    state, reason = dom.state()
    return bool(
        state == libvirt.VIR_DOMAIN_PAUSED and reason == libvirt.VIR_DOMAIN_PAUSED_MIGRATION
    )


def dedicated_pins(xml: str) -> dict[int, int]:
    """Guest vCPU -> host CPU for the dedicated vCPUs: every vcpupin but those of the vCPUs
    the metadata names shared (they float over the shared set). What libvirt enforces, so a
    stray `virsh vcpupin` shows."""
    root = ET.fromstring(xml)
    shared_text = root.findtext(
        f"./metadata/{{{METADATA_NS}}}instance/{{{METADATA_NS}}}shared-vcpus"
    )
    shared = parse_cpu_set(shared_text or "", what="shared vCPUs")
    pins = parse_pins(xml)
    return {vcpu: cpu for vcpu, cpu in pins.items() if vcpu not in shared}


def rewrite_for_destination(
    xml: str,
    guest: Guest,
    *,
    shared_cpus: frozenset[int],
    disk: Path,
    console_log: Path,
    config_drive: Path | None = None,
) -> str:
    """The source's migratable XML with the destination's claim in it: its pins, emulator
    pins, NUMA cells and memory nodes (Nova before Train kept the source's: seed 002), and
    the destination's own root disk, config drive and console paths. Volumes keep their
    paths: they are not copied."""
    root = ET.fromstring(xml)
    cputune = root.find("cputune")
    if cputune is None:
        cputune = ET.SubElement(root, "cputune")
    for el in list(cputune):
        if el.tag in ("vcpupin", "emulatorpin"):
            cputune.remove(el)
    shared_text = format_cpu_set(set(shared_cpus))
    for vcpu in range(guest.vcpus):
        cpuset = str(guest.pins[vcpu]) if vcpu in guest.pins else shared_text
        ET.SubElement(cputune, "vcpupin", vcpu=str(vcpu), cpuset=cpuset)
    emulator = set(shared_cpus) if guest.shared_vcpus else set(guest.pins.values())
    ET.SubElement(cputune, "emulatorpin", cpuset=format_cpu_set(emulator))
    vcpu_el = root.find("vcpu")
    if vcpu_el is not None and "cpuset" in vcpu_el.attrib:
        vcpu_el.set("cpuset", shared_text)
    numatune = root.find("numatune")
    if numatune is not None and guest.cells:
        for el in list(numatune):
            numatune.remove(el)
        ET.SubElement(numatune, "memory", mode="strict", nodeset=format_cpu_set(set(guest.cells)))
        for guest_cell, host_cell in enumerate(guest.cells):
            ET.SubElement(
                numatune, "memnode", cellid=str(guest_cell), mode="strict", nodeset=str(host_cell)
            )
    for disk_el in root.findall("./devices/disk"):
        source, target = disk_el.find("source"), disk_el.find("target")
        if source is None or target is None or not source.get("file"):
            continue
        if disk_el.get("device") == "cdrom":
            if config_drive is not None:
                source.set("file", str(config_drive))
        elif target.get("dev") == ROOT_TARGET:
            source.set("file", str(disk))
    for kind in ("serial", "console"):
        for chardev in root.findall(f"./devices/{kind}"):
            source, logged = chardev.find("source"), chardev.find("log")
            if logged is not None:
                logged.set("file", str(console_log))
            if source is None:
                continue
            if chardev.get("type") == "pty":
                chardev.remove(source)  # the source's pty: the destination allocates its own
            elif source.get("path"):
                source.set("path", str(console_log))  # a guest defined with a file console
    return ET.tostring(root, encoding="unicode")


def _download_volume(uri: str, pool: str, volume: str, out: Path) -> None:
    """Stream a storage volume of the libvirt at `uri` into `out`, then delete it there (the
    staged copy is taken). Blocking."""
    try:
        conn = libvirt.open(uri)
    except libvirt.libvirtError as exc:
        raise DriverError(
            f"cannot reach the source's libvirt {uri}: {exc}", code="virt.libvirt.disk_move"
        ) from None
    try:
        vol = conn.storagePoolLookupByName(pool).storageVolLookupByName(volume)
        stream = conn.newStream(0)
        with out.open("wb") as f:
            vol.download(stream, 0, 0, 0)

            def sink(_stream: Any, data: bytes, target: Any) -> int:
                return int(target.write(data))

            stream.recvAll(sink, f)
            stream.finish()
        vol.delete(0)
    except libvirt.libvirtError as exc:
        raise DriverError(
            f"cannot take volume {volume} from {uri}: {exc}", code="virt.libvirt.disk_move"
        ) from None
    finally:
        with contextlib.suppress(libvirt.libvirtError):
            conn.close()


def _file_identity(path: Path) -> list[int]:
    """(device, inode) of a file: two paths are one file when theirs match on one machine."""
    try:
        st = path.stat()
    except OSError:
        return []
    return [st.st_dev, st.st_ino]


def _machine_id() -> str:
    for candidate in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        with contextlib.suppress(OSError):
            text = Path(candidate).read_text().strip()
            if text:
                return text
    return ""


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


def _guest_types(capabilities: str, arch: str) -> set[str]:
    """The domain types offered for hvm guests of `arch`."""
    root = ET.fromstring(capabilities)
    out: set[str] = set()
    for guest in root.findall("./guest"):
        arch_el = guest.find("arch")
        if (
            guest.findtext("os_type") == "hvm"
            and arch_el is not None
            and arch_el.get("name") == arch
        ):
            out |= {d.get("type", "") for d in arch_el.findall("domain")}
    return out


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
