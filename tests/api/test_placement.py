"""Placement: the ledger's hosts as resource providers, through osc-placement and raw HTTP."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select
from tests.api.cloudproc import RunningCloud

from stowage.domain.claims import Claim
from stowage.domain.numa import NO_NUMA
from stowage.domain.topology import ResourceClass
from stowage.ledger import Ledger
from stowage.ledger.db import sqlite_url
from stowage.ledger.objects import ObjectStore
from stowage.ledger.schema import changes, host_generations, hosts, hosts_and_generations

PLACEMENT = "placement 1.29"


@pytest.fixture
def ledger(cloud: RunningCloud) -> Iterator[Ledger]:
    """The running cloud's own ledger, opened beside it."""
    opened = Ledger.open(sqlite_url(cloud.state_dir / "ledger.db"), upgrade=False)
    try:
        yield opened
    finally:
        opened.close()


@pytest.fixture(scope="module")
def admin(cloud: RunningCloud) -> dict[str, str]:
    return {"X-Auth-Token": cloud.token(), "OpenStack-API-Version": PLACEMENT}


def _hosts(ledger: Ledger) -> dict[str, tuple[int, str, int]]:
    """name -> (id, uuid, generation), straight from the ledger."""
    with ledger.engine.connect() as conn:
        rows = conn.execute(
            select(
                hosts.c.name, hosts.c.id, hosts.c.uuid, host_generations.c.generation
            ).select_from(hosts_and_generations)
        )
        return {name: (host_id, rp, gen) for name, host_id, rp, gen in rows}


def _get(cloud: RunningCloud, path: str, headers: dict[str, str], **params: Any) -> httpx.Response:
    return httpx.get(f"{cloud.base_url}/placement{path}", headers=headers, params=params)


def test_the_version_document_needs_no_token_and_negotiation_answers_406(
    cloud: RunningCloud,
) -> None:
    root = httpx.get(f"{cloud.base_url}/placement/")
    assert root.status_code == 200
    version = root.json()["versions"][0]
    assert (version["id"], version["min_version"], version["max_version"]) == (
        "v1.0",
        "1.0",
        "1.39",
    )
    assert version["status"] == "CURRENT"
    assert root.headers["openstack-api-version"] == "placement 1.0"

    refused = httpx.get(
        f"{cloud.base_url}/placement/", headers={"OpenStack-API-Version": "placement 9.99"}
    )
    assert refused.status_code == 406
    error = refused.json()["errors"][0]
    assert (error["max_version"], error["min_version"]) == ("1.39", "1.0")
    assert "9.99" in error["detail"]

    latest = httpx.get(
        f"{cloud.base_url}/placement/", headers={"OpenStack-API-Version": "placement latest"}
    )
    assert latest.headers["openstack-api-version"] == "placement 1.39"
    garbled = httpx.get(
        f"{cloud.base_url}/placement/", headers={"OpenStack-API-Version": "placement one"}
    )
    assert garbled.status_code == 400


def test_every_ledger_host_is_a_root_provider(cloud: RunningCloud, ledger: Ledger) -> None:
    known = _hosts(ledger)
    listed = {row["name"]: row for row in cloud.osc_json("resource", "provider", "list")}
    assert set(known) <= set(listed)
    for name, (_, rp, generation) in known.items():
        row = listed[name]
        assert row["uuid"] == rp
        assert row["generation"] == generation
        assert row["root_provider_uuid"] == rp
        assert row["parent_provider_uuid"] is None
    _, rp, _ = known["host1"]
    shown = cloud.osc_json("resource", "provider", "show", rp)
    assert (shown["uuid"], shown["name"]) == (rp, "host1")


def test_a_ledger_claim_shows_as_usage_allocation_and_candidate_capacity(
    cloud: RunningCloud, ledger: Ledger, admin: dict[str, str]
) -> None:
    host_id, rp, _ = _hosts(ledger)["host2"]
    consumer, project, user = str(uuid.uuid4()), uuid.uuid4().hex, uuid.uuid4().hex
    claim = Claim(
        consumer_id=consumer,
        instance_id=consumer,
        host_id=host_id,
        amounts={ResourceClass.VCPU: 3, ResourceClass.MEMORY_MB: 768},
        fit=NO_NUMA,
        project_id=project,
        user_id=user,
    )
    [outcome] = ledger.claim([claim])
    assert outcome.ok, outcome.reason
    try:
        inventory = {
            row["resource_class"]: row
            for row in cloud.osc_json("resource", "provider", "inventory", "list", rp)
        }
        assert inventory["VCPU"]["used"] >= 3
        assert inventory["VCPU"]["allocation_ratio"] == 4.0
        usage = {
            row["resource_class"]: row["usage"]
            for row in cloud.osc_json("resource", "provider", "usage", "show", rp)
        }
        assert usage["VCPU"] == inventory["VCPU"]["used"]
        assert usage["MEMORY_MB"] >= 768
        assert "PCPU" in usage

        [allocation] = cloud.osc_json("resource", "provider", "allocation", "show", consumer)
        assert allocation["resource_provider"] == rp
        assert allocation["resources"] == {"MEMORY_MB": 768, "VCPU": 3}
        assert (allocation["project_id"], allocation["user_id"]) == (project, user)

        totals = cloud.osc_json("resource", "usage", "show", project)
        assert {row["resource_class"]: row["usage"] for row in totals} == {
            "MEMORY_MB": 768,
            "VCPU": 3,
        }

        rows = cloud.osc_json("allocation", "candidate", "list", "--resource", "VCPU=1")
        mine = next(row for row in rows if row["resource provider"] == rp)
        assert mine["allocation"] == "VCPU=1"
        assert f"VCPU={usage['VCPU']}/" in mine["inventory used/capacity"]
        assert "COMPUTE_NODE" in mine["traits"]

        raw = _get(cloud, f"/allocations/{consumer}", admin).json()
        assert raw["consumer_generation"] == 0
        assert raw["allocations"][rp]["resources"] == {"MEMORY_MB": 768, "VCPU": 3}
        limited = _get(cloud, "/allocation_candidates", admin, resources="VCPU:1", limit="1")
        assert len(limited.json()["allocation_requests"]) == 1
        assert len(limited.json()["provider_summaries"]) == 1
    finally:
        assert ledger.release(consumer)
    assert _get(cloud, f"/allocations/{consumer}", admin).json() == {"allocations": {}}
    after = _get(cloud, "/usages", admin, project_id=project).json()
    assert after == {"usages": {}}


def test_traits_are_set_with_the_provider_generation(
    cloud: RunningCloud, ledger: Ledger, admin: dict[str, str]
) -> None:
    _, rp, _ = _hosts(ledger)["host3"]
    trait = f"CUSTOM_T{uuid.uuid4().hex[:10].upper()}"
    url = f"{cloud.base_url}/placement"
    assert httpx.put(f"{url}/traits/{trait}", headers=admin).status_code == 201
    assert httpx.put(f"{url}/traits/{trait}", headers=admin).status_code == 204
    try:
        listed = {row["name"] for row in cloud.osc_json("trait", "list")}
        assert {trait, "HW_CPU_X86_AVX2", "COMPUTE_STATUS_DISABLED"} <= listed

        set_rows = cloud.osc_json(
            "resource",
            "provider",
            "trait",
            "set",
            rp,
            "--trait",
            trait,
            "--trait",
            "HW_CPU_X86_AVX2",
        )
        assert {trait, "HW_CPU_X86_AVX2", "COMPUTE_NODE"} <= {row["name"] for row in set_rows}
        shown = {row["name"] for row in cloud.osc_json("resource", "provider", "trait", "list", rp)}
        assert {trait, "HW_CPU_X86_AVX2"} <= shown

        found = _get(cloud, "/allocation_candidates", admin, resources="VCPU:1", required=trait)
        assert list(found.json()["provider_summaries"]) == [rp]
        avoided = _get(
            cloud, "/allocation_candidates", admin, resources="VCPU:1", required=f"!{trait}"
        )
        assert rp not in avoided.json()["provider_summaries"]

        stale = httpx.put(
            f"{url}/resource_providers/{rp}/traits",
            headers=admin,
            json={"traits": [], "resource_provider_generation": -1},
        )
        assert stale.status_code == 409
        assert stale.json()["errors"][0]["code"] == "placement.concurrent_update"
        in_use = httpx.delete(f"{url}/traits/{trait}", headers=admin)
        assert in_use.status_code == 409
    finally:
        httpx.delete(f"{url}/resource_providers/{rp}/traits", headers=admin)
    assert _get(cloud, f"/resource_providers/{rp}/traits", admin).json()["traits"] == sorted(
        {"COMPUTE_NODE", "HW_ARCH_X86_64", "HW_CPU_HYPERTHREADING"}
    )
    assert httpx.delete(f"{url}/traits/{trait}", headers=admin).status_code == 204
    assert httpx.delete(f"{url}/traits/HW_CPU_X86_AVX2", headers=admin).status_code == 400


def test_a_disabled_host_carries_compute_status_disabled(
    cloud: RunningCloud, ledger: Ledger, admin: dict[str, str]
) -> None:
    _, rp, _ = _hosts(ledger)["host3"]
    ledger.set_host_state("host3", disabled=True)
    try:
        traits = _get(cloud, f"/resource_providers/{rp}/traits", admin).json()["traits"]
        assert "COMPUTE_STATUS_DISABLED" in traits
        enabled = _get(
            cloud,
            "/allocation_candidates",
            admin,
            resources="VCPU:1",
            required="!COMPUTE_STATUS_DISABLED",
        ).json()
        assert rp not in enabled["provider_summaries"]
        assert enabled["provider_summaries"], "the enabled hosts remain candidates"
    finally:
        ledger.set_host_state("host3", disabled=False)
    traits = _get(cloud, f"/resource_providers/{rp}/traits", admin).json()["traits"]
    assert "COMPUTE_STATUS_DISABLED" not in traits


def test_compute_host_aggregates_are_provider_aggregates(
    cloud: RunningCloud, ledger: Ledger, admin: dict[str, str]
) -> None:
    """Nova mirrors host aggregates into placement by uuid; here they are the same record."""
    _, rp, _ = _hosts(ledger)["host2"]
    objects = ObjectStore(ledger.engine)
    agg_uuid, agg_id = str(uuid.uuid4()), str(900000 + uuid.uuid4().int % 99999)
    name = f"agg-{agg_uuid[:8]}"
    body = {"name": name, "uuid": agg_uuid, "hosts": ["host2"], "metadata": {}}
    objects.create("aggregate", agg_id, body, name=name)
    try:
        rows = cloud.osc_json("resource", "provider", "list", "--member-of", agg_uuid)
        assert [row["uuid"] for row in rows] == [rp]
        shown = _get(cloud, f"/resource_providers/{rp}/aggregates", admin).json()
        assert shown["aggregates"] == [agg_uuid]
        latest = {**admin, "OpenStack-API-Version": "placement 1.32"}
        outside = _get(
            cloud, "/allocation_candidates", latest, resources="VCPU:1", member_of=f"!{agg_uuid}"
        ).json()
        assert outside["provider_summaries"]
        assert rp not in outside["provider_summaries"]
        bad = _get(cloud, "/resource_providers", admin, member_of="not-a-uuid")
        assert bad.status_code == 400
    finally:
        objects.delete("aggregate", agg_id)


def test_resource_classes_list_the_standard_ones_and_custom_ones(
    cloud: RunningCloud, admin: dict[str, str]
) -> None:
    custom = f"CUSTOM_RC{uuid.uuid4().hex[:10].upper()}"
    url = f"{cloud.base_url}/placement/resource_classes"
    assert httpx.put(f"{url}/{custom}", headers=admin).status_code == 201
    try:
        names = [row["name"] for row in cloud.osc_json("resource", "class", "list")]
        assert {"VCPU", "PCPU", "MEMORY_MB", "DISK_GB", "VGPU", custom} <= set(names)
        assert names.index("VCPU") < names.index(custom)
    finally:
        assert httpx.delete(f"{url}/{custom}", headers=admin).status_code == 204
    assert httpx.delete(f"{url}/VCPU", headers=admin).status_code == 400


def test_inventory_writes_compare_the_generation_and_refuse_to_drop_below_usage(
    cloud: RunningCloud, ledger: Ledger, admin: dict[str, str]
) -> None:
    host_id, rp, _ = _hosts(ledger)["host1"]
    url = f"{cloud.base_url}/placement/resource_providers/{rp}/inventories"
    consumer = str(uuid.uuid4())
    claim = Claim(consumer, consumer, host_id, {ResourceClass.VCPU: 2}, NO_NUMA)
    assert ledger.claim([claim])[0].ok
    try:
        before = _get(cloud, f"/resource_providers/{rp}/inventories", admin).json()
        generation = before["resource_provider_generation"]
        vcpu = before["inventories"]["VCPU"]
        too_small = httpx.put(
            f"{url}/VCPU",
            headers=admin,
            json={
                **vcpu,
                "total": 1,
                "allocation_ratio": 1.0,
                "resource_provider_generation": generation,
            },
        )
        assert too_small.status_code == 409
        assert too_small.json()["errors"][0]["code"] == "placement.inventory.inuse"
        dropped = httpx.delete(f"{url}/VCPU", headers=admin)
        assert dropped.status_code == 409
        assert dropped.json()["errors"][0]["code"] == "placement.inventory.inuse"
        stale = httpx.put(
            f"{url}/DISK_GB",
            headers=admin,
            json={"total": 1000, "resource_provider_generation": generation - 1},
        )
        assert stale.status_code == 409
        assert stale.json()["errors"][0]["code"] == "placement.concurrent_update"

        with ledger.engine.connect() as conn:
            seq_before = conn.execute(select(func.max(changes.c.seq))).scalar_one()
        disk = before["inventories"]["DISK_GB"]
        shown = cloud.osc_json(
            "resource", "provider", "inventory", "class", "set", rp, "DISK_GB",
            "--total", str(disk["total"]), "--reserved", "10",
            "--max_unit", str(disk["max_unit"]),
        )  # fmt: skip
        assert shown["reserved"] == 10
        after = _get(cloud, f"/resource_providers/{rp}/inventories", admin).json()
        assert after["resource_provider_generation"] == generation + 1
        assert after["inventories"]["DISK_GB"]["reserved"] == 10
        with ledger.engine.connect() as conn:
            logged = conn.execute(
                select(changes.c.host_id, changes.c.writer).where(changes.c.seq > seq_before)
            ).all()
        assert (host_id, None) in logged, "schedulers must see the inventory change"
        summary = _get(cloud, "/allocation_candidates", admin, resources="DISK_GB:1").json()
        assert summary["provider_summaries"][rp]["resources"]["DISK_GB"]["capacity"] == (
            disk["total"] - 10
        )
        restored = httpx.put(
            f"{url}/DISK_GB",
            headers=admin,
            json={**disk, "resource_provider_generation": generation + 1},
        )
        assert restored.status_code == 200
        assert restored.json()["reserved"] == 0
        unknown = httpx.put(
            url,
            headers=admin,
            json={
                "resource_provider_generation": generation + 2,
                "inventories": {**after["inventories"], "CUSTOM_NOPE": {"total": 1}},
            },
        )
        assert unknown.status_code == 400
        assert "CUSTOM_NOPE" in unknown.json()["errors"][0]["detail"]
    finally:
        assert ledger.release(consumer)


def test_errors_have_placement_shape_and_members_are_forbidden(
    cloud: RunningCloud, admin: dict[str, str]
) -> None:
    missing = _get(cloud, f"/resource_providers/{uuid.uuid4()}", admin)
    assert missing.status_code == 404
    [error] = missing.json()["errors"]
    assert error["status"] == 404
    assert error["title"] == "Not Found"
    assert "No resource provider with uuid" in error["detail"]
    assert error["code"] == "placement.undefined_code"
    assert error["request_id"] == missing.headers["x-openstack-request-id"]
    assert missing.headers["openstack-api-version"] == PLACEMENT

    old = _get(cloud, "/traits", {**admin, "OpenStack-API-Version": "placement 1.5"})
    assert old.status_code == 404
    assert "code" not in old.json()["errors"][0], "codes start at 1.23"

    member = {"X-Auth-Token": cloud.token("demo", "stowage-demo", "demo")}
    for path in ("/resource_providers", "/traits", "/allocation_candidates?resources=VCPU:1"):
        denied = httpx.get(
            f"{cloud.base_url}/placement{path}",
            headers={**member, "OpenStack-API-Version": PLACEMENT},
        )
        assert denied.status_code == 403, path
        assert denied.json()["errors"][0]["detail"].startswith("Policy does not allow")
    result = cloud.osc("resource", "provider", "list", cloud="stowage", check=False)
    assert result.returncode != 0
    assert "Policy does not allow placement:resource_providers:list" in result.stderr

    created = httpx.post(
        f"{cloud.base_url}/placement/resource_providers", headers=admin, json={"name": "x"}
    )
    assert created.status_code == 409
    assert created.json()["errors"][0]["code"] == "placement.ledger_managed"
    bad = _get(cloud, "/resource_providers", admin, resources="VCPU:x")
    assert bad.status_code == 400
    assert "VCPU" in bad.json()["errors"][0]["detail"]
