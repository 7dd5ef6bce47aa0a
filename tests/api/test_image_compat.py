"""Image v2 details Tempest and the clients rely on: the member_status filter, the member
schemas, an empty image id, and the refusals of what is not offered (import, tasks, stores)."""

from __future__ import annotations

from tests.api.cloudproc import RunningCloud
from tests.api.test_image import Glance, admin, member, unique  # noqa: F401 (fixtures)


def test_a_member_lists_a_pending_shared_image_by_member_status(
    cloud: RunningCloud,
    admin: Glance,  # noqa: F811
    member: Glance,  # noqa: F811
) -> None:
    image = cloud.osc_json("image", "create", "--shared", "--disk-format", "raw", unique("ms"))
    cloud.osc("image", "add", "project", image["id"], "demo")
    try:
        pending = cloud.osc_json(
            "image", "list", "--shared", "--member-status", "pending", cloud="stowage"
        )
        assert image["id"] in {i["ID"] for i in pending}
        accepted = cloud.osc_json(
            "image", "list", "--shared", "--member-status", "accepted", cloud="stowage"
        )
        assert image["id"] not in {i["ID"] for i in accepted}
        listed = member.get("/images", params={"visibility": "shared", "member_status": "all"})
        assert image["id"] in {i["id"] for i in listed.json()["images"]}
        bad = member.get("/images", params={"member_status": "maybe"})
        assert bad.status_code == 400
    finally:
        cloud.osc("image", "delete", image["id"])


def test_the_member_schemas(member: Glance) -> None:  # noqa: F811
    one = member.get("/schemas/member")
    assert one.status_code == 200
    assert one.json()["name"] == "member"
    assert one.json()["properties"]["status"]["enum"] == ["pending", "accepted", "rejected"]
    many = member.get("/schemas/members").json()
    assert many["name"] == "members"
    assert many["properties"]["members"]["items"]["name"] == "member"


def test_an_empty_image_id_is_not_found_rather_than_the_list(admin: Glance) -> None:  # noqa: F811
    shown = admin.get("/images/")
    assert shown.status_code == 404
    deleted = admin.delete("/images/")
    assert deleted.status_code == 404
    assert admin.get("/images").status_code == 200


def test_import_tasks_and_stores_are_refused_as_glance_without_them(
    cloud: RunningCloud,
    admin: Glance,  # noqa: F811
) -> None:
    info = admin.get("/info/import")
    assert info.status_code == 200
    assert info.json()["import-methods"]["value"] == []
    assert cloud.osc_json("image", "import", "info") == {"import-methods": []}

    image = admin.create(name=unique("imp"), disk_format="raw", container_format="bare")
    for method in ("glance-direct", "web-download", "copy-image"):
        refused = admin.post(f"/images/{image['id']}/import", {"method": {"name": method}})
        assert refused.status_code == 400
        assert f"Unknown import method name '{method}'" in refused.text
    assert admin.post(f"/images/{image['id']}/import", {}).status_code == 400
    staged = admin.put(
        f"/images/{image['id']}/stage",
        content=b"data",
        headers={"Content-Type": "application/octet-stream"},
    )
    assert staged.status_code == 404
    assert "'glance-direct' method is not available" in staged.text
    # Nothing of the refused import stuck to the image.
    assert admin.get(f"/images/{image['id']}").json()["status"] == "queued"

    cli = cloud.osc(
        "image",
        "import",
        image["id"],
        "--method",
        "web-download",
        "--uri",
        "http://example.com/x.img",
        check=False,
    )
    assert cli.returncode != 0

    assert admin.get("/info/stores").status_code == 404
    task = admin.post("/tasks", {"type": "import", "input": {}})
    assert task.status_code == 501
    admin.delete(f"/images/{image['id']}")
