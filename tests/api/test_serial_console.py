"""The serial console through `openstack console url show --serial` and openstacksdk, read and
typed into over a real websocket client, on the simulated driver; its one-time tokens refused
when reused, used for another server or expired; the consoles that are off (VNC, SPICE, RDP,
MKS) refused as Nova refuses them when disabled."""

from __future__ import annotations

import time
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import openstack.config
import pytest
from openstack.connection import Connection
from tests.api.cloudproc import RunningCloud, start_cloud, stop_cloud
from websockets.exceptions import ConnectionClosedOK, InvalidStatus
from websockets.sync.client import ClientConnection, connect

TTL_S = 10.0  # long enough for a CLI call and a connection on a busy machine


@pytest.fixture(scope="module")
def consoles(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCloud]:
    """A cloud whose console tokens expire soon, so that expiry can be seen."""
    running = start_cloud(
        tmp_path_factory.mktemp("serial") / "state",
        "--hosts", "1", "--console-token-ttl", str(TTL_S),
    )  # fmt: skip
    try:
        yield running
    finally:
        stop_cloud(running)


def _read_until(ws: ClientConnection, wanted: bytes, timeout_s: float = 10.0) -> bytes:
    seen = b""
    deadline = time.monotonic() + timeout_s
    while wanted not in seen:
        left = deadline - time.monotonic()
        if left <= 0:
            pytest.fail(f"no {wanted!r} on the console within {timeout_s} s; saw {seen!r}")
        message = ws.recv(timeout=left)
        assert isinstance(message, bytes)  # binary frames, as websockify sends them
        seen += message
    return seen


def _refused(url: str) -> int:
    with pytest.raises(InvalidStatus) as caught, connect(url, open_timeout=10):
        pass
    return caught.value.response.status_code


def _url(cloud: RunningCloud, server: str, *args: str) -> str:
    shown = cloud.osc_json("console", "url", "show", "--serial", *args, server)
    assert shown["type"] == "serial"
    url = str(shown["url"])
    assert url.startswith(f"ws://{cloud.base_url.removeprefix('http://')}/serial-console/")
    return url


def test_the_serial_console_echoes_and_shows_the_console_log(consoles: RunningCloud) -> None:
    name = f"sc-{uuid.uuid4().hex[:6]}"
    server = consoles.boot(name)
    url = _url(consoles, name)
    with connect(url, subprotocols=["binary"], open_timeout=10) as ws:  # type: ignore[list-item]
        assert ws.subprotocol == "binary"
        # What os-getConsoleOutput shows, first.
        _read_until(ws, f"sim: {server['id']} booted with 1 vCPUs".encode())
        ws.send(b"echo hello\r")
        assert b"echo hello\r\n" in _read_until(ws, b"\r\n")
        ws.send("typed as text\n")  # a text frame is bytes to the guest too
        _read_until(ws, b"typed as text\r\n")
        # A hard reboot stops the guest: its serial line hangs up, and so does the socket.
        consoles.osc("server", "reboot", "--hard", "--wait", name)
        with pytest.raises(ConnectionClosedOK):
            _read_until(ws, b"never said")
    log = consoles.osc("console", "log", "show", name).stdout
    assert "echo hello" in log and "typed as text" in log  # the typed lines joined the log

    # Used once: a second connection with the same token is refused (HTTP 403).
    assert _refused(url) == 403


def test_a_token_is_refused_for_another_server_and_once_expired(consoles: RunningCloud) -> None:
    first, second = (f"sc-{uuid.uuid4().hex[:6]}" for _ in range(2))
    one, other = consoles.boot(first), consoles.boot(second)
    url = _url(consoles, first)
    assert _refused(url.replace(one["id"], other["id"])) == 403
    assert _refused(url) == 403  # the misused token is spent

    # The legacy action (2.1 to 2.5) hands out the same kind of URL.
    legacy = _url(consoles, first, "--os-compute-api-version", "2.5")
    time.sleep(TTL_S + 0.5)
    assert _refused(legacy) == 403  # expired

    # A token of a server that is gone opens nothing.
    url = _url(consoles, second)
    consoles.osc("server", "delete", "--wait", second)
    assert _refused(url) == 403


def test_remote_consoles_as_nova_answers_them(consoles: RunningCloud) -> None:
    name = f"sc-{uuid.uuid4().hex[:6]}"
    server_id = consoles.boot(name)["id"]
    path = f"/servers/{server_id}/remote-consoles"

    def create(protocol: str, kind: str, version: str = "2.96") -> Any:
        body = {"remote_console": {"protocol": protocol, "type": kind}}
        return consoles.compute("POST", path, json=body, version=version)

    made = create("serial", "serial")
    assert made.status_code == 200, made.text
    shown = made.json()["remote_console"]
    assert (shown["protocol"], shown["type"]) == ("serial", "serial")
    assert "?token=" in shown["url"]
    with warnings.catch_warnings():  # openstacksdk's, as the conftest's sdk fixture
        warnings.filterwarnings("ignore", category=PendingDeprecationWarning, module="openstack")
        config = openstack.config.OpenStackConfig(
            config_files=[str(consoles.state_dir / "clouds.yaml")]
        )
        with Connection(config=config.get_one(cloud="stowage-admin")) as sdk:
            console = sdk.compute.create_server_remote_console(
                server_id, protocol="serial", type="serial"
            )
    with connect(console.url, open_timeout=10) as ws:
        _read_until(ws, f"sim: {server_id} booted".encode())
    # The consoles that are off, as Nova with [vnc], [spice], [rdp], [mks] disabled.
    for protocol, kind in (
        ("vnc", "novnc"),
        ("spice", "spice-html5"),
        ("rdp", "rdp-html5"),
        ("mks", "webmks"),
    ):
        refused = create(protocol, kind)
        assert refused.status_code == 400, refused.text
        assert f"Unavailable console type {kind}." in refused.text
    assert create("mks", "webmks", version="2.7").status_code == 400  # no mks before 2.8
    wrong = create("serial", "novnc")
    assert wrong.status_code == 400 and "Invalid console type novnc" in wrong.text
    assert create("serial", "serial", version="2.5").status_code == 404  # from 2.6 on
    cli = consoles.osc("console", "url", "show", "--novnc", name, check=False)
    assert cli.returncode != 0 and "Unavailable console type novnc." in cli.stderr
    vnc = consoles.compute(
        "POST", f"/servers/{server_id}/action",
        json={"os-getVNCConsole": {"type": "novnc"}}, version="2.5",
    )  # fmt: skip
    assert vnc.status_code == 400 and "Unavailable console type novnc." in vnc.text

    # A stopped guest has no console to open: 409, as Nova's InstanceNotReady.
    consoles.osc("server", "stop", name)
    stopped = create("serial", "serial")
    assert stopped.status_code == 409, stopped.text
