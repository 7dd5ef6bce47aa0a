"""Servers and volumes through the real `openstack` CLI: boot from volume as seed 004's reporter
does, attach and detach, and what a server's delete does to its volumes."""

from __future__ import annotations

import hashlib
import time
from typing import Any

import httpx
import pytest
from tests.api.cloudproc import IMAGE, RunningCloud
from tests.api.test_volumes import SDK_WARNINGS, Volume, audit_clean, unique, volume_dir

pytestmark = pytest.mark.filterwarnings(SDK_WARNINGS)


def allocations(cloud: RunningCloud, consumer: str) -> dict[str, Any]:
    response = httpx.get(
        f"{cloud.base_url}/placement/allocations/{consumer}",
        headers={"X-Auth-Token": cloud.token(), "OpenStack-API-Version": "placement 1.28"},
    )
    found: dict[str, Any] = response.json()["allocations"]
    return found


def test_boot_from_volume_attach_detach_and_delete_on_termination(
    cloud: RunningCloud, sdk: Any
) -> None:
    name = unique("bfv")
    server = cloud.osc_json(
        "server", "create", "--flavor", "m1.tiny", "--image", IMAGE, "--boot-from-volume", "1",
        "--nic", "none", "--wait", name,
    )  # fmt: skip
    assert server["status"] == "ACTIVE"
    assert server["image"] == "N/A (booted from volume)"
    root_id = server["volumes_attached"][0]["id"]
    api = Volume(cloud)
    root = api.call("GET", f"/volumes/{root_id}").json()["volume"]
    assert (root["status"], root["bootable"], root["size"]) == ("in-use", "true", 1)
    assert root["attachments"][0]["server_id"] == server["id"]
    assert root["attachments"][0]["device"] == "/dev/vda"
    # The root disk is the volume's: the host holds no DISK_GB for it.
    held = [a["resources"] for a in allocations(cloud, server["id"]).values()]
    assert held and all("DISK_GB" not in r for r in held)

    data = sdk.block_storage.wait_for_status(
        sdk.block_storage.create_volume(size=1, name=unique("data")), "available", wait=30
    )
    cloud.osc("server", "add", "volume", "--enable-delete-on-termination", name, data.id)
    attached = cloud.compute("GET", f"/servers/{server['id']}/os-volume_attachments").json()
    devices = {a["volumeId"]: a for a in attached["volumeAttachments"]}
    assert devices[data.id]["device"] == "/dev/vdb"
    assert devices[data.id]["delete_on_termination"] is True
    assert api.status(data.id) == "in-use"
    refused = cloud.compute(
        "PUT",
        f"/servers/{server['id']}/os-volume_attachments/{data.id}",
        json={"volumeAttachment": {"volumeId": root_id}},
    )
    assert refused.status_code == 501
    root_detach = cloud.compute(
        "DELETE", f"/servers/{server['id']}/os-volume_attachments/{root_id}"
    )
    assert root_detach.status_code == 400

    detach = cloud.compute("DELETE", f"/servers/{server['id']}/os-volume_attachments/{data.id}")
    assert detach.status_code == 202
    assert api.status(data.id) == "available"
    reattach = cloud.compute(
        "POST",
        f"/servers/{server['id']}/os-volume_attachments",
        json={"volumeAttachment": {"volumeId": data.id, "delete_on_termination": True}},
    )
    assert reattach.status_code == 200
    assert api.status(data.id) == "in-use"

    cloud.osc("server", "delete", "--wait", name)
    # delete_on_termination: the data volume goes with the server, the root volume stays.
    assert api.call("GET", f"/volumes/{data.id}").status_code == 404
    assert not (volume_dir(cloud) / f"volume-{data.id}").exists()
    assert api.status(root_id) == "available"
    sdk.block_storage.delete_volume(root_id)


def test_a_mapping_of_a_volume_in_use_or_a_missing_image_is_refused(cloud: RunningCloud) -> None:
    flavor = "1"
    missing = cloud.compute(
        "POST",
        "/servers",
        json={
            "server": {
                "name": unique("bad"),
                "flavorRef": flavor,
                "networks": "none",
                "block_device_mapping_v2": [
                    {
                        "source_type": "volume",
                        "destination_type": "volume",
                        "uuid": "00000000-0000-0000-0000-000000000000",
                        "boot_index": 0,
                    }
                ],
            }
        },
    )
    assert missing.status_code == 400
    blank_local = cloud.compute(
        "POST",
        "/servers",
        json={
            "server": {
                "name": unique("bad"),
                "flavorRef": flavor,
                "imageRef": "",
                "networks": "none",
                "block_device_mapping_v2": [
                    {"source_type": "blank", "destination_type": "local", "volume_size": 1}
                ],
            }
        },
    )
    assert blank_local.status_code == 400


def test_a_volume_that_is_not_bootable_is_refused_as_the_root_disk(cloud: RunningCloud) -> None:
    api = Volume(cloud)
    blank = cloud.osc_json("volume", "create", "--size", "1", unique("blank"))
    deadline = time.monotonic() + 30
    while api.status(blank["id"]) != "available" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert api.call("GET", f"/volumes/{blank['id']}").json()["volume"]["bootable"] == "false"
    refused = cloud.osc(
        "server", "create", "--flavor", "m1.tiny", "--volume", blank["id"], "--nic", "none",
        unique("nbv"), check=False,
    )  # fmt: skip
    assert refused.returncode != 0
    assert "400" in refused.stderr
    assert f"Block Device {blank['id']} is not bootable." in refused.stderr
    # Nothing was reserved: the volume is as it was, and no server was made of the request.
    assert api.status(blank["id"]) == "available"
    assert api.call("GET", f"/volumes/{blank['id']}").json()["volume"]["attachments"] == []

    # `volume set --bootable` (os-set_bootable, the owner's as Cinder's) makes it a root disk.
    demo = Volume(cloud, "demo")
    mine = demo.call("POST", "/volumes", json={"volume": {"size": 1}}).json()["volume"]["id"]
    while demo.status(mine) != "available" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert demo.action(mine, "os-set_bootable", {"bootable": True}).status_code == 200
    assert demo.call("GET", f"/volumes/{mine}").json()["volume"]["bootable"] == "true"
    assert demo.action(blank["id"], "os-set_bootable", {"bootable": True}).status_code == 404
    demo.call("DELETE", f"/volumes/{mine}")
    cloud.osc("volume", "set", "--bootable", blank["id"])
    assert api.call("GET", f"/volumes/{blank['id']}").json()["volume"]["bootable"] == "true"
    mapping = {"source_type": "volume", "destination_type": "volume", "boot_index": 0}
    accepted = cloud.compute(
        "POST",
        "/servers",
        json={
            "server": {
                "name": unique("bv"),
                "flavorRef": "1",
                "networks": "none",
                "block_device_mapping_v2": [{**mapping, "uuid": blank["id"]}],
            }
        },
    )
    assert accepted.status_code == 202, accepted.text
    server_id = accepted.json()["server"]["id"]
    assert api.call("GET", f"/volumes/{blank['id']}").json()["volume"]["attachments"]
    cloud.osc("server", "delete", "--wait", server_id)
    deadline = time.monotonic() + 60
    while api.status(blank["id"]) != "available" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert api.call("DELETE", f"/volumes/{blank['id']}").status_code == 202


def test_shelve_offload_holds_nothing_and_unshelve_claims_again_on_the_named_host(
    cloud: RunningCloud,
) -> None:
    image = httpx.get(
        f"{cloud.base_url}/image/v2/images?name={IMAGE}", headers={"X-Auth-Token": cloud.token()}
    ).json()["images"][0]["id"]
    mapping = {
        "source_type": "image",
        "destination_type": "volume",
        "uuid": image,
        "volume_size": 1,
        "boot_index": 0,
        "delete_on_termination": True,
    }
    name = unique("shelf")
    created = cloud.compute(
        "POST",
        "/servers",
        json={
            "server": {
                "name": name,
                "flavorRef": "c1",  # m1.pinned: dedicated CPUs, pins claimed and released
                "networks": "none",
                "block_device_mapping_v2": [mapping],
            }
        },
    )
    assert created.status_code == 202, created.text
    server_id = created.json()["server"]["id"]
    shown = cloud.compute("GET", f"/servers/{server_id}").json()["server"]
    assert shown["status"] == "ACTIVE" and allocations(cloud, server_id)
    elsewhere = next(h for h in ("host1", "host2", "host3") if h != shown["OS-EXT-SRV-ATTR:host"])

    cloud.osc("server", "shelve", name)
    shelved = cloud.compute("GET", f"/servers/{server_id}").json()["server"]
    assert (shelved["status"], shelved["OS-EXT-SRV-ATTR:host"]) == ("SHELVED_OFFLOADED", None)
    assert allocations(cloud, server_id) == {}
    assert len(shelved["os-extended-volumes:volumes_attached"]) == 1
    audit_clean(cloud)
    again = cloud.compute(
        "POST", f"/servers/{server_id}/action", json={"shelve": None}
    )  # already shelved
    assert again.status_code == 409

    # With no host to take it, an unshelve leaves it SHELVED_OFFLOADED, holding nothing, to
    # be unshelved again (Nova); before the fix it went to ERROR.
    cloud.osc("compute", "service", "set", "--disable", elsewhere, "nova-compute")
    try:
        unshelve = {"unshelve": {"host": elsewhere}}
        nowhere = cloud.compute(
            "POST", f"/servers/{server_id}/action", version="2.91", json=unshelve
        )
        assert nowhere.status_code == 202, nowhere.text
        deadline = time.monotonic() + 30
        while (stuck := cloud.compute("GET", f"/servers/{server_id}").json()["server"])[
            "OS-EXT-STS:task_state"
        ] is not None:
            assert time.monotonic() < deadline, stuck
            time.sleep(0.2)
        assert (stuck["status"], stuck["OS-EXT-SRV-ATTR:host"]) == ("SHELVED_OFFLOADED", None)
        assert "fault" not in stuck
        assert allocations(cloud, server_id) == {}
    finally:
        cloud.osc("compute", "service", "set", "--enable", elsewhere, "nova-compute")

    cloud.osc("--os-compute-api-version", "2.91", "server", "unshelve", "--host", elsewhere, name)
    back = cloud.compute("GET", f"/servers/{server_id}").json()["server"]
    assert (back["status"], back["OS-EXT-SRV-ATTR:host"]) == ("ACTIVE", elsewhere)
    held = allocations(cloud, server_id)
    assert [r["resources"].get("PCPU") for r in held.values()] == [1]
    cloud.compute("DELETE", f"/servers/{server_id}")


def test_an_image_backed_server_is_shelved_into_an_image_and_unshelved_from_it(
    cloud: RunningCloud,
) -> None:
    """Before: refused (501). Now, as Nova: its disk goes into `<name>-shelved`, the server
    holds nothing while SHELVED_OFFLOADED, unshelve boots it from that image and deletes the
    image; a shelved server's delete deletes it too."""
    name = unique("shelf-img")
    server = cloud.boot(name)
    host = server["OS-EXT-SRV-ATTR:host"]
    disk = cloud.state_dir / "sim" / host / f"{server['id']}.img"
    checksum = hashlib.md5(disk.read_bytes(), usedforsecurity=False).hexdigest()

    cloud.osc("server", "shelve", "--wait", name)
    shelved = cloud.compute("GET", f"/servers/{server['id']}").json()["server"]
    assert (shelved["status"], shelved["OS-EXT-SRV-ATTR:host"]) == ("SHELVED_OFFLOADED", None)
    assert allocations(cloud, server["id"]) == {}
    assert not disk.exists()  # the guest is gone from its host
    image = cloud.osc_json("image", "show", f"{name}-shelved")
    assert (image["status"], image["checksum"]) == ("active", checksum)
    assert image["properties"]["instance_uuid"] == server["id"]
    audit_clean(cloud)

    cloud.osc("server", "unshelve", "--wait", name)
    back = cloud.compute("GET", f"/servers/{server['id']}").json()["server"]
    assert back["status"] == "ACTIVE" and allocations(cloud, server["id"])
    assert back["image"]["id"] == cloud.osc_json("image", "show", IMAGE)["id"]  # the original
    gone = cloud.osc("image", "show", f"{name}-shelved", check=False)
    assert gone.returncode != 0

    cloud.osc("server", "shelve", "--wait", name)
    again = cloud.osc_json("image", "show", f"{name}-shelved")
    cloud.osc("server", "delete", "--wait", name)
    assert cloud.osc("image", "show", again["id"], check=False).returncode != 0
    audit_clean(cloud)
