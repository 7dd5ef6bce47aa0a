"""Compute APIs that Tempest and the clients call beside the core ones: server metadata, tags,
addresses, diagnostics, the image and security group proxies, quota classes, usage, hosts,
extensions and versions; through the real CLI where it has a command, else exact HTTP checks."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
from tests.api.cloudproc import IMAGE, RunningCloud

MEMBER = ("demo", "stowage-demo", "demo")


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def boot_on_private(cloud: RunningCloud, name: str) -> str:
    """A server with one port on the shared network "private"; its id."""
    args = ("--flavor", "m1.tiny", "--image", IMAGE, "--network", "private", "--wait", name)
    return str(cloud.osc_json("server", "create", *args)["id"])


def test_server_metadata_is_set_merged_shown_and_removed(cloud: RunningCloud) -> None:
    server = cloud.boot(unique("meta"), "--property", "a=1")
    sid = server["id"]
    cloud.osc("server", "set", "--property", "b=2", sid)
    assert cloud.compute("GET", f"/servers/{sid}/metadata").json() == {
        "metadata": {"a": "1", "b": "2"}
    }
    cloud.osc("server", "unset", "--property", "a", sid)
    assert cloud.osc_json("server", "show", sid)["properties"] == {"b": "2"}
    item = cloud.compute("GET", f"/servers/{sid}/metadata/b")
    assert item.json() == {"meta": {"b": "2"}}
    assert cloud.compute("GET", f"/servers/{sid}/metadata/a").status_code == 404
    replaced = cloud.compute("PUT", f"/servers/{sid}/metadata", json={"metadata": {"c": "3"}})
    assert replaced.json() == {"metadata": {"c": "3"}}
    mismatch = cloud.compute("PUT", f"/servers/{sid}/metadata/x", json={"meta": {"y": "1"}})
    assert mismatch.status_code == 400
    blank = cloud.compute("POST", f"/servers/{sid}/metadata", json={"metadata": {"": "v"}})
    assert blank.status_code == 400
    too_many = {f"k{i}": "v" for i in range(129)}
    over = cloud.compute("POST", f"/servers/{sid}/metadata", json={"metadata": too_many})
    assert over.status_code == 403
    cloud.osc("server", "delete", "--wait", sid)


def test_a_create_with_a_blank_or_long_metadata_key_is_refused(cloud: RunningCloud) -> None:
    image = cloud.osc_json("image", "show", IMAGE)["id"]
    for metadata in ({"": "v"}, {"k" * 256: "v"}):
        body = {
            "server": {
                "name": unique("bad-meta"),
                "flavorRef": "1",
                "imageRef": image,
                "networks": "none",
                "metadata": metadata,
            }
        }
        response = cloud.compute("POST", "/servers", json=body)
        assert response.status_code == 400, response.text


def test_server_tags_follow_nova_status_codes(cloud: RunningCloud) -> None:
    sid = cloud.boot(unique("tags"))["id"]
    cloud.osc("--os-compute-api-version", "2.26", "server", "set", "--tag", "red", sid)
    added = cloud.compute("PUT", f"/servers/{sid}/tags/blue")
    assert added.status_code == 201
    assert added.headers["location"].endswith(f"/servers/{sid}/tags/blue")
    assert cloud.compute("PUT", f"/servers/{sid}/tags/blue").status_code == 204
    assert cloud.compute("GET", f"/servers/{sid}/tags").json() == {"tags": ["red", "blue"]}
    assert cloud.compute("GET", f"/servers/{sid}/tags/red").status_code == 204
    assert cloud.compute("DELETE", f"/servers/{sid}/tags/red").status_code == 204
    assert cloud.compute("GET", f"/servers/{sid}/tags/red").status_code == 404
    replaced = cloud.compute("PUT", f"/servers/{sid}/tags", json={"tags": ["x", "y"]})
    assert replaced.json() == {"tags": ["x", "y"]}
    assert cloud.compute("DELETE", f"/servers/{sid}/tags").status_code == 204
    assert cloud.compute("GET", f"/servers/{sid}/tags", version="2.25").status_code == 404
    cloud.osc("server", "delete", "--wait", sid)


def test_server_ips_and_diagnostics(cloud: RunningCloud) -> None:
    sid = boot_on_private(cloud, unique("ips"))
    addresses = cloud.compute("GET", f"/servers/{sid}/ips").json()["addresses"]
    assert list(addresses) == ["private"]
    assert set(addresses["private"][0]) == {"version", "addr"}
    by_network = cloud.compute("GET", f"/servers/{sid}/ips/private").json()
    assert by_network == {"private": addresses["private"]}
    assert cloud.compute("GET", f"/servers/{sid}/ips/nowhere").status_code == 404
    diagnostics = cloud.compute("GET", f"/servers/{sid}/diagnostics", version="2.48").json()
    assert diagnostics["state"] == "running"
    assert diagnostics["num_nics"] == 1
    member = cloud.token(*MEMBER)
    assert cloud.compute("GET", f"/servers/{sid}/diagnostics", token=member).status_code == 403
    cloud.osc("server", "delete", "--wait", sid)


def test_update_and_rebuild_answer_with_the_narrow_view_below_2_75(cloud: RunningCloud) -> None:
    server = cloud.boot(unique("views"))
    sid = server["id"]
    body = {"server": {"name": unique("renamed")}}
    narrow = cloud.compute("PUT", f"/servers/{sid}", json=body, version="2.1").json()["server"]
    assert "OS-EXT-STS:vm_state" not in narrow
    assert "security_groups" not in narrow
    full = cloud.compute("PUT", f"/servers/{sid}", json=body, version="2.75").json()["server"]
    assert "OS-EXT-STS:vm_state" in full
    listed = cloud.compute("GET", "/servers/detail", version="2.96").json()["servers"]
    assert all("server_groups" not in s for s in listed)
    shown = cloud.compute("GET", f"/servers/{sid}", version="2.96").json()["server"]
    assert "server_groups" in shown
    assert cloud.compute("GET", "/servers", params={"limit": "0"}).json() == {"servers": []}
    cloud.osc("server", "delete", "--wait", sid)


def test_the_image_proxy_shows_images_and_their_metadata_until_2_35(cloud: RunningCloud) -> None:
    created = httpx.post(
        f"{cloud.base_url}/image/v2/images",
        headers={"X-Auth-Token": cloud.token()},
        json={"name": unique("proxy"), "disk_format": "raw", "container_format": "bare"},
    )
    iid = created.json()["id"]  # queued: no data yet
    shown = cloud.compute("GET", f"/images/{iid}", version="2.1").json()["image"]
    assert shown["status"] == "SAVING"
    assert shown["progress"] == 25
    assert cloud.compute("GET", f"/images/{iid}", version="2.36").status_code == 404
    listed = cloud.compute("GET", "/images/detail", version="2.1").json()["images"]
    assert iid in [i["id"] for i in listed]
    set_meta = cloud.compute(
        "POST", f"/images/{iid}/metadata", version="2.1", json={"metadata": {"os_distro": "x"}}
    )
    assert set_meta.json()["metadata"] == {"os_distro": "x"}
    assert cloud.osc_json("image", "show", iid)["properties"]["os_distro"] == "x"
    item = cloud.compute("GET", f"/images/{iid}/metadata/os_distro", version="2.1")
    assert item.json() == {"meta": {"os_distro": "x"}}
    gone = cloud.compute("DELETE", f"/images/{iid}/metadata/os_distro", version="2.1")
    assert gone.status_code == 204
    assert cloud.compute("DELETE", f"/images/{iid}", version="2.1").status_code == 204
    assert cloud.osc("image", "show", iid, check=False).returncode != 0


def test_the_security_group_proxy_maps_neutron_groups(cloud: RunningCloud) -> None:
    token = cloud.token(*MEMBER)
    name = unique("sg")
    created = cloud.compute(
        "POST",
        "/os-security-groups",
        version="2.1",
        token=token,
        json={"security_group": {"name": name, "description": "d"}},
    ).json()["security_group"]
    assert created["rules"] == []
    assert cloud.osc_json("security group", "show", created["id"], cloud="stowage")["name"] == name
    rule = cloud.compute(
        "POST",
        "/os-security-group-rules",
        version="2.1",
        token=token,
        json={
            "security_group_rule": {
                "parent_group_id": created["id"],
                "ip_protocol": "tcp",
                "from_port": 22,
                "to_port": 22,
                "cidr": "10.0.0.0/8",
            }
        },
    ).json()["security_group_rule"]
    assert rule["ip_range"] == {"cidr": "10.0.0.0/8"}
    assert (rule["from_port"], rule["to_port"]) == (22, 22)
    duplicate = cloud.compute(
        "POST",
        "/os-security-group-rules",
        version="2.1",
        token=token,
        json={
            "security_group_rule": {
                "parent_group_id": created["id"],
                "ip_protocol": "tcp",
                "from_port": 22,
                "to_port": 22,
                "cidr": "10.0.0.0/8",
            }
        },
    )
    assert duplicate.status_code == 400
    groups = cloud.compute("GET", "/os-security-groups", version="2.1", token=token).json()
    default = next(g for g in groups["security_groups"] if g["name"] == "default")
    refused = cloud.compute(
        "DELETE", f"/os-security-groups/{default['id']}", version="2.1", token=token
    )
    assert refused.status_code == 400
    invalid = cloud.compute("GET", "/os-security-groups/not-a-uuid", version="2.1", token=token)
    assert invalid.status_code == 400
    gone = cloud.compute(
        "DELETE", f"/os-security-groups/{created['id']}", version="2.1", token=token
    )
    assert gone.status_code == 202
    assert cloud.compute("GET", "/os-security-groups", version="2.36").status_code == 404


def test_quota_classes_change_every_projects_defaults(cloud: RunningCloud) -> None:
    shown = cloud.compute("GET", "/os-quota-class-sets/default", version="2.1").json()
    assert "networks" not in shown["quota_class_set"]
    before = shown["quota_class_set"]["key_pairs"]
    cloud.osc("quota", "set", "--class", "--key-pairs", str(before + 7), "default")
    project = cloud.osc_json("project", "show", "demo")["id"]
    defaults = cloud.compute("GET", f"/os-quota-sets/{project}/defaults").json()
    assert defaults["quota_set"]["key_pairs"] == before + 7
    cloud.osc("quota", "set", "--class", "--key-pairs", str(before), "default")


def test_a_users_quota_is_kept_beside_the_projects(cloud: RunningCloud) -> None:
    project = cloud.osc_json("project", "show", "demo")["id"]
    user = cloud.osc_json("user", "show", "demo")["id"]
    path = f"/os-quota-sets/{project}"
    updated = cloud.compute(
        "PUT", path, params={"user_id": user}, json={"quota_set": {"ram": 2048}}
    )
    assert updated.json()["quota_set"]["ram"] == 2048
    assert cloud.compute("GET", path, params={"user_id": user}).json()["quota_set"]["ram"] == 2048
    assert cloud.compute("GET", path).json()["quota_set"]["ram"] != 2048
    assert cloud.compute("DELETE", path, params={"user_id": user}).status_code == 202


def test_a_flavor_id_may_be_a_number(cloud: RunningCloud) -> None:
    number = int(uuid.uuid4().int % 1_000_000_000)
    body = {"flavor": {"name": unique("numbered"), "ram": 64, "vcpus": 1, "disk": 1, "id": number}}
    created = cloud.compute("POST", "/flavors", json=body).json()["flavor"]
    assert created["id"] == str(number)
    cloud.osc("flavor", "delete", str(number))


def test_usage_hosts_extensions_and_versions(cloud: RunningCloud) -> None:
    sid = cloud.boot(unique("usage"))["id"]
    usage = cloud.osc_json("usage", "list")
    assert usage, "the admin project has a server, so it has usage"
    hosts = cloud.osc_json("host", "list")
    assert {"compute", "conductor", "scheduler"} <= {h["Service"] for h in hosts}
    host = next(h["Host Name"] for h in hosts if h["Service"] == "compute")
    detail = cloud.compute("GET", f"/os-hosts/{host}", version="2.1").json()["host"]
    assert detail[0]["resource"]["project"] == "(total)"
    assert cloud.compute("GET", "/os-hosts", version="2.43").status_code == 404
    aliases = [e["Alias"] for e in cloud.osc_json("extension", "list", "--compute")]
    assert "os-hosts" in aliases
    versions = httpx.get(f"{cloud.base_url}/compute/").json()["versions"]
    assert [v["id"] for v in versions] == ["v2.0", "v2.1"]
    for version in versions:
        self_link = version["links"][0]["href"]
        assert httpx.get(self_link).json()["version"]["links"][0]["href"] == self_link
    audit = cloud.compute("GET", "/os-instance_usage_audit_log/2020-01-01 00:00:00")
    assert audit.json()["instance_usage_audit_log"]["total_errors"] == 0
    cloud.osc("server", "delete", "--wait", sid)


def test_a_deleted_server_leaves_its_group(cloud: RunningCloud) -> None:
    group = cloud.osc_json("server", "group", "create", "--policy", "affinity", unique("grp"))
    sid = cloud.boot(unique("member"), "--hint", f"group={group['id']}")["id"]
    assert cloud.osc_json("server", "group", "show", group["id"])["members"] == [sid]
    cloud.osc("server", "delete", "--wait", sid)
    assert cloud.osc_json("server", "group", "show", group["id"])["members"] == []


def test_security_groups_are_added_to_and_removed_from_a_servers_ports(
    cloud: RunningCloud,
) -> None:
    group = cloud.osc_json("security", "group", "create", unique("sg"))
    sid = boot_on_private(cloud, unique("sg-member"))
    cloud.osc("server", "add", "security", "group", sid, group["name"])
    ports = cloud.osc_json("port", "list", "--server", sid, "--long")
    assert group["id"] in ports[0]["Security Groups"]
    assert cloud.osc("security", "group", "delete", group["id"], check=False).returncode != 0
    cloud.osc("server", "remove", "security", "group", sid, group["name"])
    ports = cloud.osc_json("port", "list", "--server", sid, "--long")
    assert group["id"] not in ports[0]["Security Groups"]
    cloud.osc("server", "delete", "--wait", sid)
    cloud.osc("security", "group", "delete", group["id"])


def test_a_resize_over_the_servers_project_quota_is_refused(cloud: RunningCloud) -> None:
    sid = cloud.boot(unique("grow"), cloud="stowage")["id"]
    name = unique("huge")
    cloud.osc("flavor", "create", "--ram", "51201", "--vcpus", "1", "--disk", "1", name)
    # The admin asks; the quota that counts is the server's project's (demo's 50 GiB of RAM).
    refused = cloud.osc("server", "resize", "--flavor", name, sid, check=False)
    assert refused.returncode != 0 and "Quota exceeded for ram" in refused.stderr
    assert cloud.osc_json("server", "show", sid)["status"] == "ACTIVE"
    cloud.osc("server", "delete", "--wait", sid)
    cloud.osc("flavor", "delete", name)


def test_a_port_deleted_through_the_network_api_leaves_the_servers_addresses(
    cloud: RunningCloud,
) -> None:
    """Before the fix the server's `addresses` (Nova's network info cache) kept the deleted
    port's address; Nova drops it on Neutron's network-vif-deleted event."""
    sid = boot_on_private(cloud, unique("vif-gone"))
    (port,) = cloud.osc_json("port", "list", "--server", sid)
    address = port["Fixed IP Addresses"][0]["ip_address"]
    shown = cloud.compute("GET", f"/servers/{sid}").json()["server"]
    assert [a["addr"] for a in shown["addresses"]["private"]] == [address]
    cloud.osc("port", "delete", port["ID"])
    shown = cloud.compute("GET", f"/servers/{sid}").json()["server"]
    assert shown["addresses"] == {}
    listed = cloud.compute("GET", f"/servers/{sid}/ips").json()
    assert listed["addresses"] == {}
    cloud.osc("server", "delete", "--wait", sid)


def test_concurrent_metadata_writes_of_different_keys_all_stay(cloud: RunningCloud) -> None:
    """Before the fix each write read the server, merged its key and wrote the whole map back
    without comparing: concurrent writers of different keys lost each other's."""
    sid = cloud.boot(unique("meta-race"))["id"]
    token = cloud.token()
    keys = [f"k{n}" for n in range(16)]

    def set_one(key: str) -> int:
        answer = cloud.compute(
            "POST", f"/servers/{sid}/metadata", token=token, json={"metadata": {key: "v"}}
        )
        return answer.status_code

    with ThreadPoolExecutor(max_workers=8) as pool:
        codes = list(pool.map(set_one, keys))
    assert codes == [200] * len(keys)
    metadata = cloud.compute("GET", f"/servers/{sid}/metadata").json()["metadata"]
    assert sorted(metadata) == sorted(keys)
    cloud.osc("server", "delete", "--wait", sid)
