"""Recovery of the production processes on PostgreSQL and RabbitMQ: processes that start at
the same moment on a fresh ledger bootstrap it once; every conductor killed with `kill -9`
while it holds operations, and the restarted conductors finish them at once (not after the
lease); a second conductor of one name waits and then takes over; a restarted simulated
agent keeps its guests and its servers stay ACTIVE/Running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, func, select
from tests.api.cloudproc import BIN, IMAGE, RunningCloud, free_port
from tests.conftest import pg_schema_url

from stowage.ledger.operations import ACTIVE_STATES
from stowage.ledger.schema import objects, operations

pytestmark = pytest.mark.postgres


@pytest.fixture
def pg_url() -> Iterator[str]:
    yield from pg_schema_url()


class Processes:
    """The production processes of one cloud, started and killed one by one."""

    def __init__(self, tmp_path: Path, pg_url: str) -> None:
        self.tmp = tmp_path
        self.db = pg_url
        self.state = tmp_path / "state"
        self.common = ("--state-dir", str(self.state), "--db", pg_url)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.engine = create_engine(pg_url.replace("postgresql://", "postgresql+psycopg://", 1))
        self._starts: dict[str, int] = {}

    def spawn(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        n = self._starts[name] = self._starts.get(name, 0) + 1
        log = self.tmp / f"{name}.{n}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [str(BIN / "stowage"), *args], stdout=out, stderr=subprocess.STDOUT
            )
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.{self._starts[name]}.log").read_text()

    def api(self) -> None:
        self.spawn("api", "api", *self.common, "--port", str(self.port))

    def conductor(self, name: str | None, *args: str, key: str | None = None) -> None:
        """A conductor of `name`, or of the default name (the host name) when None."""
        named = ("--name", name) if name else ()
        self.spawn(key or name or "conductor", "conductor", *self.common, *named, *args)

    def agent(self, host: str) -> None:
        self.spawn(host, "agent", "--host", host, *self.common, "--heartbeat-interval", "1")

    def kill9(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    def wait_api(self) -> RunningCloud:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert self.procs["api"].poll() is None, self.log("api")
            try:
                if httpx.get(f"{self.base}/identity/v3", timeout=1).status_code == 200:
                    return RunningCloud(self.base, self.state, self.procs["api"], self.tmp)
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise AssertionError("the API did not come up")

    def wait_up(self, cloud: RunningCloud, hosts: list[str]) -> None:
        def up() -> bool:
            rows = cloud.compute("GET", "/os-services?binary=nova-compute").json()["services"]
            return sorted(r["host"] for r in rows if r["state"] == "up") == sorted(hosts)

        until(up, 60, "compute services up")

    def ops(self) -> list[tuple[str, str | None]]:
        """(state, owner) of every unfinished operation."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(operations.c.state, operations.c.owner).where(
                    operations.c.state.in_(ACTIVE_STATES)
                )
            ).all()
        return [(str(s), o) for s, o in rows]

    def count(self, kind: str) -> int:
        with self.engine.connect() as conn:
            return int(
                conn.execute(select(func.count()).where(objects.c.kind == kind)).scalar() or 0
            )

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.engine.dispose()
        for log in sorted(self.tmp.glob("*.log")):
            if "Traceback" in log.read_text():
                print(f"--- {log.name} ---\n{log.read_text()}")


@pytest.fixture
def procs(tmp_path: Path, pg_url: str) -> Iterator[Processes]:
    processes = Processes(tmp_path, pg_url)
    try:
        yield processes
    finally:
        processes.close()


def until(check: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Seconds it took until `check()`; fails after `timeout_s`."""
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout_s, f"timed out waiting for {what}"
        time.sleep(0.2)
    return time.monotonic() - start


def create(cloud: RunningCloud, name: str, count: int, host: str) -> list[str]:
    images = httpx.get(
        f"{cloud.base_url}/image/v2/images?name={IMAGE}",
        headers={"X-Auth-Token": cloud.token()},
        timeout=30,
    ).json()["images"]
    body = {
        "server": {
            "name": name,
            "flavorRef": "1",
            "imageRef": images[0]["id"],
            "networks": "none",
            "min_count": count,
            "max_count": count,
            "availability_zone": f"nova:{host}",
            "return_reservation_id": True,
        }
    }
    response = cloud.compute("POST", "/servers", json=body)
    assert response.status_code == 202, response.text
    reservation = response.json()["reservation_id"]
    servers = cloud.compute("GET", f"/servers?reservation_id={reservation}").json()["servers"]
    assert len(servers) == count
    return [str(s["id"]) for s in servers]


def shown(cloud: RunningCloud, ids: list[str]) -> list[tuple[Any, Any]]:
    out = []
    for server_id in ids:
        body = cloud.compute("GET", f"/servers/{server_id}").json()["server"]
        out.append((body["status"], body["OS-EXT-STS:power_state"]))
    return out


RACER = """
import sys, time
from pathlib import Path
from stowage.services.cloud import CloudConfig
from stowage.services.runtime import open_cloud
time.sleep(max(0.0, float(sys.argv[3]) - time.time()))
cloud = open_cloud(CloudConfig(state_dir=Path(sys.argv[1]), hosts=0), db_url=sys.argv[2])
cloud.ledger.close()
"""


def test_processes_started_at_once_on_a_fresh_ledger_bootstrap_it_once(
    procs: Processes,
) -> None:
    host = f"boot-{uuid.uuid4().hex[:6]}"
    # As an init system starts them: every process at once, on an empty database; and
    # six more openers released at one instant, so the bootstraps surely overlap.
    at = time.time() + 3.0
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, str(procs.state), procs.db, str(at)],
            stderr=subprocess.PIPE,
        )
        for _ in range(6)
    ]
    procs.api()
    procs.conductor("boot-c1")
    procs.agent(host)
    failures = []
    for racer in racers:
        _, stderr = racer.communicate(timeout=120)
        if racer.returncode != 0:
            failures.append(stderr.decode()[-2000:])
    assert failures == []
    cloud = procs.wait_api()
    procs.wait_up(cloud, [host])
    for name, proc in procs.procs.items():
        assert proc.poll() is None, procs.log(name)
    counts = {k: procs.count(k) for k in ("domain", "role", "project", "user", "flavor")}
    assert counts == {"domain": 1, "role": 5, "project": 3, "user": 2, "flavor": 8}
    assert procs.count("image") == 1 and procs.count("network") == 2
    [server] = create(cloud, "boot-vm", 1, host)
    until(lambda: shown(cloud, [server]) == [("ACTIVE", 1)], 60, "the server ACTIVE")


def test_every_conductor_killed_holding_operations_and_restarted_finishes_them_at_once(
    procs: Processes,
) -> None:
    host = f"lease-{uuid.uuid4().hex[:6]}"
    procs.api()
    cloud = procs.wait_api()
    procs.agent(host)
    # Leases of the default 60 s; each agent call may wait 30 s, so a frozen agent keeps
    # the conductors holding their operations.
    for name in ("lease-c1", "lease-c2"):
        procs.conductor(name, "--op-timeout", "30")
    procs.wait_up(cloud, [host])
    [first] = create(cloud, "warm", 1, host)
    until(lambda: shown(cloud, [first]) == [("ACTIVE", 1)], 60, "the first server")

    agent = procs.procs[host]
    agent.send_signal(signal.SIGSTOP)
    ids = create(cloud, "held", 4, host)
    until(
        lambda: len([o for o in procs.ops() if o[1] in ("lease-c1", "lease-c2")]) == 4,
        30,
        "the conductors to hold the builds",
    )
    procs.kill9("lease-c1")
    procs.kill9("lease-c2")
    agent.send_signal(signal.SIGCONT)
    # Restarted under their names (a shorter lease for what follows): they take back their
    # own leases at once, well before the 60 s the dead ones were leased for.
    for name in ("lease-c1", "lease-c2"):
        procs.conductor(name, "--op-timeout", "5", "--lease-seconds", "4")
    took = until(lambda: shown(cloud, ids) == [("ACTIVE", 1)] * 4, 25, "the held builds")
    assert took < 25
    assert procs.ops() == []

    # Killed again while holding leases of 4 s: a conductor of another name takes over
    # once they run out, long before the default 60 s.
    agent.send_signal(signal.SIGSTOP)
    more = create(cloud, "held-again", 2, host)
    until(
        lambda: len([o for o in procs.ops() if o[1] in ("lease-c1", "lease-c2")]) == 2,
        30,
        "the restarted conductors to hold the builds",
    )
    procs.kill9("lease-c1")
    procs.kill9("lease-c2")
    agent.send_signal(signal.SIGCONT)
    procs.conductor("lease-c3", "--op-timeout", "5")
    until(lambda: shown(cloud, more) == [("ACTIVE", 1)] * 2, 25, "the builds after the lease")

    # A second conductor of the same name waits while the first lives, then takes over.
    procs.conductor("lease-c3", "--op-timeout", "5", key="lease-c3-twin")
    until(lambda: "waits until it ends" in procs.log("lease-c3-twin"), 30, "the twin to wait")
    procs.kill9("lease-c3")
    [last] = create(cloud, "after-twin", 1, host)
    until(lambda: shown(cloud, [last]) == [("ACTIVE", 1)], 30, "the twin to take over")
    assert "running" in procs.log("lease-c3-twin")


def test_a_restarted_sim_agent_keeps_its_guests_and_its_servers_stay_active(
    procs: Processes,
) -> None:
    host = f"keep-{uuid.uuid4().hex[:6]}"
    procs.api()
    cloud = procs.wait_api()
    procs.agent(host)
    procs.conductor(None, "--op-timeout", "5")
    procs.wait_up(cloud, [host])
    ids = create(cloud, "keep", 3, host)
    until(lambda: shown(cloud, ids) == [("ACTIVE", 1)] * 3, 60, "the servers")
    assert cloud.compute("POST", f"/servers/{ids[0]}/action", json={"os-stop": None}).is_success
    until(lambda: shown(cloud, ids[:1]) == [("SHUTOFF", 4)], 30, "the stopped server")

    procs.kill9(host)
    procs.agent(host)
    procs.wait_up(cloud, [host])

    def runs() -> dict[str, Any]:
        for agent in cloud.compute("GET", "/os-stowage-sim").json()["hosts"]:
            if agent["host"] == host:
                return dict(agent["instances"])
        return {}

    until(lambda: sorted(runs()) == sorted(ids), 30, "the guests back on the hypervisor")
    assert [runs()[i]["state"] for i in ids] == ["shutoff", "running", "running"]
    response = cloud.compute("POST", f"/os-stowage-hosts/{host}/reconcile")
    assert response.status_code == 200, response.text
    assert response.json()["reconcile"]["divergences"] == []
    assert shown(cloud, ids) == [("SHUTOFF", 4), ("ACTIVE", 1), ("ACTIVE", 1)]
    assert procs.count("instance_fault") == 0
    audit = subprocess.run(
        [str(BIN / "stowage"), "audit", "--db", procs.db],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ},
    )
    assert audit.returncode == 0, audit.stdout + audit.stderr
