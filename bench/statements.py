"""Statements and transactions per boot, counted by the database engine, by where they are made.

    .venv/bin/python bench/statements.py [--servers 20] [--nics] [--db URL]

An in-process cloud (the APIs, the conductor and one simulated agent per host on the in-process
bus, as `stowage up` runs them) on a fresh SQLite file (or `--db`): `--warm` creates first,
then `--servers` creates one after another through the compute API, each waited for until
ACTIVE. Every statement the ledger's engine runs meanwhile is counted (so the conductor's
polls are in it), grouped by statement kind and by the Stowage functions that made it, and
the stored documents decoded (a read that scans a whole kind shows here, growing with
`--warm`).

These are counts, not timings: they do not move with the machine's load, which makes them the
figure to compare across commits for "how much work is a boot" (each transaction costs a
connection checkout, BEGIN and COMMIT or ROLLBACK; on PostgreSQL each statement a round trip).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import tempfile
import traceback
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import event

from stowage.agent.local import LocalCompute
from stowage.api.app import create_app
from stowage.domain.keystone import password_login
from stowage.ledger import Ledger
from stowage.ledger import objects as objects_module
from stowage.services.cloud import Cloud, CloudConfig, bootstrap

_SKIP = ("/ledger/", "/telemetry/")


def _where() -> str:
    frames = [
        f
        for f in traceback.extract_stack()
        if "/stowage/" in f.filename and not any(s in f.filename for s in _SKIP)
    ]
    return " / ".join(f"{f.name}:{f.lineno}" for f in frames[-2:]) or "(the conductor's loop)"


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
            for _ in range(600):
                shown = await http.get(f"/compute/v2.1/servers/{server_id}", headers=headers)
                if shown.json()["server"]["status"] in ("ACTIVE", "ERROR"):
                    return
                await asyncio.sleep(0.02)
            raise SystemExit(f"{name} did not settle")

        for i in range(args.warm):
            await boot(f"warm-{i}")
        counting[0] = True
        for i in range(args.servers):
            await boot(f"counted-{i}")
        counting[0] = False


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--servers", type=int, default=20)
    parser.add_argument("--nics", action="store_true", help="each server with a port on private")
    parser.add_argument("--db", help="a ledger URL (default: a fresh SQLite file)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument(
        "--warm", type=int, default=3, help="servers booted before the counted ones"
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="stowage-bench-statements-"))
    ledger = Ledger.open(args.db or f"sqlite:///{work / 'ledger.db'}")
    cloud = Cloud(CloudConfig(state_dir=work / "state", hosts=4), ledger)
    bootstrap(cloud)
    counting = [False]
    kinds: collections.Counter[str] = collections.Counter()
    places: collections.Counter[str] = collections.Counter()
    polls = ("GET /servers", "show_server")

    @event.listens_for(ledger.engine, "before_cursor_execute")
    def _count(*_args: Any) -> None:
        if not counting[0]:
            return
        word = _args[2].split()[0].upper()
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

    local = LocalCompute(cloud)
    cloud.bus = local.start_thread()
    try:
        asyncio.run(_boots(cloud, args, counting))
    finally:
        local.stop_thread()
        ledger.close()
    n = args.servers
    total = sum(v for k, v in kinds.items() if k != "BEGIN")
    print(
        f"per boot ({n} boots{', one NIC each' if args.nics else ', no NIC'}): "
        f"{kinds['BEGIN'] / n:.1f} transactions, {total / n:.1f} statements "
        + "("
        + ", ".join(f"{k} {v / n:.1f}" for k, v in sorted(kinds.items()) if k != "BEGIN")
        + f"), {decoded[0] / n:.1f} documents decoded (after {args.warm} servers booted)"
    )
    for where, count in places.most_common(args.top):
        print(f"{count / n:6.2f}  {where}")


if __name__ == "__main__":
    main()
