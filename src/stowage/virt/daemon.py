"""A private libvirt daemon per simulated host, so several libvirt "hosts" share one machine.

Each daemon runs Debian's `libvirtd` in a mount namespace of its own (`unshare --mount`), with
its own `/etc/libvirt`, `/var/lib/libvirt`, `/run/libvirt`, `/var/cache/libvirt` and
`/var/log/libvirt` bind-mounted from `root`, its own host UUID and its own range of QEMU
migration ports, and its socket in `root/sock` (outside the namespace's private mounts), so
that the agent and the other daemons reach it at `qemu+unix:///system?socket=...`. Two such
daemons are two hypervisors to libvirt: live migration between them runs for real.

Needs root (mount namespaces, and libvirt's privileged QEMU driver). QEMU runs as root with no
security driver and no cgroups: vCPU pins are set with sched_setaffinity, NUMA memory with
QEMU's memory backends.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

from stowage.virt.driver import DriverError

__all__ = ["LibvirtDaemon"]

_BIND_TARGETS = {
    "etc": "/etc/libvirt",
    "lib": "/var/lib/libvirt",
    "cache": "/var/cache/libvirt",
    "log": "/var/log/libvirt",
    "run": "/run/libvirt",
}

# The QEMU driver resolves its compiled-in user before it reads qemu.conf: where Debian's
# libvirt-daemon-system (which creates it) is not installed, the namespace's passwd has it.
_QEMU_USER = "libvirt-qemu:x:64055:64055:Libvirt Qemu:/var/lib/libvirt:/usr/sbin/nologin"
_QEMU_GROUP = "libvirt-qemu:x:64055:"


class LibvirtDaemon:
    """One private `libvirtd`: `start()`, then `uri`; `stop()` destroys its guests and ends it."""

    def __init__(
        self,
        root: Path,
        *,
        host_uuid: str | None = None,
        migration_port_min: int = 49152,
        migration_ports: int = 16,
    ) -> None:
        self.root = Path(root).resolve()
        self.host_uuid = host_uuid or str(uuid.uuid4())
        self.migration_port_min = migration_port_min
        self.migration_port_max = migration_port_min + migration_ports - 1
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def socket(self) -> Path:
        return self.root / "sock" / "libvirt-sock"

    @property
    def uri(self) -> str:
        return f"qemu+unix:///system?socket={self.socket}"

    @property
    def log_path(self) -> Path:
        return self.root / "libvirtd.log"

    def start(self, timeout_s: float = 30.0) -> None:
        if os.geteuid() != 0:
            raise DriverError(
                "a private libvirt daemon needs root (a mount namespace and libvirt's QEMU "
                "driver); run as root or point the agent at an existing libvirt URI",
                code="virt.daemon.not_root",
            )
        for tool in ("libvirtd", "unshare", "qemu-system-x86_64"):
            if shutil.which(tool) is None:
                raise DriverError(
                    f"{tool} is not installed (Debian: libvirt-daemon "
                    "libvirt-daemon-driver-qemu qemu-system-x86 util-linux)",
                    code="virt.daemon.missing",
                )
        self._write_config()
        self.socket.unlink(missing_ok=True)
        out = (self.root / "libvirtd.out").open("ab")
        try:
            self.proc = subprocess.Popen(
                [
                    "unshare",
                    "--mount",
                    "--propagation",
                    "private",
                    "sh",
                    str(self.root / "start.sh"),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            out.close()
        deadline = time.monotonic() + timeout_s
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = _tail(self.root / "libvirtd.out") + _tail(self.log_path)
                self.stop()
                raise DriverError(
                    f"libvirtd in {self.root} did not come up: {tail}", code="virt.daemon.failed"
                )
            time.sleep(0.2)

    def stop(self) -> None:
        """Destroy every guest of this daemon, then end the daemon."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(Exception):
                self._destroy_guests()
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> LibvirtDaemon:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- helpers ---------------------------------------------------------------------

    def _answers(self) -> bool:
        if not self.socket.exists():
            return False
        import libvirt

        try:
            conn = libvirt.open(self.uri)
        except libvirt.libvirtError:
            return False
        conn.close()
        return True

    def _destroy_guests(self) -> None:
        import libvirt

        conn = libvirt.open(self.uri)
        try:
            for dom in conn.listAllDomains(0):
                with contextlib.suppress(libvirt.libvirtError):
                    if dom.isActive():
                        dom.destroy()
        finally:
            conn.close()

    def _write_config(self) -> None:
        root = self.root
        for name in (*_BIND_TARGETS, "sock"):
            (root / name).mkdir(parents=True, exist_ok=True)
        (root / "libvirtd.conf").write_text(
            f'unix_sock_dir = "{root / "sock"}"\n'
            'unix_sock_rw_perms = "0700"\n'
            'auth_unix_rw = "none"\n'
            'auth_unix_ro = "none"\n'
            f'host_uuid = "{self.host_uuid}"\n'
            f'log_outputs = "3:file:{self.log_path}"\n'
        )
        (root / "etc" / "qemu.conf").write_text(
            'user = "root"\n'
            'group = "root"\n'
            "dynamic_ownership = 0\n"
            'security_driver = "none"\n'
            "cgroup_controllers = [ ]\n"
            'stdio_handler = "file"\n'
            f"migration_port_min = {self.migration_port_min}\n"
            f"migration_port_max = {self.migration_port_max}\n"
        )
        passwd = Path("/etc/passwd").read_text()
        group = Path("/etc/group").read_text()
        if not any(line.startswith("libvirt-qemu:") for line in passwd.splitlines()):
            passwd = passwd.rstrip("\n") + "\n" + _QEMU_USER + "\n"
        if not any(line.startswith("libvirt-qemu:") for line in group.splitlines()):
            group = group.rstrip("\n") + "\n" + _QEMU_GROUP + "\n"
        (root / "passwd").write_text(passwd)
        (root / "group").write_text(group)
        lines = ["set -e"]
        for name, target in _BIND_TARGETS.items():
            lines.append(f"mkdir -p {target}")
            lines.append(f"mount --bind {root / name} {target}")
        lines.append(f"mount --bind {root / 'passwd'} /etc/passwd")
        lines.append(f"mount --bind {root / 'group'} /etc/group")
        lines.append(f"exec libvirtd -f {root / 'libvirtd.conf'} -p {root / 'libvirtd.pid'}")
        (root / "start.sh").write_text("\n".join(lines) + "\n")


def _tail(path: Path, n: int = 600) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except FileNotFoundError:
        return ""
