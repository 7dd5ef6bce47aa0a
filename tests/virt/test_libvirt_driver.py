"""The libvirt driver against libvirt's built-in test driver, and one smoke test on real QEMU."""

from __future__ import annotations

import json
import os
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

from stowage.domain.topology import HostTopology, format_cpu_set
from stowage.virt.driver import (
    BlockDevice,
    Driver,
    DriverError,
    Guest,
    ImageSpec,
    InstanceNotFound,
    InstanceState,
)
from stowage.virt.libvirt_driver import (
    DOMAIN_PREFIX,
    METADATA_NS,
    LibvirtDriver,
    domain_xml,
    host_topology,
    rewrite_for_destination,
    volume_disk,
)

TEST_URI = "test:///default"  # every open in this process shares one in-memory hypervisor
DISK_BYTES = 300_000  # not a multiple of the chunk size, so the last chunk is short
MiB_IN_KiB = 1024

# Two cells of 4 cores x 2 threads: cell 0 = CPUs 0-3,8-11, cell 1 = CPUs 4-7,12-15.
TOPOLOGY = HostTopology.uniform(cells=2, cores_per_cell=4, threads_per_core=2)


def _wait_for(
    predicate: Callable[[], bool], what: str | Callable[[], str], timeout_s: float = 30.0
) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what() if callable(what) else what}")
        time.sleep(0.02)


@pytest.fixture
def conn() -> Iterator[Any]:
    """A second, raw connection to the same test hypervisor, to look behind the driver."""
    c = libvirt.open(TEST_URI)
    yield c
    c.close()


@pytest.fixture
def ids(conn: Any) -> Iterator[Callable[[], str]]:
    """Fresh instance ids (UUIDs); every domain made with one is removed afterwards."""
    made: list[str] = []

    def new_id() -> str:
        made.append(str(uuid.uuid4()))
        return made[-1]

    yield new_id
    for iid in made:
        try:
            dom = conn.lookupByName(DOMAIN_PREFIX + iid)
        except libvirt.libvirtError:
            continue
        if dom.isActive():
            dom.destroy()
        dom.undefine()


@pytest.fixture
def events() -> list[tuple[str, str]]:
    return []


@pytest.fixture
def driver(tmp_path: Path, events: list[tuple[str, str]]) -> Iterator[LibvirtDriver]:
    d = LibvirtDriver(
        TEST_URI,
        TOPOLOGY,
        tmp_path / "disks",
        disk_bytes=DISK_BYTES,
        on_lifecycle=lambda iid, event: events.append((iid, event)),
    )
    yield d
    d.close()


def _xml(conn: Any, instance_id: str) -> ET.Element:
    return ET.fromstring(conn.lookupByName(DOMAIN_PREFIX + instance_id).XMLDesc(0))


def _domain_names(conn: Any) -> set[str]:
    return {dom.name() for dom in conn.listAllDomains(0)}


def test_is_a_driver(driver: LibvirtDriver) -> None:
    assert isinstance(driver, Driver)
    assert driver.domain_type == "test"


def test_spawn_defines_pins_numa_and_disk(
    driver: LibvirtDriver, conn: Any, ids: Callable[[], str], tmp_path: Path
) -> None:
    iid = ids()
    driver.spawn(iid, {0: 0, 1: 8, 2: 4, 3: 12}, [0, 1], 1024)

    dom = conn.lookupByName(DOMAIN_PREFIX + iid)
    assert dom.isActive()
    assert dom.isPersistent()
    root = _xml(conn, iid)
    assert root.findtext("uuid") == iid
    vcpu = root.find("vcpu")
    assert vcpu is not None
    assert (vcpu.get("placement"), vcpu.text) == ("static", "4")
    vcpupins = {p.get("vcpu"): p.get("cpuset") for p in root.findall("cputune/vcpupin")}
    assert vcpupins == {"0": "0", "1": "8", "2": "4", "3": "12"}
    emulatorpin = root.find("cputune/emulatorpin")
    assert emulatorpin is not None
    assert emulatorpin.get("cpuset") == "0,4,8,12"
    memory = root.find("numatune/memory")
    assert memory is not None
    assert (memory.get("mode"), memory.get("nodeset")) == ("strict", "0-1")
    memnodes = {
        m.get("cellid"): (m.get("mode"), m.get("nodeset")) for m in root.findall("numatune/memnode")
    }
    assert memnodes == {"0": ("strict", "0"), "1": ("strict", "1")}
    # Guest cell i is host cell cells[i]; its vCPUs are those pinned there; memory split evenly.
    cells = {
        c.get("id"): (c.get("cpus"), int(c.get("memory", "0")), c.get("unit"))
        for c in root.findall("cpu/numa/cell")
    }
    assert cells == {
        "0": ("0-1", 512 * MiB_IN_KiB, "KiB"),
        "1": ("2-3", 512 * MiB_IN_KiB, "KiB"),
    }
    source = root.find("devices/disk/source")
    assert source is not None
    disk = Path(source.get("file", ""))
    assert disk.parent == tmp_path / "disks"
    assert disk.stat().st_size == DISK_BYTES


def test_uneven_memory_and_non_uuid_ids(
    driver: LibvirtDriver, conn: Any, ids: Callable[[], str]
) -> None:
    iid = "vm-" + ids()[:8]
    try:
        driver.spawn(iid, {0: 1, 1: 5}, [0, 1], 1001)
        root = _xml(conn, iid)
        uuid.UUID(root.findtext("uuid", ""))  # a stable UUID derived from the id
        memory_kib = [int(c.get("memory", "0")) for c in root.findall("cpu/numa/cell")]
        assert memory_kib == [501 * MiB_IN_KiB, 500 * MiB_IN_KiB]
        assert iid in driver.running()
    finally:
        driver.destroy(iid)


def test_running_reports_pins_and_state(driver: LibvirtDriver, ids: Callable[[], str]) -> None:
    a, b = ids(), ids()
    driver.spawn(a, {0: 2, 1: 3}, [0], 256)
    driver.spawn(b, {0: 6}, [1], 128)
    driver.power_off(b)

    running = driver.running()
    assert running[a] == {"pins": {0: 2, 1: 3}, "state": InstanceState.RUNNING}
    assert running[b] == {"pins": {0: 6}, "state": InstanceState.SHUTOFF}
    assert "test" not in running  # domains that are not instances are not reported


def test_power_off_on_and_reboot(
    driver: LibvirtDriver,
    conn: Any,
    ids: Callable[[], str],
    events: list[tuple[str, str]],
) -> None:
    iid = ids()
    driver.spawn(iid, {0: 9}, [0], 128)
    disk = driver.disk_dir / f"{iid}.img"

    driver.power_off(iid)
    assert driver.running()[iid]["state"] is InstanceState.SHUTOFF
    assert not conn.lookupByName(DOMAIN_PREFIX + iid).isActive()
    assert disk.exists()  # the definition and disk stay
    driver.power_off(iid)  # already off: nothing to do
    assert driver.running()[iid]["state"] is InstanceState.SHUTOFF

    driver.power_on(iid)
    assert driver.running()[iid]["state"] is InstanceState.RUNNING
    driver.power_on(iid)  # already on: nothing to do
    assert driver.running()[iid] == {"pins": {0: 9}, "state": InstanceState.RUNNING}

    # Events arrive on the driver's event thread, after the call that caused them returns:
    # wait for the whole sequence so far (a count taken before the last one lands would shift
    # the window and miss the reboot's), then for the reboot's on top of it.
    def seen() -> list[str]:
        return [event for who, event in events if who == iid]

    so_far = ["defined", "started", "stopped", "started"]
    _wait_for(lambda: seen() == so_far, lambda: f"the lifecycle events {so_far}, seen {seen()}")
    driver.reboot(iid)
    assert driver.running()[iid]["state"] is InstanceState.RUNNING
    # A hard reboot is a stop and a start; the lifecycle callback sees both.
    so_far += ["stopped", "started"]
    _wait_for(lambda: seen() == so_far, lambda: f"the reboot's lifecycle events, seen {seen()}")

    driver.power_off(iid)
    driver.reboot(iid)  # a stopped instance comes back up
    assert driver.running()[iid]["state"] is InstanceState.RUNNING


def test_destroy_removes_domain_and_disk(
    driver: LibvirtDriver, conn: Any, ids: Callable[[], str], events: list[tuple[str, str]]
) -> None:
    iid = ids()
    driver.spawn(iid, {0: 10, 1: 11}, [0], 256)
    disk = driver.disk_dir / f"{iid}.img"
    assert disk.exists()

    driver.destroy(iid)
    assert DOMAIN_PREFIX + iid not in _domain_names(conn)
    assert not disk.exists()
    assert iid not in driver.running()
    _wait_for(lambda: (iid, "undefined") in events, "the undefined event")

    for op in (driver.destroy, driver.reboot, driver.power_off, driver.power_on):
        with pytest.raises(InstanceNotFound):
            op(iid)
    with pytest.raises(InstanceNotFound):
        driver.read_disk(iid, 4096)
    # The CPUs are free again.
    again = ids()
    driver.spawn(again, {0: 10, 1: 11}, [0], 256)
    assert driver.running()[again]["pins"] == {0: 10, 1: 11}


def test_read_disk_streams_the_disk(driver: LibvirtDriver, ids: Callable[[], str]) -> None:
    iid = ids()
    driver.spawn(iid, {0: 7}, [1], 128)
    expected = (driver.disk_dir / f"{iid}.img").read_bytes()
    assert len(expected) == DISK_BYTES
    assert len(set(expected[:4096])) > 1  # real data, not a sparse hole

    chunks = driver.read_disk(iid, 65536)
    got = list(chunks)
    assert all(0 < len(c) <= 65536 for c in got)
    assert len(got) == -(-DISK_BYTES // 65536)
    assert b"".join(got) == expected
    with pytest.raises(ValueError):
        driver.read_disk(iid, 0)


def test_spawning_the_same_guest_again_starts_it(
    driver: LibvirtDriver, conn: Any, ids: Callable[[], str]
) -> None:
    """A restored host (its daemon restarted: every guest defined, none running) gets the
    same spawn again: the defined guest is started, not refused."""
    iid = ids()
    driver.spawn(iid, {0: 12}, [1], 128)
    conn.lookupByName(DOMAIN_PREFIX + iid).destroy()
    assert driver.running()[iid]["state"] is InstanceState.SHUTOFF
    driver.spawn(iid, {0: 12}, [1], 128)
    assert driver.running()[iid] == {"pins": {0: 12}, "state": InstanceState.RUNNING}
    driver.spawn(iid, {0: 12}, [1], 128)  # running already: nothing to do
    assert driver.running()[iid]["state"] is InstanceState.RUNNING


def test_spawning_the_same_id_twice_fails(driver: LibvirtDriver, ids: Callable[[], str]) -> None:
    iid = ids()
    driver.spawn(iid, {0: 13}, [1], 128)
    with pytest.raises(DriverError) as caught:
        driver.spawn(iid, {0: 14}, [1], 128)
    assert caught.value.code == "virt.exists"
    assert driver.running()[iid] == {"pins": {0: 13}, "state": InstanceState.RUNNING}


@pytest.mark.parametrize(
    ("pins", "cells", "code"),
    [
        ({0: 99}, [0], "virt.libvirt.pin_not_on_host"),
        ({0: 4}, [0], "virt.libvirt.pin_outside_cells"),  # CPU 4 is in cell 1
        ({0: 1, 1: 1}, [0], "virt.libvirt.pin_conflict"),  # two vCPUs on one CPU
        ({0: 1}, [7], "virt.libvirt.cell_not_on_host"),
        ({0: 1, 2: 2}, [0], "virt.libvirt.bad_vcpus"),
        ({}, [0], "virt.libvirt.no_pins"),
    ],
)
def test_bad_claims_are_refused_before_defining(
    driver: LibvirtDriver,
    conn: Any,
    ids: Callable[[], str],
    pins: dict[int, int],
    cells: list[int],
    code: str,
) -> None:
    iid = ids()
    before = _domain_names(conn)
    with pytest.raises(DriverError) as caught:
        driver.spawn(iid, pins, cells, 128)
    assert caught.value.code == code
    assert _domain_names(conn) == before
    assert not (driver.disk_dir / f"{iid}.img").exists()


def test_pins_held_by_other_domains_are_refused(
    driver: LibvirtDriver, conn: Any, ids: Callable[[], str]
) -> None:
    first = ids()
    driver.spawn(first, {0: 0, 1: 1}, [0], 128)
    # A Stowage domain defined behind the driver's back (left by an earlier agent), not
    # running, pinning CPU 3: it carries Stowage's metadata, so its pins count.
    leftover = ids()
    conn.defineXML(
        f"<domain type='test'><name>{DOMAIN_PREFIX}{leftover}</name><memory>131072</memory>"
        f"<metadata><s:instance xmlns:s='{METADATA_NS}'><s:id>{leftover}</s:id>"
        "<s:shared-vcpus></s:shared-vcpus></s:instance></metadata>"
        "<vcpu placement='static'>1</vcpu><cputune><vcpupin vcpu='0' cpuset='3'/></cputune>"
        "<os><type>hvm</type></os></domain>"
    )
    before = _domain_names(conn)

    for pins in ({0: 2, 1: 1}, {0: 3}):
        loser = ids()
        with pytest.raises(DriverError) as caught:
            driver.spawn(loser, pins, [0], 128)
        assert caught.value.code == "virt.libvirt.pin_conflict"
        assert _domain_names(conn) == before
        assert not (driver.disk_dir / f"{loser}.img").exists()
    assert driver.running()[first]["pins"] == {0: 0, 1: 1}
    assert driver.running()[leftover]["pins"] == {0: 3}


def test_domains_that_are_not_stowages_are_left_alone(
    driver: LibvirtDriver, conn: Any, ids: Callable[[], str]
) -> None:
    # Someone else's domain pinned to CPU 9, named like ours but without Stowage's metadata.
    foreign = ids()
    conn.defineXML(
        f"<domain type='test'><name>{DOMAIN_PREFIX}{foreign}</name><memory>131072</memory>"
        "<vcpu placement='static'>1</vcpu><cputune><vcpupin vcpu='0' cpuset='9'/></cputune>"
        "<os><type>hvm</type></os></domain>"
    )
    assert foreign not in driver.running()
    mine = ids()
    driver.spawn(mine, {0: 9}, [0], 128)  # the ledger gave CPU 9 to this instance
    assert driver.running()[mine]["pins"] == {0: 9}
    driver.destroy(mine)
    assert DOMAIN_PREFIX + foreign in _domain_names(conn)


def test_bad_instance_ids_are_refused(driver: LibvirtDriver, conn: Any) -> None:
    before = _domain_names(conn)
    with pytest.raises(DriverError) as caught:
        driver.spawn("../escape", {0: 1}, [0], 128)
    assert caught.value.code == "virt.libvirt.bad_instance_id"
    assert _domain_names(conn) == before


def test_unreachable_uri_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(DriverError) as caught:
        LibvirtDriver("test:///no/such/config.xml", TOPOLOGY, tmp_path)
    assert caught.value.code == "virt.libvirt.unreachable"


# Real QEMU: tests/virt/test_libvirt_qemu.py (private libvirt daemons; never skipped in CI).


# -- the whole guest: shared, mixed, image-less -----------------------------------------


def test_a_shared_cpu_guest_floats_over_the_shared_set(
    driver: LibvirtDriver, conn: Any, ids: Callable[[], str]
) -> None:
    iid = ids()
    guest = Guest(vcpus=2, memory_mb=256, name="web-1")
    driver.spawn(iid, {}, [], 256, guest)  # refused with virt.libvirt.no_pins before
    root = _xml(conn, iid)
    shared = format_cpu_set(set(TOPOLOGY.cpu_shared_set))
    vcpu = root.find("vcpu")
    assert vcpu is not None
    assert (vcpu.text, vcpu.get("cpuset")) == ("2", shared)
    assert {p.get("vcpu"): p.get("cpuset") for p in root.findall("cputune/vcpupin")} == {
        "0": shared,
        "1": shared,
    }
    emulatorpin = root.find("cputune/emulatorpin")
    assert emulatorpin is not None and emulatorpin.get("cpuset") == shared
    assert root.find("numatune") is None
    assert driver.running()[iid] == {"pins": {}, "state": InstanceState.RUNNING}
    # Two shared guests share the shared CPUs: nothing is "taken".
    other = ids()
    driver.spawn(other, {}, [], 256, guest)
    assert driver.running()[other]["pins"] == {}


def test_a_mixed_guest_pins_some_vcpus_and_floats_the_rest(
    driver: LibvirtDriver, conn: Any, ids: Callable[[], str]
) -> None:
    iid = ids()
    guest = Guest(vcpus=3, memory_mb=512, pins={1: 0, 2: 8}, cells=(0,))
    driver.spawn(iid, {1: 0, 2: 8}, [0], 512, guest)
    root = _xml(conn, iid)
    shared = format_cpu_set(set(TOPOLOGY.cpu_shared_set))
    assert {p.get("vcpu"): p.get("cpuset") for p in root.findall("cputune/vcpupin")} == {
        "0": shared,
        "1": "0",
        "2": "8",
    }
    cells = {c.get("id"): c.get("cpus") for c in root.findall("cpu/numa/cell")}
    assert cells == {"0": "0-2"}
    assert driver.running()[iid]["pins"] == {1: 0, 2: 8}
    with pytest.raises(DriverError) as caught:
        driver.spawn(ids(), {0: 8}, [0], 128)
    assert caught.value.code == "virt.libvirt.pin_conflict"


def test_shared_vcpus_need_a_shared_set(tmp_path: Path, ids: Callable[[], str]) -> None:
    dedicated_only = HostTopology(
        cells=TOPOLOGY.cells,
        siblings=TOPOLOGY.siblings,
        cpu_dedicated_set=TOPOLOGY.cpu_dedicated_set | TOPOLOGY.cpu_shared_set,
        cpu_shared_set=frozenset(),
    )
    d = LibvirtDriver(TEST_URI, dedicated_only, tmp_path / "d")
    try:
        with pytest.raises(DriverError) as caught:
            d.spawn(ids(), {}, [], 128, Guest(vcpus=1, memory_mb=128))
        assert caught.value.code == "virt.libvirt.no_shared_cpus"
    finally:
        d.close()


def test_domains_are_tagged_and_have_a_serial_log(
    driver: LibvirtDriver, conn: Any, ids: Callable[[], str]
) -> None:
    iid = ids()
    driver.spawn(iid, {0: 1}, [0], 128, Guest(vcpus=1, memory_mb=128, pins={0: 1}, cells=(0,)))
    root = _xml(conn, iid)
    ns = {"s": METADATA_NS}
    assert root.findtext("metadata/s:instance/s:id", namespaces=ns) == iid
    # A pty for interactive sessions, logged to the file console_output reads.
    serial = root.find("devices/serial")
    assert serial is not None and serial.get("type") == "pty"
    logged = serial.find("log")
    assert logged is not None
    assert logged.get("file") == str(driver.console_dir / f"{iid}.log")
    assert driver.console_output(iid) == ""  # the test driver runs no guest
    with pytest.raises(InstanceNotFound):
        driver.console_output(ids())


def test_destination_xml_carries_the_destination_claim() -> None:
    source = domain_xml(
        instance_id="vm-1",
        domain_type="qemu",
        arch="x86_64",
        guest=Guest(vcpus=2, memory_mb=256, pins={0: 1, 1: 9}, cells=(0,)),
        guest_cell_vcpus=[[0, 1]],
        shared_cpus=frozenset({2, 3}),
        disk=Path("/src/vm-1.qcow2"),
        disk_format="qcow2",
        console_log=Path("/src/console/vm-1.log"),
    )
    dest = ET.fromstring(
        rewrite_for_destination(
            source,
            Guest(vcpus=2, memory_mb=256, pins={0: 5, 1: 13}, cells=(1,)),
            shared_cpus=frozenset({6, 7}),
            disk=Path("/dst/vm-1.qcow2"),
            console_log=Path("/dst/console/vm-1.log"),
        )
    )
    assert {p.get("vcpu"): p.get("cpuset") for p in dest.findall("cputune/vcpupin")} == {
        "0": "5",
        "1": "13",
    }
    emulatorpin = dest.find("cputune/emulatorpin")
    assert emulatorpin is not None and emulatorpin.get("cpuset") == "5,13"
    memory = dest.find("numatune/memory")
    assert memory is not None and memory.get("nodeset") == "1"
    memnode = dest.find("numatune/memnode")
    assert memnode is not None and memnode.get("nodeset") == "1"
    disk = dest.find("devices/disk/source")
    assert disk is not None and disk.get("file") == "/dst/vm-1.qcow2"
    serial = dest.find("devices/serial")
    assert serial is not None and serial.find("source") is None  # its own pty there
    logged = serial.find("log")
    assert logged is not None and logged.get("file") == "/dst/console/vm-1.log"


def test_topology_from_capabilities(conn: Any) -> None:
    caps = conn.getCapabilities()
    topo = host_topology(caps, cpu_dedicated_set=frozenset({0, 1}))
    assert [c.id for c in topo.cells] == [0, 1]  # the test driver's host has 2 cells
    assert topo.cpu_dedicated_set == {0, 1}
    everything = frozenset().union(*(c.cpus for c in topo.cells))
    assert topo.cpu_shared_set == everything - {0, 1}
    assert host_topology(caps).cpu_shared_set == everything  # Nova's default: all shared


# -- volumes and the config drive ------------------------------------------------------


def _local(path: Path, volume_id: str = "") -> dict[str, Any]:
    """The local-file backend's connection info (services/volumes/backend.py)."""
    return {
        "driver_volume_type": "local",
        "data": {"device_path": str(path), "volume_id": volume_id, "access_mode": "rw"},
    }


def _volume(tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"volume-{name}"
    with path.open("wb") as f:
        f.truncate(1024 * 1024)
    return path


def _disk_map(root: ET.Element) -> dict[str, tuple[str | None, str | None, str | None]]:
    out = {}
    for el in root.findall("devices/disk"):
        target, source = el.find("target"), el.find("source")
        assert target is not None and source is not None
        out[target.get("dev", "")] = (el.get("device"), source.get("file"), target.get("bus"))
    return out


def test_a_guest_is_defined_with_its_volumes_and_config_drive(
    driver: LibvirtDriver, conn: Any, ids: Callable[[], str], tmp_path: Path
) -> None:
    iid = ids()
    vol = _volume(tmp_path, "data")
    files = {"openstack/latest/meta_data.json": b'{"uuid": "%s"}' % iid.encode()}
    guest = Guest(
        vcpus=1,
        memory_mb=128,
        pins={0: 1},
        cells=(0,),
        volumes=(BlockDevice("/dev/vdb", _local(vol, "v-data"), None, "v-data"),),
        config_drive=files,
    )
    driver.spawn(iid, {0: 1}, [0], 128, guest)
    root = _xml(conn, iid)
    iso = driver.disk_dir / f"{iid}.config.iso"
    disks = _disk_map(root)
    assert disks["vda"] == ("disk", str(driver.disk_dir / f"{iid}.img"), "virtio")
    assert disks["vdb"] == ("disk", str(vol), "virtio")
    assert disks["hda"] == ("cdrom", str(iso), "ide")
    assert root.find("features/acpi") is not None  # hotplug needs it
    cdrom = next(el for el in root.findall("devices/disk") if el.get("device") == "cdrom")
    assert cdrom.find("readonly") is not None
    serials = [el.findtext("serial") for el in root.findall("devices/disk")]
    assert "v-data" in serials
    assert iso.read_bytes()[0x8000:0x8006] == b"\x01CD001"  # an ISO 9660 volume descriptor
    # Attaching what the definition has already (the conductor does after a build) is no
    # change; the same device for another volume, or the volume twice, is refused.
    driver.attach_volume(iid, "/dev/vdb", _local(vol, "v-data"))
    other = _volume(tmp_path, "other")
    with pytest.raises(DriverError) as caught:
        driver.attach_volume(iid, "/dev/vdb", _local(other))
    assert caught.value.code == "virt.volume.device_in_use"
    with pytest.raises(DriverError) as caught:
        driver.attach_volume(iid, "/dev/vdc", _local(vol))
    assert caught.value.code == "virt.volume.already_attached"
    with pytest.raises(DriverError) as caught:
        driver.detach_volume(iid, "/dev/vda")
    assert caught.value.code == "virt.volume.root"
    driver.detach_volume(iid, "/dev/vdq")  # a device it lacks: no error
    # A suspended guest's saved memory names its disks: neither attach nor detach then.
    driver.suspend(iid)
    for call in (
        lambda: driver.attach_volume(iid, "/dev/vdc", _local(other)),
        lambda: driver.detach_volume(iid, "/dev/vdb"),
    ):
        with pytest.raises(DriverError) as caught:
            call()
        assert caught.value.code == "virt.volume.suspended"
    assert "vdb" in _disk_map(_xml(conn, iid))

    driver.destroy(iid)
    assert not iso.exists()
    assert vol.exists()  # a volume outlives the guest


def test_a_guest_boots_from_its_root_volume(
    driver: LibvirtDriver, conn: Any, ids: Callable[[], str], tmp_path: Path
) -> None:
    iid = ids()
    vol = _volume(tmp_path, "root")
    guest = Guest(
        vcpus=1,
        memory_mb=128,
        pins={0: 2},
        cells=(0,),
        volumes=(BlockDevice("/dev/vda", _local(vol, "v-root"), 0, "v-root"),),
    )
    driver.spawn(iid, {0: 2}, [0], 128, guest)
    assert _disk_map(_xml(conn, iid)) == {"vda": ("disk", str(vol), "virtio")}
    assert not list(driver.disk_dir.glob(f"{iid}*"))  # no disk of its own
    driver.attach_volume(iid, "/dev/vda", _local(vol, "v-root"))  # the root: no change
    assert driver.export_disk(iid)["format"] == "volume"  # a cold move leaves it in place
    with pytest.raises(DriverError) as caught:
        driver.read_disk(iid, 65536)
    assert caught.value.code == "virt.libvirt.volume_root"
    driver.destroy(iid)
    assert vol.exists()


@pytest.mark.parametrize(
    ("device", "connection", "code"),
    [
        ("/dev/vdb", {"driver_volume_type": "rbd", "data": {"name": "p/v"}}, "unsupported"),
        ("/dev/vdb", {"driver_volume_type": "local", "data": {"device_path": "/no/such"}}, "open"),
        ("/dev/sdb", None, "bad_device"),
    ],
)
def test_volumes_this_host_cannot_open_are_refused_before_defining(
    driver: LibvirtDriver,
    conn: Any,
    ids: Callable[[], str],
    tmp_path: Path,
    device: str,
    connection: dict[str, Any] | None,
    code: str,
) -> None:
    iid = ids()
    volume = BlockDevice(device, connection or _local(_volume(tmp_path, "v")))
    guest = Guest(vcpus=1, memory_mb=128, pins={0: 3}, cells=(0,), volumes=(volume,))
    with pytest.raises(DriverError) as caught:
        driver.spawn(iid, {0: 3}, [0], 128, guest)
    assert caught.value.code == f"virt.volume.{code}"
    assert DOMAIN_PREFIX + iid not in _domain_names(conn)
    assert not list(driver.disk_dir.glob(f"{iid}*"))
    other = ids()
    driver.spawn(other, {0: 3}, [0], 128)
    with pytest.raises(DriverError) as caught:
        driver.attach_volume(other, device, volume.connection | {})
    assert caught.value.code == f"virt.volume.{code}"


def test_destination_xml_keeps_volumes_and_moves_the_config_drive(tmp_path: Path) -> None:
    vol = _volume(tmp_path, "data")
    guest = Guest(vcpus=1, memory_mb=128)
    source = domain_xml(
        instance_id="vm-1",
        domain_type="qemu",
        arch="x86_64",
        guest=guest,
        guest_cell_vcpus=[],
        shared_cpus=frozenset({2, 3}),
        disk=Path("/src/vm-1.qcow2"),
        disk_format="qcow2",
        console_log=Path("/src/console/vm-1.log"),
        volumes=[volume_disk("/dev/vdb", _local(vol))],
        config_drive=Path("/src/vm-1.config.iso"),
    )
    dest = ET.fromstring(
        rewrite_for_destination(
            source,
            guest,
            shared_cpus=frozenset({6, 7}),
            disk=Path("/dst/vm-1.qcow2"),
            console_log=Path("/dst/console/vm-1.log"),
            config_drive=Path("/dst/vm-1.config.iso"),
        )
    )
    assert _disk_map(dest) == {
        "vda": ("disk", "/dst/vm-1.qcow2", "virtio"),
        "vdb": ("disk", str(vol), "virtio"),  # not copied: the same file
        "hda": ("cdrom", "/dst/vm-1.config.iso", "ide"),
    }


def test_a_guest_with_volumes_and_a_config_drive_crosses_the_bus() -> None:
    guest = Guest(
        vcpus=1,
        memory_mb=64,
        volumes=(BlockDevice("/dev/vda", _local(Path("/v/r"), "r"), 0, "r"),),
        config_drive={"openstack/latest/user_data": b"\x00\xffbinary"},
    )
    again = Guest.from_payload(json.loads(json.dumps(guest.to_payload())))
    assert again == guest
    assert again.root_volume == guest.volumes[0]
    assert Guest.from_payload(Guest(vcpus=1, memory_mb=64).to_payload()).config_drive is None


def test_an_unshelved_guest_crosses_the_bus_with_the_image_to_rebase_onto() -> None:
    own = ImageSpec(id="own", disk_format="raw", size=1)
    shelved = ImageSpec(id="shelved", disk_format="qcow2", size=2)
    for guest in (
        Guest(vcpus=1, memory_mb=64, image=shelved, rebase_image=own),
        Guest(vcpus=1, memory_mb=64, image=shelved, flatten_disk=True),
    ):
        assert Guest.from_payload(json.loads(json.dumps(guest.to_payload()))) == guest
