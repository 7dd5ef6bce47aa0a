"""Statements and transactions per boot, counted by the database engine, by where they are made.

    .venv/bin/python bench/statements.py [--servers 20] [--nics] [--db URL] [--calls]
                                         [--parallel 1]

An in-process cloud (the APIs, the conductor and one simulated agent per host on the in-process
bus, as `stowage up` runs them) on a fresh SQLite file (or `--db`): `--warm` creates first,
then `--servers` creates one after another through the compute API, each waited for until
ACTIVE. Every statement the ledger's engine runs meanwhile is counted (so the conductor's
polls are in it), grouped by statement kind and by the Stowage functions that made it, and
the stored documents decoded (a read that scans a whole kind shows here, growing with
`--warm`).

With `--calls`, the Python and C function calls of every thread per boot too (counted by a
profile hook, as `bench/api_calls.py --calls` does): the wait for ACTIVE then reads the ledger
once per write of an instance document instead of polling the API, so the count is the boot's
work and a few reads; the heaviest functions by calls made inside them follow.

These are counts, not timings: they do not move with the machine's load, which makes them the
figure to compare across commits for "how much work is a boot" (each transaction costs a
connection checkout, BEGIN and COMMIT or ROLLBACK; on PostgreSQL each statement a round trip).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import sys
import tempfile
import threading
import traceback
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import event

from api_calls import Calls  # bench/ is the script's folder
from stowage.agent.local import LocalCompute
from stowage.api.app import create_app
from stowage.domain.keystone import password_login
from stowage.ledger import Ledger
from stowage.ledger import objects as objects_module
from stowage.ledger.db import sqlite_scans
from stowage.services.cloud import Cloud, CloudConfig, bootstrap

_SKIP = ("/ledger/", "/telemetry/")
_NOT_THE_BOOTS: set[Any] = set()  # code of this script's counting and waiting (`--calls`)


def _where() -> str:
    frames = [
        f
        for f in traceback.extract_stack()
        if "/stowage/" in f.filename and not any(s in f.filename for s in _SKIP)
    ]
    return " / ".join(f"{f.name}:{f.lineno}" for f in frames[-2:]) or "(the conductor's loop)"


async def _settled(cloud: Cloud, server_id: str, changed: asyncio.Event) -> None:
    """Until the server is ACTIVE or ERROR, looking once per write of an instance document."""
    for _ in range(600):
        found = cloud.objects.find("instance", server_id)
        if found is not None and found.body.get("status") in ("ACTIVE", "ERROR"):
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.5):
                await changed.wait()
        changed.clear()
    raise SystemExit(f"{server_id} did not settle")


_NOT_THE_BOOTS.update({_where.__code__, _settled.__code__})


async def _boots(cloud: Cloud, args: argparse.Namespace, counting: list[bool]) -> None:
    app = create_app(cloud)
    auth = password_login("admin", "stowage-admin", "admin")
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://stowage") as http:
        login = await http.post("/identity/v3/auth/tokens", json=auth)
        headers = {
            "X-Auth-Token": login.headers["x-subject-token"],
            "OpenStack-API-Version": "compute 2.96",
        }
        project = login.json()["token"]["project"]["id"]
        changed = asyncio.Event()
        loop = asyncio.get_running_loop()
        cloud.objects.watch(["instance"], lambda: loop.call_soon_threadsafe(changed.set))
        unlimited = {"quota_set": {"instances": -1, "cores": -1, "ram": -1}}
        await http.put(f"/compute/v2.1/os-quota-sets/{project}", headers=headers, json=unlimited)
        image = (await http.get("/image/v2/images", headers=headers)).json()["images"][0]["id"]
        networks: Any = "none"
        if args.nics:
            listed = (await http.get("/networking/v2.0/networks", headers=headers)).json()
            private = [n["id"] for n in listed["networks"] if n["name"] == "private"]
            networks = [{"uuid": private[0]}]

        async def boot(name: str) -> None:
            body = {"name": name, "flavorRef": "1", "imageRef": image, "networks": networks}
            made = await http.post("/compute/v2.1/servers", headers=headers, json={"server": body})
            assert made.status_code == 202, made.text
            server_id = made.json()["server"]["id"]
            if args.calls:
                await _settled(cloud, server_id, changed)
                return
            for _ in range(600):
                shown = await http.get(f"/compute/v2.1/servers/{server_id}", headers=headers)
                if shown.json()["server"]["status"] in ("ACTIVE", "ERROR"):
                    return
                await asyncio.sleep(0.02)
            raise SystemExit(f"{name} did not settle")

        for i in range(args.warm):
            await boot(f"warm-{i}")

        async def chain(first: int) -> None:
            for i in range(first, args.servers, args.parallel):
                await boot(f"counted-{i}")

        counting[0] = True
        await asyncio.gather(*(chain(k) for k in range(args.parallel)))
        counting[0] = False


class _FunctionCalls(Calls):
    """`Calls` while the counted boots run, and for each of Stowage's functions the calls made
    while it was on the stack (inclusive, each frame's own call included)."""

    def __init__(self, counting: list[bool]) -> None:
        super().__init__()
        self.counting = counting
        self.inside: collections.Counter[Any] = collections.Counter()

    def hook(self, frame: Any, event: str, arg: Any) -> None:
        if not self.counting[0] or event not in ("call", "c_call"):
            return
        ours = set()
        f = frame
        while f is not None:
            code = f.f_code
            if code in _NOT_THE_BOOTS:
                return  # this script's own counting and waiting, not the boot's work
            if "/stowage/" in code.co_filename:
                ours.add(code)
            f = f.f_back
        self.count += 1
        for code in ours:
            self.inside[code] += 1

    def heaviest(self, n: int) -> list[tuple[str, int]]:
        named = collections.Counter[str]()
        for code, count in self.inside.items():
            where = code.co_filename.rsplit("/stowage/", 1)[-1]
            named[f"{code.co_qualname} ({where})"] += count
        return named.most_common(n)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--servers", type=int, default=20)
    parser.add_argument("--nics", action="store_true", help="each server with a port on private")
    parser.add_argument("--db", help="a ledger URL (default: a fresh SQLite file)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--calls", action="store_true", help="count function calls per boot too")
    parser.add_argument(
        "--parallel",
        type=int,
        default=1,
        help="boots in flight at once (the conductor's polls"
        " and batches are then shared, as under load)",
    )
    parser.add_argument(
        "--warm", type=int, default=3, help="servers booted before the counted ones"
    )
    parser.add_argument(
        "--plans",
        action="store_true",
        help="SQLite's plan of every statement the boots ran: print those that scan a table",
    )
    parser.add_argument(
        "--group-writes",
        action="store_true",
        help="as `stowage up` writes: the creates and ended spawns of one moment in one commit",
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="stowage-bench-statements-"))
    ledger = Ledger.open(args.db or f"sqlite:///{work / 'ledger.db'}")
    config = CloudConfig(state_dir=work / "state", hosts=4, group_writes=args.group_writes)
    cloud = Cloud(config, ledger)
    bootstrap(cloud)
    counting = [False]
    kinds: collections.Counter[str] = collections.Counter()
    places: collections.Counter[str] = collections.Counter()
    polls = ("GET /servers", "show_server", "_settled")

    executed: dict[str, tuple[Any, str]] = {}  # each statement's first parameters, and where
    repeats: collections.Counter[str] = collections.Counter()

    @event.listens_for(ledger.engine, "before_cursor_execute")
    def _count(*_args: Any) -> None:
        _counted(_args[2].split()[0].upper())
        if args.plans and counting[0]:
            statement = _args[2]
            repeats[statement] += 1
            if statement not in executed:
                executed[statement] = (_args[3], _where())

    # Transactions by the engine's own event: SQLite's BEGIN goes to the driver directly
    # (no cursor execute to see), PostgreSQL's is the driver's implicit one.
    @event.listens_for(ledger.engine, "begin")
    def _count_begin(_conn: Any) -> None:
        _counted("BEGIN")

    def _counted(word: str) -> None:
        if not counting[0]:
            return
        where = _where()
        if any(p in where for p in polls):
            return  # this script's own wait for ACTIVE, not the boot's work
        kinds[word] += 1
        places[f"{'transaction' if word == 'BEGIN' else word.lower()} at {where}"] += 1

    decoded = [0]
    real_doc = objects_module._doc

    def counted_doc(row: Any) -> Any:
        where = _where()
        if counting[0] and not any(p in where for p in polls):
            decoded[0] += 1
            places[f"document decoded at {where}"] += 1
        return real_doc(row)

    objects_module._doc = counted_doc  # documents read: what a scan of a whole kind costs
    _NOT_THE_BOOTS.add(_count.__code__)

    calls = _FunctionCalls(counting) if args.calls else None
    if calls is not None:
        calls.install()
    local = LocalCompute(cloud)
    cloud.bus = local.start_thread()
    try:
        asyncio.run(_boots(cloud, args, counting))
    finally:
        local.stop_thread()
        scans = _scans(ledger, executed) if args.plans else []
        ledger.close()
    if calls is not None:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    n = args.servers
    total = sum(v for k, v in kinds.items() if k != "BEGIN")
    print(
        f"per boot ({n} boots{', one NIC each' if args.nics else ', no NIC'}): "
        f"{kinds['BEGIN'] / n:.1f} transactions, {total / n:.1f} statements "
        + "("
        + ", ".join(f"{k} {v / n:.1f}" for k, v in sorted(kinds.items()) if k != "BEGIN")
        + f"), {decoded[0] / n:.1f} documents decoded (after {args.warm} servers booted)"
    )
    if calls is not None:
        print(f"function calls per boot: {calls.count / n:,.0f}; Stowage's, by calls inside:")
        for name, inside in calls.heaviest(args.top):
            print(f"{inside / n:9,.0f}  {name}")
    for where, count in places.most_common(args.top):
        print(f"{count / n:6.2f}  {where}")
    if args.plans:
        print(f"statements whose plan scans a table ({len(scans)} of {len(executed)} distinct):")
        for statement, where, steps in scans:
            print(f"{repeats[statement] / n:6.2f}  at {where}: {'; '.join(steps)}")
            print(f"        {' '.join(statement.split())[:300]}")


def _scans(ledger: Ledger, executed: dict[str, tuple[Any, str]]) -> list[tuple[str, str, list]]:
    """SQLite's plan of each statement run, with the parameters of its first run: those with
    a step that reads a whole table (`SCAN t`, an index walked whole included)."""
    if ledger.engine.dialect.name != "sqlite":
        raise SystemExit("--plans reads SQLite's EXPLAIN QUERY PLAN: not with --db")
    found = []
    with ledger.engine.connect() as conn:
        for statement, (params, where) in executed.items():
            if statement.split()[0].upper() not in ("SELECT", "UPDATE", "DELETE", "INSERT"):
                continue
            try:
                steps = sqlite_scans(conn, statement, params)
            except Exception as exc:  # an executemany's list of parameters, say
                steps = [f"(not planned: {type(exc).__name__})"]
            if steps:
                found.append((statement, where, steps))
    return found


if __name__ == "__main__":
    main()
