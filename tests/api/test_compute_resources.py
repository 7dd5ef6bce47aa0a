"""Compute resources beside servers: flavors, server groups, keypairs, hypervisors, services,
aggregates, zones, limits and quotas, through the real CLI and exact HTTP checks."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, delete, insert, select
from tests.api.cloudproc import RunningCloud

from stowage.agent.processes import my_ip
from stowage.ledger.db import make_engine, sqlite_url
from stowage.ledger.schema import group_members, hosts, objects, server_groups

MEMBER = ("demo", "stowage-demo", "demo")


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


class Compute:
    """Raw compute calls at a chosen microversion, as admin or as the member."""

    def __init__(self, cloud: RunningCloud) -> None:
        self.base = f"{cloud.base_url}/compute/v2.1"
        self.admin = cloud.token()
        self.member = cloud.token(*MEMBER)

    def call(
        self,
        method: str,
        path: str,
        *,
        version: str = "2.96",
        body: Any = None,
        member: bool = False,
        params: dict[str, str] | None = None,
    ) -> httpx.Response:
        headers = {
            "X-Auth-Token": self.member if member else self.admin,
            "OpenStack-API-Version": f"compute {version}",
        }
        return httpx.request(
            method, f"{self.base}{path}", headers=headers, json=body, params=params, timeout=30
        )


@pytest.fixture(scope="module")
def api(cloud: RunningCloud) -> Compute:
    return Compute(cloud)


@pytest.fixture(scope="module")
def ledger(cloud: RunningCloud) -> Iterator[Engine]:
    """The running cloud's own database, to check what the API stored."""
    engine = make_engine(sqlite_url(cloud.state_dir / "ledger.db"))
    yield engine
    engine.dispose()


def project_id(cloud: RunningCloud, name: str) -> str:
    """The id of project admin or demo, read from a token scoped to it."""
    subject = cloud.token() if name == "admin" else cloud.token(*MEMBER)
    body = httpx.get(
        f"{cloud.base_url}/identity/v3/auth/tokens",
        headers={"X-Auth-Token": cloud.token(), "X-Subject-Token": subject},
    ).json()
    return str(body["token"]["project"]["id"])


# -- flavors --------------------------------------------------------------------------------


def test_flavor_create_with_a_pinned_property_show_and_delete(cloud: RunningCloud) -> None:
    name = unique("cirros256-pinned")
    created = cloud.osc_json(
        "flavor",
        "create",
        name,
        "--public",
        "--vcpus",
        "1",
        "--ram",
        "256",
        "--disk",
        "1",
        "--property",
        "hw:cpu_policy=dedicated",
    )
    assert created["name"] == name
    uuid.UUID(created["id"])  # "id": null asks the server for a UUID
    assert created["properties"] == {"hw:cpu_policy": "dedicated"}
    assert created["os-flavor-access:is_public"] is True
    shown = cloud.osc_json("flavor", "show", name)
    assert (shown["id"], shown["ram"], shown["vcpus"], shown["disk"]) == (created["id"], 256, 1, 1)
    assert shown["properties"] == {"hw:cpu_policy": "dedicated"}
    listed = cloud.osc_json("flavor", "list", "--long")
    assert {"m1.tiny", "m1.pinned", name} <= {row["Name"] for row in listed}
    bad = cloud.osc("flavor", "set", "--property", "hw:cpu_policy=bogus", name, check=False)
    assert bad.returncode != 0
    assert "hw:cpu_policy" in bad.stderr and "bogus" in bad.stderr
    unknown = cloud.osc("flavor", "set", "--property", "hw:cpu_polcy=dedicated", name, check=False)
    assert unknown.returncode != 0 and "hw:cpu_polcy" in unknown.stderr
    assert cloud.osc_json("flavor", "show", name)["properties"] == {"hw:cpu_policy": "dedicated"}
    cloud.osc("flavor", "delete", name)
    gone = cloud.osc("flavor", "show", name, check=False)
    assert gone.returncode != 0


def test_a_private_flavor_is_seen_only_by_projects_given_access(cloud: RunningCloud) -> None:
    name = unique("private")
    flavor = cloud.osc_json(
        "flavor", "create", name, "--private", "--vcpus", "1", "--ram", "64", "--disk", "0"
    )
    assert flavor["os-flavor-access:is_public"] is False
    hidden = cloud.osc("flavor", "show", name, cloud="stowage", check=False)
    assert hidden.returncode != 0
    assert name not in {r["Name"] for r in cloud.osc_json("flavor", "list", cloud="stowage")}
    cloud.osc("flavor", "set", "--project", "demo", name)
    assert cloud.osc_json("flavor", "show", name, cloud="stowage")["id"] == flavor["id"]
    shown = cloud.osc_json("flavor", "show", name)
    assert shown["access_project_ids"] == [project_id(cloud, "demo")]
    cloud.osc("flavor", "unset", "--project", "demo", name)
    assert cloud.osc("flavor", "show", name, cloud="stowage", check=False).returncode != 0
    cloud.osc("flavor", "delete", name)


def test_flavor_fields_follow_the_microversion(api: Compute) -> None:
    tiny = api.call("GET", "/flavors/1", version="2.1").json()["flavor"]
    assert tiny["swap"] == "" and "description" not in tiny and "extra_specs" not in tiny
    assert tiny["OS-FLV-EXT-DATA:ephemeral"] == 0 and tiny["rxtx_factor"] == 1.0
    assert tiny["links"][0]["href"].endswith("/compute/v2.1/flavors/1")
    at_261 = api.call("GET", "/flavors/c1", version="2.61").json()["flavor"]
    assert at_261["description"] is None and at_261["swap"] == ""
    assert at_261["extra_specs"] == {"hw:cpu_policy": "dedicated"}
    assert api.call("GET", "/flavors/1", version="2.75").json()["flavor"]["swap"] == 0
    brief = api.call("GET", "/flavors", version="2.55").json()["flavors"][0]
    assert set(brief) == {"id", "name", "links", "description"}
    assert api.call("PUT", "/flavors/1", version="2.54", body={"flavor": {}}).status_code == 404


def test_flavor_create_update_and_its_refusals(api: Compute) -> None:
    name = unique("raw")
    body = {"flavor": {"name": name, "ram": "128", "vcpus": 2, "disk": 0, "id": None}}
    created = api.call("POST", "/flavors", body=body)
    assert created.status_code == 200, created.text
    flavor = created.json()["flavor"]
    uuid.UUID(flavor["id"])
    assert (flavor["ram"], flavor["extra_specs"], flavor["description"]) == (128, {}, None)
    again = api.call("POST", "/flavors", body=body)
    assert again.status_code == 409
    assert "already exists" in again.json()["conflictingRequest"]["message"]
    same_id = {"flavor": {"name": unique("raw"), "ram": 1, "vcpus": 1, "disk": 0, "id": "1"}}
    assert api.call("POST", "/flavors", body=same_id).status_code == 409
    zero = api.call(
        "POST", "/flavors", body={"flavor": {"name": unique("z"), "ram": 0, "vcpus": 1, "disk": 0}}
    )
    assert zero.status_code == 400 and "ram" in zero.json()["badRequest"]["message"]
    extra = {"flavor": {"name": unique("x"), "ram": 1, "vcpus": 1, "disk": 0, "bogus": 1}}
    assert "bogus" in api.call("POST", "/flavors", body=extra).json()["badRequest"]["message"]
    early = api.call(
        "POST",
        "/flavors",
        version="2.54",
        body={"flavor": {"name": unique("d"), "ram": 1, "vcpus": 1, "disk": 0, "description": "x"}},
    )
    assert early.status_code == 400
    as_member = api.call(
        "POST",
        "/flavors",
        member=True,
        body={"flavor": {"name": unique("m"), "ram": 1, "vcpus": 1, "disk": 0}},
    )
    assert as_member.status_code == 403
    updated = api.call("PUT", f"/flavors/{flavor['id']}", body={"flavor": {"description": "small"}})
    assert updated.json()["flavor"]["description"] == "small"
    assert api.call("DELETE", f"/flavors/{flavor['id']}").status_code == 202
    assert api.call("DELETE", f"/flavors/{flavor['id']}").status_code == 404


def test_flavor_lists_filter_and_page(api: Compute) -> None:
    name = unique("hidden")
    private = api.call(
        "POST",
        "/flavors",
        body={
            "flavor": {
                "name": name,
                "ram": 64,
                "vcpus": 1,
                "disk": 0,
                "os-flavor-access:is_public": False,
            }
        },
    ).json()["flavor"]
    try:
        default = {f["name"] for f in api.call("GET", "/flavors/detail").json()["flavors"]}
        every = {
            f["name"]
            for f in api.call("GET", "/flavors/detail", params={"is_public": "None"}).json()[
                "flavors"
            ]
        }
        only_private = api.call("GET", "/flavors", params={"is_public": "false"}).json()["flavors"]
        as_member = api.call("GET", "/flavors/detail", member=True, params={"is_public": "None"})
        assert name not in default and name in every and "m1.tiny" in every
        assert name in {f["name"] for f in only_private}
        assert "m1.tiny" not in {f["name"] for f in only_private}
        assert name not in {f["name"] for f in as_member.json()["flavors"]}
        assert api.call("GET", f"/flavors/{private['id']}", member=True).status_code == 404
        big = api.call("GET", "/flavors/detail", params={"minRam": "8192"}).json()["flavors"]
        assert {f["name"] for f in big} >= {"m1.large", "m1.xlarge"}
        assert all(f["ram"] >= 8192 for f in big)
        ids = [f["id"] for f in api.call("GET", "/flavors").json()["flavors"]]
        assert ids == sorted(ids) and {"1", "2", "c1"} <= set(ids)
        first = api.call("GET", "/flavors", params={"limit": "2"}).json()
        assert [f["id"] for f in first["flavors"]] == ids[:2]
        assert f"marker={ids[1]}" in first["flavors_links"][0]["href"]
        second = api.call("GET", "/flavors", params={"limit": "2", "marker": ids[1]}).json()
        assert [f["id"] for f in second["flavors"]] == ids[2:4]
        bad = api.call("GET", "/flavors", params={"marker": "no-such"})
        assert bad.status_code == 400 and "marker" in bad.json()["badRequest"]["message"]
        assert api.call("GET", "/flavors", params={"minRam": "x"}).status_code == 400
        assert api.call("GET", "/flavors/m1.tiny").status_code == 404
    finally:
        api.call("DELETE", f"/flavors/{private['id']}")


def test_extra_specs_api(api: Compute) -> None:
    flavor = api.call(
        "POST",
        "/flavors",
        body={"flavor": {"name": unique("specs"), "ram": 1024, "vcpus": 4, "disk": 1}},
    ).json()["flavor"]
    path = f"/flavors/{flavor['id']}/os-extra_specs"
    try:
        numa = {"extra_specs": {"hw:numa_nodes": "2", "trait:HW_CPU_X86_AVX2": "required"}}
        assert api.call("POST", path, body=numa).json() == numa
        contradiction = api.call("PUT", f"{path}/hw:numa_nodes", body={"hw:numa_nodes": "8"})
        assert contradiction.status_code == 400
        assert "hw:numa_nodes" in contradiction.json()["badRequest"]["message"]
        ok = api.call("PUT", f"{path}/hw:cpu_policy", body={"hw:cpu_policy": "dedicated"})
        assert ok.json() == {"hw:cpu_policy": "dedicated"}
        mismatch = api.call("PUT", f"{path}/hw:cpu_policy", body={"hw:mem_page_size": "large"})
        assert mismatch.status_code == 400
        assert api.call("GET", f"{path}/hw:cpu_policy").json() == {"hw:cpu_policy": "dedicated"}
        assert api.call("GET", path, member=True).json()["extra_specs"]["hw:numa_nodes"] == "2"
        denied = api.call("POST", path, member=True, body={"extra_specs": {"a": "b"}})
        assert denied.status_code == 403
        assert api.call("DELETE", f"{path}/hw:numa_nodes").status_code == 202
        assert api.call("GET", f"{path}/hw:numa_nodes").status_code == 404
        assert api.call("DELETE", f"{path}/hw:numa_nodes").status_code == 404
        shown = api.call("GET", f"/flavors/{flavor['id']}").json()["flavor"]["extra_specs"]
        assert shown == {"trait:HW_CPU_X86_AVX2": "required", "hw:cpu_policy": "dedicated"}
    finally:
        api.call("DELETE", f"/flavors/{flavor['id']}")


def test_flavor_access_api(api: Compute, cloud: RunningCloud) -> None:
    demo = project_id(cloud, "demo")
    flavor = api.call(
        "POST",
        "/flavors",
        body={
            "flavor": {
                "name": unique("acl"),
                "ram": 64,
                "vcpus": 1,
                "disk": 0,
                "os-flavor-access:is_public": False,
            }
        },
    ).json()["flavor"]
    action = f"/flavors/{flavor['id']}/action"
    try:
        added = api.call("POST", action, body={"addTenantAccess": {"tenant": demo}})
        assert added.json() == {"flavor_access": [{"flavor_id": flavor["id"], "tenant_id": demo}]}
        assert (
            api.call("POST", action, body={"addTenantAccess": {"tenant": demo}}).status_code == 409
        )
        assert (
            api.call("POST", action, body={"addTenantAccess": {"tenant": "nope"}}).status_code
            == 400
        )
        assert api.call("GET", f"/flavors/{flavor['id']}", member=True).status_code == 200
        listed = api.call("GET", f"/flavors/{flavor['id']}/os-flavor-access").json()
        assert listed["flavor_access"][0]["tenant_id"] == demo
        removed = api.call("POST", action, body={"removeTenantAccess": {"tenant": demo}})
        assert removed.json() == {"flavor_access": []}
        assert (
            api.call("POST", action, body={"removeTenantAccess": {"tenant": demo}}).status_code
            == 404
        )
        public = api.call("POST", "/flavors/1/action", body={"addTenantAccess": {"tenant": demo}})
        assert public.status_code == 409
        assert api.call("GET", "/flavors/1/os-flavor-access").status_code == 404
    finally:
        api.call("DELETE", f"/flavors/{flavor['id']}")


# -- server groups --------------------------------------------------------------------------


def test_server_groups_through_the_cli_and_the_ledger(cloud: RunningCloud, ledger: Engine) -> None:
    anti, ruled = unique("anti"), unique("anti2")
    group = cloud.osc_json("server", "group", "create", "--policy", "anti-affinity", anti)
    assert group["policy"] == "anti-affinity" and group["members"] == []
    two = cloud.osc_json(
        "server",
        "group",
        "create",
        "--policy",
        "anti-affinity",
        "--rule",
        "max_server_per_host=2",
        ruled,
    )
    assert two["rules"] == {"max_server_per_host": 2}
    with ledger.connect() as conn:
        row = conn.execute(select(server_groups).where(server_groups.c.id == two["id"])).one()
    assert (row.name, row.policy, row.max_per_domain) == (ruled, "anti-affinity", 2)
    refused = cloud.osc(
        "server",
        "group",
        "create",
        "--policy",
        "affinity",
        "--rule",
        "max_server_per_host=2",
        unique("bad"),
        check=False,
    )
    assert refused.returncode != 0 and "rules" in refused.stderr
    names = {r["Name"] for r in cloud.osc_json("server", "group", "list")}
    assert {anti, ruled} <= names
    # Members come from the ledger, where the claim path records them (for servers that exist).
    member_id = str(uuid.uuid4())
    with ledger.begin() as conn:
        conn.execute(insert(group_members), {"group_id": group["id"], "instance_id": member_id})
        conn.execute(
            insert(objects),
            {
                "kind": "instance",
                "id": member_id,
                "project_id": "",
                "name": "member",
                "created_at": 0.0,
                "updated_at": 0.0,
                "body": "{}",
            },
        )
    shown = cloud.osc_json("server", "group", "show", anti)
    assert shown["members"] == [member_id]
    with ledger.begin() as conn:  # the stand-in server goes: a deleted server is no member
        conn.execute(delete(objects).where(objects.c.kind == "instance", objects.c.id == member_id))
    assert cloud.osc_json("server", "group", "show", anti)["members"] == []
    cloud.osc("server", "group", "delete", anti, ruled)
    with ledger.connect() as conn:
        left = conn.execute(
            select(server_groups.c.id).where(server_groups.c.id.in_([group["id"], two["id"]]))
        ).all()
        orphans = conn.execute(
            select(group_members).where(group_members.c.group_id == group["id"])
        ).all()
    assert left == [] and orphans == []
    assert cloud.osc("server", "group", "show", anti, check=False).returncode != 0


def test_server_group_shapes_and_project_scoping(api: Compute) -> None:
    old = api.call(
        "POST",
        "/os-server-groups",
        version="2.1",
        body={"server_group": {"name": unique("old"), "policies": ["affinity"]}},
    )
    assert old.status_code == 200, old.text
    group = old.json()["server_group"]
    assert group["policies"] == ["affinity"] and group["metadata"] == {}
    assert "project_id" not in group and "policy" not in group
    soft = api.call(
        "POST",
        "/os-server-groups",
        version="2.14",
        body={"server_group": {"name": "s", "policies": ["soft-affinity"]}},
    )
    assert soft.status_code == 400
    mine = api.call(
        "POST",
        "/os-server-groups",
        member=True,
        body={"server_group": {"name": unique("mine"), "policy": "soft-anti-affinity"}},
    ).json()["server_group"]
    try:
        at_264 = api.call("GET", f"/os-server-groups/{group['id']}").json()["server_group"]
        assert at_264["policy"] == "affinity" and at_264["rules"] == {}
        assert api.call("GET", f"/os-server-groups/{group['id']}", member=True).status_code == 404
        assert (
            api.call("DELETE", f"/os-server-groups/{group['id']}", member=True).status_code == 404
        )
        member_list = api.call(
            "GET", "/os-server-groups", member=True, params={"all_projects": "True"}
        )
        assert [g["id"] for g in member_list.json()["server_groups"]] == [mine["id"]]
        admin_all = api.call("GET", "/os-server-groups", params={"all_projects": "True"}).json()
        assert {group["id"], mine["id"]} <= {g["id"] for g in admin_all["server_groups"]}
        admin_own = api.call("GET", "/os-server-groups").json()["server_groups"]
        assert mine["id"] not in {g["id"] for g in admin_own}
        bad = api.call(
            "POST",
            "/os-server-groups",
            body={
                "server_group": {
                    "name": "x",
                    "policy": "anti-affinity",
                    "rules": {"max_server_per_host": 0},
                }
            },
        )
        assert bad.status_code == 400 and "max_server_per_host" in bad.text
    finally:
        api.call("DELETE", f"/os-server-groups/{group['id']}")
        api.call("DELETE", f"/os-server-groups/{mine['id']}", member=True)
    assert api.call("GET", f"/os-server-groups/{mine['id']}").status_code == 404


# -- keypairs -------------------------------------------------------------------------------


def test_keypairs_through_the_cli(cloud: RunningCloud) -> None:
    name = unique("kp")
    private = cloud.osc("keypair", "create", name).stdout
    assert "PRIVATE KEY" in private
    listed = {r["Name"]: r for r in cloud.osc_json("keypair", "list")}
    assert listed[name]["Type"] == "ssh"
    assert len(listed[name]["Fingerprint"].split(":")) == 16
    shown = cloud.osc_json("keypair", "show", name)
    assert shown["fingerprint"] == listed[name]["Fingerprint"] and shown["type"] == "ssh"
    assert name not in {r["Name"] for r in cloud.osc_json("keypair", "list", cloud="stowage")}
    again = cloud.osc("keypair", "create", name, check=False)
    assert again.returncode != 0 and "already exists" in again.stderr
    cloud.osc("keypair", "delete", name)
    assert cloud.osc("keypair", "show", name, check=False).returncode != 0


def test_keypair_generation_import_and_refusals(api: Compute) -> None:
    name = unique("gen")
    made = api.call("POST", "/os-keypairs", version="2.2", body={"keypair": {"name": name}})
    assert made.status_code == 201
    pair = made.json()["keypair"]
    assert pair["private_key"].startswith("-----BEGIN RSA PRIVATE KEY-----")
    assert pair["public_key"].startswith("ssh-rsa ") and pair["type"] == "ssh"
    listed = api.call("GET", "/os-keypairs", version="2.2").json()["keypairs"]
    assert {
        "name": name,
        "public_key": pair["public_key"],
        "fingerprint": pair["fingerprint"],
        "type": "ssh",
    } in [k["keypair"] for k in listed]
    imported = api.call(
        "POST",
        "/os-keypairs",
        version="2.1",
        member=True,
        body={"keypair": {"name": name, "public_key": pair["public_key"]}},
    )
    assert imported.status_code == 200  # same name, another user: no clash
    assert imported.json()["keypair"]["fingerprint"] == pair["fingerprint"]
    assert "type" not in imported.json()["keypair"]
    assert api.call("DELETE", f"/os-keypairs/{name}", version="2.1", member=True).status_code == 202
    x509 = api.call(
        "POST",
        "/os-keypairs",
        version="2.2",
        body={"keypair": {"name": unique("cert"), "type": "x509"}},
    ).json()["keypair"]
    assert x509["public_key"].startswith("-----BEGIN CERTIFICATE-----")
    assert len(x509["fingerprint"].split(":")) == 20
    garbage = api.call(
        "POST",
        "/os-keypairs",
        body={"keypair": {"name": unique("g"), "public_key": "ssh-rsa nope"}},
    )
    assert garbage.status_code == 400 and "fingerprint" in garbage.text
    no_key = api.call(
        "POST", "/os-keypairs", version="2.92", body={"keypair": {"name": unique("n")}}
    )
    assert no_key.status_code == 400 and "public_key" in no_key.text
    unsafe = api.call(
        "POST",
        "/os-keypairs",
        version="2.91",
        body={"keypair": {"name": "a@b", "public_key": pair["public_key"]}},
    )
    assert unsafe.status_code == 400
    at_292 = api.call(
        "POST",
        "/os-keypairs",
        version="2.92",
        body={"keypair": {"name": f"{name}@x.y", "public_key": pair["public_key"]}},
    )
    assert at_292.status_code == 201
    assert api.call("DELETE", f"/os-keypairs/{name}@x.y").status_code == 204
    assert api.call("DELETE", f"/os-keypairs/{name}").status_code == 204
    api.call("DELETE", f"/os-keypairs/{x509['name']}")


# -- hypervisors, services, zones, aggregates -----------------------------------------------


def test_hypervisors_through_the_cli(cloud: RunningCloud, ledger: Engine) -> None:
    listed = {r["Hypervisor Hostname"]: r for r in cloud.osc_json("hypervisor", "list")}
    assert {"host1", "host2", "host3"} <= set(listed)
    with ledger.connect() as conn:
        host1 = conn.execute(select(hosts).where(hosts.c.name == "host1")).one()
    assert listed["host1"]["ID"] == host1.uuid and listed["host1"]["State"] == "up"
    shown = cloud.osc_json("hypervisor", "show", "host1")
    assert shown["id"] == host1.uuid and shown["service_host"] == "host1"
    assert shown["hypervisor_type"] == "sim" and shown["state"] == "up"
    assert shown["users"] == "1" and shown["load_average"]
    # The hosts' real address (this machine's, for the all-in-one hosts), as Nova's my_ip.
    for name in ("host1", "host2", "host3"):
        assert cloud.osc_json("hypervisor", "show", name)["host_ip"] == my_ip() != "127.0.0.1"
    old = cloud.osc_json("--os-compute-api-version", "2.27", "hypervisor", "show", "host1")
    assert old["id"] == host1.id and old["vcpus"] == 32 and old["memory_mb"] == 65536
    assert old["cpu_info"]["topology"]["threads"] == 2
    denied = cloud.osc("hypervisor", "list", cloud="stowage", check=False)
    assert denied.returncode != 0 and "403" in denied.stderr


def test_hypervisor_shapes_per_microversion(api: Compute, ledger: Engine) -> None:
    with ledger.connect() as conn:
        host2 = conn.execute(select(hosts).where(hosts.c.name == "host2")).one()
    old = api.call("GET", f"/os-hypervisors/{host2.id}", version="2.27").json()["hypervisor"]
    assert json.loads(old["cpu_info"])["arch"] == "x86_64"
    assert old["service"]["host"] == "host2" and isinstance(old["service"]["id"], int)
    assert old["running_vms"] >= 0 and old["free_ram_mb"] == 65536 - old["memory_mb_used"]
    mid = api.call("GET", f"/os-hypervisors/{host2.uuid}", version="2.53").json()["hypervisor"]
    assert isinstance(mid["cpu_info"], dict) and mid["vcpus"] == 32
    uuid.UUID(mid["service"]["id"])
    new = api.call("GET", f"/os-hypervisors/{host2.uuid}", version="2.88").json()["hypervisor"]
    assert "vcpus" not in new and "cpu_info" not in new and " up " in new["uptime"]
    assert api.call("GET", "/os-hypervisors/host2", version="2.53").status_code == 400
    assert api.call("GET", "/os-hypervisors/999", version="2.1").status_code == 404
    uptime = api.call("GET", f"/os-hypervisors/{host2.id}/uptime", version="2.1").json()
    assert "load average" in uptime["hypervisor"]["uptime"]
    assert (
        api.call("GET", f"/os-hypervisors/{host2.uuid}/uptime", version="2.88").status_code == 404
    )
    found = api.call(
        "GET",
        "/os-hypervisors/detail",
        version="2.53",
        params={"hypervisor_hostname_pattern": "host2"},
    )
    assert [h["hypervisor_hostname"] for h in found.json()["hypervisors"]] == ["host2"]
    page = api.call("GET", "/os-hypervisors", version="2.33", params={"limit": "1"}).json()
    assert len(page["hypervisors"]) == 1 and page["hypervisors_links"]
    stats = api.call("GET", "/os-hypervisors/statistics", version="2.1").json()
    assert stats["hypervisor_statistics"]["count"] >= 3


def test_compute_services_set_down_and_disable_reach_the_ledger(
    cloud: RunningCloud, ledger: Engine
) -> None:
    def flags() -> tuple[bool, bool]:
        with ledger.connect() as conn:
            row = conn.execute(select(hosts).where(hosts.c.name == "host1")).one()
        return bool(row.disabled), bool(row.forced_down)

    listed = cloud.osc_json("compute", "service", "list")
    binaries = {(r["Binary"], r["Host"]) for r in listed}
    assert {("nova-compute", "host1"), ("nova-scheduler", "controller")} <= binaries
    assert {("nova-conductor", "controller")} <= binaries
    try:
        cloud.osc("compute", "service", "set", "--down", "host1", "nova-compute")
        assert flags() == (False, True)
        cloud.osc(
            "compute",
            "service",
            "set",
            "--disable",
            "--disable-reason",
            "maintenance",
            "host1",
            "nova-compute",
        )
        assert flags() == (True, True)
        rows = cloud.osc_json("compute", "service", "list", "--long", "--host", "host1")
        assert [
            (r["Status"], r["State"], r["Disabled Reason"], r["Forced Down"]) for r in rows
        ] == [("disabled", "down", "maintenance", True)]
    finally:
        cloud.osc("compute", "service", "set", "--up", "--enable", "host1", "nova-compute")
    assert flags() == (False, False)
    assert cloud.osc_json("compute", "service", "list", "--host", "host1")[0]["State"] == "up"


def test_service_updates_per_microversion(api: Compute, ledger: Engine) -> None:
    services = api.call("GET", "/os-services", version="2.53", params={"host": "host3"}).json()
    [compute] = services["services"]
    try:
        done = api.call(
            "PUT",
            f"/os-services/{compute['id']}",
            version="2.53",
            body={"status": "disabled", "disabled_reason": "r1"},
        )
        assert done.json()["service"]["status"] == "disabled"
        assert done.json()["service"]["disabled_reason"] == "r1"
        clash = api.call(
            "PUT",
            f"/os-services/{compute['id']}",
            version="2.53",
            body={"status": "enabled", "disabled_reason": "x"},
        )
        assert clash.status_code == 400
        empty = api.call("PUT", f"/os-services/{compute['id']}", version="2.53", body={})
        assert empty.status_code == 400
        assert api.call("PUT", "/os-services/disable", version="2.53", body={}).status_code == 400
        legacy = api.call(
            "PUT",
            "/os-services/enable",
            version="2.1",
            body={"host": "host3", "binary": "nova-compute"},
        )
        assert legacy.json() == {
            "service": {"host": "host3", "binary": "nova-compute", "status": "enabled"}
        }
        down = api.call(
            "PUT",
            "/os-services/force-down",
            version="2.11",
            body={"host": "host3", "binary": "nova-compute", "forced_down": True},
        )
        assert down.json()["service"]["forced_down"] is True
        with ledger.connect() as conn:
            row = conn.execute(select(hosts).where(hosts.c.name == "host3")).one()
        assert (row.disabled, row.forced_down) == (False, True)
        scheduler = api.call(
            "PUT",
            "/os-services/disable",
            version="2.1",
            body={"host": "controller", "binary": "nova-scheduler"},
        )
        assert scheduler.status_code == 400
        assert (
            api.call(
                "PUT",
                "/os-services/enable",
                version="2.1",
                body={"host": "nohost", "binary": "nova-compute"},
            ).status_code
            == 404
        )
        assert api.call("GET", "/os-services", member=True).status_code == 403
        old = api.call("GET", "/os-services", version="2.1").json()["services"]
        assert all(isinstance(s["id"], int) and "forced_down" not in s for s in old)
    finally:
        api.call(
            "PUT",
            f"/os-services/{compute['id']}",
            version="2.53",
            body={"status": "enabled", "forced_down": False},
        )


def test_aggregate_zone_moves_hosts_and_zones_list_them(
    cloud: RunningCloud, api: Compute, ledger: Engine
) -> None:
    def zone_of(name: str) -> str:
        with ledger.connect() as conn:
            return str(
                conn.execute(
                    select(hosts.c.availability_zone).where(hosts.c.name == name)
                ).scalar_one()
            )

    agg, zone = unique("agg"), unique("az")
    created = cloud.osc_json("aggregate", "create", "--zone", zone, agg)
    try:
        assert created["availability_zone"] == zone
        cloud.osc("aggregate", "add", "host", agg, "host1")
        assert zone_of("host1") == zone
        zones = {
            r["Zone Name"]: r for r in cloud.osc_json("availability", "zone", "list", "--compute")
        }
        assert zones[zone]["Zone Status"] == "available" and "nova" in zones
        member = {
            r["Zone Name"]
            for r in cloud.osc_json("availability", "zone", "list", "--compute", cloud="stowage")
        }
        assert zone in member and "internal" not in member
        assert cloud.osc_json("hypervisor", "show", "host1")["aggregates"] == [agg]
        other = api.call(
            "POST",
            "/os-aggregates",
            body={"aggregate": {"name": unique("agg"), "availability_zone": unique("az")}},
        ).json()["aggregate"]
        clash = api.call(
            "POST", f"/os-aggregates/{other['id']}/action", body={"add_host": {"host": "host1"}}
        )
        assert clash.status_code == 400 and zone in clash.text
        assert (
            api.call(
                "POST",
                f"/os-aggregates/{other['id']}/action",
                body={"add_host": {"host": "nohost"}},
            ).status_code
            == 404
        )
        assert api.call("DELETE", f"/os-aggregates/{other['id']}").status_code == 200
        dup = api.call("POST", "/os-aggregates", body={"aggregate": {"name": agg}})
        assert dup.status_code == 409
        assert api.call("DELETE", f"/os-aggregates/{created['id']}").status_code == 400
        shown = api.call("GET", f"/os-aggregates/{created['id']}", version="2.41").json()
        assert shown["aggregate"]["hosts"] == ["host1"] and shown["aggregate"]["uuid"]
        api.call(
            "POST",
            f"/os-aggregates/{created['id']}/action",
            body={"set_metadata": {"metadata": {"availability_zone": None}}},
        )
        assert zone_of("host1") == "nova"
    finally:
        api.call(
            "POST",
            f"/os-aggregates/{created['id']}/action",
            body={"remove_host": {"host": "host1"}},
        )
        api.call("DELETE", f"/os-aggregates/{created['id']}")
    assert zone_of("host1") == "nova"
    assert api.call("GET", f"/os-aggregates/{created['id']}").status_code == 404
    assert api.call("GET", "/os-aggregates", member=True).status_code == 403


# -- limits and quotas ----------------------------------------------------------------------


def test_limits_count_instances_and_quotas_can_be_set(
    cloud: RunningCloud, api: Compute, ledger: Engine
) -> None:
    demo = project_id(cloud, "demo")
    limits = cloud.osc_json("limits", "show", "--absolute", cloud="stowage")
    values = {r["Name"]: r["Value"] for r in limits}
    assert values["max_total_instances"] >= 0 and "total_cores_used" in values
    before = api.call("GET", "/limits", member=True).json()["limits"]["absolute"]
    fake = str(uuid.uuid4())
    now = time.time()
    body = {"name": "fake", "status": "ACTIVE", "flavor": {"vcpus": 3, "ram": 300}}
    with ledger.begin() as conn:
        conn.execute(
            insert(objects),
            {
                "kind": "instance",
                "id": fake,
                "project_id": demo,
                "name": "fake",
                "created_at": now,
                "updated_at": now,
                "body": json.dumps(body),
            },
        )
    try:
        after = api.call("GET", "/limits", member=True).json()["limits"]["absolute"]
        assert after["totalInstancesUsed"] == before["totalInstancesUsed"] + 1
        assert after["totalCoresUsed"] == before["totalCoresUsed"] + 3
        assert after["totalRAMUsed"] == before["totalRAMUsed"] + 300
    finally:
        with ledger.begin() as conn:
            conn.execute(delete(objects).where(objects.c.kind == "instance", objects.c.id == fake))
    new = api.call("GET", "/limits", version="2.57").json()["limits"]["absolute"]
    assert "maxPersonality" not in new and "maxImageMeta" not in new and "maxTotalCores" in new
    try:
        cloud.osc("quota", "set", "--cores", "33", "--key-pairs", "7", "demo")
        shown = {
            r["Resource"]: r["Limit"]
            for r in cloud.osc_json("quota", "show", "--compute", cloud="stowage")
        }
        assert shown["cores"] == 33 and shown["key-pairs"] == 7 and shown["instances"] == 10
        assert (
            api.call("GET", "/limits", member=True).json()["limits"]["absolute"]["maxTotalCores"]
            == 33
        )
        detail = api.call("GET", f"/os-quota-sets/{demo}/detail", member=True).json()["quota_set"]
        assert detail["cores"] == {"limit": 33, "in_use": before["totalCoresUsed"], "reserved": 0}
        defaults = api.call("GET", f"/os-quota-sets/{demo}/defaults", member=True).json()
        assert defaults["quota_set"]["cores"] == 20
        admin_project = project_id(cloud, "admin")
        assert api.call("GET", f"/os-quota-sets/{admin_project}", member=True).status_code == 403
        denied = api.call(
            "PUT", f"/os-quota-sets/{demo}", member=True, body={"quota_set": {"cores": 1}}
        )
        assert denied.status_code == 403
        bad = api.call("PUT", f"/os-quota-sets/{demo}", body={"quota_set": {"cores": -2}})
        assert bad.status_code == 400 and "cores" in bad.text
        gone = api.call("PUT", f"/os-quota-sets/{demo}", body={"quota_set": {"floating_ips": 1}})
        assert gone.status_code == 400  # dropped from the API at 2.36
    finally:
        assert api.call("DELETE", f"/os-quota-sets/{demo}").status_code == 202
    assert api.call("GET", f"/os-quota-sets/{demo}").json()["quota_set"]["cores"] == 20
