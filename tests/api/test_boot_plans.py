"""A boot's statements search by key; none reads a whole table. A scan costs nothing in a
test's cloud and grows with every server and host a real one holds, and the rows it returns do
not show it: two did (a create's flavor and image read scanned every document on SQLite; each
schedule batch read every host's name). SQLite's plan of each statement says."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from sqlalchemy import event
from tests.api.inprocess import InProcessCloud, in_process_cloud


def _boot(cloud: InProcessCloud, names: list[str], network: str) -> None:
    """Create these servers, each with a port on `network`, and wait until all are ACTIVE."""
    ids = []
    for name in names:
        body = cloud.tiny_server(name, networks=[{"uuid": network}])
        made = cloud.request("POST", "/compute/v2.1/servers", json=body)
        assert made.status_code == 202, made.text
        ids.append(made.json()["server"]["id"])
    deadline = time.monotonic() + 60
    for server_id in ids:
        while True:
            shown = cloud.request("GET", f"/compute/v2.1/servers/{server_id}")
            if shown.json()["server"]["status"] == "ACTIVE":
                break
            assert time.monotonic() < deadline, shown.text
            time.sleep(0.05)


def test_no_statement_of_a_boot_scans_a_table(tmp_path: Path) -> None:
    with in_process_cloud(tmp_path, hosts=3) as cloud:
        engine = cloud.cloud.ledger.engine
        networks = cloud.request("GET", "/networking/v2.0/networks").json()["networks"]
        private = next(n["id"] for n in networks if n["name"] == "private")
        # A first boot, not counted: the token, and the scheduler's view read whole once.
        _boot(cloud, ["warm"], private)
        executed: dict[str, Any] = {}

        def keep(_conn: Any, _cursor: Any, statement: str, params: Any, *_rest: Any) -> None:
            executed.setdefault(statement, params)

        event.listen(engine, "before_cursor_execute", keep)
        try:
            _boot(cloud, [f"planned-{i}" for i in range(3)], private)
        finally:
            event.remove(engine, "before_cursor_execute", keep)

        scans = {}
        with engine.connect() as conn:
            for statement, params in executed.items():
                if statement.split()[0].upper() not in ("SELECT", "UPDATE", "DELETE"):
                    continue
                plan = conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", params).all()
                steps = [str(row[-1]) for row in plan]
                if any(s.startswith("SCAN ") and "CONSTANT ROW" not in s for s in steps):
                    scans[" ".join(statement.split())] = steps
        assert len(executed) > 20  # the boots' statements were seen
        assert scans == {}
