"""Image v2 metadata definitions: namespaces, objects, properties, tags and resource-type
associations through the real CLI and plain HTTP, with Glance's policies and protection."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.api.cloudproc import RunningCloud
from tests.api.test_image import Glance, admin, member, unique  # noqa: F401 (fixtures)

from stowage.services.cloud import CloudConfig
from stowage.services.metadefs import DEFAULT_RESOURCE_TYPES
from stowage.services.runtime import open_cloud

NS = "/metadefs/namespaces"


def test_a_namespace_through_the_cli_is_protected_until_unprotected(cloud: RunningCloud) -> None:
    name = unique("ns")
    created = cloud.osc_json(
        "image", "metadef", "namespace", "create", "--public", "--protected",
        "--display-name", "Tempest-like", "--description", "Made by a test", name,
    )  # fmt: skip
    assert (created["namespace"], created["visibility"], created["protected"]) == (
        name,
        "public",
        True,
    )
    listed = cloud.osc_json("image", "metadef", "namespace", "list")
    assert name in {n["namespace"] for n in listed}
    shown = cloud.osc_json("image", "metadef", "namespace", "show", name)
    assert shown["display_name"] == "Tempest-like"
    refused = cloud.osc("image", "metadef", "namespace", "delete", name, check=False)
    assert refused.returncode != 0
    assert cloud.osc_json("image", "metadef", "namespace", "show", name)["namespace"] == name

    cloud.osc("image", "metadef", "namespace", "set", "--unprotected", "--private", name)
    shown = cloud.osc_json("image", "metadef", "namespace", "show", name)
    assert (shown["protected"], shown["visibility"]) == (False, "private")
    cloud.osc("image", "metadef", "namespace", "delete", name)
    gone = cloud.osc("image", "metadef", "namespace", "show", name, check=False)
    assert gone.returncode != 0


def test_objects_properties_and_associations_through_the_cli(
    cloud: RunningCloud,
    admin: Glance,  # noqa: F811
) -> None:
    name = unique("ns")
    cloud.osc("image", "metadef", "namespace", "create", "--public", name)
    types = {t["Name"] for t in cloud.osc_json("image", "metadef", "resource", "type", "list")}
    assert {"OS::Glance::Image", "OS::Nova::Flavor"} <= types

    cloud.osc("image", "metadef", "resource", "type", "association", "create", name,
              "OS::Nova::Flavor", "--properties-target", "flavor")  # fmt: skip
    associations = cloud.osc_json(
        "image", "metadef", "resource", "type", "association", "list", name
    )
    assert [a["Name"] for a in associations] == ["OS::Nova::Flavor"]

    obj = cloud.osc_json("image", "metadef", "object", "create", "--namespace", name, "cpu")
    assert obj["name"] == "cpu"
    cloud.osc("image", "metadef", "object", "update", name, "cpu", "--name", "cpu-policy")
    objects = cloud.osc_json("image", "metadef", "object", "list", name)
    assert [o["name"] for o in objects] == ["cpu-policy"]

    schema = json.dumps({"enum": ["dedicated", "shared"], "description": "CPU pinning"})
    prop = cloud.osc_json(
        "image", "metadef", "property", "create", "--name", "hw_cpu_policy",
        "--title", "CPU policy", "--type", "string", "--schema", schema, name,
    )  # fmt: skip
    assert (prop["name"], prop["title"]) == ("hw_cpu_policy", "CPU policy")
    shown = cloud.osc_json("image", "metadef", "property", "show", name, "hw_cpu_policy")
    assert shown["enum"] == ["dedicated", "shared"]

    # The namespace shows what it holds.
    body = admin.get(f"{NS}/{name}").json()
    assert [(a["name"], a["properties_target"]) for a in body["resource_type_associations"]] == [
        ("OS::Nova::Flavor", "flavor")
    ]
    assert [o["name"] for o in body["objects"]] == ["cpu-policy"]
    assert body["properties"]["hw_cpu_policy"]["title"] == "CPU policy"

    cloud.osc("image", "metadef", "property", "delete", name, "hw_cpu_policy")
    cloud.osc("image", "metadef", "object", "delete", name, "cpu-policy")
    cloud.osc("image", "metadef", "resource", "type", "association", "delete", name,
              "OS::Nova::Flavor")  # fmt: skip
    assert cloud.osc_json("image", "metadef", "object", "list", name) == []
    assert cloud.osc_json("image", "metadef", "property", "list", name) == []
    cloud.osc("image", "metadef", "namespace", "delete", name)


def test_tags_replace_append_rename_and_clear(admin: Glance) -> None:  # noqa: F811
    name = unique("ns")
    assert admin.post(NS, {"namespace": name}).status_code == 201
    tags = f"{NS}/{name}/tags"
    made = admin.post(tags, {"tags": [{"name": "a"}, {"name": "b"}]})
    assert made.status_code == 201
    assert [t["name"] for t in made.json()["tags"]] == ["a", "b"]
    # A POST replaces the tags; with X-Openstack-Append it adds to them.
    admin.post(tags, {"tags": [{"name": "c"}]})
    assert [t["name"] for t in admin.get(tags).json()["tags"]] == ["c"]
    appended = admin.post(tags, {"tags": [{"name": "d"}]}, headers={"X-Openstack-Append": "True"})
    assert appended.status_code == 201
    assert [t["name"] for t in admin.get(tags).json()["tags"]] == ["c", "d"]
    duplicate = admin.post(tags, {"tags": [{"name": "e"}, {"name": "e"}]})
    assert duplicate.status_code == 409

    assert admin.post(f"{tags}/f").status_code == 201
    assert admin.post(f"{tags}/f").status_code == 409
    renamed = admin.put(f"{tags}/f", json={"name": "g"})
    assert renamed.status_code == 200 and renamed.json()["name"] == "g"
    assert admin.get(f"{tags}/f").status_code == 404
    assert admin.get(f"{tags}/g").json()["name"] == "g"
    assert admin.delete(f"{tags}/g").status_code == 204
    assert admin.delete(tags).status_code == 204
    assert admin.get(tags).json()["tags"] == []
    assert admin.delete(f"{NS}/{name}").status_code == 204


def test_writes_are_for_admins_and_private_namespaces_for_their_owner(
    admin: Glance,  # noqa: F811
    member: Glance,  # noqa: F811
) -> None:
    public, private = unique("pub"), unique("priv")
    assert member.post(NS, {"namespace": public}).status_code == 403
    assert admin.post(NS, {"namespace": public, "visibility": "public"}).status_code == 201
    assert admin.post(NS, {"namespace": private}).status_code == 201
    assert admin.post(NS, {"namespace": public}).status_code == 409

    listed = {n["namespace"] for n in member.get(NS).json()["namespaces"]}
    assert public in listed and private not in listed
    assert member.get(f"{NS}/{private}").status_code == 404
    assert member.get(f"{NS}/{public}").status_code == 200
    assert member.post(f"{NS}/{public}/objects", {"name": "o"}).status_code == 403
    assert member.post(f"{NS}/{public}/tags/t").status_code == 403
    assert member.delete(f"{NS}/{public}").status_code == 403
    assert member.put(f"{NS}/{public}", json={"namespace": public}).status_code == 403
    # A property needs a title and a known type.
    bad = admin.post(f"{NS}/{public}/properties", {"name": "p", "type": "string"})
    assert bad.status_code == 400
    bad = admin.post(f"{NS}/{public}/properties", {"name": "p", "title": "P", "type": "text"})
    assert bad.status_code == 400
    assert admin.post(NS, {"namespace": unique("x"), "visibility": "shared"}).status_code == 400
    for ns in (public, private):
        assert admin.delete(f"{NS}/{ns}").status_code == 204


def test_a_rename_keeps_the_contents_and_refuses_a_taken_name(admin: Glance) -> None:  # noqa: F811
    old, new, taken = unique("old"), unique("new"), unique("taken")
    admin.post(NS, {"namespace": old, "visibility": "public", "objects": [{"name": "o"}]})
    admin.post(NS, {"namespace": taken})
    clash = admin.put(f"{NS}/{old}", json={"namespace": taken, "visibility": "public"})
    assert clash.status_code == 409
    renamed = admin.put(f"{NS}/{old}", json={"namespace": new, "visibility": "public"})
    assert renamed.status_code == 200 and renamed.json()["namespace"] == new
    assert admin.get(f"{NS}/{old}").status_code == 404
    assert [o["name"] for o in admin.get(f"{NS}/{new}/objects").json()["objects"]] == ["o"]
    for ns in (new, taken):
        assert admin.delete(f"{NS}/{ns}").status_code == 204


def test_a_show_for_a_resource_type_prefixes_the_property_names(admin: Glance) -> None:  # noqa: F811
    name = unique("pre")
    made = admin.post(
        NS,
        {
            "namespace": name,
            "resource_type_associations": [{"name": "OS::Nova::Flavor", "prefix": "hw:"}],
            "properties": {"cpu_policy": {"title": "CPU policy", "type": "string"}},
            "objects": [
                {"name": "o", "properties": {"mem": {"title": "Memory", "type": "integer"}}}
            ],
        },
    )
    assert made.status_code == 201, made.text
    plain = admin.get(f"{NS}/{name}").json()
    assert list(plain["properties"]) == ["cpu_policy"]
    flavor = admin.get(f"{NS}/{name}", params={"resource_type": "OS::Nova::Flavor"}).json()
    assert list(flavor["properties"]) == ["hw:cpu_policy"]
    assert list(flavor["objects"][0]["properties"]) == ["hw:mem"]
    other = admin.get(f"{NS}/{name}", params={"resource_type": "OS::Glance::Image"}).json()
    assert list(other["properties"]) == ["cpu_policy"]
    assert admin.delete(f"{NS}/{name}").status_code == 204


def test_a_protected_namespace_keeps_what_it_holds(admin: Glance) -> None:  # noqa: F811
    name = unique("prot")
    admin.post(NS, {"namespace": name, "protected": True, "tags": [{"name": "t"}]})
    admin.post(f"{NS}/{name}/objects", {"name": "o"})
    assert admin.delete(f"{NS}/{name}/objects/o").status_code == 403
    assert admin.delete(f"{NS}/{name}/tags/t").status_code == 403
    assert admin.delete(f"{NS}/{name}/tags").status_code == 403
    assert admin.delete(f"{NS}/{name}").status_code == 403
    admin.put(f"{NS}/{name}", json={"namespace": name, "protected": False})
    assert admin.delete(f"{NS}/{name}/objects/o").status_code == 204
    assert admin.delete(f"{NS}/{name}").status_code == 204


def test_concurrent_tag_additions_are_all_kept(admin: Glance) -> None:  # noqa: F811
    name = unique("race")
    admin.post(NS, {"namespace": name})
    with ThreadPoolExecutor(max_workers=8) as pool:
        codes = list(
            pool.map(lambda i: admin.post(f"{NS}/{name}/tags/t{i}").status_code, range(16))
        )
    assert codes == [201] * 16
    names = {t["name"] for t in admin.get(f"{NS}/{name}/tags").json()["tags"]}
    assert names == {f"t{i}" for i in range(16)}
    admin.delete(f"{NS}/{name}")


def test_the_metadef_schemas(member: Glance) -> None:  # noqa: F811
    names = {
        "namespace": "namespace",
        "namespaces": "namespaces",
        "resource_type": "resource_type_association",
        "resource_types": "resource_type_associations",
        "object": "object",
        "objects": "objects",
        "property": "property",
        "properties": "properties",
        "tag": "tag",
        "tags": "tags",
    }
    for path, name in names.items():
        schema = member.get(f"/schemas/metadefs/{path}")
        assert schema.status_code == 200, path
        assert schema.json()["name"] == name
    assert "namespace" in member.get("/schemas/metadefs/namespace").json()["required"]
    assert member.get("/schemas/metadefs/nothing").status_code == 404


def test_an_older_cloud_gets_the_resource_types_at_its_next_start(tmp_path: Path) -> None:
    config = CloudConfig(state_dir=tmp_path / "state")
    cloud = open_cloud(config)
    try:
        for doc in cloud.objects.list("metadef_resource_type"):
            cloud.objects.delete("metadef_resource_type", doc.id)
    finally:
        cloud.ledger.close()
    cloud = open_cloud(config)
    try:
        names = [doc.id for doc in cloud.objects.list("metadef_resource_type")]
        assert sorted(names) == sorted(DEFAULT_RESOURCE_TYPES)
    finally:
        cloud.ledger.close()
