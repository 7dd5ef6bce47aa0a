"""Build a bootable guest disk from Debian packages alone: no download, no loop mount, no root.

The disk is one FAT filesystem (no partition table, a "superfloppy") made with mtools, made
bootable with `syslinux --install`, holding Debian's cloud kernel (linux-image-cloud-amd64) and
a busybox (busybox-static) initramfs whose init prints a marker on the serial console, then an
uptime line every second, so a live migration can be seen to continue the same guest:

    STOWAGE-GUEST-UP boot_id=<uuid>
    stowage-uptime 1 boot_id=<uuid>
    stowage-uptime 2 boot_id=<uuid>
    ...

The boot id changes on every boot and survives a live migration. Under QEMU's TCG the marker
appears about 10 s after power-on.

Usage: scripts/make-guest-image.sh OUTPUT [--format raw|qcow2] [--kernel PATH] [--busybox PATH]
(or python -m stowage.virt.guest_image with the same arguments).
Debian packages: mtools syslinux busybox-static linux-image-cloud-amd64 (qemu-utils for qcow2).
"""

from __future__ import annotations

import argparse
import glob
import gzip
import io
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["MARKER", "UPTIME_PREFIX", "build", "default_kernel", "initramfs"]

MARKER = "STOWAGE-GUEST-UP"
UPTIME_PREFIX = "stowage-uptime"
DISK_MIB = 48

INIT = f"""#!/bin/busybox sh
/bin/busybox mkdir -p /proc /sys /dev /tmp
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sysfs /sys
/bin/busybox mount -t devtmpfs devtmpfs /dev 2>/dev/null
/bin/busybox --install -s /bin
export PATH=/bin
boot_id=$(cat /proc/sys/kernel/random/boot_id)
echo "{MARKER} boot_id=$boot_id" > /dev/ttyS0
n=0
while true; do
  sleep 1
  n=$((n + 1))
  echo "{UPTIME_PREFIX} $n boot_id=$boot_id" > /dev/ttyS0
done
"""

SYSLINUX_CFG = """DEFAULT stowage
PROMPT 0
TIMEOUT 0
SERIAL 0 115200
LABEL stowage
  KERNEL vmlinuz
  INITRD initrd.gz
  APPEND console=ttyS0,115200 quiet loglevel=1 panic=-1 rdinit=/init
"""


def _cpio_newc(entries: list[tuple[str, int, bytes]]) -> bytes:
    """A cpio archive in the kernel's "newc" format: (path, mode, data) per entry."""
    out = io.BytesIO()

    def pad(n: int) -> None:
        out.write(b"\0" * ((4 - n % 4) % 4))

    for ino, (path, mode, data) in enumerate([*entries, ("TRAILER!!!", 0, b"")], start=1):
        name = path.encode() + b"\0"
        fields = [ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(name), 0]
        header = b"070701" + b"".join(f"{f:08x}".encode() for f in fields)
        out.write(header + name)
        pad(len(header) + len(name))
        out.write(data)
        pad(len(data))
    return out.getvalue()


def initramfs(busybox: Path) -> bytes:
    """A gzipped cpio holding /init and a static busybox."""
    dir_mode, exe_mode = 0o040755, 0o100755
    entries = [
        ("bin", dir_mode, b""),
        ("dev", dir_mode, b""),
        ("proc", dir_mode, b""),
        ("sys", dir_mode, b""),
        ("tmp", dir_mode, b""),
        ("bin/busybox", exe_mode, busybox.read_bytes()),
        ("init", exe_mode, INIT.encode()),
    ]
    return gzip.compress(_cpio_newc(entries), compresslevel=6, mtime=0)


def default_kernel() -> Path:
    found = sorted(glob.glob("/boot/vmlinuz-*-cloud-amd64")) or sorted(glob.glob("/boot/vmlinuz-*"))
    if not found:
        raise SystemExit("no kernel in /boot: apt-get install linux-image-cloud-amd64")
    return Path(found[-1])


def _run(*argv: str, env: dict[str, str] | None = None) -> None:
    if shutil.which(argv[0]) is None:
        raise SystemExit(f"{argv[0]} not found: apt-get install mtools syslinux qemu-utils")
    subprocess.run(argv, check=True, env=env, stdout=subprocess.DEVNULL)


def build(output: Path, *, kernel: Path, busybox: Path, disk_format: str = "raw") -> Path:
    """Write the bootable disk to `output` (raw FAT or a qcow2 of it) and return its path."""
    output = Path(output)
    with tempfile.TemporaryDirectory(prefix="stowage-guest-") as tmp:
        work = Path(tmp)
        raw = work / "disk.raw"
        with raw.open("wb") as f:
            f.truncate(DISK_MIB * 1024 * 1024)
        (work / "initrd.gz").write_bytes(initramfs(busybox))
        (work / "syslinux.cfg").write_text(SYSLINUX_CFG)
        shutil.copyfile(kernel, work / "vmlinuz")
        env = {**os.environ, "MTOOLS_SKIP_CHECK": "1"}
        _run("mformat", "-i", str(raw), "-v", "STOWAGE", "::", env=env)
        for name in ("vmlinuz", "initrd.gz", "syslinux.cfg"):
            _run("mcopy", "-i", str(raw), str(work / name), f"::{name}", env=env)
        _run("syslinux", "--install", str(raw))
        output.parent.mkdir(parents=True, exist_ok=True)
        if disk_format == "raw":
            shutil.move(str(raw), output)
        elif disk_format == "qcow2":
            _run("qemu-img", "convert", "-f", "raw", "-O", "qcow2", str(raw), str(output))
        else:
            raise SystemExit(f"unknown format {disk_format!r}: raw or qcow2")
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("output", type=Path)
    parser.add_argument("--format", choices=("raw", "qcow2"), default="raw")
    parser.add_argument("--kernel", type=Path, default=None)
    parser.add_argument("--busybox", type=Path, default=Path("/bin/busybox"))
    args = parser.parse_args(argv)
    busybox = args.busybox
    if not busybox.exists():
        raise SystemExit(f"{busybox} not found: apt-get install busybox-static")
    path = build(
        args.output,
        kernel=args.kernel or default_kernel(),
        busybox=busybox,
        disk_format=args.format,
    )
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
