"""`stowage up` and identity: the CLI authenticates, discovers and lists the catalog."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from tests.api.cloudproc import RunningCloud, start_cloud, stop_cloud


def test_the_cli_authenticates_and_reads_the_catalog(cloud: RunningCloud) -> None:
    rows = cloud.osc_json("catalog", "list")
    types = {row["Type"] for row in rows}
    assert {"identity", "compute", "image", "network", "placement"} <= types


def test_every_prefix_answers_its_discovery_document(cloud: RunningCloud) -> None:
    identity = httpx.get(f"{cloud.base_url}/identity")
    assert identity.status_code == 300
    assert identity.json()["versions"]["values"][0]["id"] == "v3.14"
    compute = httpx.get(f"{cloud.base_url}/compute/v2.1").json()["version"]
    assert compute["min_version"] == "2.1"
    assert tuple(int(x) for x in compute["version"].split(".")) >= (2, 95)
    image = httpx.get(f"{cloud.base_url}/image")
    assert image.status_code == 300
    assert image.json()["versions"][0]["links"][0]["href"].endswith("/image/v2/")
    assert httpx.get(f"{cloud.base_url}/networking").json()["versions"][0]["id"] == "v2.0"


def test_every_response_carries_a_request_id(cloud: RunningCloud) -> None:
    for path in ("/identity/v3", "/compute/v2.1", "/compute/v2.1/servers"):
        response = httpx.get(f"{cloud.base_url}{path}")
        assert response.headers["x-openstack-request-id"].startswith("req-")


def test_compute_refuses_an_unsupported_microversion_with_406(cloud: RunningCloud) -> None:
    response = httpx.get(
        f"{cloud.base_url}/compute/v2.1/", headers={"OpenStack-API-Version": "compute 2.200"}
    )
    assert response.status_code == 406
    assert "maximum is" in response.json()["notAcceptable"]["message"]


def test_a_wrong_password_is_401_in_keystone_shape(cloud: RunningCloud) -> None:
    body = {
        "auth": {
            "identity": {
                "methods": ["password"],
                "password": {
                    "user": {"name": "admin", "domain": {"name": "Default"}, "password": "wrong"}
                },
            }
        }
    }
    response = httpx.post(f"{cloud.base_url}/identity/v3/auth/tokens", json=body)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == 401


def test_a_revoked_token_is_refused(cloud: RunningCloud) -> None:
    admin = cloud.token()
    victim = cloud.token()
    url = f"{cloud.base_url}/identity/v3/auth/tokens"
    assert (
        httpx.head(url, headers={"X-Auth-Token": admin, "X-Subject-Token": victim}).status_code
        == 200
    )
    assert (
        httpx.delete(url, headers={"X-Auth-Token": admin, "X-Subject-Token": victim}).status_code
        == 204
    )
    # Asked about, a revoked token is not found (Keystone's TokenNotFound, 404), with HEAD as
    # with GET; used, it does not authenticate (401).
    assert (
        httpx.head(url, headers={"X-Auth-Token": admin, "X-Subject-Token": victim}).status_code
        == 404
    )
    shown = httpx.get(url, headers={"X-Auth-Token": admin, "X-Subject-Token": victim})
    assert shown.status_code == 404, shown.text
    assert shown.json()["error"]["code"] == 404
    assert (
        httpx.get(url, headers={"X-Auth-Token": victim, "X-Subject-Token": admin}).status_code
        == 401
    )


def test_a_token_revoked_after_use_is_refused_at_once(cloud: RunningCloud) -> None:
    """Validated tokens are cached briefly (services/tokens.py ValidationCache); a revocation
    in this process drops the cache, so the next request with the token is a 401."""
    admin = cloud.token()
    victim = cloud.token()
    flavors = f"{cloud.base_url}/compute/v2.1/flavors"
    for _ in range(2):  # validated, then served from the cache
        assert httpx.get(flavors, headers={"X-Auth-Token": victim}).status_code == 200
    url = f"{cloud.base_url}/identity/v3/auth/tokens"
    headers = {"X-Auth-Token": admin, "X-Subject-Token": victim}
    assert httpx.delete(url, headers=headers).status_code == 204
    assert httpx.get(flavors, headers={"X-Auth-Token": victim}).status_code == 401
    assert httpx.get(flavors, headers={"X-Auth-Token": admin}).status_code == 200


def test_a_second_up_on_a_busy_port_says_so(cloud: RunningCloud, tmp_path: Path) -> None:
    port = cloud.base_url.rsplit(":", 1)[1]
    result = subprocess.run(
        [
            str(Path(sys.executable).parent / "stowage"),
            "up",
            "--state-dir",
            str(tmp_path / "s"),
            "--port",
            port,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode != 0
    assert "already in use" in result.stderr


def test_restarting_on_the_same_state_dir_brings_back_the_same_cloud(tmp_path: Path) -> None:
    first = start_cloud(tmp_path / "state")
    try:
        token = first.token()
    finally:
        stop_cloud(first)
    assert first.process.returncode == 0, "SIGTERM must stop the cloud cleanly"
    assert "Stowage stopped." in first.log.read_text()
    second = start_cloud(tmp_path / "state")
    try:
        url = f"{second.base_url}/identity/v3/auth/tokens"
        fresh = second.token()
        # The same users, projects and token key: the first process's token is still valid.
        check = httpx.get(url, headers={"X-Auth-Token": fresh, "X-Subject-Token": token})
        assert check.status_code == 200
        assert check.json()["token"]["user"]["name"] == "admin"
    finally:
        stop_cloud(second)


def test_a_topology_file_describes_the_hosts(tmp_path: Path) -> None:
    topology = tmp_path / "hosts.yaml"
    topology.write_text(
        "defaults: {cells: 1, cores_per_cell: 4, threads_per_core: 2, memory_mb_per_cell: 8192}\n"
        "hosts:\n"
        "  - {name: edge, availability_zone: az-edge, labels: {rack: r9}}\n"
        "  - {name: big, cells: 2, count: 2, cpu_dedicated_set: '0-7', cpu_shared_set: '8-15'}\n"
    )
    running = start_cloud(tmp_path / "state", "--topology", str(topology))
    try:
        names = {row["Hypervisor Hostname"] for row in running.osc_json("hypervisor", "list")}
        assert names == {"edge", "big-1", "big-2"}
        zones = {
            row["Zone Name"]
            for row in running.osc_json("availability", "zone", "list", "--compute")
        }
        assert "az-edge" in zones
    finally:
        stop_cloud(running)
    bad = tmp_path / "bad.yaml"
    bad.write_text("hosts:\n  - {name: x, sockets: 2}\n")
    result = subprocess.run(
        [
            str(Path(sys.executable).parent / "stowage"),
            "up",
            "--state-dir",
            str(tmp_path / "other"),
            "--topology",
            str(bad),
            "--port",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "sockets" in result.stderr


def test_an_idle_connection_outlives_a_clients_poll_interval(cloud: RunningCloud) -> None:
    """The openstack CLI's `--wait` polls every 5 s on one kept-alive connection; uvicorn's
    default closed idle connections after 5 s, so a poll could arrive as the server closed
    and be reset (CI: `openstack server image create --wait` failed with ECONNRESET)."""
    host, port = cloud.base_url.removeprefix("http://").split(":")
    request = f"GET /identity/v3 HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        for pause_s in (0.0, 6.0):
            time.sleep(pause_s)
            conn.sendall(request)
            head = b""
            while b"\r\n\r\n" not in head:
                piece = conn.recv(65536)
                assert piece, f"the server closed the connection after {pause_s} s idle"
                head += piece
            assert head.startswith(b"HTTP/1.1 200"), head[:200]
            length = int(
                next(
                    line.split(b":", 1)[1]
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
            )
            body = head.split(b"\r\n\r\n", 1)[1]
            while len(body) < length:
                body += conn.recv(65536)


def test_the_port_is_held_before_the_cloud_says_it_is_up(tmp_path: Path) -> None:
    """`stowage up` binds the API's port before its start-up (the compute side's console
    proxies take ports the system picks, and could take this one): when it prints that it is
    up, nobody else can take the port. Before, uvicorn bound it after the app's start-up,
    and a bind here at that moment won."""
    import os

    from tests.api.cloudproc import free_port

    port = free_port()
    process = subprocess.Popen(
        [
            *(str(Path(sys.executable).parent / "stowage"), "up"),
            *("--state-dir", str(tmp_path / "s"), "--port", str(port), "--hosts", "2"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert process.stdout is not None
        seen = []
        for line in process.stdout:
            seen.append(line)
            if "Stowage is up" in line:
                break
        else:
            raise AssertionError(f"stowage up ended without saying it is up: {seen}")
        squatter = socket.socket()
        try:
            try:
                squatter.bind(("127.0.0.1", port))
            except OSError as exc:
                assert exc.errno == 98  # EADDRINUSE: the cloud holds it
            else:
                raise AssertionError("the port was free after stowage up said it was up")
        finally:
            squatter.close()
    finally:
        process.terminate()
        process.wait(timeout=30)
        if process.stdout is not None:
            process.stdout.close()
