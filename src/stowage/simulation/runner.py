"""Run many seeds and report: each failure with its seed and faults, then the figures."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from stowage.simulation.faults import FaultKind
from stowage.simulation.world import RunConfig, RunResult, run

__all__ = ["Summary", "parse_seeds", "run_seeds"]


def parse_seeds(text: str) -> range:
    """`N` or `A-B` (both ends included)."""
    first, sep, last = text.partition("-")
    if not sep:
        return range(int(first), int(first) + 1)
    if int(last) < int(first):
        raise ValueError(f"empty seed range {text!r}")
    return range(int(first), int(last) + 1)


@dataclass(slots=True)
class Summary:
    seeds: int = 0
    failed: list[RunResult] = field(default_factory=list)
    faults: int = 0
    wall_s: float = 0.0
    hashes: dict[int, str] = field(default_factory=dict)

    @property
    def seeds_per_s(self) -> float:
        return self.seeds / self.wall_s if self.wall_s else 0.0

    @property
    def faults_per_run(self) -> float:
        return self.faults / self.seeds if self.seeds else 0.0

    def figures(self) -> str:
        return (
            f"{self.seeds} seeds, {len(self.failed)} failed, {self.wall_s:.1f} s: "
            f"{self.seeds_per_s:.2f} seeds/s, {self.faults_per_run:.1f} faults injected per run"
        )


def run_seeds(
    seeds: Iterable[int],
    faults: frozenset[FaultKind],
    *,
    db_url: str | None = None,
    requests: int = 12,
    report: Callable[[RunResult], None] = lambda _r: None,
) -> Summary:
    summary = Summary()
    started = time.perf_counter()
    for seed in seeds:
        result = run(RunConfig(seed, faults=faults, db_url=db_url, requests=requests))
        summary.seeds += 1
        summary.faults += len(result.injected)
        summary.hashes[seed] = result.trace_hash
        if not result.ok:
            summary.failed.append(result)
        report(result)
    summary.wall_s = time.perf_counter() - started
    return summary
