"""Soak: 20 hosts, 50 concurrent live migrations, cold migrations and evacuations of pinned and
grouped instances, with random injected failures (failed and crashing steps, stopped agents);
after each seed the ledger audits clean, every operation and migration has ended, and every
hypervisor runs exactly what the ledger places on it.

One seed runs in CI; `STOWAGE_SOAK_SEEDS=1,2,3,...` runs more (scripts/soak.sh). A failure
names its seed, and the same seed makes the same choices.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, select
from tests.api.cloudproc import RunningCloud, start_cloud, stop_cloud
from tests.e2e.test_seed_evacuation_anti_affinity import audit_is_clean
from tests.e2e.test_seed_stale_migration import sim

from stowage.ledger.schema import operations

SEEDS = [int(s) for s in os.environ.get("STOWAGE_SOAK_SEEDS", "7").split(",") if s.strip()]
HOSTS = 20
OPS = 50
STOPPED = 3  # hosts whose agents stop: their instances are evacuated
ENDED = {"completed", "confirmed", "reverted", "failed", "cancelled", "done"}


@pytest.fixture(params=SEEDS, ids=[f"seed{s}" for s in SEEDS])
def seeded(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[int, RunningCloud]]:
    cloud = start_cloud(
        tmp_path / "state",
        "--hosts", str(HOSTS), "--op-timeout", "2", "--heartbeat-interval", "1",
        "--service-down-time", "4",
    )  # fmt: skip
    yield request.param, cloud
    stop_cloud(cloud)


class Api:
    """The compute API with an admin token, safe to share between threads."""

    def __init__(self, cloud: RunningCloud) -> None:
        self.base = f"{cloud.base_url}/compute/v2.1"
        self.headers = {"X-Auth-Token": cloud.token(), "OpenStack-API-Version": "compute 2.96"}
        self.client = httpx.Client(timeout=120)

    def call(self, method: str, path: str, body: Any = None) -> httpx.Response:
        return self.client.request(method, self.base + path, headers=self.headers, json=body)


def boot(api: Api, name: str, flavor: str, group: str | None, seed: int) -> str:
    body: dict[str, Any] = {
        "server": {
            "name": name,
            "flavorRef": flavor,
            "imageRef": IMAGE_ID[0],
            "networks": "none",
        }
    }
    if group:
        body["os:scheduler_hints"] = {"group": group}
    response = api.call("POST", "/servers", body)
    assert response.status_code == 202, f"seed {seed}: {response.text}"
    return str(response.json()["server"]["id"])


IMAGE_ID: list[str] = []


def servers(api: Api) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = api.call("GET", "/servers/detail?all_tenants=1").json()["servers"]
    return found


def test_soak(seeded: tuple[int, RunningCloud]) -> None:
    seed, cloud = seeded
    api = Api(cloud)
    try:
        soak(seed, cloud, api)
    finally:
        api.client.close()


def soak(seed: int, cloud: RunningCloud, api: Api) -> None:
    rng = random.Random(seed)
    IMAGE_ID[:] = [cloud.osc_json("image", "show", "cirros-0.6.2-x86_64-disk")["id"]]
    cloud.osc("quota", "set", "--cores", "1000", "--instances", "1000", "--ram", "10000000",
              "admin")  # fmt: skip
    groups = [
        api.call(
            "POST",
            "/os-server-groups",
            {"server_group": {"name": f"g{i}", "policy": policy}},
        ).json()["server_group"]["id"]
        for i, policy in enumerate(["anti-affinity", "anti-affinity", "affinity"])
    ]
    ids: list[str] = []
    for i in range(40):
        flavor = "c1" if i % 2 else "1"  # m1.pinned or m1.tiny
        group = groups[i % 3] if i < 12 else None
        ids.append(boot(api, f"soak-{i}", flavor, group, seed))

    # Random failures: steps that fail or crash the agent on some hosts, some agents stopped.
    hosts = [f"host{i}" for i in range(1, HOSTS + 1)]
    for host in rng.sample(hosts, 4):
        step = rng.choice([("spawn", "define"), ("spawn", "start"), ("destroy", "stop")])
        action = rng.choice(["fail", "crash"])
        sim(cloud, "fault", host, *step, "--action", action, "--times", str(rng.randint(1, 3)))
    placed = {s["id"]: s["OS-EXT-SRV-ATTR:host"] for s in servers(api)}
    stopped = rng.sample(sorted({h for h in placed.values() if h}), STOPPED)
    for host in stopped:
        sim(cloud, "stop", host)
    time.sleep(5)  # past the service-down time: those hosts are down

    def one(index: int) -> tuple[str, int]:
        op_rng = random.Random(seed * 1000 + index)
        server = op_rng.choice(ids)
        on_stopped = placed.get(server) in stopped
        if on_stopped:
            action: dict[str, Any] = {"evacuate": {}}
        else:
            action = op_rng.choice(
                [{"os-migrateLive": {"host": None, "block_migration": "auto"}}, {"migrate": {}}]
            )
        response = api.call("POST", f"/servers/{server}/action", action)
        return next(iter(action)), response.status_code

    with ThreadPoolExecutor(OPS) as pool:
        outcomes = list(pool.map(one, range(OPS)))
    assert all(code < 500 for _, code in outcomes), f"seed {seed}: {outcomes}"
    assert any(code in (200, 202) for _, code in outcomes), f"seed {seed}: {outcomes}"

    # Heal: faults cleared, agents back; then everything must settle on its own.
    for host in hosts:
        sim(cloud, "clear", host)
    for host in stopped:
        sim(cloud, "start", host)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        waiting = [s for s in servers(api) if s["status"] == "VERIFY_RESIZE"]
        for s in waiting:
            api.call("POST", f"/servers/{s['id']}/action", {"confirmResize": None})
        if (
            not waiting
            and not _active_operations(cloud)
            and all(s["OS-EXT-STS:task_state"] is None for s in servers(api))
        ):
            break
        time.sleep(1)
    assert _active_operations(cloud) == [], f"seed {seed}: operations still running"
    migrations = api.call("GET", "/os-migrations").json()["migrations"]
    unended = [(m["id"], m["status"]) for m in migrations if m["status"] not in ENDED]
    assert not unended, f"seed {seed}: migrations not ended: {unended}"
    audit_is_clean(cloud)

    # Every hypervisor runs exactly what the ledger places on it, with the claimed pins.
    shown = {h["host"]: h["instances"] for h in json.loads(sim(cloud, "show", "--json"))}
    for s in servers(api):
        host = s["OS-EXT-SRV-ATTR:host"]
        if host is None:  # a build that failed: it holds nothing and runs nowhere
            assert all(s["id"] not in running for running in shown.values()), (
                f"seed {seed}: {s['id']} has no host but still runs somewhere"
            )
            continue
        elsewhere = [h for h, running in shown.items() if s["id"] in running and h != host]
        assert s["id"] in shown[host] and not elsewhere, f"seed {seed}: {s['id']} on {host}"
        topology = api.call("GET", f"/servers/{s['id']}/topology").json()
        claimed = {
            v: c for node in topology.get("nodes", []) for v, c in node["cpu_pinning"].items()
        }
        assert dict(shown[host][s["id"]]["pins"]) == claimed, (
            f"seed {seed}: pins of {s['id']} differ from the claim"
        )
    for group in groups[:2]:
        members = api.call("GET", f"/os-server-groups/{group}").json()["server_group"]["members"]
        placed_now = [
            s["OS-EXT-SRV-ATTR:host"]
            for s in servers(api)
            if s["id"] in members and s["OS-EXT-SRV-ATTR:host"]
        ]
        assert len(placed_now) == len(set(placed_now)), f"seed {seed}: anti-affinity {placed_now}"


def _active_operations(cloud: RunningCloud) -> list[tuple[str, str, str]]:
    engine = create_engine(f"sqlite:///{cloud.state_dir / 'ledger.db'}")
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                select(operations.c.kind, operations.c.step, operations.c.host).where(
                    operations.c.state.in_(["pending", "unknown"])
                )
            ).all()
    finally:
        engine.dispose()
    return [tuple(r) for r in rows]  # type: ignore[misc]
