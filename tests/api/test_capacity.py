"""`GET /os-stowage-capacity?fail_host=` and `stowage capacity`: a what-if that changes nothing.

The scenario needs to know every instance of its hosts, so it runs on a cloud of its own
rather than the session's shared one.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from tests.api.cloudproc import BIN, RunningCloud, start_cloud, stop_cloud

from stowage.ledger import Ledger
from stowage.ledger.db import READONLY, sqlite_url
from stowage.ledger.schema import consumers, group_slots, inventories, pins


@pytest.fixture(scope="module")
def own(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCloud]:
    running = start_cloud(tmp_path_factory.mktemp("capacity") / "state", "--hosts", "3")
    try:
        yield running
    finally:
        stop_cloud(running)


def claims(cloud: RunningCloud) -> dict[str, list[tuple[Any, ...]]]:
    """The cloud's claims as its ledger holds them (read-only, beside the running process)."""
    ledger = Ledger.open(sqlite_url(Path(cloud.state_dir) / "ledger.db"), upgrade=False)
    try:
        out = {}
        with ledger.engine.connect().execution_options(**READONLY) as conn:
            for table in (consumers, inventories, pins, group_slots):
                rows = conn.execute(select(table)).all()
                out[table.name] = sorted((tuple(r) for r in rows), key=repr)
        return out
    finally:
        ledger.close()


def capacity_cli(cloud: RunningCloud, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "stowage"), "capacity", "--state-dir", str(cloud.state_dir), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def room(body: dict[str, Any]) -> dict[str, int]:
    return {f["name"]: f["count"] for f in body["flavors"]}


def test_a_failed_hosts_instances_are_planned_apart_and_nothing_changes(
    own: RunningCloud,
) -> None:
    group = own.osc_json(
        "server", "group", "create", "--policy", "anti-affinity", f"g-{uuid.uuid4().hex[:6]}"
    )
    hint = ("--hint", f"group={group['id']}")
    member = own.boot("member-1", *hint, "--availability-zone", "nova:host1")
    own.boot("member-2", *hint, "--availability-zone", "nova:host2")
    pinned = own.boot("pinned-1", "--availability-zone", "nova:host1", flavor="m1.pinned")
    before = claims(own)

    response = own.compute("GET", "/os-stowage-capacity", params={"fail_host": "host1"})

    assert response.status_code == 200, response.text
    body = response.json()["capacity"]
    assert body["host"] == "host1" and body["fits"] is True
    where = {i["server_id"]: i["host"] for i in body["instances"]}
    assert where == {member["id"]: "host3", pinned["id"]: where[pinned["id"]]}
    assert where[pinned["id"]] in ("host2", "host3")
    names = {f["name"] for f in body["flavors"]}
    assert {"m1.tiny", "m1.pinned", "m1.xlarge"} <= names
    # 16 dedicated pCPUs per host; the evacuated pinned instance takes one of host2's or 3's.
    assert room(body)["m1.pinned"] == 2 * 16 - 1
    assert claims(own) == before
    assert [s["Status"] for s in own.osc_json("server", "list")] == ["ACTIVE"] * 3

    # One more pinned instance on host2 leaves exactly one fewer.
    own.boot("pinned-2", "--availability-zone", "nova:host2", flavor="m1.pinned")
    again = own.compute("GET", "/os-stowage-capacity", params={"fail_host": "host1"}).json()
    assert room(again["capacity"])["m1.pinned"] == 2 * 16 - 2

    # The command: a table, exit 0 when everything fits; --json gives the API's answer.
    shown = capacity_cli(own, "--fail-host", "host1")
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert member["id"] in shown.stdout and "host3" in shown.stdout
    assert "m1.pinned" in shown.stdout and "everything fits" in shown.stdout
    as_json = capacity_cli(own, "--fail-host", "host1", "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout)["instances"] == again["capacity"]["instances"]

    # A third member on host3: host1's member has nowhere left to go, and the command says so.
    own.boot("member-3", *hint, "--availability-zone", "nova:host3")
    before = claims(own)
    refused = capacity_cli(own, "--fail-host", "host1", "--json")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    answer = json.loads(refused.stdout)
    assert answer["fits"] is False
    stuck = {i["server_id"]: i for i in answer["instances"]}[member["id"]]
    assert stuck["host"] is None
    assert "No valid host was found" in stuck["reason"] and "server_group" in stuck["reason"]
    table = capacity_cli(own, "--fail-host", "host1")
    assert table.returncode == 1 and "nowhere" in table.stdout
    assert claims(own) == before
    assert own.osc_json("server", "migration", "list") == []


def test_capacity_is_for_admins_and_knows_its_hosts(own: RunningCloud) -> None:
    member = own.token("demo", "stowage-demo", "demo")
    forbidden = own.compute(
        "GET", "/os-stowage-capacity", params={"fail_host": "host1"}, token=member
    )
    assert forbidden.status_code == 403
    unknown = own.compute("GET", "/os-stowage-capacity", params={"fail_host": "host9"})
    assert unknown.status_code == 404
    assert "host9" in unknown.json()["itemNotFound"]["message"]
    assert own.compute("GET", "/os-stowage-capacity").status_code == 400
    missing = capacity_cli(own, "--fail-host", "host9")
    assert missing.returncode == 2 and "host9" in missing.stderr
