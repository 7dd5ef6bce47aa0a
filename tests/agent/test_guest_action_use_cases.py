"""Rescue, passwords and interface attach as units of work on a real ledger (SQLite and
PostgreSQL): the request commits whole or not at all, a conductor started afterwards drives
it to its end, passwords leave the operation's record with it, and a port step repeated
after a crash finds the port it made."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select
from tests.agent.test_use_cases import (
    Crash,
    crash_at_commit,
    drive,
    open_cloud,
    open_work,
    request,
    statuses,
)

from stowage.domain.errors import ConflictError
from stowage.ledger.schema import operations
from stowage.services import guest_actions, images, interfaces, networks
from stowage.services.audit import audit_cloud
from stowage.services.caller import SystemCaller
from stowage.services.cloud import Cloud
from stowage.services.compute import build_servers


class Caller(SystemCaller):
    @property
    def user_id(self) -> str:
        return "u"


ME = Caller("p", False)


@pytest.fixture
def cloud(db_url: str, tmp_path: Path) -> Iterator[Cloud]:
    made = open_cloud(db_url, tmp_path / "state")
    yield made
    made.ledger.close()


def _payloads(cloud: Cloud) -> list[dict[str, object]]:
    with cloud.ledger.engine.connect() as conn:
        rows = conn.execute(select(operations.c.payload)).scalars().all()
    return [json.loads(r) for r in rows]


def _image(cloud: Cloud) -> str:
    made = images.create_image(
        cloud, ME, {"name": "rescue", "disk_format": "raw", "container_format": "bare"}
    )
    images.store_image_bytes(cloud, ME, made["id"], [b"\0" * 512])
    return str(made["id"])


def test_a_rescue_commits_whole_or_not_at_all_and_is_driven_by_a_later_conductor(
    cloud: Cloud, tmp_path: Path
) -> None:
    image = _image(cloud)
    build = dataclasses.replace(request(1, force_host="host1"), image_id=image)
    (vm,) = (d["id"] for d in build_servers(cloud, build, "req"))
    drive(cloud, tmp_path, lambda: statuses(cloud) == ["ACTIVE"])
    with pytest.raises(Crash), crash_at_commit(cloud.ledger.engine, 1):
        guest_actions.rescue_server(cloud, ME, vm, image_id=None, password="pw", request_id="r1")
    body = cloud.objects.get("instance", vm).body
    assert (body["status"], body["task_state"]) == ("ACTIVE", None) and open_work(cloud) == []
    assert cloud.objects.find("instance_action", f"r1:{vm}") is None

    guest_actions.rescue_server(cloud, ME, vm, image_id=None, password="pw", request_id="r2")
    assert cloud.objects.get("instance", vm).body["task_state"] == "rescuing"
    assert open_work(cloud) == [("rescue", "rescue", "pending")]
    assert cloud.objects.find("instance_action", f"r2:{vm}") is not None
    # The API died after its commit: a conductor that starts later drives the rescue.
    drive(cloud, tmp_path, lambda: statuses(cloud) == ["RESCUE"])
    assert not any("admin_password" in p for p in _payloads(cloud))  # dropped as it ended

    with pytest.raises(ConflictError, match="vm_state rescued"):
        guest_actions.change_password(cloud, ME, vm, "x", request_id="r3")
    guest_actions.unrescue_server(cloud, ME, vm, request_id="r4")
    drive(cloud, tmp_path, lambda: statuses(cloud) == ["ACTIVE"])
    guest_actions.change_password(cloud, ME, vm, "n3w", request_id="r5")
    drive(cloud, tmp_path, lambda: not open_work(cloud))
    assert not any("password" in p for p in _payloads(cloud))
    assert audit_cloud(cloud.ledger, stale_after_s=0) == []


def test_a_repeated_port_step_finds_the_port_it_made(cloud: Cloud, tmp_path: Path) -> None:
    networks.bootstrap_networks(cloud, {"demo": "p", "admin": "admin"})
    private = next(n for n in networks.list_networks(cloud, ME) if n["name"] == "private")
    (vm,) = (d["id"] for d in build_servers(cloud, request(1, force_host="host1"), "req"))
    drive(cloud, tmp_path, lambda: statuses(cloud) == ["ACTIVE"])
    op_id = interfaces.attach_interface(
        cloud, ME, vm, port_id=None, net_id=private["id"], fixed_ip=None, request_id="r1"
    )
    op = cloud.operations.find(op_id)
    assert op is not None and op.step == "interface_port"
    first = interfaces.interface_port(cloud, op)
    again = interfaces.interface_port(cloud, op)  # the step ran again after a crash
    assert again["id"] == first["id"] and len(networks.ports_of(cloud, vm)) == 1
    drive(cloud, tmp_path, lambda: not open_work(cloud))
    assert cloud.operations.find(op_id).state == "done"  # type: ignore[union-attr]
    addresses = cloud.objects.get("instance", vm).body["addresses"]
    assert [a["addr"] for a in addresses["private"]] == [first["fixed_ips"][0]["ip_address"]]
    assert audit_cloud(cloud.ledger, stale_after_s=0) == []
