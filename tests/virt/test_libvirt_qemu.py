"""The libvirt driver on real QEMU (TCG): two private libvirt daemons on this machine, a guest
image served over HTTP, boots with pinned and shared CPUs, console, snapshot, power-state,
and a live migration that lands on the destination's own pins."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import http.server
import json
import os
import re
import shutil
import subprocess
import threading
import time
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

try:
    import libvirt
except ImportError as exc:
    _REASON = f"libvirt-python is not installed ({exc}); install stowage[libvirt]"
    if os.environ.get("CI"):
        pytest.fail(f"CI runs the libvirt tests: {_REASON}", pytrace=False)
    pytest.skip(_REASON, allow_module_level=True)

from stowage.virt import guest_image
from stowage.virt.daemon import LibvirtDaemon
from stowage.virt.driver import (
    BlockDevice,
    DriverError,
    Guest,
    ImageSpec,
    InstanceNotFound,
    InstanceState,
    MigrationProgress,
    MigrationTarget,
    Nic,
)
from stowage.virt.images import HttpImageFetcher
from stowage.virt.libvirt_driver import DOMAIN_PREFIX, LibvirtDriver

TOKEN = "test-token"
BOOT_TIMEOUT_S = 120.0


def _require_real_qemu() -> None:
    missing = [
        t
        for t in ("qemu-system-x86_64", "qemu-img", "libvirtd", "mformat", "syslinux")
        if not shutil.which(t)
    ]
    why = f"missing {missing}" if missing else ("needs root" if os.geteuid() != 0 else "")
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"CI runs the real-QEMU tests: {why}", pytrace=False)
        pytest.skip(why)


def _wait_for(predicate: Callable[[], bool], what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.25)


class _ImageServer:
    """The image API's download endpoint, enough of it: GET /v2/images/<id>/file."""

    def __init__(self, images: dict[str, Path]) -> None:
        self.images = images
        self.gets: list[str] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                match = re.fullmatch(r"/v2/images/([^/]+)/file", self.path)
                if self.headers.get("X-Auth-Token") != TOKEN:
                    self.send_error(401)
                    return
                if match is None or match.group(1) not in outer.images:
                    self.send_error(404)
                    return
                outer.gets.append(match.group(1))
                data = outer.images[match.group(1)].read_bytes()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *_args: Any) -> None:
                return None

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    _require_real_qemu()
    root = tmp_path_factory.mktemp("qemu")
    disk = guest_image.build(
        root / "guest.raw", kernel=guest_image.default_kernel(), busybox=Path("/bin/busybox")
    )
    data = disk.read_bytes()
    image = ImageSpec(
        id=str(uuid.uuid4()),
        disk_format="raw",
        size=len(data),
        checksum=hashlib.md5(data, usedforsecurity=False).hexdigest(),
        hash_algo="sha512",
        hash_value=hashlib.sha512(data).hexdigest(),
    )
    server = _ImageServer({image.id: disk})
    cpus = sorted(os.sched_getaffinity(0))
    # Two hosts on one machine, with the dedicated and shared CPUs swapped between them, so a
    # live migration must rewrite the pins.
    d1 = LibvirtDaemon(root / "h1", migration_port_min=49300)
    d2 = LibvirtDaemon(root / "h2", migration_port_min=49320)
    d1.start()
    d2.start()
    fetch = HttpImageFetcher(server.endpoint, lambda: TOKEN)
    events: list[tuple[str, str]] = []
    h1 = LibvirtDriver(
        d1.uri,
        None,
        root / "h1-disks",
        virt_type="qemu",
        image_fetcher=fetch,
        cpu_dedicated_set=frozenset({cpus[0]}),
        cpu_shared_set=frozenset(cpus[1:]),
        migration_uri="tcp://127.0.0.1",
        on_lifecycle=lambda iid, ev: events.append((iid, ev)),
    )
    h2 = LibvirtDriver(
        d2.uri,
        None,
        root / "h2-disks",
        virt_type="qemu",
        image_fetcher=fetch,
        cpu_dedicated_set=frozenset({cpus[-1]}),
        cpu_shared_set=frozenset(cpus[:-1]),
        migration_uri="tcp://127.0.0.1",
    )
    try:
        yield {
            "image": image,
            "server": server,
            "h1": h1,
            "h2": h2,
            "cpus": cpus,
            "events": events,
            "d1": d1,
            "d2": d2,
        }
    finally:
        h1.close()
        h2.close()
        d1.stop()
        d2.stop()
        server.close()


def _console(driver: LibvirtDriver, iid: str) -> str:
    return driver.console_output(iid)


def _booted(driver: LibvirtDriver, iid: str) -> str:
    _wait_for(
        lambda: guest_image.boot_ids(_console(driver, iid)), f"{iid}'s marker", BOOT_TIMEOUT_S
    )
    return guest_image.boot_ids(_console(driver, iid))[0]


def _pin_info(uri: str, iid: str) -> list[set[int]]:
    conn = libvirt.open(uri)
    try:
        dom = conn.lookupByName(DOMAIN_PREFIX + iid)
        return [{i for i, on in enumerate(cpu) if on} for cpu in dom.vcpuPinInfo(0)]
    finally:
        conn.close()


def _uptime(text: str) -> int:
    counts = re.findall(rf"{guest_image.UPTIME_PREFIX} (\d+) ", text)
    return int(counts[-1]) if counts else 0


def test_host_comes_from_libvirt(world: dict[str, Any]) -> None:
    h1: LibvirtDriver = world["h1"]
    cpus = world["cpus"]
    assert h1.domain_type == "qemu"
    assert h1.host_uuid == world["d1"].host_uuid != world["h2"].host_uuid
    all_cpus = frozenset().union(*(c.cpus for c in h1.topology.cells))
    assert all_cpus == frozenset(range(os.cpu_count() or 1))
    assert h1.topology.cpu_dedicated_set == {cpus[0]}
    with pytest.raises(DriverError) as caught:
        LibvirtDriver(world["d1"].uri, None, h1.disk_dir / "x", virt_type="xen")
    assert caught.value.code == "virt.libvirt.bad_virt_type"


def test_pinned_and_shared_guests_boot_migrate_and_go(world: dict[str, Any]) -> None:
    h1: LibvirtDriver = world["h1"]
    h2: LibvirtDriver = world["h2"]
    image: ImageSpec = world["image"]
    cpus = world["cpus"]
    pinned, shared = str(uuid.uuid4()), str(uuid.uuid4())
    pinned_guest = Guest(
        vcpus=1, memory_mb=192, root_gb=1, pins={0: cpus[0]}, cells=(0,), image=image
    )
    shared_guest = Guest(vcpus=2, memory_mb=192, image=image, name="shared")

    h1.spawn(pinned, {0: cpus[0]}, [0], 192, pinned_guest)
    h1.spawn(shared, {}, [], 192, shared_guest)
    assert world["server"].gets == [image.id]  # fetched once, then cached
    boot_id = _booted(h1, pinned)
    _booted(h1, shared)

    # The pins libvirt enforces are the claim's; shared vCPUs float over the shared set.
    assert _pin_info(h1.uri, pinned) == [{cpus[0]}]
    assert _pin_info(h1.uri, shared) == [set(cpus[1:])] * 2
    running = h1.running()
    assert running[pinned] == {"pins": {0: cpus[0]}, "state": InstanceState.RUNNING}
    assert running[shared] == {"pins": {}, "state": InstanceState.RUNNING}

    # A snapshot is the flattened disk in the format asked for.
    head = next(h1.read_disk(shared, 65536, "qcow2"))
    assert head[:4] == b"QFI\xfb"
    raw = b"".join(h1.read_disk(shared, 1 << 20, "raw"))
    assert len(raw) == image.size

    # Live migration to h2, whose claim pins vCPU 0 to its own dedicated CPU.
    dest_pins = {0: cpus[-1]}
    dest_guest = Guest(vcpus=1, memory_mb=192, root_gb=1, pins=dest_pins, cells=(0,), image=image)
    handle = h2.prepare_migration(pinned, dest_guest)
    before = _uptime(_console(h1, pinned))
    seen: list[MigrationProgress] = []
    h1.migrate(pinned, MigrationTarget("h2", dest_guest, handle), seen.append)
    h2.finish_migration(pinned)
    assert pinned not in h1.running()
    assert not (h1.disk_dir / f"{pinned}.qcow2").exists()
    assert h2.running()[pinned] == {"pins": dest_pins, "state": InstanceState.RUNNING}
    assert _pin_info(h2.uri, pinned) == [{cpus[-1]}]
    # The same guest: its boot id, its counter going on past where it was.
    _wait_for(
        lambda: _uptime(_console(h2, pinned)) > before + 1, "the counter on h2", BOOT_TIMEOUT_S
    )
    text = _console(h2, pinned)
    assert f"boot_id={boot_id}" in text
    assert guest_image.MARKER not in text  # no second boot

    # Power state behind Stowage's back shows.
    conn = libvirt.open(h1.uri)
    try:
        conn.lookupByName(DOMAIN_PREFIX + shared).destroy()
    finally:
        conn.close()
    assert h1.running()[shared]["state"] is InstanceState.SHUTOFF
    _wait_for(lambda: (shared, "stopped") in world["events"], "the stopped event", 10)

    for driver, iid in ((h2, pinned), (h1, shared)):
        driver.destroy(iid)
        assert iid not in driver.running()
        assert not list(driver.disk_dir.glob(f"{iid}*"))
        assert not (driver.console_dir / f"{iid}.log").exists()
        with pytest.raises(InstanceNotFound):
            driver.console_output(iid)


def _slow_down(uri: str, iid: str, mib_s: int) -> None:
    conn = libvirt.open(uri)
    try:
        conn.lookupByName(DOMAIN_PREFIX + iid).migrateSetMaxSpeed(mib_s, 0)
    finally:
        conn.close()


def test_abort_and_force_complete_act_on_the_real_job(world: dict[str, Any]) -> None:
    h1: LibvirtDriver = world["h1"]
    h2: LibvirtDriver = world["h2"]
    image: ImageSpec = world["image"]
    cpus = world["cpus"]
    iid = str(uuid.uuid4())
    guest = Guest(vcpus=1, memory_mb=192, pins={0: cpus[0]}, cells=(0,), image=image)
    h1.spawn(iid, {0: cpus[0]}, [0], 192, guest)
    boot_id = _booted(h1, iid)
    dest_guest = Guest(vcpus=1, memory_mb=192, pins={0: cpus[-1]}, cells=(0,), image=image)

    def migrate_in_background() -> tuple[threading.Thread, list[BaseException]]:
        handle = h2.prepare_migration(iid, dest_guest)
        failures: list[BaseException] = []

        def run() -> None:
            try:
                h1.migrate(iid, MigrationTarget("h2", dest_guest, handle))
            except BaseException as exc:
                failures.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()

        def counting() -> bool:
            seen = h1.migration_progress(iid)
            return seen is not None and seen.memory_total_bytes + seen.disk_total_bytes > 0

        _wait_for(counting, "the migration job's progress", 60)
        return thread, failures

    try:
        # Abort (2.24): the job is cancelled, the guest runs on at the source, the
        # destination is rolled back to nothing.
        _slow_down(h1.uri, iid, 1)
        thread, failures = migrate_in_background()
        h1.abort_migration(iid)
        thread.join(60)
        assert not thread.is_alive()
        assert failures and isinstance(failures[0], DriverError)
        assert h1.running()[iid]["state"] is InstanceState.RUNNING
        h2.rollback_migration(iid)
        assert iid not in h2.running()
        assert not list(h2.disk_dir.glob(f"{iid}*"))
        before = _uptime(_console(h1, iid))
        _wait_for(lambda: _uptime(_console(h1, iid)) > before, "the source guest to go on", 60)

        # Force-complete (2.22): the guest is paused so the copy converges; it arrives and
        # runs on the destination, the same guest.
        _slow_down(h1.uri, iid, 4)
        thread, failures = migrate_in_background()
        h1.force_complete_migration(iid)
        thread.join(120)
        assert not thread.is_alive() and not failures
        h2.finish_migration(iid)
        assert h2.running()[iid] == {"pins": {0: cpus[-1]}, "state": InstanceState.RUNNING}
        _wait_for(lambda: f"boot_id={boot_id}" in _console(h2, iid), "the guest on h2", 60)
    finally:
        for driver in (h1, h2):
            if iid in driver.running():
                driver.destroy(iid)


def _qemu_io(disk: Path, command: str, *, force_share: bool = False) -> str:
    argv = [
        "qemu-io",
        *(["-r", "-U"] if force_share else []),
        "-f",
        "qcow2",
        "-c",
        command,
        str(disk),
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0 and "Pattern verification failed" not in done.stdout, (
        done.stdout + done.stderr
    )
    return done.stdout


def test_a_cold_move_takes_the_disk_with_the_guests_data(world: dict[str, Any]) -> None:
    """A cold migration or resize moves the instance's own disk (its overlay, streamed from
    the source's libvirt) instead of building a new one from the image: data only this
    instance wrote is on the destination, on the destination's own cached base, grown to
    the new flavor's root disk, and the guest boots from it."""
    h1: LibvirtDriver = world["h1"]
    h2: LibvirtDriver = world["h2"]
    image: ImageSpec = world["image"]
    iid = str(uuid.uuid4())
    guest = Guest(vcpus=1, memory_mb=128, root_gb=1, image=image, name="cold")
    h1.spawn(iid, {}, [], 128, guest)
    h1.power_off(iid)
    overlay = h1.disk_dir / f"{iid}.qcow2"
    # 1 MiB of 0x5a at 512 MiB: past the image's 48 MiB, so only the overlay holds it.
    _qemu_io(overlay, "write -P 0x5a 512M 1M")

    handle = h1.export_disk(iid)
    assert handle["format"] == "qcow2"
    resized = Guest(vcpus=1, memory_mb=160, root_gb=2, image=image, name="cold")
    h2.spawn(iid, {}, [], 160, dataclasses.replace(resized, disk_source=handle))
    moved = h2.disk_dir / f"{iid}.qcow2"
    _qemu_io(moved, "read -P 0x5a 512M 1M", force_share=True)
    info = json.loads(
        subprocess.run(
            ["qemu-img", "info", "-U", "--output=json", str(moved)],
            capture_output=True, text=True, check=True,
        ).stdout
    )  # fmt: skip
    assert info["virtual-size"] == 2 * 1024**3  # the resize's root disk
    assert Path(info["full-backing-filename"]).parent == h2.images.directory.resolve()
    assert not list((h1.disk_dir / "outgoing").glob(f"{iid}*"))  # the staged copy is taken
    _booted(h2, iid)
    assert h2.running()[iid]["state"] is InstanceState.RUNNING

    # The source keeps its guest until the move is confirmed (or reverted).
    assert h1.running()[iid]["state"] is InstanceState.SHUTOFF
    for driver in (h1, h2):
        driver.destroy(iid)
        assert not list(driver.disk_dir.glob(f"{iid}*"))


def _local(path: Path, volume_id: str) -> dict[str, Any]:
    """The local-file volume backend's connection info (services/volumes/backend.py)."""
    return {
        "driver_volume_type": "local",
        "data": {"device_path": str(path), "volume_id": volume_id, "access_mode": "rw"},
    }


def _guest_disks(text: str) -> list[str]:
    """The disks the guest said it sees, the last time they changed."""
    seen = re.findall(rf"^{guest_image.DISKS_PREFIX} (.*)\n", text, re.MULTILINE)  # whole lines
    return seen[-1].split() if seen else []


def _host_disks(uri: str, iid: str, flags: int = 0) -> dict[str, str]:
    """`virsh domblklist`: target -> source, of the live (or, with flags, the persistent)
    definition."""
    conn = libvirt.open(uri)
    try:
        root = ET.fromstring(conn.lookupByName(DOMAIN_PREFIX + iid).XMLDesc(flags))
    finally:
        conn.close()
    out = {}
    for disk in root.findall("devices/disk"):
        target, source = disk.find("target"), disk.find("source")
        assert target is not None and source is not None
        out[target.get("dev", "")] = source.get("file", "")
    return out


def test_a_guest_boots_from_a_volume_sees_its_volumes_and_reads_its_config_drive(
    world: dict[str, Any], tmp_path: Path
) -> None:
    """Boot from volume (the root disk is the volume's file), a second volume and a config
    drive at spawn, a third volume hot-plugged and unplugged, the attachment surviving a
    restart of the domain, and a live migration that leaves the volumes in place: the
    guest's own view on its console, libvirt's beside it."""
    h1: LibvirtDriver = world["h1"]
    h2: LibvirtDriver = world["h2"]
    image: ImageSpec = world["image"]
    iid = str(uuid.uuid4())
    volumes = tmp_path / "volumes"
    volumes.mkdir()
    root, data, hot = volumes / "volume-root", volumes / "volume-data", volumes / "volume-hot"
    shutil.copyfile(world["server"].images[image.id], root)  # a volume made from the image
    for path in (data, hot):
        with path.open("wb") as f:
            f.truncate(64 * 1024 * 1024)
    meta = {"uuid": iid, "name": "from-volume", "hostname": "from-volume"}
    guest = Guest(
        vcpus=1,
        memory_mb=192,
        name="from-volume",
        volumes=(
            BlockDevice("/dev/vda", _local(root, "v-root"), 0, "v-root"),
            BlockDevice("/dev/vdb", _local(data, "v-data"), None, "v-data"),
        ),
        config_drive={
            "openstack/latest/meta_data.json": json.dumps(meta).encode(),
            "openstack/latest/user_data": b"#!/bin/sh\necho hello\n",
            "openstack/latest/network_data.json": b'{"links": [], "networks": []}',
            "openstack/latest/vendor_data.json": b"{}",
        },
    )
    try:
        h1.spawn(iid, {}, [], 192, guest)
        boot_id = _booted(h1, iid)
        assert not (h1.disk_dir / f"{iid}.qcow2").exists()  # no overlay: the volume boots
        iso = h1.disk_dir / f"{iid}.config.iso"
        assert _host_disks(h1.uri, iid) == {"vda": str(root), "vdb": str(data), "hda": str(iso)}

        def guest_sees(disks: list[str]) -> Callable[[], bool]:
            return lambda: _guest_disks(_console(h1, iid)) == disks

        _wait_for(guest_sees(["sr0", "vda", "vdb"]), "the guest's disks", 60)
        _wait_for(lambda: guest_image.META_DATA_PREFIX in _console(h1, iid), "the config drive", 30)
        text = _console(h1, iid)
        assert f"{guest_image.CONFIG_DRIVE_PREFIX} /dev/sr0" in text  # found by its label
        line = re.search(rf"^{guest_image.META_DATA_PREFIX} (.*)$", text, re.MULTILINE)
        assert line is not None and json.loads(line.group(1)) == meta
        _wait_for(lambda: guest_image.USER_DATA_PREFIX in _console(h1, iid), "the user data", 30)
        said = re.search(rf"^{guest_image.USER_DATA_PREFIX} (\S*)$", _console(h1, iid), re.M)
        assert said is not None
        assert base64.b64decode(said.group(1)) == guest.config_drive["openstack/latest/user_data"]

        # Hot-plug: the running guest sees the disk appear, the definition keeps it.
        h1.attach_volume(iid, "/dev/vdc", _local(hot, "v-hot"))
        h1.attach_volume(iid, "/dev/vdc", _local(hot, "v-hot"))  # again: no change
        _wait_for(guest_sees(["sr0", "vda", "vdb", "vdc"]), "the hot-plugged disk", 30)
        inactive = libvirt.VIR_DOMAIN_XML_INACTIVE
        assert _host_disks(h1.uri, iid, inactive)["vdc"] == str(hot)
        # ... and unplug: gone from the guest and from both definitions.
        h1.detach_volume(iid, "/dev/vdc")
        _wait_for(guest_sees(["sr0", "vda", "vdb"]), "the unplugged disk to go", 30)
        assert "vdc" not in _host_disks(h1.uri, iid)
        assert "vdc" not in _host_disks(h1.uri, iid, inactive)

        # Attached again, it is there after a restart of the domain (a hard reboot).
        h1.attach_volume(iid, "/dev/vdc", _local(hot, "v-hot"))
        _wait_for(guest_sees(["sr0", "vda", "vdb", "vdc"]), "the hot-plugged disk", 30)
        h1.reboot(iid)
        _wait_for(lambda: _console(h1, iid).count(guest_image.MARKER) == 2, "the reboot", 90)
        after = _console(h1, iid).split(guest_image.MARKER)[-1]
        _wait_for(
            lambda: (
                _guest_disks(_console(h1, iid).split(guest_image.MARKER)[-1])
                == ["sr0", "vda", "vdb", "vdc"]
            ),
            "the disks after the reboot",
            60,
        )
        assert f"boot_id={boot_id}" not in after

        # A live migration to h2 copies no volume (the same files, one machine): the
        # guest goes on there with its volumes and h2's own copy of the config drive.
        dest_guest = dataclasses.replace(
            guest,
            volumes=(*guest.volumes, BlockDevice("/dev/vdc", _local(hot, "v-hot"))),
        )
        handle = h2.prepare_migration(iid, dest_guest)
        before = _uptime(_console(h1, iid))
        h1.migrate(iid, MigrationTarget("h2", dest_guest, handle))
        h2.finish_migration(iid)
        assert _host_disks(h2.uri, iid) == {
            "vda": str(root),
            "vdb": str(data),
            "vdc": str(hot),
            "hda": str(h2.disk_dir / f"{iid}.config.iso"),
        }
        assert not iso.exists()  # the source's files went, the volumes stay
        assert root.exists() and data.exists() and hot.exists()
        _wait_for(
            lambda: _uptime(_console(h2, iid)) > before + 1, "the counter on h2", BOOT_TIMEOUT_S
        )
    finally:
        for driver in (h1, h2):
            if iid in driver.running():
                driver.destroy(iid)


def _guest_nics(text: str) -> list[str]:
    """The NICs' MACs the guest said it has, the last time they changed."""
    seen = re.findall(rf"^{guest_image.NICS_PREFIX} (.*)\n", text, re.MULTILINE)  # whole lines
    return seen[-1].split() if seen else []


def _last_boot(driver: LibvirtDriver, iid: str) -> str:
    return _console(driver, iid).split(guest_image.MARKER)[-1]


def test_nic_hotplug_nmi_and_rescue_of_a_real_guest(world: dict[str, Any]) -> None:
    """One guest: a NIC hot-plugged and unplugged (the guest sees it come and go), an NMI
    the guest kernel reports, the password refused (no guest agent), then a rescue that
    reboots it from the rescue image with its own disk second, and back."""
    h1: LibvirtDriver = world["h1"]
    image: ImageSpec = world["image"]
    iid = str(uuid.uuid4())
    first, hot = "fa:16:3e:00:00:01", "fa:16:3e:00:00:02"
    guest = Guest(vcpus=1, memory_mb=160, image=image, name="rescue", nics=(Nic(mac=first),))
    h1.spawn(iid, {}, [], 160, guest)
    try:
        _booted(h1, iid)
        _wait_for(lambda: _guest_nics(_console(h1, iid)) == [first], "the guest's NIC", 60)

        h1.attach_interface(iid, Nic(mac=hot))
        h1.attach_interface(iid, Nic(mac=hot))  # again: no change
        _wait_for(lambda: _guest_nics(_console(h1, iid)) == [first, hot], "the new NIC", 30)
        conn = libvirt.open(h1.uri)
        try:
            config = conn.lookupByName(DOMAIN_PREFIX + iid).XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)
        finally:
            conn.close()
        assert hot in config  # in the persistent definition too
        h1.detach_interface(iid, hot)
        _wait_for(lambda: _guest_nics(_console(h1, iid)) == [first], "the NIC to go", 30)

        h1.inject_nmi(iid)
        _wait_for(lambda: "NMI received" in _console(h1, iid), "the guest's NMI report", 30)
        with pytest.raises(DriverError) as refused:
            h1.set_admin_password(iid, "secret")
        assert refused.value.code == "virt.password.no_guest_agent"

        overlay = h1.disk_dir / f"{iid}.qcow2"
        rescue_disk = h1.disk_dir / f"{iid}.rescue.qcow2"
        h1.rescue(iid, image, "secret")
        h1.rescue(iid, image, "secret")  # again: no change
        _wait_for(lambda: _console(h1, iid).count(guest_image.MARKER) == 2, "the rescue boot", 90)
        assert _host_disks(h1.uri, iid) == {"vda": str(rescue_disk), "vdb": str(overlay)}
        _wait_for(lambda: _guest_disks(_last_boot(h1, iid)) == ["vda", "vdb"], "both disks", 60)
        assert h1.running()[iid]["state"] is InstanceState.RUNNING

        h1.unrescue(iid)
        _wait_for(lambda: _console(h1, iid).count(guest_image.MARKER) == 3, "the own boot", 90)
        assert _host_disks(h1.uri, iid) == {"vda": str(overlay)}
        _wait_for(lambda: _guest_disks(_last_boot(h1, iid)) == ["vda"], "its own disk", 60)
        assert not rescue_disk.exists() and not (h1.disk_dir / f"{iid}.unrescue.xml").exists()
        _wait_for(lambda: _guest_nics(_last_boot(h1, iid)) == [first], "its NIC again", 30)
    finally:
        if iid in h1.running():
            h1.destroy(iid)
    assert not list(h1.disk_dir.glob(f"{iid}*"))


def _image_of(path: Path, disk_format: str) -> ImageSpec:
    data = path.read_bytes()
    return ImageSpec(
        id=str(uuid.uuid4()),
        disk_format=disk_format,
        size=len(data),
        checksum=hashlib.md5(data, usedforsecurity=False).hexdigest(),
        hash_algo="sha512",
        hash_value=hashlib.sha512(data).hexdigest(),
    )


def test_an_unshelved_disk_is_rebased_onto_the_servers_image_or_flattened(
    world: dict[str, Any], tmp_path: Path
) -> None:
    """An unshelve boots from the shelve's image, then its disk leans on the server's own
    image (a safe rebase: what the shelve saved stays, Nova's fix of bug 1732428), or on
    nothing when that image is gone; before, it stayed an overlay on the shelve's image,
    which is deleted, while a later move fetched the server's image as its base."""
    h1: LibvirtDriver = world["h1"]
    image: ImageSpec = world["image"]
    server: Any = world["server"]
    # The shelve's image: the guest's disk with data only it wrote (0x5a at 40 MiB, inside
    # the base image's 48 MiB), flattened into a standalone qcow2, as a snapshot is.
    shelved_path = tmp_path / "shelved.qcow2"
    subprocess.run(
        ["qemu-img", "convert", "-f", "raw", "-O", "qcow2", str(server.images[image.id]),
         str(shelved_path)],
        check=True,
    )  # fmt: skip
    _qemu_io(shelved_path, "write -P 0x5a 40M 1M")
    shelved = _image_of(shelved_path, "qcow2")
    server.images[shelved.id] = shelved_path
    for rebase in (image, None):
        iid = str(uuid.uuid4())
        guest = Guest(
            vcpus=1,
            memory_mb=128,
            root_gb=1,
            image=shelved,
            name="unshelved",
            rebase_image=rebase,
            flatten_disk=rebase is None,
        )
        h1.spawn(iid, {}, [], 128, guest)
        disk = h1.disk_dir / f"{iid}.qcow2"
        info = json.loads(
            subprocess.run(
                ["qemu-img", "info", "-U", "--output=json", str(disk)],
                capture_output=True, text=True, check=True,
            ).stdout
        )  # fmt: skip
        if rebase is None:
            assert "backing-filename" not in info, info
        else:
            assert info["backing-filename"] == str((h1.images.directory / image.id).resolve())
        _qemu_io(disk, "read -P 0x5a 40M 1M", force_share=True)  # what the shelve saved
        same = subprocess.run(
            ["qemu-img", "compare", "-U", str(disk), str(shelved_path)],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert same.returncode == 0, same.stdout + same.stderr
        _booted(h1, iid)
        h1.destroy(iid)
        assert not list(h1.disk_dir.glob(f"{iid}*"))
