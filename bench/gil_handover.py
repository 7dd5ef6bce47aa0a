"""What a SQLite write transaction costs when other threads of its process want the interpreter.

    .venv/bin/python bench/gil_handover.py [--statements 7] [--busy 0,1,4,16]
                                           [--intervals 5,0.5] [--transactions 200]

One thread runs write transactions (BEGIN IMMEDIATE, `--statements - 2` inserts, COMMIT) on a
fresh SQLite file in WAL mode while `--busy` other threads of the process spin in Python,
for each switch interval (`sys.setswitchinterval`, in ms). Every statement lets go of the
interpreter while SQLite runs it; getting it back means waiting for the threads that took it.
The line with 0 busy threads is the baseline, measured in the same run. The figure that
matters for `stowage up` is the wall time of a transaction against its CPU: the writer holds
SQLite's write lock for all of it (docs/performance.md, sessions 18 and 19).
"""

from __future__ import annotations

import argparse
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path


def measure(busy: int, interval_s: float, statements: int, transactions: int) -> str:
    sys.setswitchinterval(interval_s)
    with tempfile.TemporaryDirectory(prefix="stowage-bench-gil-") as folder:
        db = sqlite3.connect(Path(folder) / "t.db", isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute("CREATE TABLE t (k INTEGER PRIMARY KEY, v TEXT)")
        stop = threading.Event()

        def spin() -> None:
            x = 0
            while not stop.is_set():
                for i in range(1000):
                    x += i

        spinners = [threading.Thread(target=spin, daemon=True) for _ in range(busy)]
        for thread in spinners:
            thread.start()
        time.sleep(0.2)
        walls: list[float] = []
        cpus: list[float] = []
        try:
            for _ in range(transactions):
                wall, cpu = time.perf_counter(), time.thread_time()
                db.execute("BEGIN IMMEDIATE")
                for _ in range(statements - 2):
                    db.execute("INSERT INTO t (v) VALUES (?)", ("x" * 100,))
                db.execute("COMMIT")
                walls.append(time.perf_counter() - wall)
                cpus.append(time.thread_time() - cpu)
        finally:
            stop.set()
            for thread in spinners:
                thread.join()
            db.close()
    return (
        f"{busy:>3} busy threads, switch interval {interval_s * 1e3:4.1f} ms: a transaction of "
        f"{statements} statements {statistics.median(walls) * 1e3:7.2f} ms wall (median), "
        f"{statistics.fmean(walls) * 1e3:7.2f} ms mean, "
        f"{statistics.fmean(cpus) * 1e3:5.2f} ms of the writer's CPU"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--statements", type=int, default=7)
    parser.add_argument("--busy", default="0,1,4,16")
    parser.add_argument("--intervals", default="5,0.5", help="switch intervals in ms")
    parser.add_argument("--transactions", type=int, default=200)
    args = parser.parse_args()
    if args.statements < 3:
        parser.error("--statements counts BEGIN and COMMIT: at least 3")
    for busy in (int(b) for b in args.busy.split(",")):
        for interval in (float(i) / 1e3 for i in args.intervals.split(",")):
            print(measure(busy, interval, args.statements, args.transactions), flush=True)


if __name__ == "__main__":
    main()
