"""Network v2.0 (neutron subset): the real CLI against networks, subnets, ports and groups."""

from __future__ import annotations

import ipaddress
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.api.cloudproc import RunningCloud

from stowage.services import networks
from stowage.services.cloud import Cloud, CloudConfig
from stowage.services.runtime import open_cloud


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


class Neutron:
    """Raw network API calls with one user's token."""

    def __init__(self, cloud: RunningCloud, token: str) -> None:
        self.base = f"{cloud.base_url}/networking/v2.0"
        self.headers = {"X-Auth-Token": token}

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return httpx.get(f"{self.base}{path}", headers=self.headers, **kw)

    def post(self, path: str, body: Any) -> httpx.Response:
        return httpx.post(f"{self.base}{path}", headers=self.headers, json=body)

    def put(self, path: str, body: Any) -> httpx.Response:
        return httpx.put(f"{self.base}{path}", headers=self.headers, json=body)

    def delete(self, path: str) -> httpx.Response:
        return httpx.delete(f"{self.base}{path}", headers=self.headers)

    def create(self, collection: str, key: str, **attrs: Any) -> dict[str, Any]:
        response = self.post(f"/{collection}", {key: attrs})
        assert response.status_code == 201, response.text
        body: dict[str, Any] = response.json()[key]
        return body


@pytest.fixture(scope="module")
def admin(cloud: RunningCloud) -> Neutron:
    return Neutron(cloud, cloud.token())


@pytest.fixture(scope="module")
def member(cloud: RunningCloud) -> Neutron:
    return Neutron(cloud, cloud.token("demo", "stowage-demo", "demo"))


def error(response: httpx.Response) -> dict[str, Any]:
    body: dict[str, Any] = response.json()["NeutronError"]
    return body


def test_the_bootstrap_networks_as_admin_and_member(cloud: RunningCloud) -> None:
    for user in ("stowage-admin", "stowage"):
        names = {row["Name"] for row in cloud.osc_json("network", "list", cloud=user)}
        assert {"private", "public"} <= names
    private = cloud.osc_json("network", "show", "private")
    assert private["shared"] is True
    assert private["status"] == "ACTIVE"
    assert len(private["subnets"]) == 1
    subnet = cloud.osc_json("subnet", "show", private["subnets"][0], cloud="stowage")
    assert subnet["cidr"] == "10.0.0.0/24"
    assert subnet["gateway_ip"] == "10.0.0.1"
    assert subnet["allocation_pools"] == [{"start": "10.0.0.2", "end": "10.0.0.254"}]


def test_network_subnet_and_port_lifecycle_through_the_cli(cloud: RunningCloud) -> None:
    net, sub = unique("n"), unique("s")
    created = cloud.osc_json("network", "create", net)
    assert (created["status"], created["shared"], created["mtu"]) == ("ACTIVE", False, 1450)
    subnet = cloud.osc_json(
        "subnet", "create", "--network", net, "--subnet-range", "10.9.0.0/24", sub
    )
    assert subnet["gateway_ip"] == "10.9.0.1"
    assert subnet["allocation_pools"] == [{"start": "10.9.0.2", "end": "10.9.0.254"}]
    first = cloud.osc_json("port", "create", "--network", net, unique("p"))
    second = cloud.osc_json("port", "create", "--network", net, unique("p"))
    assert [ip["ip_address"] for ip in first["fixed_ips"]] == ["10.9.0.2"]
    assert [ip["ip_address"] for ip in second["fixed_ips"]] == ["10.9.0.3"]
    assert first["fixed_ips"][0]["subnet_id"] == subnet["id"]
    assert first["mac_address"].startswith("fa:16:3e:")
    assert first["mac_address"] != second["mac_address"]
    assert cloud.osc_json("network", "show", net)["subnets"] == [subnet["id"]]

    busy = cloud.osc("network", "delete", net, check=False)
    assert busy.returncode != 0
    assert "ports still in use" in busy.stderr
    cloud.osc("port", "delete", first["id"], second["id"])
    cloud.osc("subnet", "delete", sub)
    cloud.osc("network", "delete", net)
    assert net not in {row["Name"] for row in cloud.osc_json("network", "list")}


def test_member_policies_and_visibility(cloud: RunningCloud, admin: Neutron) -> None:
    shared = cloud.osc("network", "create", "--share", unique("x"), cloud="stowage", check=False)
    assert shared.returncode != 0
    assert "disallowed by policy" in shared.stderr
    secret = admin.create("networks", "network", name=unique("admin-only"))
    hidden = cloud.osc("network", "show", secret["name"], cloud="stowage", check=False)
    assert hidden.returncode != 0
    assert secret["name"] not in {
        row["Name"] for row in cloud.osc_json("network", "list", cloud="stowage")
    }
    port = cloud.osc_json("port", "create", "--network", "private", unique("dp"), cloud="stowage")
    address = ipaddress.ip_address(port["fixed_ips"][0]["ip_address"])
    assert address in ipaddress.ip_network("10.0.0.0/24")
    cloud.osc("port", "delete", port["id"], cloud="stowage")
    assert admin.delete(f"/networks/{secret['id']}").status_code == 204


def test_security_groups_default_per_project(cloud: RunningCloud, member: Neutron) -> None:
    groups = cloud.osc_json("security", "group", "list", cloud="stowage")
    defaults = [g for g in groups if g["Name"] == "default"]
    assert len(defaults) == 1
    rules = cloud.osc_json("security", "group", "rule", "list", defaults[0]["ID"], cloud="stowage")
    assert sorted((r["Direction"], r["Ethertype"]) for r in rules) == [
        ("egress", "IPv4"),
        ("egress", "IPv6"),
        ("ingress", "IPv4"),
        ("ingress", "IPv6"),
    ]
    ingress = [r for r in rules if r["Direction"] == "ingress"]
    assert {r["Remote Security Group"] for r in ingress} == {defaults[0]["ID"]}
    again = member.get("/security-groups").json()["security_groups"]
    assert [g["id"] for g in again if g["name"] == "default"] == [defaults[0]["ID"]]


def test_neutron_errors_filters_fields_and_paging(admin: Neutron, member: Neutron) -> None:
    missing = admin.get(f"/networks/{uuid.uuid4()}")
    assert missing.status_code == 404
    assert error(missing)["type"] == "NetworkNotFound"
    assert admin.get("/networks/private").status_code == 404

    external = admin.get("/networks", params={"router:external": "True"}).json()["networks"]
    assert [n["name"] for n in external] == ["public"]
    trimmed = admin.get("/networks", params={"name": "private", "fields": ["id", "name"]})
    assert [set(n) for n in trimmed.json()["networks"]] == [{"id", "name"}]
    assert admin.get("/networks", params={"colour": "blue"}).status_code == 400
    assert "provider:network_type" not in member.get("/networks").json()["networks"][0]

    tag = unique("page")
    made = [admin.create("networks", "network", name=f"{tag}-{i}") for i in range(3)]
    first = admin.get("/networks", params={"limit": 2, "sort_key": "name"}).json()
    assert len(first["networks"]) == 2
    seen = []
    url: str | None = f"{admin.base}/networks?limit=1&sort_key=name&sort_dir=desc"
    while url:
        page = httpx.get(url, headers=admin.headers).json()
        seen += [n["name"] for n in page["networks"]]
        url = next(
            (link["href"] for link in page.get("networks_links", []) if link["rel"] == "next"),
            None,
        )
    assert [name for name in seen if name.startswith(tag)] == [f"{tag}-2", f"{tag}-1", f"{tag}-0"]

    net = made[0]
    bad_cidr = admin.post(
        "/subnets",
        # An address without a prefix is no CIDR (host bits set are accepted, as Neutron does).
        {"subnet": {"network_id": net["id"], "ip_version": 4, "cidr": "10.7.0.1"}},
    )
    assert bad_cidr.status_code == 400
    assert "cidr" in error(bad_cidr)["message"]
    unknown = admin.post("/networks", {"network": {"name": "x", "colour": "blue"}})
    assert unknown.status_code == 400
    assert "colour" in error(unknown)["message"]
    subnet = admin.create(
        "subnets", "subnet", network_id=net["id"], ip_version=4, cidr="10.7.0.0/29"
    )
    assert subnet["allocation_pools"] == [{"start": "10.7.0.2", "end": "10.7.0.6"}]
    overlap = admin.post(
        "/subnets",
        {"subnet": {"network_id": net["id"], "ip_version": 4, "cidr": "10.7.0.0/28"}},
    )
    assert overlap.status_code == 400
    assert "overlaps" in error(overlap)["message"]

    fixed = admin.create(
        "ports", "port", network_id=net["id"], fixed_ips=[{"ip_address": "10.7.0.5"}]
    )
    assert fixed["fixed_ips"] == [{"subnet_id": subnet["id"], "ip_address": "10.7.0.5"}]
    taken = admin.post(
        "/ports", {"port": {"network_id": net["id"], "fixed_ips": [{"ip_address": "10.7.0.5"}]}}
    )
    assert taken.status_code == 409
    assert error(taken)["type"] == "IpAddressAlreadyAllocated"
    auto = [admin.create("ports", "port", network_id=net["id"]) for _ in range(4)]
    assert [p["fixed_ips"][0]["ip_address"] for p in auto] == [
        "10.7.0.2",
        "10.7.0.3",
        "10.7.0.4",
        "10.7.0.6",
    ]
    full = admin.post("/ports", {"port": {"network_id": net["id"]}})
    assert full.status_code == 409
    assert error(full)["type"] == "IpAddressGenerationFailure"
    by_ip = admin.get("/ports", params={"fixed_ips": "ip_address=10.7.0.5"}).json()["ports"]
    assert [p["id"] for p in by_ip] == [fixed["id"]]
    in_use = admin.delete(f"/subnets/{subnet['id']}")
    assert in_use.status_code == 409
    assert error(in_use)["type"] == "SubnetInUse"

    tags = admin.put(f"/networks/{net['id']}/tags", {"tags": ["blue", "green"]})
    assert tags.json() == {"tags": ["blue", "green"]}
    tagged = admin.get("/networks", params={"tags": "blue"}).json()["networks"]
    assert [n["id"] for n in tagged] == [net["id"]]

    for port in [fixed, *auto]:
        assert admin.delete(f"/ports/{port['id']}").status_code == 204
    for made_net in made:
        assert admin.delete(f"/networks/{made_net['id']}").status_code == 204
    assert admin.get(f"/subnets/{subnet['id']}").status_code == 404


# -- what compute calls, on a cloud in this process ------------------------------------------


@pytest.fixture
def local_cloud(tmp_path: Path) -> Iterator[Cloud]:
    cloud = open_cloud(CloudConfig(state_dir=tmp_path / "state"))
    try:
        yield cloud
    finally:
        cloud.ledger.close()


@dataclass(frozen=True)
class _As:
    project_id: str
    is_admin: bool = False


def _private(cloud: Cloud) -> dict[str, Any]:
    return next(doc.body for doc in cloud.objects.list("network") if doc.name == "private")


def test_allocate_port_takes_the_next_free_address_and_release_frees_it(
    local_cloud: Cloud,
) -> None:
    net = _private(local_cloud)
    demo = net["project_id"]
    first = networks.allocate_port(local_cloud, net["id"], demo, "server-1", host="host1")
    second = networks.allocate_port(local_cloud, net["id"], demo, "server-2")
    assert first["fixed_ips"][0]["ip_address"] == "10.0.0.2"
    assert second["fixed_ips"][0]["ip_address"] == "10.0.0.3"
    assert (first["device_owner"], first["binding:host_id"], first["status"]) == (
        "compute:nova",
        "host1",
        "ACTIVE",
    )
    addresses = networks.addresses_of(local_cloud, "server-1")
    assert addresses == {
        "private": [
            {
                "version": 4,
                "addr": "10.0.0.2",
                "OS-EXT-IPS:type": "fixed",
                "OS-EXT-IPS-MAC:mac_addr": first["mac_address"],
            }
        ]
    }
    assert networks.release_ports(local_cloud, "server-1") == 1
    assert networks.addresses_of(local_cloud, "server-1") == {}
    third = networks.allocate_port(local_cloud, net["id"], demo, "server-3")
    assert third["fixed_ips"][0]["ip_address"] == "10.0.0.2"

    public = next(d.body for d in local_cloud.objects.list("network") if d.name == "public")
    with pytest.raises(networks.NetworkError) as refused:
        networks.allocate_port(local_cloud, public["id"], demo, "server-4")
    assert refused.value.status == 403
    with pytest.raises(networks.NetworkError) as missing:
        networks.allocate_port(local_cloud, str(uuid.uuid4()), demo, "server-4")
    assert missing.value.status == 404


def test_attached_ports_are_detached_not_deleted_and_fixed_ips_honoured(
    local_cloud: Cloud,
) -> None:
    net = _private(local_cloud)
    demo = _As(net["project_id"])
    own = networks.create_port(local_cloud, demo, {"network_id": net["id"], "name": "mine"})
    attached = networks.attach_port(local_cloud, own["id"], demo.project_id, "vm-a", host="h2")
    assert (attached["device_id"], attached["binding:host_id"]) == ("vm-a", "h2")
    assert "_preserve" not in attached
    with pytest.raises(networks.NetworkError) as busy:
        networks.attach_port(local_cloud, own["id"], demo.project_id, "vm-b")
    assert busy.value.status == 409
    pinned = networks.allocate_port(
        local_cloud, net["id"], demo.project_id, "vm-a", fixed_ip="10.0.0.77"
    )
    assert pinned["fixed_ips"][0]["ip_address"] == "10.0.0.77"
    assert sorted(a["addr"] for a in networks.addresses_of(local_cloud, "vm-a")["private"]) == [
        own["fixed_ips"][0]["ip_address"],
        "10.0.0.77",
    ]
    assert networks.release_ports(local_cloud, "vm-a") == 2
    kept = networks.get_port(local_cloud, demo, own["id"])
    assert (kept["device_id"], kept["status"]) == ("", "DOWN")
    with pytest.raises(networks.NetworkError) as gone:
        networks.get_port(local_cloud, demo, pinned["id"])
    assert gone.value.status == 404


def test_concurrent_allocations_never_share_an_address(local_cloud: Cloud) -> None:
    net = _private(local_cloud)
    results: list[str] = []
    failures: list[BaseException] = []

    def allocate(i: int) -> None:
        try:
            port = networks.allocate_port(local_cloud, net["id"], net["project_id"], f"vm-{i}")
            results.append(port["fixed_ips"][0]["ip_address"])
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=allocate, args=(i,)) for i in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert len(results) == len(set(results)) == 20


def test_bootstrap_is_idempotent(local_cloud: Cloud) -> None:
    projects = {doc.name or "": doc.id for doc in local_cloud.objects.list("project") if doc.name}
    networks.bootstrap_networks(local_cloud, projects)
    names = sorted(doc.name or "" for doc in local_cloud.objects.list("network"))
    assert names == ["private", "public"]
    assert len(local_cloud.objects.list("subnet")) == 2
