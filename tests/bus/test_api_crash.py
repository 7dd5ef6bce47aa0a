"""Production processes on PostgreSQL and RabbitMQ, for what the in-process tests cannot
reach: the API killed with SIGKILL in the middle of concurrent moves and creates leaves
nothing that no process will finish; and seed 000 across processes: ten members of an
anti-affinity group evacuated at once through `stowage api --workers 4` and two
conductors, every one landing on a host of its own."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, func, select
from tests.api.cloudproc import RunningCloud, free_port
from tests.bus.test_processes import spawn
from tests.conftest import pg_schema_url

from stowage.ledger.schema import objects, operations

pytestmark = pytest.mark.postgres

ACTIVE = ("pending", "unknown")


@pytest.fixture
def pg_url() -> Iterator[str]:
    yield from pg_schema_url()


def start_api(tmp_path: Path, common: tuple[str, ...], port: int, *extra: str) -> Any:
    log = tmp_path / f"api-{uuid.uuid4().hex[:4]}.log"
    api = spawn(log, "api", *common, "--port", str(port), *extra)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert api.poll() is None, log.read_text()
        try:
            if httpx.get(f"{base}/identity/v3", timeout=1).status_code == 200:
                return api, RunningCloud(base, common_state(common), api, log)
        except httpx.HTTPError:
            time.sleep(0.3)
    raise AssertionError(f"the API did not answer: {log.read_text()}")


def common_state(common: tuple[str, ...]) -> Path:
    return Path(common[common.index("--state-dir") + 1])


def wait_up(cloud: RunningCloud, hosts: list[str], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            rows = cloud.compute("GET", "/os-services?binary=nova-compute").json()["services"]
        except httpx.TimeoutException:  # a machine busy starting twenty processes
            continue
        if {r["host"] for r in rows if r["state"] == "up"} >= set(hosts):
            return
        time.sleep(0.5)
    raise AssertionError(f"hosts not up: {hosts}")


def image_id(cloud: RunningCloud, token: str) -> str:
    return str(
        cloud.compute("GET", "/images", token=token, version="2.35").json()["images"][0]["id"]
    )


def create(cloud: RunningCloud, token: str, name: str, **server: Any) -> httpx.Response:
    body = {"name": name, "flavorRef": "1", "imageRef": image_id(cloud, token), "networks": "none"}
    body.update(server)
    return cloud.compute("POST", "/servers", token=token, json={"server": body})


def until(check: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def quiet(url: str, *, but: tuple[str, ...] = ()) -> bool:
    """No operation is open (but those of the kinds `but` names)."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return not conn.execute(
                select(func.count())
                .select_from(operations)
                .where(operations.c.state.in_(ACTIVE), operations.c.kind.not_in(but))
            ).scalar_one()
    finally:
        engine.dispose()


def statuses(url: str) -> dict[str, tuple[str, Any]]:
    import json

    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                select(objects.c.id, objects.c.body).where(objects.c.kind == "instance")
            ).all()
            migration_rows = conn.execute(
                select(objects.c.body).where(objects.c.kind == "migration")
            ).scalars()
            migrations = [json.loads(b)["status"] for b in migration_rows]
    finally:
        engine.dispose()
    out = {r.id: (json.loads(r.body)["status"], json.loads(r.body)["task_state"]) for r in rows}
    out["migrations"] = ("", migrations)
    return out


def audit(url: str, state: Path) -> subprocess.CompletedProcess[str]:
    from tests.api.cloudproc import BIN

    return subprocess.run(
        [
            str(BIN / "stowage"),
            "audit",
            "--state-dir",
            str(state),
            "--db",
            url,
            "--stale-after",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def stop_all(procs: list[Any]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_api_killed_mid_moves_and_creates_leaves_nothing_stuck(tmp_path: Path, pg_url: str) -> None:
    """Before the fix: two servers MIGRATING for good, migrations `pre-migrating` with no
    destination and no operation, a claim held on a would-be destination; `stowage audit`
    called the ledger clean."""
    state = tmp_path / "state"
    common = ("--state-dir", str(state), "--db", pg_url)
    port = free_port()
    api, cloud = start_api(tmp_path, common, port)
    suffix = uuid.uuid4().hex[:6]
    hosts = [f"k-{suffix}-{i}" for i in range(3)]
    procs = [api]
    procs.append(spawn(tmp_path / "conductor.log", "conductor", *common, "--op-timeout", "5"))
    for host in hosts:
        procs.append(
            spawn(
                tmp_path / f"{host}.log",
                "agent",
                "--host",
                host,
                *common,
                "--heartbeat-interval",
                "1",
                "--driver",
                "sim",
            )
        )
    try:
        wait_up(cloud, hosts)
        token = cloud.token()
        cloud.compute(
            "PUT",
            "/os-quota-sets/" + cloud_project(cloud, token),
            token=token,
            json={"quota_set": {"instances": -1, "cores": -1, "ram": -1}},
        )
        ids = []
        for i, host in enumerate(hosts * 2):
            made = create(cloud, token, f"vm{i}", availability_zone=f"nova:{host}")
            assert made.status_code == 202, made.text
            ids.append(made.json()["server"]["id"])
        until(
            lambda: all(
                s == ("ACTIVE", None) for k, s in statuses(pg_url).items() if k != "migrations"
            ),
            120,
            "six servers ACTIVE",
        )

        def fire(i: int) -> int:
            with httpx.Client(timeout=30) as http:
                headers = {"X-Auth-Token": token, "OpenStack-API-Version": "compute 2.96"}
                url = f"{cloud.base_url}/compute/v2.1"
                try:
                    if i < len(ids):
                        action = {"os-migrateLive": {"host": None}} if i % 2 else {"migrate": {}}
                        r = http.post(
                            f"{url}/servers/{ids[i]}/action", headers=headers, json=action
                        )
                    else:
                        body = {
                            "server": {
                                "name": f"new{i}",
                                "flavorRef": "1",
                                "imageRef": image_id(cloud, token),
                                "networks": "none",
                            }
                        }
                        r = http.post(f"{url}/servers", headers=headers, json=body)
                    return r.status_code
                except httpx.HTTPError:
                    return -1  # the API died under it

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(fire, i) for i in range(16)]
            time.sleep(0.4)
            os.kill(api.pid, signal.SIGKILL)
            answered = [f.result() for f in futures]
        assert -1 in answered or all(a in (202, 409) for a in answered), answered
        api.wait(timeout=10)
        api2, cloud = start_api(tmp_path, common, port)
        procs.append(api2)
        until(lambda: quiet(pg_url), 180, "every operation ended")
        shown = statuses(pg_url)
        migrations = shown.pop("migrations")[1]
        assert all(m in ("completed", "finished", "failed", "done") for m in migrations), migrations
        for server_id, (status, task) in shown.items():
            assert task is None and status in ("ACTIVE", "VERIFY_RESIZE", "ERROR"), (
                server_id,
                status,
                task,
            )
        result = audit(pg_url, state)
        assert result.returncode == 0, result.stdout + result.stderr
    finally:
        stop_all(procs)


def cloud_project(cloud: RunningCloud, token: str) -> str:
    response = httpx.get(
        f"{cloud.base_url}/identity/v3/auth/tokens",
        headers={"X-Auth-Token": token, "X-Subject-Token": token},
    )
    return str(response.json()["token"]["project"]["id"])


MEMBERS = 10


def test_ten_members_evacuated_at_once_across_api_workers_and_two_conductors(
    tmp_path: Path, pg_url: str
) -> None:
    """Seed 000 in production: today an in-process lock of one API process serialized the
    evacuations; across four API workers and two conductors only the ledger stands between
    them and a broken anti-affinity policy."""
    state = tmp_path / "state"
    common = ("--state-dir", str(state), "--db", pg_url)
    port = free_port()
    api, cloud = start_api(tmp_path, common, port, "--workers", "4")
    suffix = uuid.uuid4().hex[:6]
    down = [f"d-{suffix}-{i}" for i in range(MEMBERS)]
    spare = [f"s-{suffix}-{i}" for i in range(MEMBERS)]
    procs = [api]
    procs += [
        spawn(tmp_path / f"c{i}.log", "conductor", *common, "--op-timeout", "5") for i in (0, 1)
    ]
    agents = {
        host: spawn(
            tmp_path / f"{host}.log",
            "agent",
            "--host",
            host,
            *common,
            "--heartbeat-interval",
            "2",
            "--driver",
            "sim",
        )
        for host in down
    }
    procs += list(agents.values())
    try:
        wait_up(cloud, down, 180)
        token = cloud.token()
        project = cloud_project(cloud, token)
        cloud.compute(
            "PUT",
            f"/os-quota-sets/{project}",
            token=token,
            json={"quota_set": {"instances": -1, "cores": -1, "ram": -1}},
        )
        group = cloud.compute(
            "POST",
            "/os-server-groups",
            token=token,
            json={"server_group": {"name": "anti", "policies": ["anti-affinity"]}},
            version="2.1",
        ).json()["server_group"]["id"]
        ids = []
        for host in down:
            made = cloud.compute(
                "POST",
                "/servers",
                token=token,
                json={
                    "server": {
                        "name": f"m-{host}",
                        "flavorRef": "1",
                        "imageRef": image_id(cloud, token),
                        "networks": "none",
                        "availability_zone": f"nova:{host}",
                    },
                    "os:scheduler_hints": {"group": group},
                },
            )
            assert made.status_code == 202, made.text
            ids.append(made.json()["server"]["id"])
        until(
            lambda: all(
                s == ("ACTIVE", None) for k, s in statuses(pg_url).items() if k != "migrations"
            ),
            180,
            "members ACTIVE",
        )
        # The spare hosts come up only now, so every member sits on a host of the first set.
        for host in spare:
            procs.append(
                spawn(
                    tmp_path / f"{host}.log",
                    "agent",
                    "--host",
                    host,
                    *common,
                    "--heartbeat-interval",
                    "2",
                    "--driver",
                    "sim",
                )
            )
        wait_up(cloud, spare, 180)
        for host in down:
            agents[host].terminate()
            agents[host].wait(timeout=20)
            forced = cloud.compute(
                "PUT",
                "/os-services/force-down",
                token=token,
                version="2.11",
                json={"host": host, "binary": "nova-compute", "forced_down": True},
            )
            assert forced.status_code == 200, forced.text

        def evacuate(server_id: str) -> int:
            return cloud.compute(
                "POST", f"/servers/{server_id}/action", token=token, json={"evacuate": {}}
            ).status_code

        with concurrent.futures.ThreadPoolExecutor(MEMBERS) as pool:
            answers = list(pool.map(evacuate, ids))
        assert answers == [200] * MEMBERS, answers
        # The down hosts' clean-ups wait for their agents to come back; the rest must end.
        until(lambda: quiet(pg_url, but=("cleanup",)), 180, "every evacuation ended")
        placed = {}
        for server_id in ids:
            shown = cloud.compute("GET", f"/servers/{server_id}", token=token).json()["server"]
            assert shown["status"] == "SHUTOFF", shown  # evacuated at 2.95+: stopped, as Nova
            placed[server_id] = shown["OS-EXT-SRV-ATTR:host"]
        assert set(placed.values()) <= set(spare)
        assert len(set(placed.values())) == MEMBERS  # one host each: the policy held
        result = audit(pg_url, state)
        # Only the down hosts' clean-ups may wait (an undriven operation, by design).
        lines = [ln for ln in result.stdout.splitlines() if ln.strip().startswith("[")]
        assert all("undriven_operation" in ln and "cleanup" in ln for ln in lines), result.stdout
    finally:
        stop_all(procs)
