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

After the marker the init loads the kernel's disk modules (virtio-blk, IDE cdrom, ISO 9660:
linux-image-cloud-amd64 builds them as modules, so they are copied into the initramfs), and
prints the block devices and the NICs' MAC addresses it sees whenever they change (a
hot-plugged volume or NIC shows), and the config drive's meta_data.json once a device
labelled `config-2` appears:

    stowage-disks: hda vda vdb
    stowage-nics: fa:16:3e:00:00:01
    stowage-config-drive: /dev/sr0
    stowage-meta-data: {"uuid": ...}
    stowage-user-data: <the user_data file, base64, when the drive has one>

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
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = [
    "CONFIG_DRIVE_PREFIX",
    "DISKS_PREFIX",
    "MARKER",
    "META_DATA_PREFIX",
    "NICS_PREFIX",
    "UPTIME_PREFIX",
    "USER_DATA_PREFIX",
    "boot_ids",
    "build",
    "default_kernel",
    "disk_modules",
    "initramfs",
]

MARKER = "STOWAGE-GUEST-UP"
UPTIME_PREFIX = "stowage-uptime"
DISKS_PREFIX = "stowage-disks:"
NICS_PREFIX = "stowage-nics:"
CONFIG_DRIVE_PREFIX = "stowage-config-drive:"
META_DATA_PREFIX = "stowage-meta-data:"
USER_DATA_PREFIX = "stowage-user-data:"
DISK_MIB = 48
# A boot's line as the console holds it once written whole: the console is read while the
# guest writes, so a read can end inside the line, after the marker and before its id's end.
_BOOT_LINE = re.compile(
    rf"{MARKER} boot_id=([0-9a-f]{{8}}(?:-[0-9a-f]{{4}}){{3}}-[0-9a-f]{{12}})\s"
)


def boot_ids(console: str) -> list[str]:
    """The boot ids of the boots whose marker line a console's text holds whole, in order."""
    return _BOOT_LINE.findall(console)


# In load order (each after what it needs, as modules.dep says): virtio disks, the IDE cdrom
# of the default x86 machine (ata_piix, sr_mod), ISO 9660 and virtio NICs.
DISK_MODULES = (
    "drivers/virtio/virtio_ring",
    "drivers/virtio/virtio",
    "drivers/virtio/virtio_pci_legacy_dev",
    "drivers/virtio/virtio_pci_modern_dev",
    "drivers/virtio/virtio_pci",
    "drivers/block/virtio_blk",
    "drivers/scsi/scsi_common",
    "drivers/scsi/scsi_mod",
    "drivers/ata/libata",
    "drivers/ata/ata_piix",
    "drivers/cdrom/cdrom",
    "drivers/scsi/sr_mod",
    "fs/isofs/isofs",
    "net/core/failover",
    "drivers/net/net_failover",
    "drivers/net/virtio_net",
)

INIT = f"""#!/bin/busybox sh
/bin/busybox mkdir -p /proc /sys /dev /tmp
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sysfs /sys
/bin/busybox mount -t devtmpfs devtmpfs /dev 2>/dev/null
/bin/busybox --install -s /bin
export PATH=/bin
boot_id=$(cat /proc/sys/kernel/random/boot_id)
echo "{MARKER} boot_id=$boot_id" > /dev/ttyS0
for m in $(cat /lib/modules/order 2>/dev/null); do insmod /lib/modules/$m 2>/dev/null; done
mkdir -p /mnt/cd
disks_seen=
nics_seen=
cd_seen=
look() {{
  disks=$(awk 'NR > 2 && $4 != "" {{ print $4 }}' /proc/partitions | sort | tr '\\n' ' ')
  if [ "$disks" != "$disks_seen" ]; then
    disks_seen=$disks
    echo "{DISKS_PREFIX} $disks" > /dev/ttyS0
  fi
  nics=$(cat /sys/class/net/eth*/address 2>/dev/null | sort | tr '\\n' ' ')
  if [ "$nics" != "$nics_seen" ]; then
    nics_seen=$nics
    echo "{NICS_PREFIX} $nics" > /dev/ttyS0
  fi
  [ -n "$cd_seen" ] && return
  cd=$(findfs LABEL=config-2 2>/dev/null)
  [ -n "$cd" ] || return
  mount -t iso9660 -o ro "$cd" /mnt/cd 2>/dev/null || return
  cd_seen=$cd
  echo "{CONFIG_DRIVE_PREFIX} $cd" > /dev/ttyS0
  echo "{META_DATA_PREFIX} $(cat /mnt/cd/openstack/latest/meta_data.json)" > /dev/ttyS0
  ud=/mnt/cd/openstack/latest/user_data
  [ -f $ud ] && echo "{USER_DATA_PREFIX} $(head -c 4096 $ud | base64 -w 0)" > /dev/ttyS0
  umount /mnt/cd
}}
look
n=0
while true; do
  sleep 1
  n=$((n + 1))
  echo "{UPTIME_PREFIX} $n boot_id=$boot_id" > /dev/ttyS0
  look
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


def initramfs(busybox: Path, modules: list[Path] | None = None) -> bytes:
    """A gzipped cpio holding /init, a static busybox and the kernel `modules` given (in
    load order, into /lib/modules, listed in /lib/modules/order)."""
    dir_mode, exe_mode, file_mode = 0o040755, 0o100755, 0o100644
    entries = [
        ("bin", dir_mode, b""),
        ("dev", dir_mode, b""),
        ("proc", dir_mode, b""),
        ("sys", dir_mode, b""),
        ("tmp", dir_mode, b""),
        ("bin/busybox", exe_mode, busybox.read_bytes()),
        ("init", exe_mode, INIT.encode()),
    ]
    if modules:
        entries += [("lib", dir_mode, b""), ("lib/modules", dir_mode, b"")]
        entries += [(f"lib/modules/{m.name}", file_mode, m.read_bytes()) for m in modules]
        order = "".join(f"{m.name}\n" for m in modules).encode()
        entries.append(("lib/modules/order", file_mode, order))
    return gzip.compress(_cpio_newc(entries), compresslevel=6, mtime=0)


def disk_modules(kernel: Path) -> list[Path]:
    """The disk and cdrom modules of `kernel` (/boot/vmlinuz-<version>), from
    /lib/modules/<version>; those it lacks are left out (built in, or not offered)."""
    version = kernel.name.removeprefix("vmlinuz-")
    base = Path("/lib/modules") / version / "kernel"
    return [base / f"{m}.ko" for m in DISK_MODULES if (base / f"{m}.ko").exists()]


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
        (work / "initrd.gz").write_bytes(initramfs(busybox, disk_modules(kernel)))
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
