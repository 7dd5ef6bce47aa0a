"""Server actions that change several records do it in one transaction (issue 9): the
security groups of the server and its ports; a lock and its action event. A failure part way
leaves none of them changed."""

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
    body = cloud.tiny_server("two-nics", [{"uuid": net_id}, {"uuid": net_id}])
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

        def failing_swap(
            self: ObjectStore, conn: Any, kind: str, *args: Any, **kwargs: Any
        ) -> bool:
            if kind == "instance":
                raise ConflictError("injected: the server's write fails")
            return real_swap(self, conn, kind, *args, **kwargs)

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


def test_a_lock_whose_action_event_fails_is_not_applied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before the fix the lock was written, then its action event in a transaction of its
    own: a failed event left the server locked with no event telling who locked it."""
    with in_process_cloud(tmp_path) as cloud:
        server_id = _active_server_with_two_ports(cloud)
        real_create = ObjectStore.create_in

        def failing_create(self: ObjectStore, conn: Any, kind: str, *args: Any, **kw: Any) -> Any:
            if kind == "instance_action":
                raise RuntimeError("injected: the action event is not written")
            return real_create(self, conn, kind, *args, **kw)

        action = f"/compute/v2.1/servers/{server_id}/action"
        with monkeypatch.context() as patched:
            patched.setattr(ObjectStore, "create_in", failing_create)
            failed = cloud.request("POST", action, json={"lock": None})
        assert failed.status_code == 500, failed.text
        shown = cloud.request("GET", f"/compute/v2.1/servers/{server_id}").json()["server"]
        assert shown["locked"] is False
        locked = cloud.request("POST", action, json={"lock": {"locked_reason": "maintenance"}})
        assert locked.status_code == 202, locked.text
        shown = cloud.request("GET", f"/compute/v2.1/servers/{server_id}").json()["server"]
        assert (shown["locked"], shown["locked_reason"]) == (True, "maintenance")
        events = cloud.request("GET", f"/compute/v2.1/servers/{server_id}/os-instance-actions")
        assert [a["action"] for a in events.json()["instanceActions"]].count("lock") == 1
