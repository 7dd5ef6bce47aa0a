"""Admin and tenant writes that race: requests sent at once through the real API each land
whole (no lost update, no quota passed, one flavor of a name). Before these went through a
service's compare-and-swap or lock, the handlers read, changed and wrote the document back,
and concurrent requests overwrote each other."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from tests.api.cloudproc import RunningCloud


def _at_once(calls: list[Any]) -> list[httpx.Response]:
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda call: call(), calls))


def test_extra_specs_set_at_once_are_all_kept(cloud: RunningCloud) -> None:
    name = f"race-{uuid.uuid4().hex[:6]}"
    token = cloud.token()
    created = cloud.compute(
        "POST",
        "/flavors",
        token=token,
        json={"flavor": {"name": name, "ram": 512, "vcpus": 1, "disk": 1}},
    )
    assert created.status_code == 200, created.text
    flavor_id = created.json()["flavor"]["id"]
    keys = [f"stowage:race{i}" for i in range(16)]
    answers = _at_once(
        [
            lambda key=key: cloud.compute(
                "POST",
                f"/flavors/{flavor_id}/os-extra_specs",
                token=token,
                json={"extra_specs": {key: "1"}},
            )
            for key in keys
        ]
    )
    assert [a.status_code for a in answers] == [200] * len(keys)
    specs = cloud.compute("GET", f"/flavors/{flavor_id}/os-extra_specs", token=token).json()
    assert set(specs["extra_specs"]) == set(keys)
    cloud.compute("DELETE", f"/flavors/{flavor_id}", token=token)


def test_flavors_of_one_name_created_at_once_make_one(cloud: RunningCloud) -> None:
    name = f"twin-{uuid.uuid4().hex[:6]}"
    token = cloud.token()
    answers = _at_once(
        [
            lambda i=i: cloud.compute(
                "POST",
                "/flavors",
                token=token,
                json={
                    "flavor": {"name": name, "ram": 512, "vcpus": 1, "disk": 1, "id": f"{name}-{i}"}
                },
            )
            for i in range(8)
        ]
    )
    assert sorted(a.status_code for a in answers) == [200] + [409] * 7
    listed = cloud.compute("GET", "/flavors?is_public=None", token=token).json()["flavors"]
    assert [f["name"] for f in listed].count(name) == 1
    winner = next(a.json()["flavor"]["id"] for a in answers if a.status_code == 200)
    cloud.compute("DELETE", f"/flavors/{winner}", token=token)


def test_key_pairs_created_at_once_stop_at_the_quota(cloud: RunningCloud) -> None:
    suffix = uuid.uuid4().hex[:6]
    project, user, password = f"kp-{suffix}", f"kp-user-{suffix}", "kp-password-1"
    cloud.osc("project", "create", project)
    cloud.osc("user", "create", "--password", password, user)
    cloud.osc("role", "add", "--user", user, "--project", project, "member")
    cloud.osc("quota", "set", "--key-pairs", "3", project)
    token = cloud.token(user, password, project)
    answers = _at_once(
        [
            lambda i=i: cloud.compute(
                "POST",
                "/os-keypairs",
                token=token,
                version="2.91",  # the last that generates a key pair
                json={"keypair": {"name": f"k{i}"}},
            )
            for i in range(10)
        ]
    )
    codes = sorted(a.status_code for a in answers)
    assert codes == [201] * 3 + [403] * 7, codes
    listed = cloud.compute("GET", "/os-keypairs", token=token).json()["keypairs"]
    assert len(listed) == 3


def test_hosts_added_to_one_aggregate_at_once_all_land(cloud: RunningCloud) -> None:
    token = cloud.token()
    name = f"agg-{uuid.uuid4().hex[:6]}"
    created = cloud.compute(
        "POST", "/os-aggregates", token=token, json={"aggregate": {"name": name}}
    )
    assert created.status_code == 200, created.text
    agg = created.json()["aggregate"]["id"]
    hosts = ["host1", "host2", "host3"]  # the hosts `stowage up` starts
    answers = _at_once(
        [
            lambda host=host: cloud.compute(
                "POST",
                f"/os-aggregates/{agg}/action",
                token=token,
                json={"add_host": {"host": host}},
            )
            for host in hosts
        ]
    )
    assert [a.status_code for a in answers] == [200] * len(hosts)
    shown = cloud.compute("GET", f"/os-aggregates/{agg}", token=token).json()["aggregate"]
    assert sorted(shown["hosts"]) == hosts
    for host in hosts:
        cloud.compute(
            "POST",
            f"/os-aggregates/{agg}/action",
            token=token,
            json={"remove_host": {"host": host}},
        )
    assert cloud.compute("DELETE", f"/os-aggregates/{agg}", token=token).status_code == 200
