"""Block storage v3 through the real `openstack` CLI, openstacksdk and raw calls: volumes,
snapshots, types, quotas, the attach actions and attachments, on the local-file backend."""

from __future__ import annotations

import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.api.cloudproc import BIN, IMAGE, RunningCloud

GIB = 1024**3
# openstacksdk 4.22 warns about its own internals (InfluxDB support, _compute_attributes) on
# calls the tests make; they are the SDK's deprecations, not this cloud's.
SDK_WARNINGS = "ignore::PendingDeprecationWarning:openstack"
pytestmark = pytest.mark.filterwarnings(SDK_WARNINGS)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


class Volume:
    """Raw block storage calls with a project-scoped token, at a microversion."""

    def __init__(self, cloud: RunningCloud, user: str = "admin") -> None:
        password = "stowage-admin" if user == "admin" else "stowage-demo"
        self.cloud = cloud
        self.token = cloud.token(user, password, user)
        tokens = httpx.get(
            f"{cloud.base_url}/identity/v3/auth/tokens",
            headers={"X-Auth-Token": self.token, "X-Subject-Token": self.token},
        ).json()["token"]
        self.project_id = tokens["project"]["id"]

    def call(self, method: str, path: str, version: str = "3.70", **kwargs: Any) -> httpx.Response:
        headers = {"X-Auth-Token": self.token, "OpenStack-API-Version": f"volume {version}"}
        url = f"{self.cloud.base_url}/volume/v3/{self.project_id}{path}"
        return httpx.request(method, url, headers=headers, timeout=30, **kwargs)

    def action(self, volume_id: str, name: str, args: Any = None, **kw: Any) -> httpx.Response:
        return self.call("POST", f"/volumes/{volume_id}/action", json={name: args or {}}, **kw)

    def status(self, volume_id: str) -> str:
        return str(self.call("GET", f"/volumes/{volume_id}").json()["volume"]["status"])


def wait(sdk: Any, resource: Any, status: str = "available") -> Any:
    return sdk.block_storage.wait_for_status(resource, status, wait=30, interval=0.1)


def volume_dir(cloud: RunningCloud) -> Path:
    return cloud.state_dir / "volumes"


def audit_clean(cloud: RunningCloud) -> None:
    result = subprocess.run(
        [str(BIN / "stowage"), "audit", "--state-dir", str(cloud.state_dir)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_catalog_and_the_version_documents_name_block_storage(cloud: RunningCloud) -> None:
    api = Volume(cloud)
    catalog = httpx.get(
        f"{cloud.base_url}/identity/v3/auth/catalog", headers={"X-Auth-Token": api.token}
    ).json()["catalog"]
    urls = {entry["type"]: entry["endpoints"][0]["url"] for entry in catalog}
    assert urls["block-storage"] == urls["volumev3"]
    assert urls["volumev3"].endswith(f"/volume/v3/{api.project_id}")
    versions = httpx.get(f"{cloud.base_url}/volume/")
    assert versions.status_code == 300
    current = versions.json()["versions"][0]
    assert (current["id"], current["version"], current["min_version"]) == ("v3.0", "3.70", "3.0")
    listed = api.call("GET", "/volumes", version="3.27")
    assert listed.headers["OpenStack-API-Version"] == "volume 3.27"
    assert api.call("GET", "/volumes", version="3.99").status_code == 406
    wrong = httpx.get(
        f"{cloud.base_url}/volume/v3/not-my-project/volumes", headers={"X-Auth-Token": api.token}
    )
    assert wrong.status_code == 400
    assert "Malformed request URL" in wrong.json()["badRequest"]["message"]


def test_a_volume_lives_as_a_file_from_blank_image_and_snapshot(
    cloud: RunningCloud, sdk: Any
) -> None:
    blank, from_image = unique("blank"), unique("img")
    # The CLI's own create and list (what an operator types); the rest through the SDK.
    made = cloud.osc_json("volume", "create", "--size", "1", "--property", "k=v", blank)
    assert made["status"] == "available" and made["size"] == 1
    path = volume_dir(cloud) / f"volume-{made['id']}"
    assert path.stat().st_size == GIB
    image = cloud.osc_json("volume", "create", "--size", "1", "--image", IMAGE, from_image)
    assert image["bootable"] is True
    assert "volume_image_metadata" not in image  # as Cinder: show and detail have it
    shown_image = cloud.osc_json("volume", "show", image["id"])
    assert shown_image["volume_image_metadata"]["image_name"] == IMAGE
    shown = subprocess.run(
        ["qemu-img", "info", "--output", "json", str(volume_dir(cloud) / f"volume-{image['id']}")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert '"format": "raw"' in shown.stdout

    snapshot = wait(sdk, sdk.block_storage.create_snapshot(volume_id=made["id"], name="s"))
    assert (volume_dir(cloud) / f"snapshot-{snapshot.id}").exists()
    child = wait(sdk, sdk.block_storage.create_volume(snapshot_id=snapshot.id, size=2))
    assert (child.size, child.snapshot_id) == (2, snapshot.id)
    sdk.block_storage.extend_volume(made["id"], 3)
    assert wait(sdk, sdk.block_storage.get_volume(made["id"])).size == 3
    assert path.stat().st_size == 3 * GIB
    listed = cloud.osc_json("volume", "list", "--long", "--property", "k=v")
    assert [row["Name"] for row in listed] == [blank]

    refused = Volume(cloud).call("DELETE", f"/volumes/{made['id']}")
    assert refused.status_code == 400 and "dependent snapshots" in refused.text
    for volume in (child.id, image["id"]):
        sdk.block_storage.delete_volume(volume)
    sdk.block_storage.delete_snapshot(snapshot)
    sdk.block_storage.wait_for_delete(snapshot, interval=0.1)
    sdk.block_storage.delete_volume(made["id"])
    left = {v.name for v in sdk.block_storage.volumes()}
    assert not left & {blank, from_image}
    assert not path.exists()


def test_quotas_are_counted_and_capacity_is_claimed_in_the_pool(cloud: RunningCloud) -> None:
    admin, demo = Volume(cloud), Volume(cloud, "demo")
    quotas = f"/os-quota-sets/{demo.project_id}"

    def set_quota(**values: int) -> httpx.Response:
        return admin.call("PUT", quotas, json={"quota_set": values})

    assert set_quota(volumes=1, gigabytes=-1).status_code == 200
    try:
        first = demo.call("POST", "/volumes", json={"volume": {"size": 1, "name": unique("q")}})
        assert first.status_code == 202
        first_id = first.json()["volume"]["id"]
        second = demo.call("POST", "/volumes", json={"volume": {"size": 1}})
        assert second.status_code == 413
        assert "VolumeLimitExceeded" in second.json()["overLimit"]["message"]
        assert set_quota(volumes=0).status_code == 400
        assert demo.call("PUT", quotas, json={"quota_set": {"volumes": 9}}).status_code == 403
        usage = demo.call("GET", f"{quotas}?usage=True").json()["quota_set"]
        assert usage["volumes"] == {"limit": 1, "in_use": 1, "reserved": 0, "allocated": 0}
        demo.call("DELETE", f"/volumes/{first_id}")
        # Past the pool (1000 GiB by default) the volume is recorded in error, holding nothing.
        set_quota(volumes=5)
        huge = demo.call("POST", "/volumes", json={"volume": {"size": 5000}})
        assert huge.status_code == 202
        huge_id = huge.json()["volume"]["id"]
        assert demo.status(huge_id) == "error"
        assert not (volume_dir(cloud) / f"volume-{huge_id}").exists()
        audit_clean(cloud)
        assert demo.call("DELETE", f"/volumes/{huge_id}").status_code == 202
    finally:
        set_quota(volumes=10, gigabytes=1000)


def test_types_are_an_admins_and_a_type_for_no_backend_ends_in_error(
    sdk: Any, cloud: RunningCloud
) -> None:
    name = unique("type")
    made = sdk.block_storage.create_type(name=name, extra_specs={"volume_backend_name": "rbd"})
    assert {"__DEFAULT__", name} <= {t.name for t in sdk.block_storage.types()}
    demo = Volume(cloud, "demo")
    refused = demo.call("POST", "/types", json={"volume_type": {"name": unique("t")}})
    assert refused.status_code == 403
    volume = wait(sdk, sdk.block_storage.create_volume(size=1, volume_type=name), "error")
    assert Volume(cloud).call("DELETE", f"/types/{made.id}").status_code == 400
    sdk.block_storage.delete_volume(volume)
    sdk.block_storage.wait_for_delete(volume, interval=0.1)
    sdk.block_storage.delete_type(made)


def test_the_legacy_attach_actions_move_the_status_as_nova_drives_them(
    cloud: RunningCloud, sdk: Any
) -> None:
    api = Volume(cloud)
    volume_id = wait(sdk, sdk.block_storage.create_volume(size=1)).id
    server = str(uuid.uuid4())
    assert api.action(volume_id, "os-reserve").status_code == 202
    assert api.status(volume_id) == "attaching"
    assert api.action(volume_id, "os-reserve").status_code == 400
    connector = {"host": "host1", "initiator": "iqn.x"}
    info = api.action(volume_id, "os-initialize_connection", {"connector": connector})
    data = info.json()["connection_info"]
    assert data["driver_volume_type"] == "local"
    assert Path(data["data"]["device_path"]).exists()
    attach = {"instance_uuid": server, "mountpoint": "/dev/vdb", "mode": "rw"}
    assert api.action(volume_id, "os-attach", attach).status_code == 202
    shown = api.call("GET", f"/volumes/{volume_id}").json()["volume"]
    assert shown["status"] == "in-use"
    assert shown["attachments"][0]["server_id"] == server
    assert api.call("DELETE", f"/volumes/{volume_id}").status_code == 400
    assert api.action(volume_id, "os-begin_detaching").status_code == 202
    assert api.status(volume_id) == "detaching"
    assert api.action(volume_id, "os-roll_detaching").status_code == 202
    assert api.action(volume_id, "os-begin_detaching").status_code == 202
    attachment_id = shown["attachments"][0]["attachment_id"]
    assert api.action(volume_id, "os-detach", {"attachment_id": attachment_id}).status_code == 202
    assert api.status(volume_id) == "available"
    assert api.action(volume_id, "os-terminate_connection", {"connector": connector}).is_success
    assert api.action(volume_id, "os-retype", {"new_type": "x"}).status_code == 501
    assert api.action(volume_id, "os-no-such-thing").status_code == 400
    api.call("DELETE", f"/volumes/{volume_id}")


def test_force_detach_is_an_admins_and_ends_the_attachment_of_a_volume_in_error(
    cloud: RunningCloud, sdk: Any
) -> None:
    # Tempest's test_force_detach_volume: attach, reset to error, force-detach, then its
    # cleanup's os-detach of the volume that is no longer attached (Cinder answers 202).
    api = Volume(cloud)
    volume_id = wait(sdk, sdk.block_storage.create_volume(size=1)).id
    attach = {"instance_uuid": str(uuid.uuid4()), "mountpoint": "/dev/vdb"}
    assert api.action(volume_id, "os-attach", attach).status_code == 202
    shown = api.call("GET", f"/volumes/{volume_id}").json()["volume"]
    attachment_id = shown["attachments"][0]["attachment_id"]
    assert api.action(volume_id, "os-reset_status", {"status": "error"}).status_code == 202
    force = {"connector": None, "attachment_id": attachment_id}
    assert Volume(cloud, "demo").action(volume_id, "os-force_detach", force).status_code == 403
    assert api.action(volume_id, "os-force_detach", force).status_code == 202
    shown = api.call("GET", f"/volumes/{volume_id}").json()["volume"]
    assert (shown["status"], shown["attachments"]) == ("available", [])
    assert api.call("GET", f"/attachments/{attachment_id}").status_code == 404
    assert api.action(volume_id, "os-detach").status_code == 202
    assert api.action(volume_id, "os-detach", {"attachment_id": attachment_id}).status_code == 202
    assert api.status(volume_id) == "available"
    api.call("DELETE", f"/volumes/{volume_id}")


def test_the_attachments_api_reserves_connects_completes_and_ends(
    cloud: RunningCloud, sdk: Any
) -> None:
    volume = wait(sdk, sdk.block_storage.create_volume(size=1, name=unique("sdk")))
    api = Volume(cloud)
    body = {"attachment": {"volume_uuid": volume.id, "instance_uuid": str(uuid.uuid4())}}
    created = api.call("POST", "/attachments", json=body)
    assert created.status_code == 200
    attachment = created.json()["attachment"]
    assert attachment["status"] == "reserved"
    assert api.status(volume.id) == "reserved"
    connector = {"attachment": {"connector": {"host": "host1", "initiator": "iqn.x"}}}
    updated = api.call("PUT", f"/attachments/{attachment['id']}", json=connector)
    assert updated.json()["attachment"]["connection_info"]["driver_volume_type"] == "local"
    done = api.call("POST", f"/attachments/{attachment['id']}/action", json={"os-complete": {}})
    assert done.status_code == 204
    assert sdk.block_storage.get_volume(volume.id).status == "in-use"
    listed = api.call("GET", f"/attachments?volume_id={volume.id}").json()["attachments"]
    assert [a["id"] for a in listed] == [attachment["id"]]
    assert api.call("GET", "/attachments", version="3.26").status_code == 404
    assert api.call("DELETE", f"/attachments/{attachment['id']}").status_code == 200
    assert sdk.block_storage.get_volume(volume.id).status == "available"
    sdk.block_storage.delete_volume(volume)
    sdk.block_storage.wait_for_delete(volume, interval=0.1)


def test_answers_in_the_shapes_tempest_holds_cinder_to(cloud: RunningCloud) -> None:
    """What Tempest's block-storage schemas pin down: a create's or update's answer lacks what
    only show and detail extend (snapshot attributes, the tenant), a full page links to the
    next, extra specs one at a time, the extensions, capabilities and service filters."""
    api = Volume(cloud)
    made = api.call("POST", "/volumes", json={"volume": {"size": 1, "name": unique("shape")}})
    volume = made.json()["volume"]
    assert "os-vol-tenant-attr:tenant_id" not in volume
    detail = api.call("GET", f"/volumes/{volume['id']}").json()["volume"]
    assert detail["os-vol-tenant-attr:tenant_id"] == api.project_id
    deadline = time.monotonic() + 30
    while api.status(volume["id"]) != "available" and time.monotonic() < deadline:
        time.sleep(0.1)
    snap = api.call(
        "POST", "/snapshots", json={"snapshot": {"volume_id": volume["id"], "name": "aa"}}
    )
    assert snap.status_code == 202, snap.text
    assert "os-extended-snapshot-attributes:progress" not in snap.json()["snapshot"]
    shown = api.call("GET", f"/snapshots/{snap.json()['snapshot']['id']}").json()["snapshot"]
    assert "os-extended-snapshot-attributes:progress" in shown

    listed = api.call("GET", "/volumes?limit=1&sort=created_at:desc").json()
    assert [link["rel"] for link in listed["volumes_links"]] == ["next"]

    vtype = api.call("POST", "/types", json={"volume_type": {"name": unique("t")}}).json()
    assert "qos_specs_id" not in vtype["volume_type"]
    type_id = vtype["volume_type"]["id"]
    specs = f"/types/{type_id}/extra_specs"
    assert api.call("POST", specs, json={"extra_specs": {"k": "v"}}).json() == {
        "extra_specs": {"k": "v"}
    }
    assert api.call("PUT", f"{specs}/k", json={"k": "w"}).json() == {"k": "w"}
    assert api.call("GET", f"{specs}/k").json() == {"k": "w"}
    assert api.call("PUT", f"{specs}/k", json={"other": "x"}).status_code == 400
    assert api.call("GET", f"{specs}/nope").status_code == 404

    aliases = {e["alias"] for e in api.call("GET", "/extensions").json()["extensions"]}
    assert {"os-vol-tenant-attr", "os-extended-snapshot-attributes"} <= aliases
    pool = api.call("GET", "/scheduler-stats/get_pools?detail=true").json()["pools"][0]
    caps = api.call("GET", f"/capabilities/{pool['name'].replace('#', '%23')}").json()
    assert caps["vendor_name"] == pool["capabilities"]["vendor_name"] == "Stowage"
    assert api.call("GET", "/capabilities/elsewhere@x").status_code == 404
    only = api.call("GET", "/os-services?binary=cinder-volume").json()["services"]
    assert [s["binary"] for s in only] == ["cinder-volume"]
    on_host = api.call("GET", "/os-services?host=stowage").json()["services"]
    assert sorted(s["binary"] for s in on_host) == ["cinder-scheduler", "cinder-volume"]
    assert api.call("POST", specs, json={"extra_specs": None}).status_code == 400

    # Metadata one key at a time, for volumes and snapshots alike.
    snap_id = snap.json()["snapshot"]["id"]
    for item in (f"/volumes/{volume['id']}", f"/snapshots/{snap_id}"):
        assert api.call("POST", f"{item}/metadata", json={"metadata": {"a": "1"}}).json() == {
            "metadata": {"a": "1"}
        }
        assert api.call("PUT", f"{item}/metadata/b", json={"meta": {"b": "2"}}).json() == {
            "meta": {"b": "2"}
        }
        assert api.call("GET", f"{item}/metadata/b").json() == {"meta": {"b": "2"}}
        assert api.call("PUT", f"{item}/metadata/b", json={"meta": {"c": "3"}}).status_code == 400
        assert api.call("DELETE", f"{item}/metadata/a").status_code == 200
        assert api.call("GET", f"{item}/metadata").json() == {"metadata": {"b": "2"}}

    # Snapshot lists take Cinder's offset and its display_name sort key.
    second = api.call(
        "POST", "/snapshots", json={"snapshot": {"volume_id": volume["id"], "name": "zz"}}
    ).json()["snapshot"]["id"]
    named = api.call("GET", f"/snapshots?volume_id={volume['id']}&sort_key=display_name")
    assert named.status_code == 200, named.text
    ids = [s["id"] for s in named.json()["snapshots"]]
    assert ids[0] == second  # "zz" first, descending
    skipped = api.call(
        "GET", f"/snapshots?volume_id={volume['id']}&sort_key=display_name&offset=1"
    ).json()["snapshots"]
    assert [s["id"] for s in skipped] == ids[1:]
    assert api.call("GET", "/snapshots?offset=-1").status_code == 400

    # An admin's snapshot actions, and a snapshot of no volume is one of a volume not found.
    act = f"/snapshots/{second}/action"
    assert (
        api.call("POST", act, json={"os-reset_status": {"status": "creating"}}).status_code == 202
    )
    progressed = {"os-update_snapshot_status": {"status": "available", "progress": "100%"}}
    assert api.call("POST", act, json=progressed).status_code == 202
    shown = api.call("GET", f"/snapshots/{second}").json()["snapshot"]
    assert shown["os-extended-snapshot-attributes:progress"] == "100%"
    assert api.call("POST", act, json=progressed).status_code == 400  # not from available
    member = Volume(cloud, "demo")
    forced = {"os-force_delete": {}}
    assert member.call("POST", act, json=forced).status_code in (403, 404)
    owned = member.call("POST", "/volumes", json={"volume": {"size": 1}}).json()["volume"]["id"]
    deadline = time.monotonic() + 30
    while member.status(owned) != "available" and time.monotonic() < deadline:
        time.sleep(0.1)
    theirs = member.call("POST", "/snapshots", json={"snapshot": {"volume_id": owned}})
    their_act = f"/snapshots/{theirs.json()['snapshot']['id']}/action"
    # The owner may move a creating snapshot on (Nova does, with its user's token)...
    assert member.call("POST", their_act, json=progressed).status_code in (202, 400)
    # ...but only an admin resets a status.
    reset = {"os-reset_status": {"status": "error"}}
    assert member.call("POST", their_act, json=reset).status_code == 403
    assert (
        api.call("POST", act, json={"os-reset_status": {"status": "error_deleting"}}).status_code
        == 202
    )
    assert api.call("POST", act, json=forced).status_code == 202
    deadline = time.monotonic() + 30
    while api.call("GET", f"/snapshots/{second}").status_code != 404:
        assert time.monotonic() < deadline, "the forced delete did not end"
        time.sleep(0.1)
    assert api.call("POST", "/snapshots", json={"snapshot": {}}).status_code == 404
