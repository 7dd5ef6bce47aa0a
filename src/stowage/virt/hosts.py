"""Real libvirt/QEMU hosts on this machine for the all-in-one cloud (`stowage up --driver libvirt`).

Each host is a private libvirt daemon (`LibvirtDaemon`) with its own host UUID; its topology
is read from libvirt's capabilities. With several hosts on one machine, host i dedicates CPU
i (mod the CPU count) and shares the rest, so that pinned guests move between different
pCPUs when they migrate.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from stowage.domain.topology import HostSpec
from stowage.virt.daemon import LibvirtDaemon
from stowage.virt.driver import DriverError

__all__ = ["LibvirtHosts", "kvm_makes_progress", "start_libvirt_hosts"]


@dataclass
class LibvirtHosts:
    specs: list[HostSpec]
    uris: dict[str, str]
    daemons: list[LibvirtDaemon] = field(default_factory=list)
    virt_type: str = "qemu"

    def stop(self) -> None:
        for daemon in self.daemons:
            daemon.stop()


def start_libvirt_hosts(
    state_dir: Path, count: int, *, virt_type: str | None = None
) -> LibvirtHosts:
    """Start `count` daemons under `state_dir/libvirt` and describe their hosts.

    `virt_type` None means: kvm if libvirt offers it and a KVM guest makes progress here
    (`kvm_makes_progress`), else qemu (TCG).
    """
    import libvirt

    from stowage.virt.libvirt_driver import host_topology

    hosts = LibvirtHosts([], {})
    try:
        for i in range(count):
            name = f"host{i + 1}"
            host_uuid = str(uuid.uuid5(uuid.NAMESPACE_URL, f"stowage:{state_dir}:{name}"))
            daemon = LibvirtDaemon(
                state_dir / "libvirt" / name / "daemon",
                host_uuid=host_uuid,
                migration_port_min=49152 + 32 * i,
            )
            _seed_qemu_capabilities(daemon.root)
            daemon.start()
            hosts.daemons.append(daemon)
            conn = libvirt.open(daemon.uri)
            try:
                caps = str(conn.getCapabilities())
            finally:
                conn.close()
            _keep_qemu_capabilities(daemon.root)
            cpus = sorted(os.sched_getaffinity(0))
            dedicated = frozenset({cpus[i % len(cpus)]}) if len(cpus) > 1 else frozenset()
            topology = host_topology(caps, cpu_dedicated_set=dedicated)
            hosts.specs.append(
                HostSpec(
                    name,
                    topology,
                    disk_gb=_disk_gb(state_dir),
                    labels={"rack": f"r{i % 2 + 1}"},
                    hypervisor_type="QEMU",
                )
            )
            hosts.uris[name] = daemon.uri
        hosts.virt_type = virt_type or ("kvm" if kvm_makes_progress() else "qemu")
    except BaseException:
        hosts.stop()
        raise
    return hosts


def _capabilities_cache() -> Path:
    """Where QEMU's capabilities, as libvirt probed them, are kept between daemons: probing
    runs every installed `qemu-system-*` and takes seconds each (tens on a busy machine),
    and every private daemon would probe again. libvirt checks a cached entry against the
    binaries' and its own times and versions, and probes again when it is stale."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "stowage" / "libvirt-qemu-capabilities"


def _qemu_capabilities_dir(daemon_root: Path) -> Path:
    return daemon_root / "cache" / "qemu" / "capabilities"


def _seed_qemu_capabilities(daemon_root: Path) -> None:
    try:
        cached = list(_capabilities_cache().glob("*.xml"))
        if not cached:
            return
        target = _qemu_capabilities_dir(daemon_root)
        target.mkdir(parents=True, exist_ok=True)
        for path in cached:
            if not (target / path.name).exists():
                shutil.copyfile(path, target / path.name)
    except OSError:
        return  # a cache only: the daemon probes


def _keep_qemu_capabilities(daemon_root: Path) -> None:
    try:
        cache = _capabilities_cache()
        cache.mkdir(parents=True, exist_ok=True)
        for path in _qemu_capabilities_dir(daemon_root).glob("*.xml"):
            part = cache / f".{path.name}.{os.getpid()}.part"
            shutil.copyfile(path, part)
            part.replace(cache / path.name)
    except OSError:
        return


def _disk_gb(state_dir: Path) -> int:
    state_dir.mkdir(parents=True, exist_ok=True)
    return max(1, shutil.disk_usage(state_dir).free // 1024**3)


def kvm_makes_progress(timeout_s: float = 20.0) -> bool:
    """Whether a KVM guest gets as far as our guest image's marker on this machine.

    `/dev/kvm` can exist and still hang every guest (nested virtualisation without the
    features it needs): boot the real thing under `-accel kvm` and watch the serial console.
    """
    qemu = shutil.which("qemu-system-x86_64")
    if qemu is None or not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False
    from stowage.virt import guest_image

    with tempfile.TemporaryDirectory(prefix="stowage-kvm-probe-") as tmp:
        try:
            disk = guest_image.build(
                Path(tmp) / "probe.raw",
                kernel=guest_image.default_kernel(),
                busybox=Path("/bin/busybox"),
            )
        except (SystemExit, OSError, subprocess.CalledProcessError, DriverError):
            return False
        serial = Path(tmp) / "serial.log"
        argv = [qemu, "-accel", "kvm", "-m", "128", "-display", "none", "-nodefaults"]
        argv += ["-no-reboot", "-drive", f"file={disk},format=raw,if=virtio,snapshot=on"]
        argv += ["-serial", f"file:{serial}"]
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and proc.poll() is None:
                if serial.exists() and guest_image.MARKER in serial.read_text(errors="replace"):
                    return True
                time.sleep(0.5)
            return False
        finally:
            proc.kill()
            proc.wait()
