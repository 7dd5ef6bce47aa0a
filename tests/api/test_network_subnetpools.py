"""Subnet pools (Neutron's subnet_allocation, default-subnetpools): the real CLI and
openstacksdk as member, reader and admin, the refusals, and concurrent allocation."""

from __future__ import annotations

import ipaddress
import multiprocessing
import threading
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from tests.api.cloudproc import RunningCloud
from tests.api.personas import Personas, personas
from tests.api.sdk import SDK_WARNINGS, connect
from tests.api.test_identity import unique
from tests.api.test_network import Neutron, local_cloud  # noqa: F401 (a fixture)

from stowage.ledger import Ledger
from stowage.services import networks
from stowage.services.cloud import Cloud, CloudConfig
from stowage.services.networks import subnetpools
from stowage.services.networks.common import _As


@pytest.fixture(scope="module")
def team(cloud: RunningCloud) -> Personas:
    return personas(cloud, "pool")


def _error(response: Any) -> tuple[int, str]:
    return response.status_code, response.json()["NeutronError"]["type"]


def test_subnet_pool_lifecycle_through_the_cli(cloud: RunningCloud, team: Personas) -> None:
    name = unique("pool")
    made = team.osc(
        "member",
        *("subnet", "pool", "create", "--pool-prefix", "10.60.0.0/16"),
        *("--default-prefix-length", "24", "--min-prefix-length", "20"),
        *("--max-prefix-length", "28", "-f", "json", name),
    )
    assert made.returncode == 0, made.stderr
    member = Neutron(cloud, team.token("member"))
    pool = member.get("/subnetpools", params={"name": name}).json()["subnetpools"][0]
    assert {k: pool[k] for k in ("prefixes", "ip_version", "shared", "is_default")} == {
        "prefixes": ["10.60.0.0/16"],
        "ip_version": 4,
        "shared": False,
        "is_default": False,
    }
    assert (pool["min_prefixlen"], pool["default_prefixlen"], pool["max_prefixlen"]) == (20, 24, 28)
    assert pool["address_scope_id"] is None and pool["project_id"] == team.project["id"]
    assert pool["revision_number"] == 1 and pool["tags"] == []

    net = unique("poolnet")
    assert team.osc("member", "network", "create", net).returncode == 0
    first = team.osc(
        "member",
        *("subnet", "create", "--network", net, "--subnet-pool", name),
        *("--prefix-length", "26", "-f", "json", unique("s")),
    )
    assert first.returncode == 0, first.stderr
    second = team.osc(
        "member", "subnet", "create", "--network", net, "--subnet-pool", name, unique("s")
    )
    assert second.returncode == 0, second.stderr
    subnets = member.get("/subnets", params={"subnetpool_id": pool["id"]}).json()["subnets"]
    assert sorted(s["cidr"] for s in subnets) == ["10.60.0.0/26", "10.60.1.0/24"]
    assert all(s["subnetpool_id"] == pool["id"] for s in subnets)

    # The reader sees the pool and may change nothing.
    assert team.osc("reader", "subnet", "pool", "show", name).returncode == 0
    assert team.osc("reader", "subnet", "pool", "set", "--name", "x", name).returncode != 0
    assert (
        team.osc(
            "reader", "subnet", "pool", "create", "--pool-prefix", "10.9.0.0/16", "r"
        ).returncode
        != 0
    )

    # Growing the prefixes is allowed; deleting a pool with subnets is not.
    assert (
        team.osc(
            "member", "subnet", "pool", "set", "--pool-prefix", "10.61.0.0/16", name
        ).returncode
        == 0
    )
    shown = member.get(f"/subnetpools/{pool['id']}").json()["subnetpool"]
    assert shown["prefixes"] == ["10.60.0.0/15"] and shown["revision_number"] == 2
    busy = member.delete(f"/subnetpools/{pool['id']}")
    assert _error(busy) == (409, "SubnetPoolInUse")
    for subnet in subnets:
        assert team.osc("member", "subnet", "delete", subnet["id"]).returncode == 0
    # Their prefixes are released: the first one is given again.
    again = member.post(
        "/subnets",
        {
            "subnet": {
                "network_id": subnets[0]["network_id"],
                "ip_version": 4,
                "subnetpool_id": pool["id"],
                "prefixlen": 26,
            }
        },
    )
    assert again.status_code == 201, again.text
    assert again.json()["subnet"]["cidr"] == "10.60.0.0/26"
    assert member.delete(f"/subnets/{again.json()['subnet']['id']}").status_code == 204
    assert team.osc("member", "subnet", "pool", "delete", name).returncode == 0
    assert member.get(f"/subnetpools/{pool['id']}").status_code == 404


def test_subnet_pool_refusals(cloud: RunningCloud, team: Personas) -> None:
    member = Neutron(cloud, team.token("member"))
    pool = member.post(
        "/subnetpools",
        {
            "subnetpool": {
                "name": unique("p"),
                "prefixes": ["192.168.64.0/24"],
                "min_prefixlen": 25,
                "max_prefixlen": 26,
            }
        },
    ).json()["subnetpool"]
    assert pool["default_prefixlen"] == 25
    net = member.post("/networks", {"network": {"name": unique("n")}}).json()["network"]

    def subnet(**extra: Any) -> Any:
        body = {"network_id": net["id"], "ip_version": 4, "subnetpool_id": pool["id"], **extra}
        return member.post("/subnets", {"subnet": body})

    assert _error(subnet(prefixlen=24)) == (400, "MinPrefixSubnetAllocationError")
    assert _error(subnet(prefixlen=27)) == (400, "MaxPrefixSubnetAllocationError")
    assert _error(subnet(cidr="10.0.0.0/25")) == (400, "SubnetAllocationError")
    assert _error(subnet(ip_version=6)) == (400, "BadRequest")
    inside = subnet(cidr="192.168.64.128/25")
    assert inside.status_code == 201 and inside.json()["subnet"]["cidr"] == "192.168.64.128/25"
    assert subnet(prefixlen=26).json()["subnet"]["cidr"] == "192.168.64.0/26"
    assert subnet(prefixlen=26).json()["subnet"]["cidr"] == "192.168.64.64/26"
    exhausted = subnet(prefixlen=26)
    assert _error(exhausted) == (409, "SubnetAllocationError")
    assert "Insufficient prefix space" in exhausted.json()["NeutronError"]["message"]
    # Members may not share a pool or make it the default; bounds must hold.
    shared = {"name": "s", "prefixes": ["10.70.0.0/16"], "shared": True}
    assert _error(member.post("/subnetpools", {"subnetpool": shared})) == (
        403,
        "PolicyNotAuthorized",
    )
    default = {"name": "d", "prefixes": ["10.70.0.0/16"], "is_default": True}
    assert member.post("/subnetpools", {"subnetpool": default}).status_code == 403
    bounds = {"name": "b", "prefixes": ["10.70.0.0/16"], "min_prefixlen": 28, "max_prefixlen": 24}
    assert _error(member.post("/subnetpools", {"subnetpool": bounds})) == (
        400,
        "IllegalSubnetPoolPrefixBounds",
    )
    scoped = {"name": "a", "prefixes": ["10.70.0.0/16"], "address_scope_id": "nope"}
    assert _error(member.post("/subnetpools", {"subnetpool": scoped})) == (
        404,
        "AddressScopeNotFound",
    )
    shrink = member.put(f"/subnetpools/{pool['id']}", {"subnetpool": {"prefixes": ["10.1.0.0/16"]}})
    assert _error(shrink) == (400, "IllegalSubnetPoolPrefixUpdate")
    # Another project neither sees nor allocates from a pool not shared.
    other = Neutron(cloud, personas(cloud, "pool2").token("member"))
    assert _error(other.get(f"/subnetpools/{pool['id']}")) == (404, "SubnetPoolNotFound")
    assert pool["id"] not in {p["id"] for p in other.get("/subnetpools").json()["subnetpools"]}


@SDK_WARNINGS
def test_shared_and_default_pools_as_admin_through_the_sdk(
    cloud: RunningCloud, team: Personas
) -> None:
    admin = connect(cloud)
    shared = admin.network.create_subnet_pool(
        name=unique("shared"),
        prefixes=["10.80.0.0/16"],
        default_prefix_length=24,
        is_shared=True,
        is_default=True,
        default_quota=512,
    )
    try:
        assert (shared.is_shared, shared.is_default, shared.ip_version) == (True, True, 4)
        assert shared.default_quota == 512
        second = {"name": "d2", "prefixes": ["10.81.0.0/16"], "is_default": True}
        admin_api = Neutron(cloud, cloud.token())
        assert _error(admin_api.post("/subnetpools", {"subnetpool": second})) == (
            400,
            "InvalidInput",
        )
        member = connect(
            cloud,
            username=team.users["member"]["name"],
            password="persona-secret",
            project_name=team.project["name"],
        )
        assert shared.id in {p.id for p in member.network.subnet_pools()}
        net = member.network.create_network(name=unique("n"))
        picked = member.network.create_subnet(
            network_id=net.id, ip_version=4, use_default_subnet_pool=True
        )
        assert (picked.subnet_pool_id, picked.cidr) == (shared.id, "10.80.0.0/24")
        # default_quota: 512 addresses per project: two /24s, not a third.
        member.network.create_subnet(network_id=net.id, ip_version=4, subnet_pool_id=shared.id)
        over = Neutron(cloud, team.token("member")).post(
            "/subnets",
            {"subnet": {"network_id": net.id, "ip_version": 4, "subnetpool_id": shared.id}},
        )
        assert _error(over) == (409, "SubnetPoolQuotaExceeded")
        # The member may not change a pool it does not own.
        assert (
            Neutron(cloud, team.token("member"))
            .put(f"/subnetpools/{shared.id}", {"subnetpool": {"name": "mine"}})
            .status_code
            == 403
        )
        for s in member.network.subnets(network_id=net.id):
            member.network.delete_subnet(s)
        member.network.delete_network(net)

        # The auto-allocated topology takes its subnet from the default pool.
        project = team.project["id"]
        topo = Neutron(cloud, team.token("member")).get(f"/auto-allocated-topology/{project}")
        assert topo.status_code == 200, topo.text
        auto_net = topo.json()["auto_allocated_topology"]["id"]
        auto = admin_api.get("/subnets", params={"network_id": auto_net}).json()["subnets"]
        assert [(s["subnetpool_id"], s["cidr"]) for s in auto] == [(shared.id, "10.80.0.0/24")]
        assert admin_api.delete(f"/auto-allocated-topology/{project}").status_code == 204
    finally:
        admin.network.delete_subnet_pool(shared)
    assert admin.network.find_subnet_pool(shared.id) is None


def test_extensions_advertise_subnet_allocation(cloud: RunningCloud) -> None:
    aliases = {e["Alias"] for e in cloud.osc_json("extension", "list", "--network")}
    assert {"subnet_allocation", "default-subnetpools"} <= aliases


def test_concurrent_allocations_over_http_never_overlap(
    cloud: RunningCloud, team: Personas
) -> None:
    member = Neutron(cloud, team.token("member"))
    pool = member.post(
        "/subnetpools",
        {
            "subnetpool": {
                "name": unique("race"),
                "prefixes": ["172.30.0.0/26"],
                "min_prefixlen": 27,
                "max_prefixlen": 28,
            }
        },
    ).json()["subnetpool"]
    net = member.post("/networks", {"network": {"name": unique("n")}}).json()["network"]
    answers: list[Any] = []

    def allocate(length: int) -> None:
        body = {
            "network_id": net["id"],
            "ip_version": 4,
            "subnetpool_id": pool["id"],
            "prefixlen": length,
        }
        answers.append(member.post("/subnets", {"subnet": body}))

    threads = [threading.Thread(target=allocate, args=(27 + i % 2,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    made = [
        ipaddress.ip_network(a.json()["subnet"]["cidr"]) for a in answers if a.status_code == 201
    ]
    refused = [_error(a) for a in answers if a.status_code != 201]
    assert made and refused
    assert set(refused) == {(409, "SubnetAllocationError")}
    assert sum(n.num_addresses for n in made) <= 64
    assert all(not a.overlaps(b) for i, a in enumerate(made) for b in made[i + 1 :])


def test_concurrent_claims_in_process_never_overlap(local_cloud: Cloud) -> None:  # noqa: F811
    owner = _As("p1")
    pool = subnetpools.create_subnetpool(
        local_cloud,
        owner,
        {"name": "tiny", "prefixes": ["10.9.0.0/28"], "min_prefixlen": 29, "max_prefixlen": 30},
    )
    net = networks.create_network(local_cloud, owner, {"name": "n"})
    made: list[str] = []
    failures: list[BaseException] = []

    def allocate(i: int) -> None:
        body = {
            "network_id": net["id"],
            "ip_version": 4,
            "subnetpool_id": pool["id"],
            "prefixlen": 29 + i % 2,
        }
        try:
            made.append(networks.create_subnet(local_cloud, owner, body)["cidr"])
        except networks.NetworkError as exc:
            failures.append(exc)

    threads = [threading.Thread(target=allocate, args=(i,)) for i in range(10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    nets = [ipaddress.ip_network(c) for c in made]
    assert nets and failures
    assert {getattr(f, "code", None) for f in failures} == {"SubnetAllocationError"}
    assert all(not a.overlaps(b) for i, a in enumerate(nets) for b in nets[i + 1 :])
    claims = local_cloud.objects.ids(subnetpools.CLAIM, name=pool["id"])
    assert sorted(c.partition("/")[2] for c in claims) == sorted(made)


def _allocate_from(
    url: str, state: str, net_id: str, pool_id: str, length: int, barrier: Any
) -> list[str]:
    """One process: create subnets of `length` from the pool (8 tries); their CIDRs."""
    ledger = Ledger.open(url, upgrade=False)
    cloud = Cloud(CloudConfig(state_dir=Path(state), hosts=0), ledger)
    made: list[str] = []
    body = {"network_id": net_id, "ip_version": 4, "subnetpool_id": pool_id, "prefixlen": length}
    try:
        barrier.wait(timeout=120)
        for _ in range(8):
            try:
                made.append(networks.create_subnet(cloud, _As("p1"), body)["cidr"])
            except networks.NetworkError as exc:
                assert exc.code == "SubnetAllocationError", exc
        return made
    finally:
        ledger.close()


def test_processes_sharing_a_ledger_never_get_overlapping_prefixes(
    db_url: str, tmp_path: Path
) -> None:
    ledger = Ledger.open(db_url)
    cloud = Cloud(CloudConfig(state_dir=tmp_path / "state", hosts=0), ledger)
    owner = _As("p1")
    pool = subnetpools.create_subnetpool(
        cloud, owner, {"name": "p", "prefixes": ["10.7.0.0/26"], "min_prefixlen": 28}
    )
    net = networks.create_network(cloud, owner, {"name": "n"})
    ledger.close()
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        barrier = manager.Barrier(3)
        with ProcessPoolExecutor(3, mp_context=ctx) as workers:
            futures = [
                workers.submit(
                    _allocate_from,
                    *(db_url, str(tmp_path / "state"), net["id"], pool["id"]),
                    28 + i % 2,
                    barrier,
                )
                for i in range(3)
            ]
            results = [f.result() for f in futures]
    made = [ipaddress.ip_network(c) for r in results for c in r]
    # /28s and /29s from a /26: none overlapping, and the pool filled (the /29 process's
    # last refusal means no /29 was left).
    assert all(not a.overlaps(b) for i, a in enumerate(made) for b in made[i + 1 :])
    assert sum(n.num_addresses for n in made) == 64
