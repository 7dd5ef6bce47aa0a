"""Seed: parallel evacuations must not break anti-affinity (evacuation-breaks-anti-affinity.txt).

Run with the `openstack` CLI against `stowage up`, the evacuations fired at the same moment
as separate processes, as an operator's script would.
"""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.api.cloudproc import BIN, RunningCloud, start_cloud, stop_cloud


@pytest.fixture
def make_cloud(tmp_path: Path) -> Iterator[object]:
    started: list[RunningCloud] = []

    def make(hosts: int) -> RunningCloud:
        cloud = start_cloud(tmp_path / f"state{len(started)}", "--hosts", str(hosts))
        started.append(cloud)
        return cloud

    yield make
    for cloud in started:
        stop_cloud(cloud)


def place_group(cloud: RunningCloud, hosts: list[str]) -> tuple[str, list[str]]:
    """An anti-affinity group with one member on each of `hosts`; returns the server ids.

    The group with the CLI, the members through the API (faster than a CLI process each;
    the API answers once the build has finished)."""
    group = cloud.osc_json(
        "server", "group", "create", "--policy", "anti-affinity", f"anti-{uuid.uuid4().hex[:6]}"
    )
    token = cloud.token()
    image = cloud.compute("GET", "/images", token=token, version="2.35").json()["images"][0]
    ids = []
    for host in hosts:
        response = cloud.compute(
            "POST",
            "/servers",
            token=token,
            json={
                "server": {
                    "name": f"member-{host}",
                    "flavorRef": "1",
                    "imageRef": image["id"],
                    "networks": "none",
                    "availability_zone": f"nova:{host}",
                },
                "os:scheduler_hints": {"group": group["id"]},
            },
        )
        assert response.status_code == 202, response.text
        server_id = response.json()["server"]["id"]
        assert where(cloud, server_id, token)["status"] == "ACTIVE"
        ids.append(server_id)
    return group["id"], ids


def take_down(cloud: RunningCloud, hosts: list[str]) -> None:
    """The seed's hosts go down: their agents stop (as `stowage sim stop` does, like
    `systemctl stop nova-compute`) and the operator marks them forced down rather than wait
    for the timeout (`openstack compute service set --down`, through the API here)."""
    token = cloud.token()
    for host in hosts:
        stopped = cloud.compute(
            "POST", f"/os-stowage-sim/{host}/action", token=token, json={"stop": {}}
        )
        assert stopped.status_code == 200, stopped.text
        down = cloud.compute(
            "PUT",
            "/os-services/force-down",
            token=token,
            version="2.11",
            json={"host": host, "binary": "nova-compute", "forced_down": True},
        )
        assert down.status_code == 200, down.text


def evacuate_at_once(
    cloud: RunningCloud, server_ids: list[str]
) -> list[subprocess.CompletedProcess[str]]:
    """Start every `openstack server evacuate` before waiting for any."""
    procs = [
        subprocess.Popen(
            [str(BIN / "openstack"), "server", "evacuate", server_id],
            env=cloud.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for server_id in server_ids
    ]
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=180)
        out.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    return out


def where(cloud: RunningCloud, server_id: str, token: str | None = None) -> dict[str, Any]:
    """The server as the API shows it (status, host, fault)."""
    response = cloud.compute("GET", f"/servers/{server_id}", token=token)
    assert response.status_code == 200, response.text
    shown: dict[str, Any] = response.json()["server"]
    return shown


def audit_is_clean(cloud: RunningCloud) -> None:
    result = subprocess.run(
        [str(BIN / "stowage"), "audit", "--state-dir", str(cloud.state_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_two_members_three_hosts_one_lands_the_other_fails_clearly(make_cloud) -> None:  # type: ignore[no-untyped-def]
    cloud = make_cloud(3)
    _, ids = place_group(cloud, ["host1", "host2"])
    take_down(cloud, ["host1", "host2"])
    results = evacuate_at_once(cloud, ids)
    assert all(r.returncode == 0 for r in results), [r.stderr for r in results]
    servers = [where(cloud, i) for i in ids]
    # The CLI negotiates 2.95+, where Nova leaves an evacuated server stopped (SHUTOFF).
    landed = [s for s in servers if s["status"] == "SHUTOFF"]
    failed = [s for s in servers if s["status"] == "ERROR"]
    assert len(landed) == 1 and len(failed) == 1, [(s["status"], s.get("fault")) for s in servers]
    assert landed[0]["OS-EXT-SRV-ATTR:host"] == "host3"
    assert "No valid host was found" in str(failed[0]["fault"])
    assert "server_group" in str(failed[0]["fault"])
    migrations = cloud.osc_json("server", "migration", "list")
    assert sorted(m["Status"] for m in migrations) == ["done", "failed"]
    audit_is_clean(cloud)


def test_two_members_four_hosts_both_land_on_different_hosts(make_cloud) -> None:  # type: ignore[no-untyped-def]
    cloud = make_cloud(4)
    _, ids = place_group(cloud, ["host1", "host2"])
    take_down(cloud, ["host1", "host2"])
    evacuate_at_once(cloud, ids)
    servers = [where(cloud, i) for i in ids]
    assert [s["status"] for s in servers] == ["SHUTOFF", "SHUTOFF"]  # evacuated at 2.95+
    assert {s["OS-EXT-SRV-ATTR:host"] for s in servers} == {"host3", "host4"}
    audit_is_clean(cloud)


def test_ten_members_ten_down_hosts_ten_free_all_land_apart(make_cloud) -> None:  # type: ignore[no-untyped-def]
    cloud = make_cloud(20)
    down = [f"host{i}" for i in range(1, 11)]
    _, ids = place_group(cloud, down)
    take_down(cloud, down)
    evacuate_at_once(cloud, ids)
    servers = [where(cloud, i) for i in ids]
    evacuated = [s["status"] for s in servers]  # at 2.95+ (the CLI's), stopped
    assert evacuated == ["SHUTOFF"] * 10, [s.get("fault") for s in servers]
    landed = [s["OS-EXT-SRV-ATTR:host"] for s in servers]
    assert len(set(landed)) == 10, f"anti-affinity broken: {sorted(map(str, landed))}"
    assert not set(landed) & set(down)
    audit_is_clean(cloud)


def test_evacuating_from_a_host_that_is_up_is_refused(make_cloud) -> None:  # type: ignore[no-untyped-def]
    cloud = make_cloud(2)
    _, ids = place_group(cloud, ["host1"])
    result = cloud.osc("server", "evacuate", ids[0], check=False)
    assert result.returncode != 0
    assert "still in use" in result.stderr
    assert where(cloud, ids[0])["status"] == "ACTIVE"
    audit_is_clean(cloud)


def test_a_whole_host_is_evacuated_as_one_plan(make_cloud) -> None:  # type: ignore[no-untyped-def]
    """`stowage host evacuate`: every instance of a down host, re-planned together."""
    cloud = make_cloud(4)
    group, _ = place_group(cloud, ["host2", "host3"])
    ids = []
    for i in range(3):
        hint = ("--hint", f"group={group}") if i == 0 else ()
        server = cloud.boot(f"on-host1-{i}", *hint, "--availability-zone", "nova:host1")
        ids.append(server["id"])
    take_down(cloud, ["host1"])
    result = subprocess.run(
        [str(BIN / "stowage"), "host", "evacuate", "host1", "--state-dir", str(cloud.state_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("done on") == 3
    hosts = [where(cloud, i)["OS-EXT-SRV-ATTR:host"] for i in ids]
    assert "host1" not in hosts
    assert hosts[0] == "host4"  # the group member: host2 and host3 hold its siblings
    audit_is_clean(cloud)
