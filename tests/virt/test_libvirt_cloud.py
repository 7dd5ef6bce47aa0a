"""End to end on `stowage up --driver libvirt --hosts 3`: real QEMU guests through the real
openstack CLI, three libvirt daemons on this machine, live migrations between them.

Never skipped in CI (CI=true): a missing QEMU, libvirt or guest package is a failure.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.api.cloudproc import RunningCloud, start_cloud, stop_cloud
from websockets.sync.client import ClientConnection, connect

from stowage.virt import guest_image

BOOT_TIMEOUT_S = 120.0
HOSTS = ("host1", "host2", "host3")


def _require_real_qemu() -> None:
    tools = ("qemu-system-x86_64", "qemu-img", "libvirtd", "virsh", "mformat", "syslinux")
    missing = [t for t in tools if not shutil.which(t)]
    why = f"missing {missing}" if missing else ("needs root" if os.geteuid() != 0 else "")
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"CI runs the real-QEMU cloud test: {why}", pytrace=False)
        pytest.skip(why)


def _wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = BOOT_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.5)


class _Api:
    """The compute API over plain HTTP, for the polls: one `openstack` process costs seconds
    of CPU on a busy machine, a request a few milliseconds. Actions go through the CLI."""

    def __init__(self, cloud: RunningCloud) -> None:
        self.cloud = cloud
        self._token = cloud.token()
        self._ids: dict[str, str] = {}

    def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        response = self.cloud.compute(method, path, token=self._token, **kwargs)
        if response.status_code == 401:  # expired: once more with a new token
            self._token = self.cloud.token()
            response = self.cloud.compute(method, path, token=self._token, **kwargs)
        return response

    def id_of(self, name: str) -> str:
        if name not in self._ids:
            found = self._call("GET", f"/servers?name=^{name}$").json()["servers"]
            assert len(found) == 1, found
            self._ids[name] = str(found[0]["id"])
        return self._ids[name]

    def forget(self, name: str) -> None:
        self._ids.pop(name, None)

    def server(self, name: str) -> dict[str, Any]:
        shown = self._call("GET", f"/servers/{self.id_of(name)}").json()["server"]
        return {
            "id": shown["id"],
            "status": shown["status"],
            "host": shown["OS-EXT-SRV-ATTR:host"],
            "task_state": shown["OS-EXT-STS:task_state"],
        }

    def console(self, name: str) -> str:
        response = self._call(
            "POST", f"/servers/{self.id_of(name)}/action", json={"os-getConsoleOutput": {}}
        )
        return str(response.json()["output"]) if response.status_code == 200 else ""

    def boot_id(self, name: str) -> str:
        _wait_for(lambda: guest_image.boot_ids(self.console(name)), f"{name}'s console marker")
        return guest_image.boot_ids(self.console(name))[-1]

    def serial_console(self, name: str) -> str:
        """A serial console URL through remote-consoles (2.6+), as openstacksdk asks."""
        response = self._call(
            "POST",
            f"/servers/{self.id_of(name)}/remote-consoles",
            json={"remote_console": {"protocol": "serial", "type": "serial"}},
        )
        assert response.status_code == 200, response.text
        return str(response.json()["remote_console"]["url"])

    def active(self, *names: str) -> None:
        def settled() -> bool:
            shown = [self.server(n) for n in names]
            failed = [s for s in shown if s["status"] == "ERROR"]
            assert not failed, failed
            return all(s["status"] == "ACTIVE" and not s["task_state"] for s in shown)

        _wait_for(settled, f"{', '.join(names)} to be ACTIVE")


@pytest.fixture(scope="module")
def cloud(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCloud]:
    _require_real_qemu()
    state = tmp_path_factory.mktemp("libvirt-cloud") / "state"
    running = start_cloud(
        state, "--driver", "libvirt", "--hosts", "3", "--virt-type", "qemu", timeout_s=180
    )
    try:
        yield running
    finally:
        stop_cloud(running)


def _uri(cloud: RunningCloud, host: str) -> str:
    sock = cloud.state_dir / "libvirt" / host / "daemon" / "sock" / "libvirt-sock"
    return f"qemu+unix:///system?socket={sock}"


def _virsh(cloud: RunningCloud, host: str, *args: str) -> str:
    done = subprocess.run(
        ["virsh", "-c", _uri(cloud, host), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _vcpupin(cloud: RunningCloud, host: str, server_id: str) -> dict[int, str]:
    out = _virsh(cloud, host, "vcpupin", f"instance-{server_id}")
    return {int(m[0]): m[1] for m in re.findall(r"^\s*(\d+)\s+(\S+)\s*$", out, re.M)}


def _ledger_pins(cloud: RunningCloud, consumer_id: str) -> dict[int, int]:
    db = sqlite3.connect(f"file:{cloud.state_dir / 'ledger.db'}?mode=ro", uri=True)
    try:
        rows = db.execute(
            "SELECT guest_vcpu, cpu_id FROM pins "
            "WHERE consumer_seq = (SELECT seq FROM consumers WHERE id = ?)",
            (consumer_id,),
        ).fetchall()
    finally:
        db.close()
    return {int(v): int(c) for v, c in rows}


def _console(cloud: RunningCloud, name: str) -> str:
    return cloud.osc("console", "log", "show", name).stdout


def _uptime(text: str) -> int:
    counts = re.findall(rf"{guest_image.UPTIME_PREFIX} (\d+) ", text)
    return int(counts[-1]) if counts else 0


def _read_serial(ws: ClientConnection, pattern: str) -> re.Match[str]:
    """Read the websocket until its text matches `pattern`."""
    seen = ""
    deadline = time.monotonic() + BOOT_TIMEOUT_S
    while (found := re.search(pattern, seen)) is None:
        left = deadline - time.monotonic()
        if left <= 0:
            pytest.fail(f"no {pattern!r} on the serial console; saw {seen[-2000:]!r}")
        try:
            message = ws.recv(timeout=left)
        except TimeoutError:
            pytest.fail(f"no {pattern!r} on the serial console; saw {seen[-2000:]!r}")
        seen += message.decode(errors="replace") if isinstance(message, bytes) else message
    return found


def _server(cloud: RunningCloud, name: str) -> dict[str, str]:
    shown = cloud.osc_json("server", "show", name)
    return {
        "id": shown["id"],
        "status": shown["status"],
        "host": shown["OS-EXT-SRV-ATTR:host"],
    }


def _osc_in_background(cloud: RunningCloud, *args: str) -> subprocess.Popen[str]:
    """`openstack ARGS` running while the test goes on; `_finished` checks its exit."""
    return subprocess.Popen(
        [str(Path(sys.executable).parent / "openstack"), *args],
        env=cloud.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finished(proc: subprocess.Popen[str]) -> None:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, f"{proc.args}: {out}{err}"


def test_real_guests_through_the_openstack_cli(cloud: RunningCloud, tmp_path: Path) -> None:
    api = _Api(cloud)
    # The guest disk, built from Debian packages by the repo's script, uploaded as an image.
    script = Path(__file__).parents[2] / "scripts" / "make-guest-image.sh"
    disk = tmp_path / "guest.qcow2"
    made = subprocess.run(
        ["bash", str(script), str(disk), "--format", "qcow2"], capture_output=True, check=False
    )
    assert made.returncode == 0, made.stderr
    cloud.osc(
        "image", "create", "--disk-format", "qcow2", "--container-format", "bare",
        "--file", str(disk), "--public", "guest",
    )  # fmt: skip
    hypervisors = cloud.osc_json("hypervisor", "list", "--long")
    assert {h["Hypervisor Type"] for h in hypervisors} == {"QEMU"}

    def create(name: str, flavor: str, image: str = "guest") -> None:
        cloud.osc(
            "server", "create", "--flavor", flavor, "--image", image, "--nic", "none", name
        )  # fmt: skip

    # Both guests boot at once.
    create("pinned", "m1.pinned")
    create("shared", "m1.micro")
    api.active("pinned", "shared")
    pinned, shared = api.server("pinned"), api.server("shared")
    assert pinned["status"] == shared["status"] == "ACTIVE"
    boot_id = api.boot_id("pinned")
    api.boot_id("shared")
    for name in ("pinned", "shared"):  # the CLI's console log shows the marker
        assert guest_image.MARKER in _console(cloud, name)

    # What libvirt enforces is what the ledger claims.
    ledger = _ledger_pins(cloud, pinned["id"])
    assert len(ledger) == 1
    assert _vcpupin(cloud, pinned["host"], pinned["id"]) == {0: str(ledger[0])}
    assert not _ledger_pins(cloud, shared["id"])
    assert str(ledger[0]) not in _vcpupin(cloud, shared["host"], shared["id"]).values() or (
        pinned["host"] != shared["host"]
    )

    # The snapshot of the shared guest is taken while the pinned one live-migrates.
    snapshot = _osc_in_background(
        cloud, "server", "image", "create", "--name", "snap", "--wait", "shared"
    )

    # Live migration of the running pinned guest: the same guest, on the other host's pins.
    before = _uptime(api.console("pinned"))
    cloud.osc("server", "migrate", "--live-migration", "--wait", "pinned")
    moved = _server(cloud, "pinned")
    assert moved["status"] == "ACTIVE"
    assert moved["host"] != pinned["host"]
    assert f"instance-{pinned['id']}" not in _virsh(cloud, pinned["host"], "list", "--all")
    new_pins = _ledger_pins(cloud, pinned["id"])
    assert _vcpupin(cloud, moved["host"], pinned["id"]) == {0: str(new_pins[0])}
    _wait_for(lambda: _uptime(api.console("pinned")) > before + 1, "the counter to go on")
    after = _console(cloud, "pinned")  # the destination's log: from the switch-over on
    assert f"boot_id={boot_id}" in after
    assert guest_image.MARKER not in after  # not booted again
    counts = [int(n) for n in re.findall(rf"{guest_image.UPTIME_PREFIX} (\d+) ", after)]
    assert min(counts) >= before  # it goes on from where it was
    migrations = cloud.osc_json("server", "migration", "list", "--server", "pinned")
    assert [m["Status"] for m in migrations] == ["completed"]

    # A snapshot is an image of the disk, flattened, in the base's format (qcow2 data
    # labelled qcow2), and it boots (while the shared guest stops, starts and reboots).
    _finished(snapshot)
    snap = cloud.osc_json("image", "show", "snap")
    assert (snap["status"], snap["disk_format"]) == ("active", "qcow2")
    saved = tmp_path / "snap.qcow2"
    cloud.osc("image", "save", "--file", str(saved), "snap")
    assert saved.read_bytes()[:4] == b"QFI\xfb"
    info = subprocess.run(
        ["qemu-img", "info", "--output=json", str(saved)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert '"backing-filename"' not in info  # standalone, not an overlay
    create("from-snap", "m1.micro", image="snap")

    # Stop, start, reboot: the guest really stops, and boots again; its serial console,
    # opened as soon as it runs, carries the new boot's output.
    first = api.boot_id("shared")
    cloud.osc("server", "stop", "shared")
    _wait_for(lambda: api.server("shared")["status"] == "SHUTOFF", "shared to stop")
    assert "shut off" in _virsh(cloud, shared["host"], "domstate", f"instance-{shared['id']}")
    cloud.osc("server", "start", "shared")
    _wait_for(lambda: api.server("shared")["status"] == "ACTIVE", "shared to start")
    with connect(api.serial_console("shared"), open_timeout=30) as ws:
        # The boot's id, from its marker if the console opened before the guest wrote it,
        # else from the next uptime line (each carries it too): a console shows only what
        # the guest says once it is open, and a guest can be up before the CLI has looked
        # (CI on a155773 missed the marker and failed on the uptime lines).
        booted = _read_serial(
            ws, rf"(?:{guest_image.MARKER}|{guest_image.UPTIME_PREFIX} \d+) boot_id=(\S+)\s"
        )
        _read_serial(ws, rf"{guest_image.UPTIME_PREFIX} \d+ ")  # and it goes on
    _wait_for(lambda: api.boot_id("shared") != first, "a new boot after start")
    second = api.boot_id("shared")
    assert booted.group(1) == second  # the boot the console log shows
    cloud.osc("server", "reboot", "--hard", "--wait", "shared")
    _wait_for(lambda: api.boot_id("shared") != second, "a new boot after reboot")

    # The snapshot's guest: the rest of the life cycle on it, through the CLI.
    api.active("from-snap")
    snap_boot = api.boot_id("from-snap")
    _life_cycle_on_a_real_guest(cloud, api, "from-snap", snap_boot)

    # The live-migrated guest's serial console, on its new host, through the CLI's URL.
    url = cloud.osc_json("console", "url", "show", "--serial", "pinned")["url"]
    with connect(url, open_timeout=30) as ws:
        counted = _read_serial(ws, rf"{guest_image.UPTIME_PREFIX} (\d+) ")
    assert int(counted.group(1)) > before

    # `virsh destroy` behind Stowage's back shows in the server's state.
    _virsh(cloud, moved["host"], "destroy", f"instance-{pinned['id']}")
    _wait_for(lambda: api.server("pinned")["status"] == "SHUTOFF", "power sync of pinned", 40)

    # Delete leaves no domain and no disk anywhere.
    cloud.osc("server", "delete", "--wait", "from-snap", "pinned", "shared")
    for host in HOSTS:
        assert "instance-" not in _virsh(cloud, host, "list", "--all")
        disks = cloud.state_dir / "libvirt" / host / "disks"
        assert not [p.name for p in disks.glob("*") if p.is_file()]
        assert not list((disks / "console").glob("*"))


def _life_cycle_on_a_real_guest(cloud: RunningCloud, api: _Api, name: str, boot_id: str) -> None:
    """The password refused (no guest agent: 409, as Nova), an NMI the guest kernel reports,
    a NIC hot-plugged on a new port that the guest sees, and a rescue that boots the guest
    again from the rescue image with its own disk second, then back on its own disk."""
    refused = cloud.osc("server", "set", "--password", "secret", name, check=False)
    assert refused.returncode != 0 and "409" in refused.stderr, refused.stderr
    cloud.osc("--os-compute-api-version", "2.17", "server", "dump", "create", name)
    _wait_for(lambda: "NMI received" in api.console(name), "the guest's NMI report", 60)

    cloud.osc("server", "add", "network", name, "private")
    path = f"/servers/{api.id_of(name)}/os-interface"
    attached = api._call("GET", path).json()["interfaceAttachments"]
    events = api._call("GET", f"/servers/{api.id_of(name)}/os-instance-actions").json()
    assert len(attached) == 1, (attached, events)
    mac = attached[0]["mac_addr"]
    _wait_for(lambda: mac in _last_nics(api.console(name)), "the hot-plugged NIC", 60)

    cloud.osc("server", "rescue", "--image", "stowage-guest", name)
    _wait_for(lambda: api.server(name)["status"] == "RESCUE", f"{name} to be rescued")
    _wait_for(lambda: api.boot_id(name) != boot_id, "the rescue boot")
    _wait_for(lambda: _last_disks(api.console(name)) == ["vda", "vdb"], "the rescue's disks")
    rescued = api.boot_id(name)
    cloud.osc("server", "unrescue", name)
    api.active(name)
    _wait_for(lambda: api.boot_id(name) != rescued, "the boot on its own disk")
    _wait_for(lambda: _last_disks(api.console(name)) == ["vda"], "its own disk alone")


def _last_boot(console: str) -> str:
    return console.rsplit(guest_image.MARKER, maxsplit=1)[-1]


def _last_disks(console: str) -> list[str]:
    seen = re.findall(rf"^{guest_image.DISKS_PREFIX} (.*)$", _last_boot(console), re.M)
    return seen[-1].split() if seen else []


def _last_nics(console: str) -> list[str]:
    seen = re.findall(rf"^{guest_image.NICS_PREFIX} (.*)$", console, re.M)
    return seen[-1].split() if seen else []


def test_a_server_boots_from_a_volume_with_a_config_drive_through_the_openstack_cli(
    cloud: RunningCloud, tmp_path: Path
) -> None:
    """Seed 004's `--boot-from-volume` on real QEMU: the guest boots from the volume's own file
    (no overlay of the image) and reads its config drive (meta_data.json's uuid is the
    server's, user_data is the file given); a data volume hot-plugged and unplugged, the guest
    seeing it come and go; a live migration that copies no volume; the root volume kept at
    delete (the CLI sends delete_on_termination false) and no domain or disk left behind."""
    api = _Api(cloud)
    # The cloud's guest disk (built at its start by stowage.virt.guest_image, as the script
    # does), uploaded as qcow2 as the script's --format qcow2 makes it: the volume made from
    # it must be raw, the same bytes as the disk.
    built = cloud.state_dir / "libvirt" / "guest.raw"
    qcow2 = tmp_path / "guest.qcow2"
    subprocess.run(
        ["qemu-img", "convert", "-f", "raw", "-O", "qcow2", str(built), str(qcow2)], check=True
    )
    cloud.osc(
        "image", "create", "--disk-format", "qcow2", "--container-format", "bare",
        "--file", str(qcow2), "guest-bfv",
    )  # fmt: skip
    user_data = tmp_path / "user-data"
    user_data.write_bytes(b"#!/bin/sh\necho stowage boot from volume\n")
    cloud.osc(
        "server", "create", "--flavor", "m1.micro", "--image", "guest-bfv",
        "--boot-from-volume", "1", "--config-drive", "true", "--user-data", str(user_data),
        "--nic", "none", "bfv",
    )  # fmt: skip
    api.active("bfv")
    server = api.server("bfv")
    sid, source = server["id"], server["host"]
    project = str(api._call("GET", f"/servers/{sid}").json()["server"]["tenant_id"])
    attachments = api._call("GET", f"/servers/{sid}/os-volume_attachments").json()
    (root,) = attachments["volumeAttachments"]
    assert (root["device"], root["delete_on_termination"]) == ("/dev/vda", False)
    root_id = str(root["volumeId"])
    volumes = cloud.state_dir / "volumes"
    root_file = volumes / f"volume-{root_id}"

    # The root disk is the volume's file, raw, not an overlay of the image.
    disks = _domain_disks(cloud, source, sid)
    config_iso = cloud.state_dir / "libvirt" / source / "disks" / f"{sid}.config.iso"
    assert disks == {"vda": str(root_file), "hda": str(config_iso)}
    assert not list((cloud.state_dir / "libvirt" / source / "disks").glob(f"{sid}*.qcow2"))
    assert _qemu_img_info(root_file).get("format") == "raw"
    assert "backing-filename" not in _qemu_img_info(root_file)
    inode = root_file.stat().st_ino
    assert root_file.stat().st_size == 1 << 30  # --boot-from-volume 1: 1 GiB
    with built.open("rb") as image, root_file.open("rb") as volume:
        disk = image.read()
        assert volume.read(len(disk)) == disk  # converted to raw: the image's own disk

    # The guest boots from it and reads its config drive.
    boot_id = api.boot_id("bfv")
    _wait_for(lambda: _last_disks(api.console("bfv")) == ["sr0", "vda"], "the guest's disks", 60)
    _wait_for(lambda: guest_image.META_DATA_PREFIX in api.console("bfv"), "the config drive", 60)
    text = api.console("bfv")
    assert f"{guest_image.CONFIG_DRIVE_PREFIX} /dev/sr0" in text
    meta = re.search(rf"^{guest_image.META_DATA_PREFIX} (.*)$", text, re.M)
    assert meta is not None and json.loads(meta.group(1))["uuid"] == sid
    assert json.loads(meta.group(1))["name"] == "bfv"
    _wait_for(lambda: guest_image.USER_DATA_PREFIX in api.console("bfv"), "the user data", 30)
    seen = re.search(rf"^{guest_image.USER_DATA_PREFIX} (\S*)", api.console("bfv"), re.M)
    assert seen is not None and base64.b64decode(seen.group(1)) == user_data.read_bytes()

    # A blank volume hot-plugged: the guest sees a new disk, Cinder says in-use.
    data_id = str(cloud.osc_json("volume", "create", "--size", "1", "data")["id"])
    cloud.osc("server", "add", "volume", "bfv", "data")
    _wait_for(lambda: _volume(api, project, data_id)["status"] == "in-use", "data to be in-use", 60)
    _wait_for(lambda: _last_disks(api.console("bfv")) == ["sr0", "vda", "vdb"], "the new disk", 60)
    shown = cloud.osc_json("volume", "show", "data")
    assert shown["status"] == "in-use"
    assert [(a["server_id"], a["device"]) for a in shown["attachments"]] == [(sid, "/dev/vdb")]
    assert _domain_disks(cloud, source, sid)["vdb"] == str(volumes / f"volume-{data_id}")
    listed = api._call("GET", f"/servers/{sid}").json()["server"]
    assert {v["id"] for v in listed["os-extended-volumes:volumes_attached"]} == {root_id, data_id}
    # ... and unplugged: gone from the guest and from the domain, available again.
    cloud.osc("server", "remove", "volume", "bfv", "data")
    _wait_for(
        lambda: _volume(api, project, data_id)["status"] == "available", "data to be available", 60
    )
    _wait_for(lambda: _last_disks(api.console("bfv")) == ["sr0", "vda"], "the disk to go", 60)
    assert "vdb" not in _domain_disks(cloud, source, sid)
    assert not _volume(api, project, data_id)["attachments"]

    # Attached again, to go at the server's delete (2.79): it moves with the guest.
    cloud.osc(
        "--os-compute-api-version", "2.79", "server", "add", "volume",
        "--enable-delete-on-termination", "bfv", "data",
    )  # fmt: skip
    _wait_for(lambda: _volume(api, project, data_id)["status"] == "in-use", "data in-use again")
    _wait_for(lambda: _last_disks(api.console("bfv")) == ["sr0", "vda", "vdb"], "vdb again", 60)
    data_file = volumes / f"volume-{data_id}"
    files = {"vda": (str(root_file), inode), "vdb": (str(data_file), data_file.stat().st_ino)}

    # Live migration: the same guest goes on elsewhere, on the very same volume files.
    before = _uptime(api.console("bfv"))
    cloud.osc("server", "migrate", "--live-migration", "--wait", "bfv")
    api.active("bfv")
    dest = api.server("bfv")["host"]
    assert dest != source
    assert f"instance-{sid}" not in _virsh(cloud, source, "list", "--all")
    assert not list((cloud.state_dir / "libvirt" / source / "disks").glob(f"{sid}*"))
    moved = _domain_disks(cloud, dest, sid)
    dest_disks = cloud.state_dir / "libvirt" / dest / "disks"
    assert moved == {
        "vda": str(root_file),
        "vdb": str(data_file),
        "hda": str(dest_disks / f"{sid}.config.iso"),
    }
    assert {t: (p, Path(p).stat().st_ino) for t, p in moved.items() if t != "hda"} == files
    assert not list(dest_disks.glob(f"{sid}*.qcow2"))
    _wait_for(lambda: _uptime(api.console("bfv")) > before + 1, "the counter to go on")
    after = api.console("bfv")  # the destination's log: from the switch-over on
    assert f"boot_id={boot_id}" in after and guest_image.MARKER not in after
    assert min(int(n) for n in re.findall(rf"{guest_image.UPTIME_PREFIX} (\d+) ", after)) >= before

    # Delete: the root volume stays (the CLI's delete_on_termination false), detached; the
    # data volume goes with the server (true); no domain and no disk is left on any host.
    cloud.osc("server", "delete", "--wait", "bfv")
    _wait_for(
        lambda: _volume(api, project, root_id)["status"] == "available", "the root volume's detach"
    )
    kept = cloud.osc_json("volume", "show", root_id)
    assert (kept["status"], kept["attachments"], kept["bootable"]) == ("available", [], True)
    assert root_file.stat().st_ino == inode
    _wait_for(lambda: not data_file.exists(), "the data volume's file to go", 60)
    assert _volume(api, project, data_id) == {}  # 404
    for host in HOSTS:
        assert f"instance-{sid}" not in _virsh(cloud, host, "list", "--all")
        disks_dir = cloud.state_dir / "libvirt" / host / "disks"
        assert not list(disks_dir.glob(f"{sid}*")) and not list(disks_dir.glob(f"console/*{sid}*"))
    cloud.osc("volume", "delete", root_id)
    _wait_for(lambda: not root_file.exists(), "the root volume's file to go", 30)


def _domain_disks(cloud: RunningCloud, host: str, server_id: str) -> dict[str, str]:
    """The live domain's disks on `host`: target dev -> source file."""
    root = ET.fromstring(_virsh(cloud, host, "dumpxml", f"instance-{server_id}"))
    disks: dict[str, str] = {}
    for disk in root.iterfind("./devices/disk"):
        target, source = disk.find("target"), disk.find("source")
        if target is not None and source is not None:
            disks[target.get("dev", "")] = source.get("file") or source.get("dev") or ""
    return disks


def _qemu_img_info(path: Path) -> dict[str, Any]:
    done = subprocess.run(
        ["qemu-img", "info", "-U", "--output=json", str(path)],
        capture_output=True,
        text=True,
        check=True,
    )
    info: dict[str, Any] = json.loads(done.stdout)
    return info


def _volume(api: _Api, project_id: str, volume_id: str) -> dict[str, Any]:
    """A volume as the block storage API shows it, over plain HTTP (for the polls); {} for
    one that is not found."""
    response = httpx.get(
        f"{api.cloud.base_url}/volume/v3/{project_id}/volumes/{volume_id}",
        headers={"X-Auth-Token": api._token},
        timeout=30,
    )
    if response.status_code == 404:
        return {}
    assert response.status_code == 200, response.text
    volume: dict[str, Any] = response.json()["volume"]
    return volume


def test_two_pinned_guests_migrated_at_once_to_room_for_one(cloud: RunningCloud) -> None:
    """Seed 002 on a real hypervisor: each host has one dedicated CPU; two pinned guests are
    live-migrated at the same moment while only one host has room. One moves, onto that
    host's CPU; the other stays where it runs; no pCPU is ever pinned twice."""
    api = _Api(cloud)
    names = ("seed-a", "seed-b")
    for name in names:  # both boot at once
        cloud.osc(
            "server", "create", "--flavor", "m1.pinned", "--image", "stowage-guest",
            "--nic", "none", name,
        )  # fmt: skip
    api.active(*names)
    before = {name: api.server(name) for name in names}
    assert before["seed-a"]["host"] != before["seed-b"]["host"]
    (free,) = set(HOSTS) - {s["host"] for s in before.values()}
    for name in names:
        api.boot_id(name)
    counts = {name: _uptime(api.console(name)) for name in names}

    moves = [
        _osc_in_background(cloud, "server", "migrate", "--live-migration", "--wait", name)
        for name in names
    ]
    for move in moves:
        move.communicate(timeout=300)  # one of them is refused: no host has room for both

    def settled() -> bool:
        shown = [api.server(n) for n in names]
        return all(s["status"] == "ACTIVE" and not s["task_state"] for s in shown)

    _wait_for(settled, "both servers to settle")
    after = {name: api.server(name) for name in names}
    moved = [n for n in names if after[n]["host"] != before[n]["host"]]
    assert len(moved) == 1, after
    assert after[moved[0]]["host"] == free
    for host in HOSTS:
        pinned_here: list[str] = []
        for name in names:
            if after[name]["host"] == host:
                server_id = after[name]["id"]
                pins = _vcpupin(cloud, host, server_id)
                assert pins == {0: str(_ledger_pins(cloud, server_id)[0])}
                pinned_here += pins.values()
        assert len(pinned_here) == len(set(pinned_here)), (host, pinned_here)
    for name in names:  # both guests still run, the moved one and the one that stayed
        _wait_for(_counting(api, name, counts[name]), f"{name} running")
    cloud.osc("server", "delete", "--wait", *names)


def _counting(api: _Api, name: str, past: int) -> Callable[[], bool]:
    return lambda: _uptime(api.console(name)) > past


def test_a_real_guest_shelved_offloaded_and_unshelved_through_the_openstack_cli(
    cloud: RunningCloud,
) -> None:
    """Shelve on real QEMU, as Nova with `shelved_offload_time = 0`: the disk goes into the
    image `<name>-shelved`, then the guest, its disk and every claim go; unshelve to a named
    host (2.91) boots a new guest from that image, pinned as the ledger says, and the image
    goes; a server deleted while shelved takes its image with it."""
    api = _Api(cloud)
    name = "shelf"
    cloud.osc(
        "server", "create", "--flavor", "m1.pinned", "--image", "stowage-guest",
        "--nic", "none", name,
    )  # fmt: skip
    api.active(name)
    first = api.server(name)
    server_id = first["id"]
    boot_id = api.boot_id(name)
    pins = _ledger_pins(cloud, server_id)
    assert _vcpupin(cloud, first["host"], server_id) == {0: str(pins[0])}
    original = cloud.osc_json("image", "show", "stowage-guest")

    cloud.osc("server", "shelve", "--offload", "--wait", name)
    shelved = api.server(name)
    assert (shelved["status"], shelved["host"], shelved["task_state"]) == (
        "SHELVED_OFFLOADED",
        None,
        None,
    )
    _assert_nowhere(cloud, server_id)
    assert _shelve_claims(cloud, server_id) == {}
    image = cloud.osc_json("image", "show", f"{name}-shelved")
    assert (image["status"], image["disk_format"]) == ("active", original["disk_format"])
    assert image["properties"]["instance_uuid"] == server_id

    target = next(h for h in HOSTS if h != first["host"])
    cloud.osc(
        "--os-compute-api-version", "2.91", "server", "unshelve", "--host", target, "--wait",
        name,
    )  # fmt: skip
    api.active(name)
    back = api.server(name)
    assert back["host"] == target
    _wait_for(lambda: api.boot_id(name) != boot_id, "a new boot from the shelved image")
    assert guest_image.MARKER in _console(cloud, name)
    # It booted from the shelved image, and its disk was then rebased onto the server's own
    # image (Nova's fix of bug 1732428): a later move fetches that one as the base.
    _assert_disk_of_shelved(cloud, target, server_id, original["id"], image["id"])
    new_pins = _ledger_pins(cloud, server_id)
    assert len(new_pins) == 1
    assert _vcpupin(cloud, target, server_id) == {0: str(new_pins[0])}
    assert set(_shelve_claims(cloud, server_id)) == {"allocations", "numa_claims", "pins"}
    shown = api._call("GET", f"/servers/{server_id}").json()["server"]
    assert shown["image"]["id"] == original["id"]  # as Nova: the server's image is the one it had
    gone = cloud.osc("image", "show", image["id"], check=False)
    assert gone.returncode != 0  # unshelved: the shelve's image is deleted (Nova's)

    # Live-migrated afterwards: the destination's disk, on the server's image, is the same
    # data the shelve saved (before the rebase, the overlay went onto the wrong base).
    cloud.osc("server", "migrate", "--live-migration", "--wait", name)
    moved = api.server(name)
    assert moved["status"] == "ACTIVE" and moved["host"] != target
    cached = cloud.state_dir / "libvirt" / target / "disks" / "images" / image["id"]
    _assert_disk_of_shelved(cloud, moved["host"], server_id, original["id"], image["id"], cached)
    assert _vcpupin(cloud, moved["host"], server_id) == {0: str(_ledger_pins(cloud, server_id)[0])}

    # Shelved again, then deleted while shelved: the new image goes with the server.
    cloud.osc("server", "shelve", "--wait", name)
    _assert_nowhere(cloud, server_id)
    again = cloud.osc_json("image", "show", f"{name}-shelved")
    cloud.osc("server", "delete", "--wait", name)
    _assert_nowhere(cloud, server_id)
    assert _shelve_claims(cloud, server_id) == {}
    assert cloud.osc("image", "show", again["id"], check=False).returncode != 0


def _assert_disk_of_shelved(
    cloud: RunningCloud,
    host: str,
    server_id: str,
    own_image: str,
    shelved_image: str,
    shelved_copy: Path | None = None,
) -> None:
    """The server's disk on `host` is an overlay on its own image, cached there, and holds
    what the shelve saved (the shelved image's cached copy on `host`, or `shelved_copy`)."""
    disks = cloud.state_dir / "libvirt" / host / "disks"
    disk = disks / f"{server_id}.qcow2"
    done = subprocess.run(
        ["qemu-img", "info", "-U", "--output=json", str(disk)],
        capture_output=True,
        text=True,
        check=True,
    )
    backing = json.loads(done.stdout).get("backing-filename")
    assert backing == str((disks / "images" / own_image).resolve()), done.stdout
    saved = shelved_copy or disks / "images" / shelved_image
    same = subprocess.run(
        ["qemu-img", "compare", "-U", str(disk), str(saved)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert same.returncode == 0, same.stdout + same.stderr


def _assert_nowhere(cloud: RunningCloud, server_id: str) -> None:
    """No domain and no file of the server on any host."""
    for host in HOSTS:
        assert f"instance-{server_id}" not in _virsh(cloud, host, "list", "--all")
        disks = cloud.state_dir / "libvirt" / host / "disks"
        left = [p.name for p in disks.rglob(f"*{server_id}*")]
        assert not left, (host, left)


def _shelve_claims(cloud: RunningCloud, consumer_id: str) -> dict[str, int]:
    """The ledger's rows of each claim table held by `consumer_id` (none: absent)."""
    db = sqlite3.connect(f"file:{cloud.state_dir / 'ledger.db'}?mode=ro", uri=True)
    try:
        counts = {
            table: db.execute(
                f"SELECT count(*) FROM {table} "
                "WHERE consumer_seq = (SELECT seq FROM consumers WHERE id = ?)",
                (consumer_id,),
            ).fetchone()[0]
            for table in ("allocations", "numa_claims", "pins")
        }
    finally:
        db.close()
    return {table: n for table, n in counts.items() if n}
