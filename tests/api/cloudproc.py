"""Start and stop a `stowage up` process, and drive the real `openstack` CLI against it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RunningCloud:
    """A cloud process and what the CLI needs to reach it."""

    base_url: str
    state_dir: Path
    process: subprocess.Popen[bytes]
    log: Path

    def env(self, cloud: str = "stowage-admin") -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OS_")}
        env["OS_CLIENT_CONFIG_FILE"] = str(self.state_dir / "clouds.yaml")
        env["OS_CLOUD"] = cloud
        return env

    def osc(
        self, *args: str, cloud: str = "stowage-admin", check: bool = True, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run `openstack ARGS`; with check, a non-zero exit fails the test with its stderr."""
        result = subprocess.run(
            [str(BIN / "openstack"), *args],
            env=self.env(cloud),
            capture_output=True,
            text=True,
            timeout=120,
            input=stdin,
            check=False,
        )
        if check and result.returncode != 0:
            pytest.fail(
                f"openstack {' '.join(args)} exited {result.returncode}\n"
                f"stdout: {result.stdout}\nstderr: {result.stderr}"
            )
        return result

    def osc_json(self, *args: str, cloud: str = "stowage-admin") -> Any:
        return json.loads(self.osc(*args, "-f", "json", cloud=cloud).stdout)

    def boot(
        self, name: str, *args: str, flavor: str = "m1.tiny", cloud: str = "stowage-admin"
    ) -> dict[str, Any]:
        """`openstack server create --wait` of the bootstrap image with no NIC, as JSON."""
        server: dict[str, Any] = self.osc_json(*boot_args(name, *args, flavor=flavor), cloud=cloud)
        return server

    def compute(
        self,
        method: str,
        path: str,
        *,
        version: str = "2.96",
        token: str | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        """A raw compute API call (admin's token unless one is given) at a microversion."""
        headers = {
            "X-Auth-Token": token or self.token(),
            "OpenStack-API-Version": f"compute {version}",
        }
        return httpx.request(
            method, f"{self.base_url}/compute/v2.1{path}", headers=headers, timeout=30, **kwargs
        )

    def token(
        self, user: str = "admin", password: str = "stowage-admin", project: str = "admin"
    ) -> str:
        body = password_auth(user, password, project)
        response = httpx.post(f"{self.base_url}/identity/v3/auth/tokens", json=body)
        response.raise_for_status()
        return response.headers["x-subject-token"]


def password_auth(user: str, password: str, project: str) -> dict[str, Any]:
    """The body of a password login scoped to a project, all in the Default domain."""
    return {
        "auth": {
            "identity": {
                "methods": ["password"],
                "password": {
                    "user": {"name": user, "domain": {"name": "Default"}, "password": password}
                },
            },
            "scope": {"project": {"name": project, "domain": {"name": "Default"}}},
        }
    }


IMAGE = "cirros-0.6.2-x86_64-disk"


def boot_args(name: str, *args: str, flavor: str = "m1.tiny") -> list[str]:
    """The CLI words that boot `name` from the bootstrap image, with no NIC, and wait."""
    return [
        "server",
        "create",
        "--flavor",
        flavor,
        "--image",
        IMAGE,
        "--nic",
        "none",
        *args,
        "--wait",
        name,
    ]


def start_cloud(
    state_dir: Path, *extra: str, timeout_s: float = 60.0, new_session: bool = False
) -> RunningCloud:
    """`stowage up` on a free port. The port is free when chosen, not when the cloud binds
    it: another test's process can take it in between (seen in CI as "address already in
    use" and exit 3; or its own check, exit 1), so it is started again on another port.
    `new_session`: in a process group of its own, for a test that signals the whole group as
    an init system would."""
    for _ in range(3):
        try:
            return _start_cloud_once(state_dir, extra, timeout_s, new_session)
        except _PortTaken:
            continue
    return _start_cloud_once(state_dir, extra, timeout_s, new_session)


class _PortTaken(RuntimeError):
    """The cloud exited because its port was taken before it bound it."""


def _start_cloud_once(
    state_dir: Path, extra: tuple[str, ...], timeout_s: float, new_session: bool
) -> RunningCloud:
    port = free_port()
    log = state_dir.parent / f"{state_dir.name}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                str(BIN / "stowage"),
                "up",
                "--state-dir",
                str(state_dir),
                "--port",
                str(port),
                # Scripts here read a server's state right after an action without polling;
                # waiting for the (quick, simulated) operation first keeps them short.
                *(() if "--api-wait-seconds" in extra else ("--api-wait-seconds", "5")),
                *extra,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=new_session,
        )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            text = log.read_text()
            if "already in use" in text:  # its own check, or the bind after it
                raise _PortTaken(f"stowage up exited {process.returncode}: {text}")
            raise RuntimeError(f"stowage up exited {process.returncode}: {text}")
        try:
            if httpx.get(f"{base}/identity/v3", timeout=1).status_code == 200:
                return RunningCloud(base, state_dir, process, log)
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"stowage up did not answer within {timeout_s} s: {log.read_text()}")


def stop_cloud(cloud: RunningCloud) -> None:
    cloud.process.terminate()
    try:
        cloud.process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        cloud.process.kill()
        cloud.process.wait()
