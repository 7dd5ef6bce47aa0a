"""The seed "compute agent stuck on busy disk": reproduced with a naive agent, gone with ours."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from stowage.agent.runtime import Agent, AgentConfig, LagWatchdog, percentile
from stowage.virt.driver import Driver, DriverCrashed, InstanceState
from stowage.virt.sim import FaultKind, SimConfig, SimDriver

INTERVAL_S = 0.2
CHUNK_BYTES = 256 * 1024
DISK_BYTES = 4 * CHUNK_BYTES  # four chunks: 2 s per snapshot at 0.5 s a chunk


@pytest.fixture
def driver(tmp_path: Path) -> Iterator[SimDriver]:
    sim = SimDriver(SimConfig(disk_bytes=DISK_BYTES, seed=7), disk_dir=tmp_path / "disks")
    yield sim
    sim.close()


def _config(**overrides: float) -> AgentConfig:
    base: dict[str, float] = {
        "heartbeat_interval_s": INTERVAL_S,
        "lag_interval_s": 0.02,
        "chunk_bytes": CHUNK_BYTES,
        "max_workers": 4,
        "max_concurrent_disk_ops": 5,
    }
    base.update(overrides)
    return AgentConfig(**base)  # type: ignore[arg-type]


async def _naive_snapshot(driver: Driver, instance_id: str, sink: list[bytes]) -> None:
    """What nova-compute did before the fix: read the disk on the event loop."""
    for chunk in driver.read_disk(instance_id, CHUNK_BYTES):
        sink.append(chunk)
        await asyncio.sleep(0)  # yields between chunks, yet every read still blocks the loop


def _spawn_all(driver: SimDriver, ids: list[str]) -> None:
    for iid in ids:
        driver.spawn(iid, {0: 2, 1: 3}, [0], 512)


def test_naive_agent_reading_on_the_loop_misses_heartbeats(driver: SimDriver) -> None:
    """Proves the test can see the failure: heartbeat gaps far beyond the interval."""
    _spawn_all(driver, ["vm-0"])
    driver.config.slow_disk_s = 0.5

    async def scenario() -> Agent:
        agent = Agent(driver, heartbeat=lambda: None, config=_config())
        async with agent:
            await asyncio.sleep(0.3)
            got: list[bytes] = []
            await _naive_snapshot(driver, "vm-0", got)
            await asyncio.sleep(0.3)
        assert len(b"".join(got)) == DISK_BYTES
        return agent

    agent = asyncio.run(scenario())
    # Each blocking read holds the loop for 0.5 s; yielding between reads does not help,
    # since a beat needs two turns of the loop (its timer, then its executor's answer).
    assert agent.heartbeat_gap_max_s > 4 * INTERVAL_S, list(agent.heartbeat_gaps_s)
    assert agent.watchdog.lag_max_s > 0.45
    assert agent.watchdog.stalls >= 1


def test_agent_keeps_heartbeating_through_five_snapshots_on_a_saturated_disk(
    driver: SimDriver,
) -> None:
    ids = [f"vm-{i}" for i in range(5)]
    _spawn_all(driver, ids)
    expected = {iid: hashlib.sha256((driver.disk_dir / f"{iid}.img").read_bytes()) for iid in ids}
    driver.config.slow_disk_s = 0.5
    beats: list[float] = []

    digests = {iid: hashlib.sha256() for iid in ids}

    def sink_for(iid: str) -> Callable[[bytes], Awaitable[None]]:
        async def sink(chunk: bytes) -> None:
            digests[iid].update(chunk)
            await asyncio.sleep(0)  # an upload would await the network here

        return sink

    async def scenario() -> tuple[Agent, list[bool], float]:
        agent = Agent(driver, heartbeat=lambda: beats.append(time.monotonic()), config=_config())

        async with agent:
            start = time.monotonic()
            snaps = [asyncio.create_task(agent.snapshot(iid, sink_for(iid))) for iid in ids]
            await asyncio.sleep(0.3)  # the disk is saturated now
            spawned = await agent.spawn("op-spawn", "vm-new", {0: 8}, [1], 1024)
            rebooted = await agent.reboot("op-reboot", "vm-0")
            ops_done_s = time.monotonic() - start
            sizes = await asyncio.gather(*snaps)
            assert sizes == [DISK_BYTES] * len(ids)
        return agent, [spawned.ok, rebooted.ok], ops_done_s

    agent, oks, ops_done_s = asyncio.run(scenario())

    assert oks == [True, True]
    assert ops_done_s < 1.0, "driver calls must not queue behind the disk"
    assert {iid: d.hexdigest() for iid, d in digests.items()} == {
        iid: d.hexdigest() for iid, d in expected.items()
    }
    assert len(agent.heartbeat_gaps_s) >= 10
    assert len(beats) == len(agent.heartbeat_gaps_s) + 1
    assert agent.heartbeat_gap_max_s < 0.6, list(agent.heartbeat_gaps_s)
    assert agent.watchdog.lag_max_s < 0.1
    assert agent.watchdog.stalls == 0
    assert driver.running()["vm-new"]["state"] is InstanceState.RUNNING


def test_disk_ops_are_limited_by_max_concurrent_disk_ops(driver: SimDriver) -> None:
    ids = [f"vm-{i}" for i in range(4)]
    _spawn_all(driver, ids)
    driver.config.slow_disk_s = 0.05
    in_flight = 0
    in_flight_max = 0
    real_chunks = driver._chunks

    def counting_chunks(disk: Path, chunk_bytes: int) -> Iterator[bytes]:
        nonlocal in_flight, in_flight_max
        in_flight += 1
        in_flight_max = max(in_flight_max, in_flight)
        try:
            yield from real_chunks(disk, chunk_bytes)
        finally:
            in_flight -= 1

    driver._chunks = counting_chunks  # type: ignore[method-assign]

    async def scenario() -> list[int]:
        async with Agent(driver, lambda: None, _config(max_concurrent_disk_ops=2)) as agent:
            return await asyncio.gather(*(agent.snapshot(iid, _discard) for iid in ids))

    assert asyncio.run(scenario()) == [DISK_BYTES] * 4
    assert in_flight_max == 2


async def _discard(chunk: bytes) -> None:
    del chunk


def test_a_redelivered_op_id_runs_once(driver: SimDriver) -> None:
    driver.config.step_latency_s["spawn.start"] = 0.1

    async def scenario() -> None:
        async with Agent(driver, lambda: None, _config()) as agent:
            # Redelivered while running, and again after it finished.
            first, second = await asyncio.gather(
                agent.spawn("op-1", "vm-a", {0: 1}, [0], 256),
                agent.spawn("op-1", "vm-a", {0: 1}, [0], 256),
            )
            third = await agent.spawn("op-1", "vm-a", {0: 1}, [0], 256)
            assert first.ok
            assert first == second == third
            # A different op id is a different operation, even on the same instance.
            again = await agent.spawn("op-2", "vm-a", {0: 1}, [0], 256)
            assert not again.ok
            assert again.error_code == "virt.exists"

    asyncio.run(scenario())
    assert driver.calls.count(("spawn", "vm-a")) == 2


def test_destroying_what_is_not_there_is_no_warning(
    driver: SimDriver, caplog: pytest.LogCaptureFixture
) -> None:
    """A live migration's source clean-up destroys a guest the hypervisor already let go:
    before, every migration left a warning that the destroy "failed"; it is the asked state."""
    _spawn_all(driver, ["vm-0"])

    async def scenario() -> None:
        async with Agent(driver, lambda: None, _config()) as agent:
            gone = await agent.destroy("op-1", "vm-gone")
            assert (gone.ok, gone.error_code) == (False, "virt.instance.not_found")
            failed = await agent.reboot("op-2", "vm-gone")  # any other op: still a warning
            assert not failed.ok

    with caplog.at_level(logging.INFO, logger="stowage.agent.runtime"):
        asyncio.run(scenario())
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "reboot" in warned[0], warned
    assert any("not on this host" in r.getMessage() for r in caplog.records)


def test_injected_failure_is_an_error_result(driver: SimDriver) -> None:
    _spawn_all(driver, ["vm-0"])
    driver.inject("reboot", "start", FaultKind.FAIL)

    async def scenario() -> None:
        async with Agent(driver, lambda: None, _config()) as agent:
            failed = await agent.reboot("op-1", "vm-0")
            assert not failed.ok
            assert failed.error_code == "virt.sim.injected"
            assert "reboot.start" in (failed.error or "")
            assert (await agent.reboot("op-2", "vm-0")).ok  # the fault fired once

    asyncio.run(scenario())


def test_a_hung_step_times_out_and_the_agent_stays_healthy(driver: SimDriver) -> None:
    _spawn_all(driver, ["vm-0", "vm-1"])
    driver.inject("power_off", "stop", FaultKind.HANG)

    async def scenario() -> Agent:
        agent = Agent(driver, lambda: None, _config())
        async with agent:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(agent.power_off("op-hang", "vm-0"), timeout=0.5)
            # Other work goes on while one driver thread is stuck.
            assert (await agent.reboot("op-2", "vm-1")).ok
            await asyncio.sleep(0.3)
            driver.release_hangs()
            released = await agent.power_off("op-hang", "vm-0")  # redelivery: same run
            assert not released.ok
            assert released.error_code == "virt.sim.released"
        return agent

    agent = asyncio.run(scenario())
    assert driver.calls.count(("power_off", "vm-0")) == 1
    assert agent.heartbeat_gap_max_s < 0.6


def test_an_injected_crash_raises_a_distinct_exception(driver: SimDriver) -> None:
    driver.inject("spawn", "define", FaultKind.CRASH)

    async def scenario() -> None:
        async with Agent(driver, lambda: None, _config()) as agent:
            with pytest.raises(DriverCrashed):
                await agent.spawn("op-1", "vm-c", {0: 1}, [0], 256)
            with pytest.raises(DriverCrashed):  # redelivered: the same outcome, no rerun
                await agent.spawn("op-1", "vm-c", {0: 1}, [0], 256)

    asyncio.run(scenario())
    assert driver.calls.count(("spawn", "vm-c")) == 1


def test_a_failing_heartbeat_is_counted_and_the_next_one_goes_out() -> None:
    calls = 0

    def heartbeat() -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise ConnectionError("bus unreachable")

    sim = SimDriver()
    try:

        async def scenario() -> Agent:
            async with Agent(sim, heartbeat, _config(heartbeat_interval_s=0.05)) as agent:
                await asyncio.sleep(0.3)
            return agent

        agent = asyncio.run(scenario())
    finally:
        sim.close()
    assert agent.heartbeat_failures == 1
    assert calls >= 4


def test_percentile_by_nearest_rank() -> None:
    assert percentile([], 0.99) == 0.0
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([float(i) for i in range(1, 101)], 0.99) == 99.0
    assert percentile([5.0], 0.01) == 5.0


def test_watchdogs_on_one_loop_share_one_sleeper_and_each_sees_a_stall() -> None:
    """Twenty watchdogs on one loop (as `stowage up`'s simulated hosts share the compute
    loop): one task sleeps for all of them, each records every wake-up and the stall, one
    stopping does not stop the others, and the last stopping leaves nothing on the loop."""

    def sleepers() -> list[asyncio.Task[Any]]:
        return [
            t
            for t in asyncio.all_tasks()
            if t.get_name() == "agent-watchdog-sleeper" and not t.done()
        ]

    async def scenario() -> tuple[list[LagWatchdog], int, list[int], int]:
        dogs = [LagWatchdog(0.01, 0.2, 1000) for _ in range(20)]
        tasks = [asyncio.create_task(dog.run()) for dog in dogs]
        await asyncio.sleep(0.1)
        shared = len(sleepers())
        time.sleep(0.3)  # the loop held: one stall, seen by every watchdog
        await asyncio.sleep(0.05)
        tasks[0].cancel()
        await asyncio.gather(tasks[0], return_exceptions=True)
        stopped = len(dogs[0].samples)
        await asyncio.sleep(0.1)
        counts = [stopped, *(len(dog.samples) for dog in dogs[1:])]
        for task in tasks[1:]:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0)
        return dogs, shared, counts, len(sleepers())

    dogs, shared, counts, left = asyncio.run(scenario())
    assert shared == 1
    assert [dog.stalls for dog in dogs] == [1] * 20
    assert all(dog.lag_max_s > 0.25 for dog in dogs)
    assert len(set(counts[1:])) == 1 and counts[1] > counts[0] + 3, counts
    assert left == 0
