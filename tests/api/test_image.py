"""Image v2 (glance): the real CLI creates, uploads, downloads, updates and deletes images."""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.api.cloudproc import RunningCloud

from stowage.services.cloud import CloudConfig
from stowage.services.images import bootstrap_images
from stowage.services.runtime import open_cloud

CIRROS = "cirros-0.6.2-x86_64-disk"
PATCH = {"Content-Type": "application/openstack-images-v2.1-json-patch"}


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


class Glance:
    """Raw image API calls with one user's token."""

    def __init__(self, cloud: RunningCloud, token: str) -> None:
        self.base = f"{cloud.base_url}/image/v2"
        self.headers = {"X-Auth-Token": token}

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return httpx.get(f"{self.base}{path}", headers=self.headers, **kw)

    def post(
        self, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> httpx.Response:
        return httpx.post(
            f"{self.base}{path}", headers={**self.headers, **(headers or {})}, json=body
        )

    def put(self, path: str, **kw: Any) -> httpx.Response:
        headers = {**self.headers, **kw.pop("headers", {})}
        return httpx.put(f"{self.base}{path}", headers=headers, **kw)

    def patch(self, path: str, ops: Any, content_type: str | None = None) -> httpx.Response:
        headers = {**self.headers, **PATCH}
        if content_type is not None:
            headers["Content-Type"] = content_type
        return httpx.patch(f"{self.base}{path}", headers=headers, json=ops)

    def delete(self, path: str) -> httpx.Response:
        return httpx.delete(f"{self.base}{path}", headers=self.headers)

    def create(self, **body: Any) -> dict[str, Any]:
        response = self.post("/images", body)
        assert response.status_code == 201, response.text
        image: dict[str, Any] = response.json()
        return image

    def upload(self, image_id: str, data: Any) -> httpx.Response:
        return self.put(
            f"/images/{image_id}/file",
            content=data,
            headers={"Content-Type": "application/octet-stream"},
        )


@pytest.fixture(scope="module")
def admin(cloud: RunningCloud) -> Glance:
    return Glance(cloud, cloud.token())


@pytest.fixture(scope="module")
def member(cloud: RunningCloud) -> Glance:
    return Glance(cloud, cloud.token("demo", "stowage-demo", "demo"))


def files_of(cloud: RunningCloud, image_id: str) -> list[str]:
    return [name for name in os.listdir(cloud.state_dir / "images") if image_id in name]


def test_the_bootstrap_cirros_image_is_public_active_and_has_real_bytes(
    cloud: RunningCloud, member: Glance
) -> None:
    shown = cloud.osc_json("image", "show", CIRROS, cloud="stowage")
    assert shown["status"] == "active"
    assert shown["visibility"] == "public"
    assert (shown["disk_format"], shown["container_format"]) == ("qcow2", "bare")
    data = member.get(f"/images/{shown['id']}/file").content
    assert len(data) == shown["size"] > 1024
    assert data[:4] == b"QFI\xfb"
    assert hashlib.md5(data).hexdigest() == shown["checksum"]
    body = member.get(f"/images/{shown['id']}").json()
    assert body["os_hash_algo"] == "sha512"
    assert hashlib.sha512(data).hexdigest() == body["os_hash_value"]
    assert body["virtual_size"] == 112 * 1024 * 1024
    assert body["self"] == f"/v2/images/{shown['id']}"
    assert body["file"] == f"/v2/images/{shown['id']}/file"


def test_create_upload_save_set_and_delete_through_the_cli(
    cloud: RunningCloud, tmp_path: Path
) -> None:
    name = unique("img")
    source = tmp_path / "disk.raw"
    payload = os.urandom(300_000)
    source.write_bytes(payload)
    created = cloud.osc_json(
        "image",
        "create",
        "--file",
        str(source),
        "--disk-format",
        "raw",
        "--container-format",
        "bare",
        name,
    )
    assert created["status"] == "active"
    assert created["size"] == len(payload)
    assert created["checksum"] == hashlib.md5(payload).hexdigest()
    assert created["visibility"] == "shared"
    assert files_of(cloud, created["id"]) == [created["id"]]

    out = tmp_path / "out.raw"
    cloud.osc("image", "save", "--file", str(out), name)
    assert out.read_bytes() == payload

    cloud.osc("image", "set", "--property", "flavour=vanilla", "--tag", "golden", name)
    shown = cloud.osc_json("image", "show", name)
    assert shown["properties"]["flavour"] == "vanilla"
    assert shown["tags"] == ["golden"]

    listed = {row["Name"] for row in cloud.osc_json("image", "list")}
    assert {name, CIRROS} <= listed
    cloud.osc("image", "delete", name)
    assert name not in {row["Name"] for row in cloud.osc_json("image", "list")}
    assert files_of(cloud, created["id"]) == []


def test_a_private_image_is_invisible_to_another_project(
    cloud: RunningCloud, tmp_path: Path
) -> None:
    source = tmp_path / "small.raw"
    source.write_bytes(b"private bytes")
    private = unique("admin-private")
    cloud.osc("image", "create", "--private", "--file", str(source), private)
    mine = unique("demo-own")
    cloud.osc("image", "create", "--file", str(source), mine, cloud="stowage")

    seen_by_member = {row["Name"] for row in cloud.osc_json("image", "list", cloud="stowage")}
    assert mine in seen_by_member
    assert CIRROS in seen_by_member
    assert private not in seen_by_member
    refused = cloud.osc("image", "show", private, cloud="stowage", check=False)
    assert refused.returncode != 0
    assert "No Image found" in refused.stderr

    seen_by_admin = {row["Name"] for row in cloud.osc_json("image", "list")}
    assert {private, mine} <= seen_by_admin

    public = cloud.osc("image", "create", "--public", unique("nope"), cloud="stowage", check=False)
    assert public.returncode != 0
    assert "publicize_image" in public.stderr


def test_an_aborted_upload_leaves_the_image_queued_and_no_file(
    cloud: RunningCloud, admin: Glance
) -> None:
    image = admin.create(name=unique("abort"), disk_format="raw", container_format="bare")
    assert image["status"] == "queued"
    seen: dict[str, Any] = {}

    def body() -> Iterator[bytes]:
        yield b"a" * 200_000
        time.sleep(0.3)
        seen["status"] = admin.get(f"/images/{image['id']}").json()["status"]
        seen["files"] = files_of(cloud, image["id"])
        yield b"b" * 200_000
        raise RuntimeError("the client gives up halfway")

    with pytest.raises(RuntimeError, match="gives up"):
        admin.upload(image["id"], body())
    assert seen["status"] == "saving"
    assert len(seen["files"]) == 1
    assert seen["files"][0].endswith(".part")

    deadline = time.monotonic() + 10
    status = "saving"
    while time.monotonic() < deadline:
        status = admin.get(f"/images/{image['id']}").json()["status"]
        if status == "queued" and not files_of(cloud, image["id"]):
            break
        time.sleep(0.1)
    assert status == "queued"
    assert files_of(cloud, image["id"]) == []
    assert admin.get(f"/images/{image['id']}/file").status_code == 204

    assert admin.upload(image["id"], b"complete").status_code == 204
    after = admin.get(f"/images/{image['id']}").json()
    assert (after["status"], after["size"]) == ("active", 8)
    assert admin.get(f"/images/{image['id']}/file").content == b"complete"
    assert admin.upload(image["id"], b"again").status_code == 409
    assert admin.delete(f"/images/{image['id']}").status_code == 204
    assert files_of(cloud, image["id"]) == []


def test_list_filters_the_in_operator_sorting_and_paging(admin: Glance) -> None:
    tag = unique("batch")
    made = [
        admin.create(name=f"{tag}-{letter}", tags=[tag], visibility="private")
        for letter in ("c", "a", "b")
    ]
    ids = [image["id"] for image in made]

    both = admin.get("/images", params={"id": f"in:{ids[0]},{ids[2]}"}).json()["images"]
    assert {image["id"] for image in both} == {ids[0], ids[2]}
    by_name = admin.get("/images", params={"name": f'in:"{tag}-a",{tag}-b'}).json()["images"]
    assert sorted(image["name"] for image in by_name) == [f"{tag}-a", f"{tag}-b"]

    ordered = admin.get("/images", params={"tag": tag, "sort": "name:asc"}).json()["images"]
    assert [image["name"] for image in ordered] == [f"{tag}-a", f"{tag}-b", f"{tag}-c"]
    newest_first = admin.get("/images", params={"tag": tag}).json()["images"]
    assert [image["id"] for image in newest_first] == list(reversed(ids))

    names, url, pages = [], "/images", 0
    params: dict[str, Any] | None = {"tag": tag, "limit": 1, "sort_key": "name", "sort_dir": "asc"}
    while url:
        page = admin.get(url, params=params).json()
        names += [image["name"] for image in page["images"]]
        url = page.get("next", "").removeprefix("/v2")
        params, pages = None, pages + 1
    assert names == [f"{tag}-a", f"{tag}-b", f"{tag}-c"]
    assert pages == 4  # three full pages, then an empty one

    queued = admin.get("/images", params={"tag": tag, "status": "queued"}).json()["images"]
    assert len(queued) == 3
    assert admin.get("/images", params={"tag": tag, "status": "active"}).json()["images"] == []
    bad = admin.get("/images", params={"marker": str(uuid.uuid4())})
    assert bad.status_code == 400
    assert bad.json()["title"] == "Bad Request"
    assert admin.get("/images", params={"sort_key": "nonsense"}).status_code == 400
    assert admin.get("/images", params={"limit": "-1"}).status_code == 400


def test_patch_tags_actions_and_policies(admin: Glance, member: Glance) -> None:
    image = admin.create(name=unique("patch"), visibility="public", disk_format="raw")
    path = f"/images/{image['id']}"

    wrong_type = admin.patch(path, [], content_type="application/json")
    assert wrong_type.status_code == 415
    read_only = admin.patch(path, [{"op": "replace", "path": "/status", "value": "active"}])
    assert read_only.status_code == 403, read_only.text
    assert read_only.json() == {
        "code": "403 Forbidden",
        "title": "Forbidden",
        "message": "Attribute 'status' is read-only.",
    }
    missing = admin.patch(path, [{"op": "remove", "path": "/nothing-here"}])
    assert missing.status_code == 409
    bad_value = admin.patch(path, [{"op": "add", "path": "/min_ram", "value": "lots"}])
    assert bad_value.status_code == 400
    assert "min_ram" in bad_value.json()["message"]

    changed = admin.patch(
        path,
        [
            {"op": "replace", "path": "/name", "value": image["name"] + "-renamed"},
            {"op": "add", "path": "/hw_disk_bus", "value": "scsi"},
            {"op": "add", "path": "/tags", "value": ["x", "y"]},
            {"op": "replace", "path": "/container_format", "value": "bare"},
        ],
    )
    assert changed.status_code == 200, changed.text
    body = changed.json()
    assert body["name"].endswith("-renamed")
    assert body["hw_disk_bus"] == "scsi"
    assert body["tags"] == ["x", "y"]
    half = admin.patch(
        path,
        [
            {"op": "replace", "path": "/name", "value": "never-applied"},
            {"op": "replace", "path": "/id", "value": str(uuid.uuid4())},
        ],
    )
    assert half.status_code == 403
    assert admin.get(path).json()["name"].endswith("-renamed")

    assert admin.put(f"{path}/tags/z").status_code == 204
    assert admin.delete(f"{path}/tags/x").status_code == 204
    assert admin.delete(f"{path}/tags/x").status_code == 404
    assert admin.get(path).json()["tags"] == ["y", "z"]

    assert member.get(path).status_code == 200
    assert member.patch(path, [{"op": "add", "path": "/k", "value": "v"}]).status_code == 403
    assert member.delete(path).status_code == 403
    assert member.post(f"{path}/actions/deactivate").status_code == 403

    assert admin.upload(image["id"], b"payload").status_code == 204
    assert admin.post(f"{path}/actions/deactivate").status_code == 204
    assert admin.get(path).json()["status"] == "deactivated"
    assert member.get(f"{path}/file").status_code == 403
    assert admin.get(f"{path}/file").content == b"payload"
    assert admin.post(f"{path}/actions/reactivate").status_code == 204
    assert member.get(f"{path}/file").content == b"payload"

    protect = admin.patch(path, [{"op": "replace", "path": "/protected", "value": True}])
    assert protect.status_code == 200
    assert admin.delete(path).status_code == 403
    admin.patch(path, [{"op": "replace", "path": "/protected", "value": False}])
    assert admin.delete(path).status_code == 204
    assert admin.get(path).status_code == 404


def test_create_refuses_bad_input_without_leaving_anything(admin: Glance) -> None:
    name = unique("refused")
    for body, status, word in (
        ({"name": name, "disk_format": "floppy"}, 400, "disk_format"),
        ({"name": name, "visibility": "everyone"}, 400, "visibility"),
        ({"name": name, "min_disk": -1}, 400, "min_disk"),
        ({"name": name, "size": 5}, 403, "size"),
        ({"name": name, "os_glance_x": "1"}, 403, "os_glance_x"),
        ({"name": name, "custom": 7}, 400, "custom"),
        ({"name": name, "id": "not-a-uuid"}, 400, "id"),
    ):
        response = admin.post("/images", body)
        assert response.status_code == status, (body, response.text)
        assert word in response.json()["message"]
    assert admin.get("/images", params={"name": name}).json()["images"] == []
    image_id = str(uuid.uuid4())
    admin.create(id=image_id, name=name)
    assert admin.post("/images", {"id": image_id, "name": name}).status_code == 409
    assert admin.get("/images/not-an-image").status_code == 404


def test_the_schemas_clients_fetch(admin: Glance) -> None:
    image = admin.get("/schemas/image").json()
    assert image["name"] == "image"
    assert "visibility" in image["properties"]
    assert image["additionalProperties"] == {"type": "string"}
    images = admin.get("/schemas/images").json()
    assert images["name"] == "images"
    assert images["properties"]["images"]["items"]["name"] == "image"


def test_bootstrap_images_is_idempotent(tmp_path: Path) -> None:
    cloud = open_cloud(CloudConfig(state_dir=tmp_path / "state"))
    try:
        admin_project = next(d.id for d in cloud.objects.list("project") if d.name == "admin")
        bootstrap_images(cloud, admin_project)
        cirros = [d.body for d in cloud.objects.list("image") if d.name == CIRROS]
        assert len(cirros) == 1
        assert cirros[0]["status"] == "active"
        # The stored document is glance's shape: other services read properties at top level.
        assert cirros[0]["hw_rng_model"] == "virtio"
        assert cirros[0]["file"] == f"/v2/images/{cirros[0]['id']}/file"
        assert os.listdir(tmp_path / "state" / "images") == [cirros[0]["id"]]
    finally:
        cloud.ledger.close()


def test_a_shared_image_reaches_a_member_project_once_it_accepts(cloud: RunningCloud) -> None:
    """Glance's image members through the CLI: owner shares, member sees, accepts, lists."""
    name = unique("shared")
    image = cloud.osc_json("image", "create", "--shared", "--disk-format", "raw", name)
    demo = cloud.osc_json("project", "show", "demo")["id"]
    private = cloud.osc_json("image", "create", "--private", "--disk-format", "raw", unique("p"))

    added = cloud.osc_json("image", "add", "project", name, "demo")
    assert (added["member_id"], added["status"]) == (demo, "pending")
    members = cloud.osc_json("image", "member", "list", name)
    assert [(m["Member ID"], m["Status"]) for m in members] == [(demo, "pending")]
    again = cloud.osc("image", "add", "project", name, "demo", check=False)
    assert again.returncode != 0 and "409" in again.stderr
    refused = cloud.osc("image", "add", "project", private["id"], "demo", check=False)
    assert refused.returncode != 0 and "403" in refused.stderr  # only shared images

    # The member sees it by id at once, but lists it only after accepting.
    assert cloud.osc_json("image", "show", image["id"], cloud="stowage")["name"] == name
    listed = cloud.osc_json("image", "list", cloud="stowage")
    assert image["id"] not in {i["ID"] for i in listed}
    owner_says = cloud.osc("image", "set", "--accept", image["id"], check=False)
    assert owner_says.returncode != 0  # only the member itself accepts
    cloud.osc("image", "set", "--accept", image["id"], cloud="stowage")
    listed = cloud.osc_json("image", "list", cloud="stowage")
    assert image["id"] in {i["ID"] for i in listed}
    members = cloud.osc_json("image", "member", "list", name)
    assert [m["Status"] for m in members] == ["accepted"]

    cloud.osc("image", "remove", "project", name, "demo")
    gone = cloud.osc("image", "show", image["id"], cloud="stowage", check=False)
    assert gone.returncode != 0
    cloud.osc("image", "delete", name, private["id"])
