"""Production mode with `--volume-dir`: the API, a conductor and a simulated agent as separate
processes, each with a state directory of its own (as on separate hosts) and one shared
volume directory. Volumes made by the API and by a build land there, a server boots from one
and attaches another (the simulated driver opens the file it is given), and deletes remove
the files there."""

from __future__ import annotations

import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.api.cloudproc import IMAGE, RunningCloud, free_port
from tests.bus.test_processes import spawn
from tests.conftest import pg_schema_url

pytestmark = pytest.mark.postgres


@pytest.fixture
def pg_url() -> Iterator[str]:
    yield from pg_schema_url()


def wait_for(what: str, check: Any, timeout: float = 90.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.5)
    pytest.fail(f"timed out waiting for {what}")


def volume_status(cloud: RunningCloud, name: str) -> str:
    return str(cloud.osc_json("volume", "show", name)["status"])


@pytest.fixture
def shared_volumes(tmp_path: Path, pg_url: str) -> Iterator[tuple[RunningCloud, str, Path]]:
    shared = tmp_path / "shared-volumes"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    db = ("--db", pg_url)
    api = spawn(
        tmp_path / "api.log",
        "api",
        "--state-dir",
        str(tmp_path / "api-host"),
        *db,
        "--port",
        str(port),
        "--volume-dir",
        str(shared),
    )
    wait_for(
        "the API",
        lambda: api.poll() is None and _answers(f"{base}/identity/v3"),
        timeout=90,
    )
    host = f"vdir-{uuid.uuid4().hex[:6]}"
    others = [
        spawn(
            tmp_path / "conductor.log",
            "conductor",
            "--state-dir",
            str(tmp_path / "conductor-host"),
            *db,
            "--op-timeout",
            "10",
            "--volume-dir",
            str(shared),
            "--image-api",
            f"{base}/image",
        ),
        spawn(
            tmp_path / "agent.log",
            "agent",
            "--host",
            host,
            "--state-dir",
            str(tmp_path / "compute-host"),
            *db,
            "--heartbeat-interval",
            "1",
            "--image-api",
            f"{base}/image",
            "--driver",
            "sim",
            "--volume-dir",
            str(shared),
        ),
    ]
    cloud = RunningCloud(base, tmp_path / "api-host", api, tmp_path / "api.log")
    try:
        wait_for(
            "the agent's host",
            lambda: any(
                r["Host"] == host and r["State"] == "up"
                for r in cloud.osc_json("compute", "service", "list", "--service", "nova-compute")
            ),
        )
        yield cloud, host, shared
    finally:
        for proc in [*others, api]:
            proc.terminate()
        for proc in [*others, api]:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        for name in ("api", "conductor", "agent"):
            log = tmp_path / f"{name}.log"
            if log.exists() and "Traceback" in log.read_text():
                print(f"--- {name}.log ---\n{log.read_text()}")


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_volumes_live_in_the_shared_directory_and_a_server_boots_from_one(
    shared_volumes: tuple[RunningCloud, str, Path],
) -> None:
    cloud, host, shared = shared_volumes
    # Made by the API's volume workers, from the image.
    boot = cloud.osc_json("volume", "create", "--size", "1", "--image", IMAGE, "vdir-boot")
    wait_for("the boot volume", lambda: volume_status(cloud, "vdir-boot") == "available")
    boot_file = shared / f"volume-{boot['id']}"
    assert boot_file.is_file() and boot_file.stat().st_size > 0
    assert not (cloud.state_dir / "volumes").exists()

    # A build by the conductor: boot from that volume, with a new blank volume made by the
    # build (in the conductor's process) beside it.
    server = cloud.osc_json(
        "server", "create", "--flavor", "m1.tiny", "--volume", "vdir-boot", "--nic", "none",
        "--block-device", "source_type=blank,destination_type=volume,volume_size=1,"
        "delete_on_termination=true",
        "--wait", "vdir-vm",
    )  # fmt: skip
    assert (server["status"], server["OS-EXT-SRV-ATTR:host"]) == ("ACTIVE", host)
    attached = {v["id"] for v in cloud.osc_json("server", "show", "vdir-vm")["volumes_attached"]}
    assert boot["id"] in attached and len(attached) == 2
    (blank_id,) = attached - {boot["id"]}
    assert (shared / f"volume-{blank_id}").is_file()
    assert volume_status(cloud, "vdir-boot") == "in-use"

    # Attached on the agent's host: the simulated driver opens the file at the path it is
    # given, which must be there.
    extra = cloud.osc_json("volume", "create", "--size", "1", "vdir-extra")
    wait_for("the extra volume", lambda: volume_status(cloud, "vdir-extra") == "available")
    assert (shared / f"volume-{extra['id']}").is_file()
    cloud.osc("server", "add", "volume", "vdir-vm", "vdir-extra")
    wait_for("the attach", lambda: volume_status(cloud, "vdir-extra") == "in-use")
    shown = cloud.osc_json("volume", "show", "vdir-extra")
    assert [a["server_id"] for a in shown["attachments"]] == [server["id"]]

    # Deleting the server deletes the build's blank volume (delete_on_termination) there;
    # the others are freed and deleted by the API, files and all.
    cloud.osc("server", "delete", "--wait", "vdir-vm")
    wait_for("the blank volume's file to go", lambda: not (shared / f"volume-{blank_id}").exists())
    for name in ("vdir-boot", "vdir-extra"):
        wait_for(f"{name} to be freed", lambda name=name: volume_status(cloud, name) == "available")
    cloud.osc("volume", "delete", "vdir-boot", "vdir-extra")
    wait_for("the files to go", lambda: not any(shared.iterdir()), timeout=60)
    for state in ("api-host", "conductor-host", "compute-host"):
        assert not (cloud.state_dir.parent / state / "volumes").exists(), state


def test_a_build_makes_its_root_volume_from_an_image_the_conductor_does_not_hold(
    shared_volumes: tuple[RunningCloud, str, Path],
) -> None:
    """`server create --image X --boot-from-volume N`: the conductor makes the root volume
    from the image. On a host of its own it has no copy of the image API's files: it fetches
    the image from the image API (checked against its checksums) instead of failing the
    build with "image has no data"."""
    cloud, host, shared = shared_volumes
    server = cloud.osc_json(
        "server", "create", "--flavor", "m1.tiny", "--image", IMAGE, "--boot-from-volume", "1",
        "--nic", "none", "--wait", "vdir-from-image",
    )  # fmt: skip
    assert (server["status"], server["OS-EXT-SRV-ATTR:host"]) == ("ACTIVE", host)
    (root,) = cloud.osc_json("server", "show", "vdir-from-image")["volumes_attached"]
    root_file = shared / f"volume-{root['id']}"
    image_id = cloud.osc_json("image", "show", IMAGE)["id"]
    # The image's bytes, converted to raw if need be, then grown to the volume's 1 GiB.
    assert root_file.stat().st_size == 1024**3
    # The conductor's copy came from the image API, byte for byte, into its cache.
    conductor_host = cloud.state_dir.parent / "conductor-host"
    fetched = conductor_host / "image-cache" / image_id
    assert fetched.read_bytes() == (cloud.state_dir / "images" / image_id).read_bytes()
    assert not any((conductor_host / "images").glob("*"))
    cloud.osc("server", "delete", "--wait", "vdir-from-image")
