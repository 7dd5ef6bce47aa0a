"""A whole `stowage up` cloud served from this test process (uvicorn in a thread), for tests
that must reach into the process: patch a store method, count what a handler does."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from tests.api.cloudproc import free_port, password_auth

from stowage.ledger import Ledger
from stowage.services.cloud import Cloud, CloudConfig, bootstrap
from stowage.wiring import all_in_one


class InProcessCloud:
    def __init__(self, cloud: Cloud, base_url: str) -> None:
        self.cloud = cloud
        self.base_url = base_url
        self._token: str | None = None

    def token(self) -> str:
        if self._token is None:
            body = password_auth("admin", self.cloud.config.admin_password, "admin")
            issued = httpx.post(f"{self.base_url}/identity/v3/auth/tokens", json=body)
            issued.raise_for_status()
            self._token = issued.headers["x-subject-token"]
        return self._token

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """`path` under the cloud's base URL, with the admin's token (compute at 2.96)."""
        headers = {
            "X-Auth-Token": self.token(),
            "OpenStack-API-Version": "compute 2.96",
            **kwargs.pop("headers", {}),
        }
        return httpx.request(
            method, f"{self.base_url}{path}", headers=headers, timeout=30, **kwargs
        )

    def tiny_server(self, name: str, networks: Any = "none") -> dict[str, Any]:
        """A create body of one m1.tiny server from the first image."""
        images = self.request("GET", "/image/v2/images").json()["images"]
        flavors = self.request("GET", "/compute/v2.1/flavors").json()["flavors"]
        flavor = next(f["id"] for f in flavors if f["name"] == "m1.tiny")
        server = {"name": name, "imageRef": images[0]["id"], "flavorRef": flavor}
        return {"server": {**server, "networks": networks}}


@contextmanager
def in_process_cloud(tmp_path: Path, *, hosts: int = 2) -> Iterator[InProcessCloud]:
    port = free_port()
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'ledger.db'}")
    cloud = Cloud(
        CloudConfig(state_dir=tmp_path / "state", hosts=hosts, host="127.0.0.1", port=port),
        ledger,
    )
    bootstrap(cloud)
    server = uvicorn.Server(
        uvicorn.Config(all_in_one(cloud), host="127.0.0.1", port=port, log_config=None)
    )
    thread = threading.Thread(target=server.run, name="in-process-cloud", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the cloud did not start"
            time.sleep(0.05)
        yield InProcessCloud(cloud, f"http://127.0.0.1:{port}")
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        ledger.close()
