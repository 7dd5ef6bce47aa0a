"""Rescue and unrescue, changePassword and trigger_crash_dump on the simulated hypervisor,
through the openstack CLI and openstacksdk: each a real change of the simulated guest
(`/os-stowage-sim` shows what it was told), refused as Nova refuses in the wrong state."""

from __future__ import annotations

import hashlib
import uuid
from typing import Any

import httpx
from tests.api.cloudproc import IMAGE, RunningCloud
from tests.api.sdk import SDK_WARNINGS


def _image_id(cloud: RunningCloud) -> str:
    found = httpx.get(
        f"{cloud.base_url}/image/v2/images?name={IMAGE}", headers={"X-Auth-Token": cloud.token()}
    ).json()["images"]
    return str(found[0]["id"])


def _boot(cloud: RunningCloud, prefix: str, token: str | None = None) -> tuple[str, str]:
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    body = {"name": name, "flavorRef": "1", "imageRef": _image_id(cloud), "networks": "none"}
    created = cloud.compute("POST", "/servers", json={"server": body}, token=token)
    server_id = created.json()["server"]["id"]
    assert _server(cloud, server_id)["status"] == "ACTIVE"
    return name, str(server_id)


def _server(cloud: RunningCloud, server_id: str) -> dict[str, Any]:
    server: dict[str, Any] = cloud.compute("GET", f"/servers/{server_id}").json()["server"]
    return server


def guest(cloud: RunningCloud, server_id: str) -> dict[str, Any]:
    """What the simulated hypervisor records for the server's guest."""
    for host in cloud.compute("GET", "/os-stowage-sim").json()["hosts"]:
        if server_id in host["instances"]:
            found: dict[str, Any] = host["instances"][server_id]
            return found
    raise AssertionError(f"no simulated guest for {server_id}")


def _action(cloud: RunningCloud, server_id: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
    return cloud.compute("POST", f"/servers/{server_id}/action", json=body, **kw)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def test_rescue_and_unrescue_through_the_cli(cloud: RunningCloud) -> None:
    name, server_id = _boot(cloud, "rescue")
    other = cloud.osc_json(
        "image", "create", "--disk-format", "raw", "--container-format", "bare",
        "--file", "/dev/null", f"rescue-img-{uuid.uuid4().hex[:6]}",
    )  # fmt: skip
    cloud.osc("server", "rescue", "--image", other["id"], "--password", "s3cret", name)
    shown = _server(cloud, server_id)
    assert (shown["status"], shown["OS-EXT-STS:vm_state"]) == ("RESCUE", "rescued")
    assert shown["OS-EXT-STS:task_state"] is None
    seen = guest(cloud, server_id)
    assert seen["rescue_image"] == other["id"]
    assert seen["rescue_password_sha256"] == _digest("s3cret")
    assert seen["state"] == "running"
    console = cloud.osc("console", "log", "show", name).stdout
    assert f"booted rescue image {other['id']} with its own disk second" in console

    # What a rescued server refuses, as Nova's check_instance_state does.
    for body in (
        {"rescue": None},
        {"reboot": {"type": "HARD"}},
        {"os-stop": None},
        {"changePassword": {"adminPass": "x"}},
        {"createImage": {"name": "no"}},
        {"trigger_crash_dump": None},
    ):
        assert _action(cloud, server_id, body).status_code == 409, body

    cloud.osc("server", "unrescue", name)
    shown = _server(cloud, server_id)
    assert (shown["status"], shown["OS-EXT-STS:task_state"]) == ("ACTIVE", None)
    assert guest(cloud, server_id)["rescue_image"] is None
    assert _action(cloud, server_id, {"unrescue": None}).status_code == 409  # not rescued
    events = cloud.osc_json("server", "event", "list", name)
    assert {"rescue", "unrescue"} <= {e["Action"] for e in events}

    # Without an image the server's own rescues it; the answer carries a generated password.
    answer = _action(cloud, server_id, {"rescue": None})
    assert answer.status_code == 200, answer.text
    password = answer.json()["adminPass"]
    assert guest(cloud, server_id)["rescue_image"] == _image_id(cloud)
    assert guest(cloud, server_id)["rescue_password_sha256"] == _digest(password)
    assert _action(cloud, server_id, {"unrescue": None}).status_code == 202
    cloud.compute("DELETE", f"/servers/{server_id}")


def test_rescue_refusals(cloud: RunningCloud) -> None:
    member = cloud.token("demo", "stowage-demo", "demo")
    _, server_id = _boot(cloud, "norescue", member)
    bad = (
        {"rescue": {"adminPass": 1}},
        {"rescue": {"rescue_image_ref": "no-such-image"}},
        {"rescue": {"colour": "red"}},
        {"changePassword": {}},
        {"changePassword": {"adminPass": "x", "more": 1}},
        {"trigger_crash_dump": {"now": True}},
    )
    for body in bad:
        assert _action(cloud, server_id, body).status_code == 400, body
    assert (
        _action(cloud, server_id, {"trigger_crash_dump": None}, version="2.16").status_code == 404
    )
    # A server an admin locked refuses its owner ...
    assert _action(cloud, server_id, {"lock": None}).status_code == 202
    for body in ({"rescue": None}, {"changePassword": {"adminPass": "x"}}):
        refused = _action(cloud, server_id, body, token=member)
        assert refused.status_code == 409 and "locked" in refused.text, refused.text
    assert _action(cloud, server_id, {"unlock": None}).status_code == 202
    # ... and a stopped one refuses the password and the NMI, but can be rescued.
    assert _action(cloud, server_id, {"os-stop": None}).status_code == 202
    assert _server(cloud, server_id)["status"] == "SHUTOFF"
    assert _action(cloud, server_id, {"changePassword": {"adminPass": "x"}}).status_code == 409
    assert _action(cloud, server_id, {"trigger_crash_dump": None}).status_code == 409
    assert _action(cloud, server_id, {"rescue": None}).status_code == 200
    assert _server(cloud, server_id)["status"] == "RESCUE"
    assert guest(cloud, server_id)["state"] == "running"
    assert _action(cloud, server_id, {"unrescue": None}).status_code == 202
    assert _server(cloud, server_id)["status"] == "ACTIVE"
    cloud.compute("DELETE", f"/servers/{server_id}")


@SDK_WARNINGS
def test_change_password_and_crash_dump(cloud: RunningCloud, sdk: Any) -> None:
    name, server_id = _boot(cloud, "pw")
    cloud.osc("server", "set", "--password", "n3w-pass", name)
    assert guest(cloud, server_id)["admin_password_sha256"] == _digest("n3w-pass")
    sdk.compute.change_server_password(server_id, "other-pass")
    assert guest(cloud, server_id)["admin_password_sha256"] == _digest("other-pass")
    assert _server(cloud, server_id)["OS-EXT-STS:task_state"] is None

    cloud.osc("--os-compute-api-version", "2.17", "server", "dump", "create", name)
    assert guest(cloud, server_id)["nmis"] == 1
    sdk.compute.get_server(server_id).trigger_crash_dump(sdk.compute)
    assert guest(cloud, server_id)["nmis"] == 2
    assert "NMI received" in cloud.osc("console", "log", "show", name).stdout
    events = {e["Action"] for e in cloud.osc_json("server", "event", "list", name)}
    assert {"changePassword", "trigger_crash_dump"} <= events
    cloud.compute("DELETE", f"/servers/{server_id}")
