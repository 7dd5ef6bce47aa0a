"""The simulated hypervisor: per-step latency, injected faults and a real local disk."""

from __future__ import annotations

import hashlib
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

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
    check_guest,
    guest_for,
)

__all__ = ["STEPS", "FaultKind", "SimConfig", "SimDriver"]

_DISK_HEAD_BYTES = 4096

# The steps of each operation, in order; latency and faults are configured per step.
STEPS: dict[str, tuple[str, ...]] = {
    "spawn": ("create_disk", "define", "start"),
    "destroy": ("stop", "undefine", "delete_disk"),
    "reboot": ("stop", "start"),
    "power_off": ("stop",),
    "power_on": ("start",),
    "read_disk": ("open", "read"),
    "pause": ("pause",),
    "unpause": ("unpause",),
    "suspend": ("save",),
    "resume": ("restore",),
    "prepare_migration": ("create_disk", "define"),
    "migrate": ("transfer", "switch"),
    "finish_migration": ("start",),
    "rollback_migration": ("undefine", "delete_disk"),
    "rescue": ("stop", "start"),
    "unrescue": ("stop", "start"),
    "attach_interface": ("plug",),
    "detach_interface": ("unplug",),
    "set_admin_password": ("agent",),
    "inject_nmi": ("nmi",),
}


class FaultKind(StrEnum):
    """What an injected fault does when its step is reached."""

    FAIL = "fail"  # raise DriverError: an orderly failure
    HANG = "hang"  # block until `release_hangs()` or `close()`
    CRASH = "crash"  # raise DriverCrashed: the outcome is unknown


# Instance -> when its source paused it for the switch-over (monotonic), for the downtime
# the destination reports: the simulated hosts of one cloud share this process.
_SWITCHOVER_AT: dict[str, float] = {}
_SWITCHOVER_LOCK = threading.Lock()


@dataclass
class SimConfig:
    """Latencies in seconds; `step_latency_s` keys are "op.step" or a bare "step"."""

    step_latency_s: dict[str, float] = field(default_factory=dict)
    slow_disk_s: float = 0.0  # every chunk read blocks this long, like a saturated disk
    disk_bytes: int = 4 * 1024 * 1024
    seed: int = 0


@dataclass
class _Fault:
    kind: FaultKind
    times_left: int


@dataclass
class _Instance:
    pins: dict[int, int]
    cells: list[int]
    memory_mb: int
    state: InstanceState
    disk: Path
    guest: Guest | None = None
    console: list[str] = field(default_factory=list)
    migrating: bool = False
    volumes: dict[str, Path] = field(default_factory=dict)  # device -> the volume's file
    nics: dict[str, Nic] = field(default_factory=dict)  # MAC -> NIC, hot-plugged ones too
    rescue_image: str | None = None  # booted from this image, its own disk second
    rescue_password: str | None = None  # the rescue system's, while rescued
    admin_password: str | None = None  # what the guest agent was told last
    nmis: int = 0  # non-maskable interrupts received
    serial: _SimSerial | None = None  # the open serial console session
    typed: str = ""  # what was typed on the serial line since its last newline

    def __post_init__(self) -> None:
        if self.guest is not None and not self.nics:
            self.nics = {nic.mac: nic for nic in self.guest.nics}


def _digest(secret: str | None) -> str | None:
    return None if secret is None else hashlib.sha256(secret.encode()).hexdigest()


class _SimSerial:
    """A session on a simulated guest's serial console: a terminal line whose guest echoes
    what is typed and keeps each typed line in its console log, as a shell on a serial
    port would."""

    def __init__(self, driver: SimDriver, instance_id: str, output: SerialOutput) -> None:
        self.driver = driver
        self.instance_id = instance_id
        self.output = output

    def write(self, data: bytes) -> None:
        self.driver._typed(self, data)

    def close(self) -> None:
        self.driver._hang_up(self.instance_id, self, tell=False)


class SimDriver:
    """A `Driver` for tests and the all-in-one cloud; thread-safe.

    Disks are real files in `disk_dir` (a temporary directory unless given), so snapshot
    reads do real IO; `slow_disk_s` adds a blocking sleep per chunk on top.
    """

    def __init__(
        self,
        config: SimConfig | None = None,
        disk_dir: Path | None = None,
        *,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.config = config or SimConfig()
        self._sleep = sleep  # the simulation passes its virtual clock's
        self._latency_s: dict[tuple[str, str], float] = {}  # set_latency's, over the config's
        self._own_dir = disk_dir is None
        self.disk_dir = (
            Path(tempfile.mkdtemp(prefix="stowage-sim-")) if disk_dir is None else disk_dir
        )
        self.disk_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._instances: dict[str, _Instance] = {}
        self._faults: dict[tuple[str, str], _Fault] = {}
        self._release = threading.Event()
        self._rng = random.Random(self.config.seed)
        self.calls: list[tuple[str, str]] = []  # (operation, instance_id), in call order

    # -- fault injection -------------------------------------------------------------

    def inject(self, operation: str, step: str, kind: FaultKind, times: int = 1) -> None:
        """Make the next `times` runs of `operation`'s `step` fail, hang or crash."""
        if step not in STEPS.get(operation, ()):
            raise ValueError(f"{operation!r} has no step {step!r}; steps: {STEPS.get(operation)}")
        with self._lock:
            self._faults[(operation, step)] = _Fault(kind, times)

    def set_latency(self, operation: str, step: str, seconds: float) -> None:
        """Make every later run of `operation`'s `step` take `seconds` (0: none)."""
        if step not in STEPS.get(operation, ()):
            raise ValueError(f"{operation!r} has no step {step!r}; steps: {STEPS.get(operation)}")
        if seconds < 0:
            raise ValueError("seconds must be >= 0")
        with self._lock:
            self._latency_s[(operation, step)] = seconds

    def clear_latency(self) -> None:
        """Undo every `set_latency` (the configured latencies stay)."""
        with self._lock:
            self._latency_s.clear()

    def tamper_pins(self, instance_id: str, pins: dict[int, int]) -> None:
        """Repin a defined instance behind the ledger's back, as a stray `virsh vcpupin` would."""
        with self._lock:
            inst = self._instances.get(instance_id)
            if inst is None:
                raise InstanceNotFound(f"instance {instance_id} is not on this host")
            inst.pins = dict(pins)

    def adopt(
        self,
        instance_id: str,
        pins: dict[int, int],
        cells: list[int] | None = None,
        memory_mb: int = 0,
    ) -> None:
        """Define and start an instance the ledger never placed (an empty disk, no step faults)."""
        disk = self.disk_dir / f"{instance_id}.img"
        with self._lock:
            if instance_id in self._instances:
                raise DriverError(f"instance {instance_id} already exists", code="virt.exists")
            disk.touch()
            self._instances[instance_id] = _Instance(
                dict(pins), list(cells or []), memory_mb, InstanceState.RUNNING, disk
            )

    def release_hangs(self) -> None:
        """Let every hung step (and every later HANG fault) return, failing with an error."""
        self._release.set()

    def clear_faults(self) -> None:
        """Disarm every fault and let hung steps return (with an error); later hangs hang."""
        with self._lock:
            self._faults.clear()
            released, self._release = self._release, threading.Event()
        released.set()

    def close(self) -> None:
        """Release hung steps and delete the disk directory if this driver created it."""
        self.release_hangs()
        if self._own_dir:
            shutil.rmtree(self.disk_dir, ignore_errors=True)

    # -- Driver ----------------------------------------------------------------------

    def spawn(
        self,
        instance_id: str,
        pins: dict[int, int],
        cells: list[int],
        memory_mb: int,
        guest: Guest | None = None,
    ) -> None:
        self._record("spawn", instance_id)
        guest = guest_for(pins, cells, memory_mb, guest)
        check_guest(guest)
        with self._lock:
            if instance_id in self._instances:
                raise DriverError(f"instance {instance_id} already exists", code="virt.exists")
        disk = self.disk_dir / f"{instance_id}.img"
        self._step("spawn", "create_disk")
        source = (guest.disk_source or {}).get("path")
        if source:
            # A cold migration's or resize's destination: the source's disk, moved.
            staged = Path(str(source))
            try:
                data = staged.read_bytes()
            except FileNotFoundError:
                raise DriverError(
                    f"the moved disk {staged} is gone", code="virt.sim.no_moved_disk"
                ) from None
            staged.unlink(missing_ok=True)
            disk.write_bytes(data)
        else:
            with self._lock:
                # A seeded head of its own, the rest a hole: a file of the disk's size that
                # costs no CPU to fill (a megabyte of random bytes per boot did, in the GIL).
                head = self._rng.randbytes(min(self.config.disk_bytes, _DISK_HEAD_BYTES))
            with disk.open("wb") as out:
                out.write(head)
                out.truncate(self.config.disk_bytes)
        if guest.config_drive is not None:
            # A real config drive, as on libvirt: the ISO beside the disk (no guest reads it).
            build_config_drive(dict(guest.config_drive), disk.with_suffix(".config.iso"))
        self._step("spawn", "define")
        with self._lock:
            self._instances[instance_id] = _Instance(
                dict(pins), list(cells), memory_mb, InstanceState.SHUTOFF, disk, guest
            )
        self._step("spawn", "start")
        self._set_state(instance_id, InstanceState.RUNNING)
        self._boot_console(instance_id)

    def attach_volume(self, instance_id: str, device: str, connection: dict[str, Any]) -> None:
        """A simulated guest's volume is a real file: it must exist and be readable here."""
        self._record("attach_volume", instance_id)
        if connection.get("driver_volume_type") != "local":
            raise DriverError(
                f"volume type {connection.get('driver_volume_type')!r} cannot be attached here",
                code="virt.volume.unsupported",
            )
        path = Path(str((connection.get("data") or {}).get("device_path") or ""))
        try:
            with path.open("rb") as disk:
                disk.read(512)
        except OSError as exc:
            raise DriverError(
                f"volume file {path} cannot be opened: {exc}", code="virt.volume.open"
            ) from None
        inst = self._get(instance_id)
        with self._lock:
            inst.volumes[device] = path

    def detach_volume(self, instance_id: str, device: str) -> None:
        self._record("detach_volume", instance_id)
        inst = self._get(instance_id)
        with self._lock:
            inst.volumes.pop(device, None)

    def destroy(self, instance_id: str) -> None:
        self._record("destroy", instance_id)
        inst = self._get(instance_id)
        self._step("destroy", "stop")
        self._set_state(instance_id, InstanceState.SHUTOFF)
        self._step("destroy", "undefine")
        self._hang_up(instance_id, tell=True)
        with self._lock:
            self._instances.pop(instance_id, None)
        self._step("destroy", "delete_disk")
        inst.disk.unlink(missing_ok=True)
        inst.disk.with_suffix(".outgoing").unlink(missing_ok=True)
        inst.disk.with_suffix(".config.iso").unlink(missing_ok=True)

    def reboot(self, instance_id: str) -> None:
        self._record("reboot", instance_id)
        self._get(instance_id)
        self._step("reboot", "stop")
        self._set_state(instance_id, InstanceState.SHUTOFF)
        self._step("reboot", "start")
        self._set_state(instance_id, InstanceState.RUNNING)
        self._boot_console(instance_id)

    def power_off(self, instance_id: str) -> None:
        self._record("power_off", instance_id)
        self._get(instance_id)
        self._step("power_off", "stop")
        self._set_state(instance_id, InstanceState.SHUTOFF)

    def power_on(self, instance_id: str) -> None:
        self._record("power_on", instance_id)
        self._get(instance_id)
        self._step("power_on", "start")
        if self._get(instance_id).state is not InstanceState.RUNNING:
            self._set_state(instance_id, InstanceState.RUNNING)
            self._boot_console(instance_id)

    def rescue(self, instance_id: str, image: ImageSpec | None, admin_password: str) -> None:
        """The guest boots the rescue image (its own when None) with its disk second."""
        self._record("rescue", instance_id)
        inst = self._get(instance_id)
        if inst.rescue_image is not None:
            return
        if inst.state in (InstanceState.PAUSED, InstanceState.SUSPENDED):
            raise DriverError(
                f"instance {instance_id} is {inst.state}: it cannot be rescued",
                code="virt.rescue.bad_state",
            )
        own = inst.guest.image.id if inst.guest is not None and inst.guest.image else ""
        rescue_image = image.id if image is not None else own
        self._step("rescue", "stop")
        self._set_state(instance_id, InstanceState.SHUTOFF)
        self._step("rescue", "start")
        with self._lock:
            inst.rescue_image = rescue_image
            inst.rescue_password = admin_password
            inst.state = InstanceState.RUNNING
            inst.console.append(
                f"sim: {instance_id} booted rescue image {rescue_image or '(none)'} "
                f"with its own disk second"
            )

    def unrescue(self, instance_id: str) -> None:
        self._record("unrescue", instance_id)
        inst = self._get(instance_id)
        if inst.rescue_image is None:
            return
        self._step("unrescue", "stop")
        self._set_state(instance_id, InstanceState.SHUTOFF)
        self._step("unrescue", "start")
        with self._lock:
            inst.rescue_image = None
            inst.rescue_password = None
            inst.state = InstanceState.RUNNING
        self._boot_console(instance_id)

    def attach_interface(self, instance_id: str, nic: Nic) -> None:
        self._record("attach_interface", instance_id)
        inst = self._get(instance_id)
        if nic.mac in inst.nics:
            return
        self._step("attach_interface", "plug")
        with self._lock:
            inst.nics[nic.mac] = nic
            inst.console.append(f"sim: {instance_id} NIC {nic.mac} plugged")

    def detach_interface(self, instance_id: str, mac: str) -> None:
        self._record("detach_interface", instance_id)
        inst = self._get(instance_id)
        if mac not in inst.nics:
            return
        self._step("detach_interface", "unplug")
        with self._lock:
            inst.nics.pop(mac, None)
            inst.console.append(f"sim: {instance_id} NIC {mac} unplugged")

    def set_admin_password(self, instance_id: str, password: str) -> None:
        """A simulated guest has an agent: it takes the password (while it runs)."""
        self._record("set_admin_password", instance_id)
        inst = self._get(instance_id)
        if inst.state is not InstanceState.RUNNING:
            raise DriverError(
                f"instance {instance_id} is {inst.state}: its agent does not answer",
                code="virt.password.agent_unreachable",
            )
        self._step("set_admin_password", "agent")
        with self._lock:
            inst.admin_password = password

    def inject_nmi(self, instance_id: str) -> None:
        self._record("inject_nmi", instance_id)
        inst = self._get(instance_id)
        if inst.state is not InstanceState.RUNNING:
            raise DriverError(
                f"instance {instance_id} is {inst.state}, not running",
                code="virt.nmi.not_running",
            )
        self._step("inject_nmi", "nmi")
        with self._lock:
            inst.nmis += 1
            inst.console.append(f"sim: {instance_id} NMI received")

    def guest_details(self) -> dict[str, dict[str, Any]]:
        """What each simulated guest was told beyond its state (for `stowage sim show`): its
        rescue image, its NICs, a digest of its admin password, NMIs received."""
        with self._lock:
            return {
                iid: {
                    "rescue_image": inst.rescue_image,
                    "nics": sorted(inst.nics),
                    "admin_password_sha256": _digest(inst.admin_password),
                    "rescue_password_sha256": _digest(inst.rescue_password),
                    "nmis": inst.nmis,
                }
                for iid, inst in self._instances.items()
            }

    def running(self) -> dict[str, RunningInstance]:
        with self._lock:
            return {
                iid: RunningInstance(pins=dict(inst.pins), state=inst.state)
                for iid, inst in self._instances.items()
            }

    def read_disk(
        self, instance_id: str, chunk_bytes: int, disk_format: str | None = None
    ) -> Iterator[bytes]:
        """The disk's bytes as they are: a simulated disk has no format to convert."""
        if chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be positive")
        self._record("read_disk", instance_id)
        disk = self._get(instance_id).disk
        self._step("read_disk", "open")
        # A generator would defer the checks above to the first next(); return one instead.
        return self._chunks(disk, chunk_bytes)

    def export_disk(self, instance_id: str) -> dict[str, Any]:
        """A copy of the disk beside it (the simulated hosts share this machine)."""
        self._record("export_disk", instance_id)
        disk = self._get(instance_id).disk
        staged = disk.with_suffix(".outgoing")
        shutil.copyfile(disk, staged)
        return {"path": str(staged)}

    def console_output(self, instance_id: str, length: int | None = None) -> str:
        with self._lock:
            inst = self._instances.get(instance_id)
            if inst is None:
                raise InstanceNotFound(f"instance {instance_id} is not on this host")
            lines = list(inst.console)
        if length is not None:
            lines = lines[-length:] if length > 0 else []
        return "".join(line + "\n" for line in lines)

    def open_serial_console(self, instance_id: str, output: SerialOutput) -> _SimSerial:
        """The console so far (what `console_output` shows), then what the guest says and
        the echo of what is typed; an older session is hung up."""
        session = _SimSerial(self, instance_id, output)
        with self._lock:
            inst = self._instances.get(instance_id)
            if inst is None:
                raise InstanceNotFound(f"instance {instance_id} is not on this host")
            if inst.state is not InstanceState.RUNNING or inst.migrating:
                raise DriverError(
                    f"instance {instance_id} is {inst.state}: no serial console to open",
                    code="virt.console.not_running",
                )
            older, inst.serial = inst.serial, session
            history = "".join(line + "\n" for line in inst.console)
        if older is not None:
            older.output(b"")
        output(history.encode())
        return session

    def _typed(self, session: _SimSerial, data: bytes) -> None:
        """Echo `data` on the line; each line typed joins the console log."""
        echo: list[str] = []
        with self._lock:
            inst = self._instances.get(session.instance_id)
            if inst is None or inst.serial is not session:
                return
            for char in data.decode(errors="replace"):
                if char in "\r\n":
                    inst.console.append(inst.typed)
                    inst.typed = ""
                    echo.append("\r\n")
                elif char in "\x7f\b":
                    if inst.typed:
                        inst.typed = inst.typed[:-1]
                        echo.append("\b \b")
                else:
                    inst.typed += char
                    echo.append(char)
        if echo:
            session.output("".join(echo).encode())

    def _hang_up(self, instance_id: str, session: _SimSerial | None = None, *, tell: bool) -> None:
        """End the instance's serial session (`session` only, if given); `tell` its reader."""
        with self._lock:
            inst = self._instances.get(instance_id)
            current = None if inst is None else inst.serial
            if current is None or (session is not None and current is not session):
                return
            assert inst is not None
            inst.serial = None
        if tell:
            current.output(b"")

    def _say(self, instance_id: str, line: str) -> None:
        """The guest prints `line` on its serial console: into the log and to a session."""
        with self._lock:
            inst = self._instances.get(instance_id)
            if inst is None:
                return
            inst.console.append(line)
            session = inst.serial
        if session is not None:
            session.output((line + "\n").encode())

    def pause(self, instance_id: str) -> None:
        self._transition("pause", "pause", instance_id, InstanceState.RUNNING, InstanceState.PAUSED)

    def unpause(self, instance_id: str) -> None:
        self._transition(
            "unpause", "unpause", instance_id, InstanceState.PAUSED, InstanceState.RUNNING
        )

    def suspend(self, instance_id: str) -> None:
        self._transition(
            "suspend", "save", instance_id, InstanceState.RUNNING, InstanceState.SUSPENDED
        )

    def resume(self, instance_id: str) -> None:
        self._transition(
            "resume", "restore", instance_id, InstanceState.SUSPENDED, InstanceState.RUNNING
        )

    # -- live migration ----------------------------------------------------------------

    def prepare_migration(self, instance_id: str, guest: Guest) -> dict[str, Any]:
        """Define the incoming guest with the destination's pins, paused until it arrives."""
        self._record("prepare_migration", instance_id)
        check_guest(guest)
        with self._lock:
            if instance_id in self._instances:
                raise DriverError(f"instance {instance_id} already exists", code="virt.exists")
        disk = self.disk_dir / f"{instance_id}.img"
        self._step("prepare_migration", "create_disk")
        disk.touch()
        self._step("prepare_migration", "define")
        with self._lock:
            self._instances[instance_id] = _Instance(
                dict(guest.pins),
                list(guest.cells),
                guest.memory_mb,
                InstanceState.PAUSED,
                disk,
                guest,
                migrating=True,
            )
        return {"disk": str(disk)}

    def migrate(
        self,
        instance_id: str,
        target: MigrationTarget,
        progress: ProgressCallback | None = None,
    ) -> None:
        """The memory copy (the step's latency), then the source's guest is gone."""
        self._record("migrate", instance_id)
        with self._lock:
            inst = self._instances.get(instance_id)
            if inst is None:
                raise InstanceNotFound(f"instance {instance_id} is not on this host")
            if inst.state is not InstanceState.RUNNING:
                raise DriverError(
                    f"instance {instance_id} is {inst.state}, not running",
                    code="virt.migrate.not_running",
                )
            inst.migrating = True
            total = inst.memory_mb * 1024 * 1024
        try:
            self._step("migrate", "transfer")
            if progress is not None:
                progress(MigrationProgress(total, total, 0))
            # The guest pauses here and runs again when the destination takes it: that
            # window is the migration's downtime (the destination's console reports it).
            with _SWITCHOVER_LOCK:
                _SWITCHOVER_AT[instance_id] = time.monotonic()
            self._step("migrate", "switch")
        finally:
            with self._lock:
                inst.migrating = False
        self._hang_up(instance_id, tell=True)
        with self._lock:
            self._instances.pop(instance_id, None)
        inst.disk.unlink(missing_ok=True)

    def migration_progress(self, instance_id: str) -> MigrationProgress | None:
        inst = self._get(instance_id)
        if not inst.migrating:
            return None
        total = inst.memory_mb * 1024 * 1024
        return MigrationProgress(total, 0, total)

    def finish_migration(self, instance_id: str) -> None:
        self._record("finish_migration", instance_id)
        inst = self._get(instance_id)
        self._step("finish_migration", "start")
        with _SWITCHOVER_LOCK:
            paused_at = _SWITCHOVER_AT.pop(instance_id, None)
        arrived = f"sim: {instance_id} arrived"
        if paused_at is not None:  # the source ran in this process (the all-in-one cloud)
            arrived += f" after a {(time.monotonic() - paused_at) * 1000:.1f} ms pause"
        with self._lock:
            inst.migrating = False
            inst.state = InstanceState.RUNNING
        self._say(instance_id, arrived)

    def abort_migration(self, instance_id: str) -> None:
        if self.migration_progress(instance_id) is None:
            raise DriverError(
                f"instance {instance_id} has no migration job", code="virt.migrate.no_job"
            )
        self.release_hangs()

    def force_complete_migration(self, instance_id: str) -> None:
        if self.migration_progress(instance_id) is None:
            raise DriverError(
                f"instance {instance_id} has no migration job", code="virt.migrate.no_job"
            )

    def rollback_migration(self, instance_id: str) -> None:
        self._record("rollback_migration", instance_id)
        with self._lock:
            inst = self._instances.get(instance_id)
        if inst is None:
            return
        if not inst.migrating:
            raise DriverError(
                f"instance {instance_id} runs here: not an incoming migration",
                code="virt.migrate.not_incoming",
            )
        self._step("rollback_migration", "undefine")
        self._hang_up(instance_id, tell=True)
        with self._lock:
            self._instances.pop(instance_id, None)
        self._step("rollback_migration", "delete_disk")
        inst.disk.unlink(missing_ok=True)

    # -- helpers ---------------------------------------------------------------------

    def _transition(
        self,
        operation: str,
        step: str,
        instance_id: str,
        before: InstanceState,
        after: InstanceState,
    ) -> None:
        self._record(operation, instance_id)
        inst = self._get(instance_id)
        if inst.state is not before:
            raise DriverError(
                f"instance {instance_id} is {inst.state}, not {before}",
                code=f"virt.{operation}.bad_state",
            )
        self._step(operation, step)
        self._set_state(instance_id, after)

    def _boot_console(self, instance_id: str) -> None:
        with self._lock:
            inst = self._instances.get(instance_id)
            if inst is None:
                return
            vcpus = inst.guest.vcpus if inst.guest is not None else len(inst.pins)
        self._say(instance_id, f"sim: {instance_id} booted with {vcpus} vCPUs")

    def _chunks(self, disk: Path, chunk_bytes: int) -> Iterator[bytes]:
        with disk.open("rb") as f:
            while True:
                self._step("read_disk", "read")
                if self.config.slow_disk_s > 0:
                    self._sleep(self.config.slow_disk_s)  # a saturated disk: the read blocks
                chunk = f.read(chunk_bytes)
                if not chunk:
                    return
                yield chunk

    def _record(self, operation: str, instance_id: str) -> None:
        with self._lock:
            self.calls.append((operation, instance_id))

    def _get(self, instance_id: str) -> _Instance:
        with self._lock:
            inst = self._instances.get(instance_id)
        if inst is None:
            raise InstanceNotFound(f"instance {instance_id} is not on this host")
        return inst

    def _set_state(self, instance_id: str, state: InstanceState) -> None:
        if state is not InstanceState.RUNNING:
            self._hang_up(instance_id, tell=True)  # a stopped guest's line goes quiet
        with self._lock:
            inst = self._instances.get(instance_id)
            if inst is not None:
                inst.state = state

    def _step(self, operation: str, step: str) -> None:
        """Sleep the step's latency, then apply an injected fault if one is armed."""
        latency = self.config.step_latency_s
        delay_s = latency.get(f"{operation}.{step}", latency.get(step, 0.0))
        with self._lock:
            delay_s = self._latency_s.get((operation, step), delay_s)
        if delay_s > 0:
            self._sleep(delay_s)
        fault = self._take_fault(operation, step)
        if fault is None:
            return
        where = f"{operation}.{step}"
        if fault is FaultKind.FAIL:
            raise DriverError(f"injected failure at {where}", code="virt.sim.injected")
        if fault is FaultKind.CRASH:
            raise DriverCrashed(f"injected crash at {where}")
        self._release.wait()
        raise DriverError(f"hung step {where} released", code="virt.sim.released")

    def _take_fault(self, operation: str, step: str) -> FaultKind | None:
        with self._lock:
            fault = self._faults.get((operation, step))
            if fault is None:
                return None
            fault.times_left -= 1
            if fault.times_left <= 0:
                del self._faults[(operation, step)]
            return fault.kind
