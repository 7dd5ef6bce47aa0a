"""Paths that read the document store inside a write transaction of their own, read in that
transaction (on SQLite and PostgreSQL, with the suite's nesting guard on): before, each read
took a second connection while the first held the write, which the guard refuses
(NestedTransaction) and which can wait on it for good (SQLite's writer lock, a PostgreSQL row
lock, the pool's last connection)."""

from __future__ import annotations

from typing import Any

import pytest
from tests.agent.test_use_cases import request
from tests.agent.test_volume_use_cases import Caller, volume_cloud  # noqa: F401 - `cloud`

from stowage.services import compute_catalog, consoles
from stowage.services.cloud import Cloud
from stowage.services.compute import build_servers
from stowage.services.documents import modify_document
from stowage.services.volumes import InvalidVolume, types, volumes
from stowage.services.volumes.server_volumes import parse_block_devices

IMAGE = {
    "id": "img",
    "name": "cirros",
    "status": "active",
    "visibility": "public",
    "size": 1024,
    "disk_format": "qcow2",
    "container_format": "bare",
}


def test_a_documents_change_reads_the_store_in_its_own_transaction(cloud: Cloud) -> None:
    """A server's metadata change checks the project's quota limits, an aggregate's the
    other aggregates' zones, while modify_document's swap transaction is open."""
    cloud.objects.create("aggregate", "1", {"name": "a", "hosts": [], "metadata": {}})
    cloud.objects.create("aggregate", "2", {"name": "b", "hosts": ["host1"], "metadata": {}})

    def change(body: dict[str, Any]) -> dict[str, Any]:
        limit = compute_catalog.quota_limits(cloud, "p")["metadata_items"]
        others = [d.id for d in cloud.objects.list("aggregate") if d.id != "1"]
        return {**body, "metadata": {"limit": str(limit), "others": ",".join(others)}}

    new = modify_document(cloud, "aggregate", "1", change, name_field="name")
    assert new["metadata"] == {"limit": "128", "others": "2"}
    assert cloud.objects.get("aggregate", "1").body == new


def test_a_console_token_is_kept_and_the_expired_ones_dropped_in_one_transaction(
    cloud: Cloud,
) -> None:
    now = cloud.clock()
    old = {"instance_id": "i", "host": "host1", "console_type": "serial", "expires_at": now - 1}
    consoles._store_token(cloud, "old-token", old, now - 601)
    fresh = {**old, "expires_at": now + 600}
    consoles._store_token(cloud, "new-token", fresh, now)  # lists the old one, deletes it
    assert len(cloud.objects.list(consoles.TOKEN_KIND)) == 1
    assert consoles._take_token(cloud, "new-token") == fresh
    assert consoles._take_token(cloud, "new-token") is None  # once
    assert consoles._take_token(cloud, "old-token") is None


def test_a_volume_type_delete_lists_the_volumes_in_its_transaction(cloud: Cloud) -> None:
    used = types.create_type(cloud, {"name": "used"})
    unused = types.create_type(cloud, {"name": "unused"})
    volumes.create_volume(cloud, Caller("p", False), {"size": 1, "volume_type": "used"})
    with pytest.raises(InvalidVolume, match="still in use"):
        types.delete_type(cloud, used["id"])
    types.delete_type(cloud, unused["id"])
    assert cloud.objects.find("volume_type", unused["id"]) is None
    assert cloud.objects.find("volume_type", used["id"]) is not None


def test_a_build_reads_its_block_devices_image_in_the_builds_transaction(cloud: Cloud) -> None:
    cloud.objects.create("image", "img", IMAGE)
    devices = parse_block_devices(
        [
            {
                "source_type": "image",
                "destination_type": "volume",
                "uuid": "img",
                "volume_size": 1,
                "boot_index": 0,
            }
        ]
    )
    (server,) = build_servers(cloud, request(block_devices=[dict(d) for d in devices]), "req-1")
    (device,) = server["block_devices"]
    volume = cloud.objects.get("volume", device["volume_id"])
    assert volume.body["image_id"] == "img" and volume.body["status"] == "creating"
    assert server["boot_from_volume"] is True


def test_find_each_inside_a_write_reads_in_its_transaction(cloud: Cloud) -> None:
    with cloud.objects.writing() as conn:
        cloud.objects.create_in(conn, "flavor", "f1", {"name": "one"})
        found = cloud.objects.find_each([("flavor", "f1"), ("flavor", "missing")])
    assert list(found) == [("flavor", "f1")]  # its own, not yet committed, write
    assert found["flavor", "f1"].body == {"name": "one"}
