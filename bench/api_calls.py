"""The API's own cost per request, in process: CPU and Python function calls.

    .venv/bin/python bench/api_calls.py [--gets 1000] [--creates 300] [--detail 0]
    PYTHONPATH=/tmp/before/src .venv/bin/python bench/api_calls.py     # another checkout

`create_app` of a fresh SQLite cloud (no conductor, no agents: a create is answered once its
request is committed, and its servers stay in BUILD), called as an ASGI app directly (no
uvicorn, no client library), one request at a time, for:

- `GET /compute/v2.1/flavors/1` with a token (bench/api.py's trivial authenticated GET);
- `POST /compute/v2.1/servers` of one m1.tiny with no NIC;
- with `--detail N`, `GET /compute/v2.1/servers/detail` of N servers (made by multi-creates
  of 100), best of 3.

For each it prints the process's CPU per request (`time.process_time`, every thread: the
handlers run in worker threads), the least of five equal batches; with `--calls`, the
function calls (Python's and C's) per request instead, counted by a profile hook in every
thread (which slows everything down: its CPU figures are not the API's). The calls do not
move with the machine's load, so they compare two checkouts on a busy machine; the CPU
figures do, a little. Logs are not configured (the access line is dropped at its level
check) unless `--access-log`, which renders them as `stowage up` does. With `--statements`,
also the ledger's statements and transactions (BEGINs) per request, and where each request's
statements are made.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from sqlalchemy import event

import stowage
from stowage.api.app import create_app
from stowage.domain.keystone import password_login
from stowage.ledger import Ledger
from stowage.services.cloud import Cloud, CloudConfig, bootstrap
from stowage.telemetry import configure_logging

App = Any
Headers = list[tuple[str, str]]


class Calls:
    """Counts every function call in every thread while `on`."""

    def __init__(self) -> None:
        self.on = False
        self.count = 0

    def hook(self, frame: Any, event: str, arg: Any) -> None:
        if self.on and event in ("call", "c_call"):
            self.count += 1

    def install(self) -> None:
        sys.setprofile(self.hook)
        threading.setprofile(self.hook)  # worker threads started from now on


class Statements:
    """Counts the ledger's statements and transactions while `on`, by kind and by place."""

    def __init__(self) -> None:
        self.on = False
        self.kinds: collections.Counter[str] = collections.Counter()
        self.places: collections.Counter[str] = collections.Counter()

    def install(self, ledger: Ledger) -> None:
        event.listen(ledger.engine, "before_cursor_execute", self.count)
        # Transactions by the engine's own event: SQLite's BEGIN goes to the driver directly
        # (no cursor execute to see), PostgreSQL's is the driver's implicit one.
        event.listen(ledger.engine, "begin", lambda _conn: self.counted("BEGIN"))

    def count(self, *args: Any) -> None:
        self.counted(args[2].split()[0].upper())

    def counted(self, word: str) -> None:
        if not self.on:
            return
        self.kinds[word] += 1
        frames = [
            f
            for f in traceback.extract_stack()
            if "/stowage/" in f.filename and "/ledger/" not in f.filename
        ]
        where = " / ".join(f"{f.name}:{f.lineno}" for f in frames[-2:])
        self.places[f"{word.lower()} at {where}"] += 1


async def call(
    app: App, method: str, path: str, headers: Headers = (), body: bytes = b""
) -> dict[str, Any]:
    raw = [(k.lower().encode(), v.encode()) for k, v in headers]
    if body:
        raw += [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"stowage"), *raw],
        "client": ("127.0.0.1", 1),
        "server": ("stowage", 80),
    }
    given = False

    async def receive() -> dict[str, Any]:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    out: dict[str, Any] = {"status": 0, "headers": [], "body": b""}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            out["status"] = message["status"]
            out["headers"] = message.get("headers", [])
        else:
            out["body"] += message.get("body", b"")

    await app(scope, receive, send)
    return out


async def measure(
    args: argparse.Namespace, calls: Calls, statements: Statements
) -> dict[str, float]:
    work = Path(tempfile.mkdtemp(prefix="stowage-bench-api-calls-"))
    ledger = Ledger.open(f"sqlite:///{work / 'ledger.db'}")
    statements.install(ledger)
    cloud = Cloud(CloudConfig(state_dir=work / "state", hosts=4), ledger)
    bootstrap(cloud)
    app = create_app(cloud)
    login = json.dumps(password_login("admin", "stowage-admin", "admin")).encode()
    answer = await call(app, "POST", "/identity/v3/auth/tokens", body=login)
    token = dict(answer["headers"])[b"x-subject-token"].decode()
    project = json.loads(answer["body"])["token"]["project"]["id"]
    headers = [("X-Auth-Token", token), ("OpenStack-API-Version", "compute 2.96")]
    unlimited = {"quota_set": {"instances": -1, "cores": -1, "ram": -1}}
    quotas = json.dumps(unlimited).encode()
    await call(app, "PUT", f"/compute/v2.1/os-quota-sets/{project}", headers, quotas)
    images = await call(app, "GET", "/image/v2/images", headers)
    image = json.loads(images["body"])["images"][0]["id"]
    made = 0

    def create_body(count: int = 1) -> bytes:
        nonlocal made
        made += 1
        server = {"name": f"b{made}", "flavorRef": "1", "imageRef": image, "networks": "none"}
        if count > 1:
            server.update(min_count=count, max_count=count)
        return json.dumps({"server": server}).encode()

    async def get() -> None:
        answer = await call(app, "GET", "/compute/v2.1/flavors/1", headers)
        assert answer["status"] == 200, answer

    async def create() -> None:
        answer = await call(app, "POST", "/compute/v2.1/servers", headers, create_body())
        assert answer["status"] == 202, answer

    def also(path: str) -> Any:
        async def request() -> None:
            answer = await call(app, "GET", path, [*headers, ("X-Subject-Token", token)])
            assert answer["status"] == 200, answer

        return request

    figures: dict[str, float] = {}
    measured = [("get", get, args.gets), ("create", create, args.creates)]
    measured += [(f"GET {path}", also(path), args.gets) for path in args.also]
    for name, request, total in measured:
        await request()  # warm: routes built, statements compiled
        per_batch = max(1, total // 5)
        best = float("inf")
        for _ in range(5):
            started = time.process_time()
            for _ in range(per_batch):
                await request()
            best = min(best, (time.process_time() - started) / per_batch)
        figures[f"{name}_cpu_ms"] = best * 1e3
        if args.calls:
            calls.count, calls.on = 0, True
            for _ in range(per_batch):
                await request()
            calls.on = False
            figures[f"{name}_calls"] = calls.count / per_batch
        if args.statements:
            statements.kinds.clear()
            statements.places.clear()
            statements.on = True
            for _ in range(per_batch):
                await request()
            statements.on = False
            kinds = statements.kinds
            figures[f"{name}_transactions"] = kinds["BEGIN"] / per_batch
            figures[f"{name}_statements"] = (sum(kinds.values()) - kinds["BEGIN"]) / per_batch
            for where, count in statements.places.most_common():
                print(f"{name}: {count / per_batch:5.2f} {where}")
    if args.detail:
        listed = await call(app, "GET", "/compute/v2.1/servers", headers)
        have = len(json.loads(listed["body"])["servers"])
        while have < args.detail:
            count = min(100, args.detail - have)
            body = create_body(count)
            answer = await call(app, "POST", "/compute/v2.1/servers", headers, body)
            assert answer["status"] == 202, answer
            have += count
        walls = []
        started = time.process_time()
        for _ in range(3):
            began = time.perf_counter()
            answer = await call(app, "GET", "/compute/v2.1/servers/detail", headers)
            walls.append(time.perf_counter() - began)
            assert answer["status"] == 200, answer
        figures["detail_servers"] = len(json.loads(answer["body"])["servers"])
        figures["detail_best_ms"] = min(walls) * 1e3
        figures["detail_cpu_ms"] = (time.process_time() - started) / 3 * 1e3
    ledger.close()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gets", type=int, default=1000)
    parser.add_argument("--creates", type=int, default=300)
    parser.add_argument("--detail", type=int, default=0, help="servers in the detail list")
    parser.add_argument("--calls", action="store_true", help="count calls per request instead")
    parser.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="PATH",
        help="another authenticated GET to measure as the first (the token in X-Subject-Token "
        "too, for GET /identity/v3/auth/tokens), e.g. /networking/v2.0/ports",
    )
    parser.add_argument(
        "--statements", action="store_true", help="count the ledger's statements per request too"
    )
    parser.add_argument(
        "--access-log",
        action="store_true",
        help="log as `stowage up` does (key=value lines at info), here to /dev/null",
    )
    args = parser.parse_args()
    if args.access_log:
        configure_logging("kv", "info", process="api", stream=open(os.devnull, "w"))  # noqa: SIM115
    calls = Calls()
    if args.calls:
        calls.install()
    print(f"stowage imported from {Path(stowage.__file__).parent}", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the start", flush=True)
    figures = asyncio.run(measure(args, calls, Statements()))
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    if args.calls:
        print(
            f"function calls per GET /flavors/1: {figures['get_calls']:.0f}; "
            f"per POST /servers: {figures['create_calls']:.0f}"
        )
    else:
        print(
            f"CPU per GET /flavors/1: {figures['get_cpu_ms']:.3f} ms; "
            f"per POST /servers: {figures['create_cpu_ms']:.3f} ms"
        )
    for path in args.also:
        name = f"GET {path}"
        print(f"{name}: CPU {figures[f'{name}_cpu_ms']:.3f} ms", end="")
        print(f", {figures[f'{name}_calls']:.0f} function calls" if args.calls else "")
    if args.statements:
        print(
            f"statements (transactions) per GET /flavors/1: {figures['get_statements']:.1f} "
            f"({figures['get_transactions']:.1f}); per POST /servers: "
            f"{figures['create_statements']:.1f} ({figures['create_transactions']:.1f})"
        )
    if args.detail:
        print(
            f"GET /servers/detail of {figures['detail_servers']:.0f} servers: "
            f"{figures['detail_best_ms']:.1f} ms (best of 3), "
            f"{figures['detail_cpu_ms']:.1f} ms CPU each"
        )


if __name__ == "__main__":
    main()
