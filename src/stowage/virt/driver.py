"""The hypervisor driver port: blocking calls that the agent runs in its executors."""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol, TypedDict, runtime_checkable

from stowage.domain.errors import StowageError

__all__ = [
    "BlockDevice",
    "Driver",
    "DriverCrashed",
    "DriverError",
    "Guest",
    "ImageSpec",
    "InstanceNotFound",
    "InstanceState",
    "MigrationProgress",
    "MigrationTarget",
    "Nic",
    "RunningInstance",
    "SerialConsole",
    "SerialOutput",
    "check_guest",
    "guest_for",
]


class InstanceState(StrEnum):
    """What the hypervisor says an instance is doing."""

    RUNNING = "running"
    SHUTOFF = "shutoff"
    PAUSED = "paused"
    SUSPENDED = "suspended"


class RunningInstance(TypedDict):
    """One row of `Driver.running()`: guest vCPU -> host CPU pins, and the state."""

    pins: dict[int, int]
    state: InstanceState


@dataclass(frozen=True)
class ImageSpec:
    """The image a guest boots from, as the image API describes it."""

    id: str
    disk_format: str = "raw"
    size: int = 0
    checksum: str | None = None  # md5, Glance's `checksum`
    hash_algo: str | None = None  # Glance's `os_hash_algo` (sha512) ...
    hash_value: str | None = None  # ... and `os_hash_value`


@dataclass(frozen=True)
class Nic:
    """One port of the guest."""

    mac: str
    ips: tuple[str, ...] = ()
    network_id: str = ""
    port_id: str = ""


@dataclass(frozen=True)
class BlockDevice:
    """One volume of the guest: the device it is at (`/dev/vdb`; `/dev/vda` with boot index
    0 is the root disk, boot from volume), and how the host reaches it (os-brick's connection
    info, as the volume backend answers it: `{"driver_volume_type": "local", "data":
    {"device_path": ...}}`)."""

    device: str
    connection: Mapping[str, Any]
    boot_index: int | None = None
    volume_id: str = ""

    def to_payload(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "connection": dict(self.connection),
            "boot_index": self.boot_index,
            "volume_id": self.volume_id,
        }

    @classmethod
    def from_payload(cls, payload: Mapping[str, Any]) -> BlockDevice:
        boot_index = payload.get("boot_index")
        return cls(
            device=str(payload["device"]),
            connection=dict(payload.get("connection") or {}),
            boot_index=None if boot_index is None else int(boot_index),
            volume_id=str(payload.get("volume_id") or ""),
        )


@dataclass(frozen=True)
class Guest:
    """Everything a hypervisor needs to build one guest.

    `pins` maps the dedicated guest vCPUs to host CPUs and `cells` are their host NUMA cells
    (guest cell i on host cell `cells[i]`); the other vCPUs (all of them for a shared-CPU
    flavor, some for a mixed one) float over `shared_cpus`, the host's shared CPU set.
    """

    vcpus: int
    memory_mb: int
    root_gb: int = 0
    pins: Mapping[int, int] = field(default_factory=dict)
    cells: tuple[int, ...] = ()
    shared_cpus: frozenset[int] = frozenset()
    image: ImageSpec | None = None
    nics: tuple[Nic, ...] = ()
    user_data: str | None = None
    name: str = ""
    # A cold migration's or resize's destination takes the disk the source's `export_disk`
    # answered (the guest's data), instead of a new one from the image.
    disk_source: Mapping[str, Any] | None = None
    # The volumes the guest has when it is defined (spawn, a move's destination); the one
    # with boot index 0 is its root disk. Attached later: `Driver.attach_volume`.
    volumes: tuple[BlockDevice, ...] = ()
    # The config drive's files (path -> bytes) when the server asked for one.
    config_drive: Mapping[str, bytes] | None = None
    # An unshelve boots from the shelve's image (`image`), then its disk is rebased onto the
    # server's own image, or flattened when that image is gone (Nova's fix of bug 1732428):
    # a later move fetches the server's image as the base, not the deleted shelve's.
    rebase_image: ImageSpec | None = None
    flatten_disk: bool = False

    @property
    def root_volume(self) -> BlockDevice | None:
        """The volume the guest boots from (boot index 0), None for an image-backed guest."""
        return next((v for v in self.volumes if v.boot_index == 0), None)

    @classmethod
    def of_claim(cls, pins: Mapping[int, int], cells: list[int], memory_mb: int) -> Guest:
        """A guest from a claim alone: every vCPU dedicated, no image, no NICs."""
        return cls(vcpus=len(pins), memory_mb=memory_mb, pins=dict(pins), cells=tuple(cells))

    @property
    def shared_vcpus(self) -> list[int]:
        """The guest vCPUs that are not pinned, in order."""
        return [v for v in range(self.vcpus) if v not in self.pins]

    def to_payload(self) -> dict[str, Any]:
        """A JSON-safe form, for the bus."""
        return {
            "vcpus": self.vcpus,
            "memory_mb": self.memory_mb,
            "root_gb": self.root_gb,
            "pins": {str(k): v for k, v in sorted(self.pins.items())},
            "cells": list(self.cells),
            "shared_cpus": sorted(self.shared_cpus),
            "image": None if self.image is None else dict(self.image.__dict__),
            "nics": [
                {"mac": n.mac, "ips": list(n.ips), "network_id": n.network_id, "port_id": n.port_id}
                for n in self.nics
            ],
            "user_data": self.user_data,
            "name": self.name,
            "disk_source": None if self.disk_source is None else dict(self.disk_source),
            "volumes": [v.to_payload() for v in self.volumes],
            "config_drive": None
            if self.config_drive is None
            else {k: base64.b64encode(v).decode() for k, v in sorted(self.config_drive.items())},
            "rebase_image": None if self.rebase_image is None else dict(self.rebase_image.__dict__),
            "flatten_disk": self.flatten_disk,
        }

    @classmethod
    def from_payload(cls, payload: Mapping[str, Any]) -> Guest:
        """The inverse of `to_payload`; a bare claim (pins, cells, memory_mb) works too."""
        pins = {int(k): int(v) for k, v in dict(payload.get("pins") or {}).items()}
        image = payload.get("image")
        rebase = payload.get("rebase_image")
        return cls(
            vcpus=int(payload.get("vcpus") or len(pins)),
            memory_mb=int(payload.get("memory_mb") or 0),
            root_gb=int(payload.get("root_gb") or 0),
            pins=pins,
            cells=tuple(int(c) for c in payload.get("cells") or ()),
            shared_cpus=frozenset(int(c) for c in payload.get("shared_cpus") or ()),
            image=None if not image else ImageSpec(**dict(image)),
            nics=tuple(
                Nic(
                    mac=str(n["mac"]),
                    ips=tuple(str(ip) for ip in n.get("ips") or ()),
                    network_id=str(n.get("network_id") or ""),
                    port_id=str(n.get("port_id") or ""),
                )
                for n in payload.get("nics") or ()
            ),
            user_data=payload.get("user_data"),
            name=str(payload.get("name") or ""),
            disk_source=dict(payload["disk_source"]) if payload.get("disk_source") else None,
            volumes=tuple(BlockDevice.from_payload(v) for v in payload.get("volumes") or ()),
            config_drive=None
            if payload.get("config_drive") is None
            else {str(k): base64.b64decode(v) for k, v in dict(payload["config_drive"]).items()},
            rebase_image=ImageSpec(**dict(rebase)) if rebase else None,
            flatten_disk=bool(payload.get("flatten_disk")),
        )


@dataclass(frozen=True)
class MigrationTarget:
    """Where a live migration goes: what the destination's `prepare_migration` answered,
    and the guest as the destination's claim describes it (its own pins and cells)."""

    host: str
    guest: Guest
    handle: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class MigrationProgress:
    """One look at a running migration job (bytes as libvirt's job info counts them)."""

    memory_total_bytes: int = 0
    memory_processed_bytes: int = 0
    memory_remaining_bytes: int = 0
    disk_total_bytes: int = 0
    disk_processed_bytes: int = 0
    disk_remaining_bytes: int = 0


ProgressCallback = Callable[[MigrationProgress], None]

SerialOutput = Callable[[bytes], None]
"""Takes what a guest's serial console says, from any thread; `b""` once: it closed."""


class SerialConsole(Protocol):
    """One open session on a guest's serial console (`Driver.open_serial_console`)."""

    def write(self, data: bytes) -> None:
        """Send `data` to the guest's serial port; never blocks on the guest."""
        ...

    def close(self) -> None:
        """End the session (idempotent); the output callback is called no more."""
        ...


class DriverError(StowageError):
    """An operation failed in an orderly way; the agent reports it as an error result."""

    code = "virt.driver.failed"


class InstanceNotFound(DriverError):
    """The hypervisor does not know the instance."""

    code = "virt.instance.not_found"


class DriverCrashed(Exception):
    """The hypervisor connection died mid-operation; the outcome of the step is unknown.

    Deliberately not a `DriverError`: an error result says "this did not happen", a crash
    says "we do not know", and the caller must reconcile rather than retry blindly.
    """


def guest_for(pins: dict[int, int], cells: list[int], memory_mb: int, guest: Guest | None) -> Guest:
    """The guest to build: `guest` with the claim's pins, cells and memory, or the claim."""
    if guest is None:
        return Guest.of_claim(pins, cells, memory_mb)
    return dataclasses.replace(
        guest, memory_mb=memory_mb or guest.memory_mb, pins=dict(pins), cells=tuple(cells)
    )


def check_guest(guest: Guest) -> None:
    """What any hypervisor refuses: no vCPUs, no memory, pins naming vCPUs the guest lacks."""
    if guest.vcpus < 1:
        raise DriverError("a guest needs at least one vCPU", code="virt.guest.no_vcpus")
    if any(v < 0 or v >= guest.vcpus for v in guest.pins):
        raise DriverError(
            f"pins name vCPUs outside 0..{guest.vcpus - 1}: {sorted(guest.pins)}",
            code="virt.guest.bad_vcpus",
        )
    if guest.memory_mb <= 0:
        raise DriverError("a guest needs memory", code="virt.guest.no_memory")


@runtime_checkable
class Driver(Protocol):
    """A hypervisor on one host.

    Every method may block (file IO, libvirt, subprocess): the agent calls them from a
    bounded executor, never on its event loop. Methods are called from several threads at
    once, so implementations guard their own state.
    """

    def spawn(
        self,
        instance_id: str,
        pins: dict[int, int],
        cells: list[int],
        memory_mb: int,
        guest: Guest | None = None,
    ) -> None:
        """Create the instance's disk, define it with these pins and NUMA cells, start it.

        `guest` describes the whole guest (vCPUs, shared CPUs, image, NICs, ...); without it
        the guest is the claim alone (`Guest.of_claim`). Its pins, cells and memory win.
        """
        ...

    def destroy(self, instance_id: str) -> None:
        """Stop the instance, undefine it and delete its disk."""
        ...

    def attach_volume(self, instance_id: str, device: str, connection: dict[str, Any]) -> None:
        """Give the guest the volume `connection` describes (os-brick's connection info) as
        `device`; idempotent for the same device and volume."""
        ...

    def detach_volume(self, instance_id: str, device: str) -> None:
        """Take the volume at `device` away from the guest; a device it lacks is no error."""
        ...

    def reboot(self, instance_id: str) -> None:
        """Stop and start the instance."""
        ...

    def rescue(self, instance_id: str, image: ImageSpec | None, admin_password: str) -> None:
        """Boot the guest from `image` (its own image when None) with its own root disk
        attached second (Nova's rescue); `admin_password` is the rescue system's. Repeated
        on a rescued guest: no change."""
        ...

    def unrescue(self, instance_id: str) -> None:
        """Boot the rescued guest from its own disk again, as it was defined before the
        rescue; a guest that is not rescued: no change."""
        ...

    def attach_interface(self, instance_id: str, nic: Nic) -> None:
        """Hot-plug `nic` into the guest (and its persistent definition); the same MAC
        again is no change."""
        ...

    def detach_interface(self, instance_id: str, mac: str) -> None:
        """Unplug the NIC with this MAC address; a MAC the guest lacks is no error."""
        ...

    def set_admin_password(self, instance_id: str, password: str) -> None:
        """Set the guest's administrator password (a guest agent's job); a `DriverError`
        when the guest cannot take it."""
        ...

    def inject_nmi(self, instance_id: str) -> None:
        """Send the running guest a non-maskable interrupt (a crash dump's trigger)."""
        ...

    def power_off(self, instance_id: str) -> None:
        """Stop the instance, keeping its definition and disk."""
        ...

    def power_on(self, instance_id: str) -> None:
        """Start a stopped instance."""
        ...

    def running(self) -> dict[str, RunningInstance]:
        """Every instance the hypervisor knows, by instance id."""
        ...

    def read_disk(
        self, instance_id: str, chunk_bytes: int, disk_format: str | None = None
    ) -> Iterator[bytes]:
        """The instance's disk data in chunks of at most `chunk_bytes`, for snapshots, as one
        standalone image in `disk_format` (raw or qcow2; default: what the guest booted from).

        Each `next()` may block on the disk; the caller closes the iterator when done.
        """
        ...

    def console_output(self, instance_id: str, length: int | None = None) -> str:
        """The guest's serial console so far; its last `length` lines if given."""
        ...

    def open_serial_console(self, instance_id: str, output: SerialOutput) -> SerialConsole:
        """An interactive session on the running guest's serial console: what the guest
        writes from now on goes to `output`, `write` types into it. A new session takes the
        console from an older one (which gets `b""`), as a serial line has one end."""
        ...

    def export_disk(self, instance_id: str) -> dict[str, Any]:
        """On the source of a cold migration or resize: a consistent copy of the instance's
        disk, staged for the destination to take; the answer (JSON-safe) is what the
        destination's `spawn` needs in `Guest.disk_source` to build the guest on that disk,
        keeping its data. The staged copy goes with the destination's taking it, or with
        `destroy` here."""
        ...

    def pause(self, instance_id: str) -> None:
        """Freeze the guest's vCPUs, keeping its memory where it is."""
        ...

    def unpause(self, instance_id: str) -> None:
        """Let a paused guest run again."""
        ...

    def suspend(self, instance_id: str) -> None:
        """Save the guest's memory to disk and stop it."""
        ...

    def resume(self, instance_id: str) -> None:
        """Start a suspended guest from its saved memory."""
        ...

    # -- live migration, in Nova's phases -------------------------------------------

    def prepare_migration(self, instance_id: str, guest: Guest) -> dict[str, Any]:
        """On the destination: make room for an incoming guest (its disk on the cached
        image); the answer is the handle the source's `migrate` needs (JSON-safe)."""
        ...

    def migrate(
        self,
        instance_id: str,
        target: MigrationTarget,
        progress: ProgressCallback | None = None,
    ) -> None:
        """On the source: move the running guest to `target`, defined there with the
        target guest's pins and cells; returns once the guest runs there. On failure the
        guest still runs here."""
        ...

    def migration_progress(self, instance_id: str) -> MigrationProgress | None:
        """The running migration job of this guest, None when there is none."""
        ...

    def finish_migration(self, instance_id: str) -> None:
        """On the destination, once `migrate` returned: the guest runs here now."""
        ...

    def abort_migration(self, instance_id: str) -> None:
        """Cancel the running migration job; the guest stays here."""
        ...

    def force_complete_migration(self, instance_id: str) -> None:
        """Pause the guest so that the copy converges (Nova's force-complete)."""
        ...

    def rollback_migration(self, instance_id: str) -> None:
        """On the destination: drop what `prepare_migration` made (no running guest)."""
        ...
