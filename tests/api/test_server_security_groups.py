"""addSecurityGroup / removeSecurityGroup change the server's ports and the server in one
transaction (issue 9): a failure part way leaves neither changed."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from tests.api.inprocess import InProcessCloud, in_process_cloud

from stowage.domain.errors import ConflictError
from stowage.ledger.objects import ObjectStore


def _active_server_with_two_ports(cloud: InProcessCloud) -> str:
    networks = cloud.request("GET", "/networking/v2.0/networks?name=private").json()
    net_id = networks["networks"][0]["id"]
    images = cloud.request("GET", "/image/v2/images").json()["images"]
    flavors = cloud.request("GET", "/compute/v2.1/flavors").json()["flavors"]
    body = {
        "server": {
            "name": "two-nics",
            "imageRef": images[0]["id"],
            "flavorRef": next(f["id"] for f in flavors if f["name"] == "m1.tiny"),
            "networks": [{"uuid": net_id}, {"uuid": net_id}],
        }
    }
    created = cloud.request("POST", "/compute/v2.1/servers", json=body)
    assert created.status_code == 202, created.text
    server_id = str(created.json()["server"]["id"])
    deadline = time.monotonic() + 60
    while (
        status := cloud.request("GET", f"/compute/v2.1/servers/{server_id}").json()["server"][
            "status"
        ]
    ) != "ACTIVE":
        assert status != "ERROR" and time.monotonic() < deadline, status
        time.sleep(0.1)
    return server_id


def _port_groups(cloud: InProcessCloud, server_id: str) -> list[list[str]]:
    ports = cloud.request("GET", f"/networking/v2.0/ports?device_id={server_id}").json()["ports"]
    assert len(ports) == 2
    return [sorted(p["security_groups"]) for p in ports]


def test_a_failed_add_leaves_the_ports_and_the_server_as_they_were(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before the fix each port was updated in a transaction of its own, then the server:
    a server write that failed left the group on its ports but not in its list."""
    with in_process_cloud(tmp_path) as cloud:
        server_id = _active_server_with_two_ports(cloud)
        group = cloud.request(
            "POST",
            "/networking/v2.0/security-groups",
            json={"security_group": {"name": f"sg-{uuid.uuid4().hex[:6]}"}},
        ).json()["security_group"]
        ports_before = _port_groups(cloud, server_id)
        action = f"/compute/v2.1/servers/{server_id}/action"

        real_swap = ObjectStore.swap_in

        def failing_swap(self: ObjectStore, conn: Any, kind: str, *args: Any) -> bool:
            if kind == "instance":
                raise ConflictError("injected: the server's write fails")
            return real_swap(self, conn, kind, *args)

        with monkeypatch.context() as patched:
            patched.setattr(ObjectStore, "swap_in", failing_swap)
            refused = cloud.request(
                "POST", action, json={"addSecurityGroup": {"name": group["name"]}}
            )
        assert refused.status_code == 409, refused.text
        assert _port_groups(cloud, server_id) == ports_before
        shown = cloud.request("GET", f"/compute/v2.1/servers/{server_id}").json()["server"]
        assert [g["name"] for g in shown["security_groups"]] == ["default"]

        # Unhindered, the group reaches both ports and the server, and leaves them again.
        added = cloud.request("POST", action, json={"addSecurityGroup": {"name": group["name"]}})
        assert added.status_code == 202, added.text
        assert all(group["id"] in groups for groups in _port_groups(cloud, server_id))
        shown = cloud.request("GET", f"/compute/v2.1/servers/{server_id}").json()["server"]
        assert sorted(g["name"] for g in shown["security_groups"]) == sorted(
            ["default", group["name"]]
        )
        again = cloud.request("POST", action, json={"addSecurityGroup": {"name": group["name"]}})
        assert again.status_code == 400, again.text
        removed = cloud.request(
            "POST", action, json={"removeSecurityGroup": {"name": group["name"]}}
        )
        assert removed.status_code == 202, removed.text
        assert _port_groups(cloud, server_id) == ports_before
        unknown = cloud.request("POST", action, json={"addSecurityGroup": {"name": "no-such"}})
        assert unknown.status_code == 404, unknown.text
