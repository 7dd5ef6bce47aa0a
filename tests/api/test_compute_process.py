"""`stowage up --compute-process`: the conductor and the agents in a second process beside the
APIs', on the same ledger. What the one-process cloud does, it does (boots, the agents' calls,
their metrics); a killed compute process is started again and finishes what was in flight;
no compute process outlives its cloud."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tests.api.cloudproc import IMAGE, RunningCloud, start_cloud, stop_cloud


def _compute_pids(parent: int) -> list[int]:
    """The parent's child processes that run the compute side (multiprocessing's spawn)."""
    found = []
    for task in Path(f"/proc/{parent}/task").iterdir():
        for pid in (task / "children").read_text().split():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except FileNotFoundError:
                continue
            if b"spawn_main" in cmdline:
                found.append(int(pid))
    return found


def _bound_paths(pid: int) -> list[Path]:
    """The paths of the Unix sockets process `pid` has bound."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(FileNotFoundError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    paths = []
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) == 8 and fields[6] in inodes:
            paths.append(Path(fields[7]))
    return paths


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


def _wait(predicate: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.1)
    pytest.fail(f"not within {timeout_s} s: {what}")


@pytest.fixture
def cloud(tmp_path: Path) -> Iterator[RunningCloud]:
    running = start_cloud(tmp_path / "state", "--compute-process", "--hosts", "2")
    try:
        yield running
    finally:
        stop_cloud(running)


def _status(cloud: RunningCloud, server_id: str) -> str:
    response = cloud.compute("GET", f"/servers/{server_id}")
    assert response.status_code == 200, response.text
    return str(response.json()["server"]["status"])


def test_the_compute_side_runs_in_its_own_process_and_serves_the_api(
    cloud: RunningCloud,
) -> None:
    [child] = _compute_pids(cloud.process.pid)
    assert child != cloud.process.pid

    server = cloud.boot("split-1")
    assert server["status"] == "ACTIVE"
    # The agents' calls cross to the compute process: the console log, the simulated
    # hypervisors' controls and view.
    log = cloud.osc("console", "log", "show", server["id"]).stdout
    assert f"sim: {server['id']} booted" in log
    hosts = cloud.compute("GET", "/os-stowage-sim").json()["hosts"]
    assert [h["host"] for h in hosts] == ["host1", "host2"]
    running = {i for h in hosts for i in h["instances"]}
    assert server["id"] in running
    # The agents' metrics come through the API's /metrics.
    metrics = httpx.get(f"{cloud.base_url}/metrics", headers={"X-Auth-Token": cloud.token()})
    assert metrics.status_code == 200
    assert 'stowage_reconcile_passes_total{host="host1"}' in metrics.text


def test_a_killed_compute_process_is_started_again_and_ends_the_build_it_held(
    cloud: RunningCloud,
) -> None:
    # Every spawn hangs on both hosts: the build is held by the agent when the process dies.
    for host in ("host1", "host2"):
        fault = {"fault": {"operation": "spawn", "step": "define", "action": "hang"}}
        answer = cloud.compute("POST", f"/os-stowage-sim/{host}/action", json=fault)
        assert answer.status_code == 200, answer.text
    created = cloud.compute(
        "POST",
        "/servers",
        json={
            "server": {
                "name": "held",
                "imageRef": cloud.osc_json("image", "show", IMAGE)["id"],
                "flavorRef": "1",
                "networks": "none",
            }
        },
    )
    assert created.status_code == 202, created.text
    server_id = created.json()["server"]["id"]
    assert _status(cloud, server_id) == "BUILD"

    [child] = _compute_pids(cloud.process.pid)
    os.kill(child, signal.SIGKILL)
    # A new compute process (its simulated hypervisors without the fault) takes the build
    # over from the ledger and ends it.
    _wait(lambda: _status(cloud, server_id) == "ACTIVE", 60, "the held build ACTIVE")
    [again] = _compute_pids(cloud.process.pid)
    assert again != child
    assert "the compute process" in cloud.log.read_text()


def test_no_compute_process_outlives_its_cloud(tmp_path: Path) -> None:
    stopped = start_cloud(tmp_path / "stopped", "--compute-process", "--hosts", "1")
    [child] = _compute_pids(stopped.process.pid)
    stop_cloud(stopped)
    _wait(lambda: not _alive(child), 30, "the compute process gone after its cloud stopped")

    killed = start_cloud(tmp_path / "killed", "--compute-process", "--hosts", "1")
    [child] = _compute_pids(killed.process.pid)
    sockets = _bound_paths(child)
    assert len(sockets) == 2  # the kick and the control sockets
    killed.process.kill()  # no goodbye: the child sees its pipe close
    killed.process.wait()
    _wait(lambda: not _alive(child), 30, "the compute process gone after its parent was killed")
    for path in sockets:
        assert not path.parent.exists()


def test_no_compute_process_keeps_the_cloud_in_one_process(tmp_path: Path) -> None:
    single = start_cloud(tmp_path / "single", "--no-compute-process", "--hosts", "1")
    try:
        assert _compute_pids(single.process.pid) == []
        assert single.boot("alone")["status"] == "ACTIVE"
    finally:
        stop_cloud(single)


def test_a_sigterm_to_the_whole_group_stops_both_processes_in_turn(tmp_path: Path) -> None:
    """An init system stops a service by signalling its whole process group: the compute
    process waits for its parent to stop it (its agents and conductor end their work), rather
    than die at the signal while the APIs still run."""
    cloud = start_cloud(tmp_path / "state", "--compute-process", "--hosts", "1", new_session=True)
    try:
        [child] = _compute_pids(cloud.process.pid)
        os.killpg(cloud.process.pid, signal.SIGTERM)
        assert cloud.process.wait(timeout=60) == 0
        _wait(lambda: not _alive(child), 30, "the compute process gone")
        text = cloud.log.read_text()
        assert "the compute process stopped (told to)" in text, text
        assert "starting it again" not in text
    finally:
        if cloud.process.poll() is None:
            cloud.process.kill()
            cloud.process.wait()


def test_a_closed_handle_starts_no_compute_process(tmp_path: Path) -> None:
    """The cloud's stop closes the handle while its watchdog may be starting the process
    again: the start finishes first and is then stopped, and no start comes after the close,
    so no compute process is left for nobody to stop."""
    import threading

    from stowage.agent.compute_process import ComputeProcess
    from stowage.services.cloud import CloudConfig
    from stowage.services.runtime import open_cloud

    config = CloudConfig(state_dir=tmp_path / "state", hosts=1)
    cloud = open_cloud(config)
    url = cloud.ledger.engine.url.render_as_string(hide_password=False)
    handle = ComputeProcess(config, url, log_format="kv", log_level="warning")
    started: list[BaseException | None] = []

    def start() -> None:
        try:
            handle.start()
            started.append(None)
        except BaseException as exc:
            started.append(exc)

    try:
        starting = threading.Thread(target=start)
        starting.start()
        _wait(lambda: handle.pid is not None, 60, "the start under way")
        pid = handle.pid
        assert pid is not None
        handle.close()  # waits for the start, then stops what it started
        starting.join(timeout=60)
        assert started == [None]
        assert not _alive(pid)
        with pytest.raises(RuntimeError, match="stopped"):
            handle.start()
    finally:
        handle.close()
        cloud.ledger.close()
