"""Servers through the real `openstack` CLI and raw calls: build, list, show, act, delete."""

from __future__ import annotations

import hashlib
import time
import uuid
from typing import Any

import httpx
from tests.api.cloudproc import IMAGE, RunningCloud, boot_args


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def compute(
    cloud: RunningCloud, token: str, method: str, path: str, version: str = "2.96", **kwargs: Any
) -> httpx.Response:
    return cloud.compute(method, path, version=version, token=token, **kwargs)


def create(
    cloud: RunningCloud, name: str, *args: str, flavor: str = "m1.tiny", user: str = "stowage-admin"
) -> dict[str, Any]:
    return cloud.boot(name, *args, flavor=flavor, cloud=user)


def test_a_server_is_built_shown_listed_and_deleted(cloud: RunningCloud) -> None:
    name = unique("vm")
    server = create(cloud, name)
    assert server["status"] == "ACTIVE"
    shown = cloud.osc_json("server", "show", name)
    assert shown["id"] == server["id"]
    assert shown["OS-EXT-SRV-ATTR:host"] in {"host1", "host2", "host3"}
    assert "m1.tiny" in str(shown["flavor"])
    listed = {row["Name"]: row for row in cloud.osc_json("server", "list")}
    assert listed[name]["Status"] == "ACTIVE"
    cloud.osc("server", "delete", "--wait", name)
    gone = cloud.osc("server", "show", name, check=False)
    assert gone.returncode != 0
    assert "No Server found" in gone.stderr or "could not be found" in gone.stderr


def test_an_unknown_server_is_a_404_in_nova_shape(cloud: RunningCloud) -> None:
    response = compute(cloud, cloud.token(), "GET", "/servers/no-such-server")
    assert response.status_code == 404
    assert response.json()["itemNotFound"]["code"] == 404


def test_a_bad_create_is_a_400_naming_the_field_and_leaves_nothing(cloud: RunningCloud) -> None:
    token = cloud.token()
    before = len(compute(cloud, token, "GET", "/servers").json()["servers"])
    response = compute(cloud, token, "POST", "/servers", json={"server": {"name": "x"}})
    assert response.status_code == 400
    assert "flavorRef" in response.json()["badRequest"]["message"]
    response = compute(
        cloud,
        token,
        "POST",
        "/servers",
        json={"server": {"name": "x", "flavorRef": "1", "imageRef": "nope", "networks": "none"}},
    )
    assert response.status_code == 400
    assert "nope" in response.json()["badRequest"]["message"]
    assert len(compute(cloud, token, "GET", "/servers").json()["servers"]) == before


def test_a_create_checks_the_images_minimums_and_the_metadata_quota(cloud: RunningCloud) -> None:
    """Nova's create checks that read what the create had already read (the image) or that
    apply only to some creates (the metadata quota): still made."""
    token = cloud.token()
    headers = {"X-Auth-Token": token}
    image = httpx.post(
        f"{cloud.base_url}/image/v2/images",
        headers=headers,
        json={
            "name": unique("big-ram"),
            "disk_format": "raw",
            "container_format": "bare",
            "min_ram": 1024,
        },
    ).json()
    stored = httpx.put(
        f"{cloud.base_url}/image/v2/images/{image['id']}/file",
        headers={**headers, "Content-Type": "application/octet-stream"},
        content=b"\0" * 4096,
    )
    assert stored.status_code == 204, stored.text
    body = {"server": {"name": unique("x"), "flavorRef": "1", "networks": "none"}}
    small = compute(
        cloud,
        token,
        "POST",
        "/servers",
        json={"server": {**body["server"], "imageRef": image["id"]}},
    )
    assert small.status_code == 400, small.text
    assert (
        small.json()["badRequest"]["message"] == "Flavor's memory is too small for requested image."
    )

    project = httpx.get(
        f"{cloud.base_url}/identity/v3/auth/tokens",
        headers={**headers, "X-Subject-Token": token},
    ).json()["token"]["project"]["id"]
    quota = f"/os-quota-sets/{project}"
    before = compute(cloud, token, "GET", quota, version="2.1").json()["quota_set"][
        "metadata_items"
    ]
    assert (
        compute(
            cloud, token, "PUT", quota, version="2.1", json={"quota_set": {"metadata_items": 1}}
        ).status_code
        == 200
    )
    try:
        over = {**body["server"], "imageRef": _image_id(cloud), "metadata": {"a": "1", "b": "2"}}
        refused = compute(cloud, token, "POST", "/servers", json={"server": over})
        assert refused.status_code == 403, refused.text
        assert "metadata_items" in refused.json()["forbidden"]["message"]
    finally:
        compute(
            cloud,
            token,
            "PUT",
            quota,
            version="2.1",
            json={"quota_set": {"metadata_items": before}},
        )


def test_a_member_cannot_see_another_projects_server(cloud: RunningCloud) -> None:
    name = unique("admin-vm")
    server = create(cloud, name)
    member = cloud.token("demo", "stowage-demo", "demo")
    assert compute(cloud, member, "GET", f"/servers/{server['id']}").status_code == 404
    names = [s["name"] for s in compute(cloud, member, "GET", "/servers/detail").json()["servers"]]
    assert name not in names
    cloud.osc("server", "delete", "--wait", name)


def test_anti_affinity_puts_members_on_distinct_hosts_and_refuses_one_too_many(
    cloud: RunningCloud,
) -> None:
    group = cloud.osc_json("server", "group", "create", "--policy", "anti-affinity", unique("anti"))
    names = [unique("member") for _ in range(3)]
    hosts = set()
    for name in names:
        server = create(cloud, name, "--hint", f"group={group['id']}")
        hosts.add(cloud.osc_json("server", "show", server["id"])["OS-EXT-SRV-ATTR:host"])
    assert len(hosts) == 3
    extra = unique("member")
    result = cloud.osc(
        *boot_args(extra, "--hint", f"group={group['id']}"),
        check=False,
    )
    assert result.returncode != 0
    shown = cloud.osc_json("server", "show", extra)
    assert shown["status"] == "ERROR"
    assert "No valid host was found" in str(shown["fault"])
    assert "server_group" in str(shown["fault"])
    for name in [*names, extra]:
        cloud.osc("server", "delete", "--wait", name)


def test_a_pinned_server_reports_its_pcpus_in_topology(cloud: RunningCloud) -> None:
    name = unique("pinned")
    server = create(cloud, name, flavor="m1.pinned")
    token = cloud.token()
    topology = compute(cloud, token, "GET", f"/servers/{server['id']}/topology", "2.78").json()
    assert len(topology["nodes"]) == 1
    pinning = topology["nodes"][0]["cpu_pinning"]
    assert list(pinning) == ["0"]
    assert isinstance(pinning["0"], int)
    older = compute(cloud, token, "GET", f"/servers/{server['id']}/topology", "2.77")
    assert older.status_code == 404
    cloud.osc("server", "delete", "--wait", name)


def test_min_count_places_all_or_none(cloud: RunningCloud) -> None:
    token = cloud.token()
    body = {
        "server": {
            "name": unique("many"),
            "flavorRef": "1",
            "imageRef": _image_id(cloud),
            "networks": "none",
            "min_count": 2,
            "max_count": 2,
        }
    }
    assert compute(cloud, token, "POST", "/servers", json=body).status_code == 202
    mine = [
        s
        for s in compute(cloud, token, "GET", "/servers/detail").json()["servers"]
        if s["name"].startswith(body["server"]["name"])
    ]
    assert sorted(s["status"] for s in mine) == ["ACTIVE", "ACTIVE"]
    for s in mine:
        assert compute(cloud, token, "DELETE", f"/servers/{s['id']}").status_code == 204


def test_server_ids_are_uuids_that_sort_by_creation(cloud: RunningCloud) -> None:
    """Version 7 UUIDs (RFC 9562): the rows keyed and indexed by a server's id go in at the
    end of each B-tree instead of at a random page (docs/performance.md, session 15)."""
    token = cloud.token()
    ids = []
    for _ in range(2):
        body = {
            "server": {
                "name": unique("ordered"),
                "flavorRef": "1",
                "imageRef": _image_id(cloud),
                "networks": "none",
            }
        }
        response = compute(cloud, token, "POST", "/servers", json=body)
        assert response.status_code == 202
        ids.append(response.json()["server"]["id"])
        rid = response.headers["x-openstack-request-id"]
        assert uuid.UUID(rid.removeprefix("req-")).version == 7
        time.sleep(0.002)
    parsed = [uuid.UUID(i) for i in ids]
    assert [str(p) for p in parsed] == ids
    assert [p.version for p in parsed] == [7, 7]
    assert ids[0] < ids[1]
    # Made within a minute, the two ids share their first 8 digits (the time): the name on the
    # hypervisor is the libvirt driver's domain name, the whole id.
    names = [
        compute(cloud, token, "GET", f"/servers/{i}").json()["server"][
            "OS-EXT-SRV-ATTR:instance_name"
        ]
        for i in ids
    ]
    assert names == [f"instance-{i}" for i in ids]
    for server_id in ids:
        assert compute(cloud, token, "DELETE", f"/servers/{server_id}").status_code == 204


def _image_id(cloud: RunningCloud) -> str:
    return str(cloud.osc_json("image", "show", IMAGE)["id"])


def test_power_actions_follow_the_state_machine(cloud: RunningCloud) -> None:
    name = unique("power")
    server = create(cloud, name)
    token = cloud.token()
    started = compute(
        cloud, token, "POST", f"/servers/{server['id']}/action", json={"os-start": None}
    )
    assert started.status_code == 409
    cloud.osc("server", "stop", name)
    assert cloud.osc_json("server", "show", name)["status"] == "SHUTOFF"
    cloud.osc("server", "start", name)
    assert cloud.osc_json("server", "show", name)["status"] == "ACTIVE"
    events = cloud.osc_json("server", "event", "list", name)
    assert {"create", "stop", "start"} <= {e["Action"] for e in events}
    cloud.osc("server", "delete", "--wait", name)


def test_reset_state_is_admin_only(cloud: RunningCloud) -> None:
    name = unique("reset")
    server_id = create(cloud, name, user="stowage")["id"]
    denied = cloud.osc(
        "server", "set", "--state", "error", "--auto-approve", name, cloud="stowage", check=False
    )
    assert denied.returncode != 0
    assert "403" in denied.stderr or "Policy" in denied.stderr
    # The admin works in its own project, so it names the member's server by id.
    cloud.osc("server", "set", "--state", "error", "--auto-approve", server_id)
    assert cloud.osc_json("server", "show", name, cloud="stowage")["status"] == "ERROR"
    cloud.osc("server", "set", "--state", "active", "--auto-approve", server_id)
    assert cloud.osc_json("server", "show", name, cloud="stowage")["status"] == "ACTIVE"
    cloud.osc("server", "delete", "--wait", name, cloud="stowage")


def test_the_flavor_field_follows_the_microversion(cloud: RunningCloud) -> None:
    name = unique("mv")
    server = create(cloud, name)
    token = cloud.token()
    for version in ("2.1", "2.46", "2.47", "2.96"):
        body = compute(cloud, token, "GET", f"/servers/{server['id']}", version).json()["server"]
        if tuple(int(x) for x in version.split(".")) >= (2, 47):
            assert body["flavor"]["original_name"] == "m1.tiny"
            assert "id" not in body["flavor"]
        else:
            assert body["flavor"]["id"] == "1"
    cloud.osc("server", "delete", "--wait", name)


def test_resize_waits_for_confirm_then_moves_its_claims(cloud: RunningCloud) -> None:
    name = unique("resize")
    server = create(cloud, name)
    before = cloud.osc_json("server", "show", name)["OS-EXT-SRV-ATTR:host"]
    cloud.osc("server", "resize", "--flavor", "m1.small", name)
    waiting = cloud.osc_json("server", "show", name)
    assert waiting["status"] == "VERIFY_RESIZE"
    migrations = cloud.osc_json("server", "migration", "list", "--server", name)
    assert [m["Status"] for m in migrations] == ["finished"]
    cloud.osc("server", "resize", "confirm", name)
    done = cloud.osc_json("server", "show", name)
    assert done["status"] == "ACTIVE"
    assert "m1.small" in str(done["flavor"])
    assert done["OS-EXT-SRV-ATTR:host"] != before
    statuses = [
        m["Status"] for m in cloud.osc_json("server", "migration", "list", "--server", name)
    ]
    assert statuses == ["confirmed"]
    again = cloud.compute("POST", f"/servers/{server['id']}/action", json={"confirmResize": None})
    assert again.status_code == 409
    cloud.osc("server", "delete", "--wait", name)


def test_a_reverted_cold_migration_stays_on_its_host(cloud: RunningCloud) -> None:
    name = unique("cold")
    create(cloud, name)
    before = cloud.osc_json("server", "show", name)["OS-EXT-SRV-ATTR:host"]
    cloud.osc("server", "migrate", name)
    assert cloud.osc_json("server", "show", name)["status"] == "VERIFY_RESIZE"
    cloud.osc("server", "resize", "revert", name)
    after = cloud.osc_json("server", "show", name)
    assert after["status"] == "ACTIVE"
    assert after["OS-EXT-SRV-ATTR:host"] == before
    statuses = [
        m["Status"] for m in cloud.osc_json("server", "migration", "list", "--server", name)
    ]
    assert statuses == ["reverted"]
    denied = cloud.osc("server", "migrate", name, cloud="stowage", check=False)
    assert denied.returncode != 0
    cloud.osc("server", "delete", "--wait", name)


def test_a_snapshot_becomes_an_active_private_image_of_the_servers_disk(
    cloud: RunningCloud,
) -> None:
    name = unique("snap-src")
    server = create(cloud, name)
    snap = unique("snap")
    cloud.osc("server", "image", "create", "--name", snap, "--wait", name)
    image = cloud.osc_json("image", "show", snap)
    assert image["status"] == "active"
    assert image["visibility"] == "private"
    assert image["properties"]["instance_uuid"] == server["id"]
    # The data is the instance's disk as its hypervisor holds it, streamed by the agent.
    host = cloud.osc_json("server", "show", name)["OS-EXT-SRV-ATTR:host"]
    disk = cloud.state_dir / "sim" / host / f"{server['id']}.img"
    assert int(image["size"]) == disk.stat().st_size > 0
    assert image["checksum"] == hashlib.md5(disk.read_bytes(), usedforsecurity=False).hexdigest()
    nameless = cloud.compute("POST", f"/servers/{server['id']}/action", json={"createImage": {}})
    assert nameless.status_code == 400
    cloud.osc("image", "delete", snap)
    cloud.osc("server", "delete", "--wait", name)


def test_rebuild_keeps_the_host_and_changes_the_image(cloud: RunningCloud) -> None:
    name = unique("rebuild")
    create(cloud, name)
    host = cloud.osc_json("server", "show", name)["OS-EXT-SRV-ATTR:host"]
    other = unique("img")
    cloud.osc("server", "image", "create", "--name", other, "--wait", name)
    other_id = cloud.osc_json("image", "show", other)["id"]
    cloud.osc("server", "rebuild", "--image", other, "--wait", name)
    shown = cloud.osc_json("server", "show", name)
    assert shown["status"] == "ACTIVE"
    assert shown["OS-EXT-SRV-ATTR:host"] == host
    assert other_id in str(shown["image"])
    cloud.osc("server", "delete", "--wait", name)
    cloud.osc("image", "delete", other)


def test_a_reader_lists_servers_but_cannot_create_or_delete_them(cloud: RunningCloud) -> None:
    name = unique("reader")
    cloud.osc("user", "create", "--password", "read-only", "--project", "demo", name)
    cloud.osc("role", "add", "--project", "demo", "--user", name, "reader")
    owned = create(cloud, unique("demo-vm"), user="stowage")
    token = cloud.token(name, "read-only", "demo")
    listed = cloud.compute("GET", "/servers", token=token)
    assert listed.status_code == 200
    assert owned["id"] in {s["id"] for s in listed.json()["servers"]}
    body = {
        "server": {
            "name": "nope",
            "flavorRef": "1",
            "imageRef": _image_id(cloud),
            "networks": "none",
        }
    }
    assert cloud.compute("POST", "/servers", token=token, json=body).status_code == 403
    assert cloud.compute("DELETE", f"/servers/{owned['id']}", token=token).status_code == 403
    stop = cloud.compute(
        "POST", f"/servers/{owned['id']}/action", token=token, json={"os-stop": None}
    )
    assert stop.status_code == 403
    cloud.osc("server", "delete", "--wait", owned["id"])
    cloud.osc("user", "delete", name)


def test_console_log_comes_from_the_guests_host_with_its_length(cloud: RunningCloud) -> None:
    name = unique("console")
    server = create(cloud, name)
    whole = cloud.osc("console", "log", "show", name).stdout
    assert whole.strip(), "the simulated guest's console is empty"
    last = cloud.osc("console", "log", "show", "--lines", "1", name).stdout
    assert last.strip() == whole.strip().splitlines()[-1]
    token = cloud.token()
    bad = compute(
        cloud,
        token,
        "POST",
        f"/servers/{server['id']}/action",
        json={"os-getConsoleOutput": {"length": -2}},
    )
    assert bad.status_code == 400
    cloud.osc("server", "delete", "--wait", name)


def test_before_2_37_a_create_may_leave_out_networks(cloud: RunningCloud) -> None:
    """Nova before 2.37: no `networks` attaches the available network (the demo project's
    own `private`); a string there is refused, since `auto` and `none` came with 2.37."""
    token = cloud.token("demo", "stowage-demo", "demo")
    body: dict[str, Any] = {
        "server": {"name": unique("old-client"), "flavorRef": "1", "imageRef": _image_id(cloud)}
    }
    created = cloud.compute("POST", "/servers", version="2.1", token=token, json=body)
    assert created.status_code == 202, created.text
    server_id = created.json()["server"]["id"]
    body["server"]["networks"] = "auto"
    refused = cloud.compute("POST", "/servers", version="2.36", token=token, json=body)
    assert refused.status_code == 400
    cloud.osc("server", "delete", "--wait", server_id, cloud="stowage")


def test_from_2_37_a_create_must_say_networks(cloud: RunningCloud) -> None:
    """Nova's 2.37 schema makes `networks` required: a create without it is refused with 400
    and leaves no server behind (python-openstackclient and openstacksdk send "auto" or
    "none" themselves; Tempest sends "none")."""
    token = cloud.token("demo", "stowage-demo", "demo")
    name = unique("no-networks")
    body: dict[str, Any] = {
        "server": {"name": name, "flavorRef": "1", "imageRef": _image_id(cloud)}
    }
    for version in ("2.37", "2.96"):
        refused = cloud.compute("POST", "/servers", version=version, token=token, json=body)
        assert refused.status_code == 400, refused.text
        assert "'networks' is a required property" in refused.text
    listed = cloud.compute("GET", f"/servers?name={name}", version="2.96", token=token)
    assert listed.json()["servers"] == []
    body["server"]["networks"] = "none"
    created = cloud.compute("POST", "/servers", version="2.37", token=token, json=body)
    assert created.status_code == 202, created.text
    cloud.osc("server", "delete", "--wait", created.json()["server"]["id"], cloud="stowage")
