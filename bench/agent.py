"""Agent benchmark: heartbeats and event-loop lag while N snapshots read a saturated disk.

For N = 1, 5, 10 concurrent snapshots from a `SimDriver` whose every chunk read blocks
`--slow-disk-s`, it prints the heartbeat gap p50/p99/max and the loop lag p99/max of the
real `Agent`, then the same for a naive agent that reads the disk on its event loop (what
nova-compute did before its snapshot upload moved to a native thread). Figures only.

Run `.venv/bin/python bench/agent.py --help`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from stowage.agent.runtime import Agent, AgentConfig, percentile
from stowage.virt.sim import SimConfig, SimDriver


async def _discard(chunk: bytes) -> None:
    del chunk


async def _real(agent: Agent, driver: SimDriver, ids: list[str]) -> None:
    await asyncio.gather(*(agent.snapshot(iid, _discard) for iid in ids))


async def _naive(agent: Agent, driver: SimDriver, ids: list[str]) -> None:
    async def one(iid: str) -> None:
        for chunk in driver.read_disk(iid, agent.config.chunk_bytes):  # blocks the loop
            await _discard(chunk)
            await asyncio.sleep(0)

    await asyncio.gather(*(one(iid) for iid in ids))


Workload = Callable[[Agent, SimDriver, list[str]], Coroutine[Any, Any, None]]


def run(workload: Workload, n: int, args: argparse.Namespace) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="stowage-bench-agent-") as tmp:
        disk_bytes = args.chunks * args.chunk_kib * 1024
        driver = SimDriver(SimConfig(disk_bytes=disk_bytes), disk_dir=Path(tmp))
        ids = [f"vm-{i}" for i in range(n)]
        for iid in ids:
            driver.spawn(iid, {0: 0}, [0], 512)
        driver.config.slow_disk_s = args.slow_disk_s
        config = AgentConfig(
            heartbeat_interval_s=args.interval_s,
            lag_interval_s=args.lag_interval_s,
            chunk_bytes=args.chunk_kib * 1024,
            max_concurrent_disk_ops=args.disk_ops,
        )

        async def scenario() -> tuple[Agent, float]:
            agent = Agent(driver, lambda: None, config)
            async with agent:
                start = time.monotonic()
                await workload(agent, driver, ids)
                elapsed_s = time.monotonic() - start
                await asyncio.sleep(args.interval_s)  # one more beat after the work
            return agent, elapsed_s

        agent, elapsed_s = asyncio.run(scenario())
        driver.close()
    gaps = list(agent.heartbeat_gaps_s)
    return {
        "elapsed_s": elapsed_s,
        "beats": float(len(gaps) + 1),
        "gap_p50_s": percentile(gaps, 0.50),
        "gap_p99_s": percentile(gaps, 0.99),
        "gap_max_s": max(gaps, default=0.0),
        "lag_p99_s": agent.watchdog.lag_p99_s,
        "lag_max_s": agent.watchdog.lag_max_s,
        "stalls": float(agent.watchdog.stalls),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", default="1,5,10", help="concurrent snapshots, comma-separated")
    parser.add_argument("--slow-disk-s", type=float, default=0.2, help="block per chunk read")
    parser.add_argument("--chunks", type=int, default=5, help="chunks per instance disk")
    parser.add_argument("--chunk-kib", type=int, default=256)
    parser.add_argument("--interval-s", type=float, default=0.2, help="heartbeat interval")
    parser.add_argument("--lag-interval-s", type=float, default=0.02)
    parser.add_argument("--disk-ops", type=int, default=4, help="max_concurrent_disk_ops")
    parser.add_argument("--skip-naive", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)  # stalls are counted in the table instead

    print(
        f"heartbeat every {args.interval_s} s; disk read blocks {args.slow_disk_s} s per "
        f"{args.chunk_kib} KiB chunk; {args.chunks} chunks per disk; "
        f"max_concurrent_disk_ops={args.disk_ops}"
    )
    header = (
        f"{'agent':<6} {'N':>3} {'elapsed_s':>9} {'beats':>5} {'gap_p50':>8} {'gap_p99':>8} "
        f"{'gap_max':>8} {'lag_p99':>8} {'lag_max':>8} {'stalls':>6}"
    )
    print(header)
    variants: list[tuple[str, Workload]] = [("agent", _real)]
    if not args.skip_naive:
        variants.append(("naive", _naive))
    for name, workload in variants:
        for n in (int(x) for x in args.n.split(",")):
            r = run(workload, n, args)
            print(
                f"{name:<6} {n:>3} {r['elapsed_s']:>9.2f} {int(r['beats']):>5} "
                f"{r['gap_p50_s']:>8.3f} {r['gap_p99_s']:>8.3f} {r['gap_max_s']:>8.3f} "
                f"{r['lag_p99_s']:>8.3f} {r['lag_max_s']:>8.3f} {int(r['stalls']):>6}"
            )


if __name__ == "__main__":
    main()
