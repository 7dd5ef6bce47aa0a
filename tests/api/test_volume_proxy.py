"""Nova's volume proxy (/os-volumes, /os-snapshots, to 2.35) over HTTP as the admin, member
and reader personas: the block storage service's volumes in Nova's view, the volume API's
authorization (a reader changes nothing through the proxy), and 404 from 2.36."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
from tests.api.cloudproc import RunningCloud, boot_args
from tests.api.personas import Personas, personas
from tests.api.test_volumes import SDK_WARNINGS, Volume, unique

pytestmark = pytest.mark.filterwarnings(SDK_WARNINGS)

PROXY = "2.35"
VOLUME_KEYS = {
    "id",
    "status",
    "size",
    "availabilityZone",
    "createdAt",
    "attachments",
    "displayName",
    "displayDescription",
    "volumeType",
    "snapshotId",
    "metadata",
}
SNAPSHOT_KEYS = {
    "id",
    "volumeId",
    "status",
    "size",
    "createdAt",
    "displayName",
    "displayDescription",
}


class Proxy:
    """One persona's compute calls at a microversion, and its volume API calls."""

    def __init__(self, team: Personas, role: str) -> None:
        self.cloud = team.cloud
        self.token = team.token(role)
        self.cinder = Volume(team.cloud)
        self.cinder.token = self.token
        self.cinder.project_id = team.project["id"]

    def call(self, method: str, path: str, version: str = PROXY, **kw: Any) -> httpx.Response:
        return self.cloud.compute(method, path, version=version, token=self.token, **kw)


@pytest.fixture(scope="module")
def team(cloud: RunningCloud) -> Personas:
    return personas(cloud, "vproxy")


def gone(api: Volume, path: str) -> bool:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if api.call("GET", path).status_code == 404:
            return True
        time.sleep(0.2)
    return False


def make_volume(proxy: Proxy, name: str, size: int = 1) -> dict[str, Any]:
    made = proxy.call("POST", "/os-volumes", json={"volume": {"size": size, "display_name": name}})
    assert made.status_code == 200, made.text
    volume: dict[str, Any] = made.json()["volume"]
    return volume


def test_a_member_creates_lists_shows_and_deletes_through_the_proxy(team: Personas) -> None:
    member = Proxy(team, "member")
    name = unique("pvol")
    made = member.call(
        "POST",
        "/os-volumes",
        json={
            "volume": {
                "size": "2",
                "display_name": name,
                "display_description": "through nova",
                "metadata": {"tier": "gold"},
            }
        },
    )
    assert made.status_code == 200, made.text
    volume = made.json()["volume"]
    assert set(volume) == VOLUME_KEYS
    assert made.headers["location"].endswith(f"/compute/v2.1/os-volumes/{volume['id']}")
    assert volume["size"] == 2 and volume["displayName"] == name
    assert volume["displayDescription"] == "through nova"
    assert volume["metadata"] == {"tier": "gold"} and volume["attachments"] == [{}]
    assert volume["volumeType"] == "__DEFAULT__" and volume["availabilityZone"] == "nova"
    # The block storage service's volume: the volume API shows the same one.
    cinder = member.cinder.call("GET", f"/volumes/{volume['id']}").json()["volume"]
    assert (cinder["name"], cinder["size"], cinder["description"]) == (name, 2, "through nova")
    shown = member.call("GET", f"/os-volumes/{volume['id']}").json()["volume"]
    assert shown["status"] == cinder["status"] == "available"
    assert shown["createdAt"] == cinder["created_at"]
    for path in ("/os-volumes", "/os-volumes/detail"):
        listed = member.call("GET", path).json()["volumes"]
        assert name in {v["displayName"] for v in listed}
        assert all(set(v) == VOLUME_KEYS for v in listed)
    # Nova's limit and offset.
    other = make_volume(member, unique("pvol"))
    everything = [v["id"] for v in member.call("GET", "/os-volumes").json()["volumes"]]
    assert len(everything) >= 2
    first = member.call("GET", "/os-volumes", params={"limit": 1}).json()["volumes"]
    second = member.call("GET", "/os-volumes", params={"limit": 1, "offset": 1}).json()
    assert [v["id"] for v in first + second["volumes"]] == everything[:2]
    assert member.call("GET", "/os-volumes", params={"limit": "x"}).status_code == 400
    for doomed in (volume["id"], other["id"]):
        assert member.call("DELETE", f"/os-volumes/{doomed}").status_code == 202
        assert gone(member.cinder, f"/volumes/{doomed}")
    assert member.call("GET", f"/os-volumes/{volume['id']}").status_code == 404


def test_a_member_snapshots_through_the_proxy(team: Personas) -> None:
    member = Proxy(team, "member")
    volume = make_volume(member, unique("psnapvol"))
    name = unique("psnap")
    made = member.call(
        "POST",
        "/os-snapshots",
        json={
            "snapshot": {
                "volume_id": volume["id"],
                "display_name": name,
                "display_description": "by nova",
                "force": "false",
            }
        },
    )
    assert made.status_code == 200, made.text
    snap = made.json()["snapshot"]
    assert set(snap) == SNAPSHOT_KEYS
    assert (snap["volumeId"], snap["size"], snap["displayName"]) == (volume["id"], 1, name)
    cinder = member.cinder.call("GET", f"/snapshots/{snap['id']}").json()["snapshot"]
    assert (cinder["name"], cinder["description"], cinder["volume_id"]) == (
        name,
        "by nova",
        volume["id"],
    )
    shown = member.call("GET", f"/os-snapshots/{snap['id']}").json()["snapshot"]
    assert shown["status"] == "available"
    for path in ("/os-snapshots", "/os-snapshots/detail"):
        assert snap["id"] in {s["id"] for s in member.call("GET", path).json()["snapshots"]}
    # A volume with a snapshot cannot go (Cinder's refusal, Nova's 400).
    assert member.call("DELETE", f"/os-volumes/{volume['id']}").status_code == 400
    assert member.call("DELETE", f"/os-snapshots/{snap['id']}").status_code == 202
    assert gone(member.cinder, f"/snapshots/{snap['id']}")
    assert member.call("DELETE", f"/os-volumes/{volume['id']}").status_code == 202
    assert gone(member.cinder, f"/volumes/{volume['id']}")


def test_a_reader_reads_but_changes_nothing_through_the_proxy(team: Personas) -> None:
    member = Proxy(team, "member")
    reader = Proxy(team, "reader")
    volume = make_volume(member, unique("pread"))
    snap = member.call(
        "POST", "/os-snapshots", json={"snapshot": {"volume_id": volume["id"]}}
    ).json()["snapshot"]
    before = {v["id"] for v in member.cinder.call("GET", "/volumes").json()["volumes"]}
    # Reading is the reader's, as in the volume API.
    assert reader.call("GET", f"/os-volumes/{volume['id']}").status_code == 200
    assert volume["id"] in {v["id"] for v in reader.call("GET", "/os-volumes").json()["volumes"]}
    assert reader.call("GET", f"/os-snapshots/{snap['id']}").status_code == 200
    # The volume API refuses the reader's changes; so does the proxy, and nothing happens.
    assert reader.cinder.call("POST", "/volumes", json={"volume": {"size": 1}}).status_code == 403
    assert reader.cinder.call("DELETE", f"/volumes/{volume['id']}").status_code == 403
    created = reader.call("POST", "/os-volumes", json={"volume": {"size": 1}})
    assert created.status_code == 403, created.text
    assert created.json()["forbidden"]["code"] == 403
    assert reader.call("DELETE", f"/os-volumes/{volume['id']}").status_code == 403
    made_snap = reader.call("POST", "/os-snapshots", json={"snapshot": {"volume_id": volume["id"]}})
    assert made_snap.status_code == 403
    assert reader.call("DELETE", f"/os-snapshots/{snap['id']}").status_code == 403
    after = {v["id"] for v in member.cinder.call("GET", "/volumes").json()["volumes"]}
    assert after == before
    assert member.cinder.status(volume["id"]) == "available"
    snaps = member.cinder.call("GET", "/snapshots").json()["snapshots"]
    assert [s["id"] for s in snaps if s["volume_id"] == volume["id"]] == [snap["id"]]
    assert member.call("DELETE", f"/os-snapshots/{snap['id']}").status_code == 202
    assert gone(member.cinder, f"/snapshots/{snap['id']}")
    assert member.call("DELETE", f"/os-volumes/{volume['id']}").status_code == 202


def test_an_admin_sees_its_project_and_reaches_any_volume_by_id(
    cloud: RunningCloud, team: Personas
) -> None:
    member = Proxy(team, "member")
    admin_token = cloud.token()
    volume = make_volume(member, unique("padmin"))
    mine = cloud.compute("GET", "/os-volumes", version=PROXY, token=admin_token).json()
    # Nova's proxy lists the caller's project (Cinder's list without all_tenants).
    assert volume["id"] not in {v["id"] for v in mine["volumes"]}
    shown = cloud.compute("GET", f"/os-volumes/{volume['id']}", version=PROXY, token=admin_token)
    assert (
        shown.status_code == 200 and shown.json()["volume"]["displayName"] == volume["displayName"]
    )
    deleted = cloud.compute(
        "DELETE", f"/os-volumes/{volume['id']}", version=PROXY, token=admin_token
    )
    assert deleted.status_code == 202
    assert gone(member.cinder, f"/volumes/{volume['id']}")


def test_an_attached_volume_shows_its_server(cloud: RunningCloud, team: Personas) -> None:
    member = Proxy(team, "member")
    volume = make_volume(member, unique("pattach"))
    server = team.osc("member", *boot_args(unique("pserver")), "-f", "json")
    assert server.returncode == 0, server.stderr
    import json

    server_id = json.loads(server.stdout)["id"]
    attached = member.call(
        "POST",
        f"/servers/{server_id}/os-volume_attachments",
        json={"volumeAttachment": {"volumeId": volume["id"]}},
    )
    assert attached.status_code == 200, attached.text
    device = attached.json()["volumeAttachment"]["device"]
    deadline = time.monotonic() + 30
    while member.cinder.status(volume["id"]) != "in-use" and time.monotonic() < deadline:
        time.sleep(0.2)
    shown = member.call("GET", f"/os-volumes/{volume['id']}").json()["volume"]
    assert shown["status"] == "in-use"
    assert shown["attachments"] == [
        {"id": volume["id"], "volumeId": volume["id"], "serverId": server_id, "device": device}
    ]
    # An attached volume cannot be deleted (Cinder's 400, passed on by Nova).
    assert member.call("DELETE", f"/os-volumes/{volume['id']}").status_code == 400
    team.osc("member", "server", "delete", "--wait", server_id)
    deadline = time.monotonic() + 30
    while member.cinder.status(volume["id"]) != "available" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert member.call("GET", f"/os-volumes/{volume['id']}").json()["volume"]["attachments"] == [{}]
    assert member.call("DELETE", f"/os-volumes/{volume['id']}").status_code == 202


def test_the_proxy_takes_novas_bodies_only(team: Personas) -> None:
    member = Proxy(team, "member")
    for body in (
        {},
        {"volume": {}},
        {"volume": {"size": 0}},
        {"volume": {"size": "one"}},
        {"volume": {"size": 1, "name": "cinder's field, not nova's"}},
        {"volume": {"size": 1}, "extra": {}},
        {"volume": {"size": 1, "metadata": {"a": 1}}},
    ):
        response = member.call("POST", "/os-volumes", json=body)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["badRequest"]["code"] == 400
    for body in (
        {"snapshot": {}},
        {"snapshot": {"volume_id": "x", "force": "maybe"}},
        {"snapshot": {"volume_id": "x", "name": "cinder's"}},
    ):
        assert member.call("POST", "/os-snapshots", json=body).status_code == 400, body
    missing = member.call("POST", "/os-snapshots", json={"snapshot": {"volume_id": "no-such"}})
    assert missing.status_code == 404
    assert member.call("GET", "/os-volumes/no-such").status_code == 404
    assert member.call("GET", "/os-snapshots/no-such").status_code == 404
    assert member.call("DELETE", "/os-snapshots/no-such").status_code == 404
    # Past the volumes quota: Nova's 403 (OverQuota).
    too_big = member.call("POST", "/os-volumes", json={"volume": {"size": 100000}})
    assert too_big.status_code == 403, too_big.text


def test_the_proxy_is_gone_from_2_36(team: Personas) -> None:
    member = Proxy(team, "member")
    volume = make_volume(member, unique("pgone"))
    routes = (
        ("GET", "/os-volumes"),
        ("GET", "/os-volumes/detail"),
        ("GET", f"/os-volumes/{volume['id']}"),
        ("POST", "/os-volumes"),
        ("DELETE", f"/os-volumes/{volume['id']}"),
        ("GET", "/os-snapshots"),
        ("GET", "/os-snapshots/detail"),
        ("GET", "/os-snapshots/x"),
        ("POST", "/os-snapshots"),
        ("DELETE", "/os-snapshots/x"),
    )
    for version in ("2.36", "2.96"):
        for method, path in routes:
            body = {"volume": {"size": 1}} if method == "POST" else None
            response = member.call(method, path, version=version, json=body)
            assert response.status_code == 404, (version, method, path, response.text)
            assert response.json()["itemNotFound"]["code"] == 404
    # Nothing was made or deleted by those calls.
    assert member.cinder.status(volume["id"]) == "available"
    assert member.call("GET", "/os-volumes/detail", version="2.1").status_code == 200
    assert member.call("DELETE", f"/os-volumes/{volume['id']}").status_code == 202
