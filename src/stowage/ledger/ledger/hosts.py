"""Hosts: registration with their cells, pCPUs and inventories; service state; heartbeats."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import Connection, insert, select, update
from sqlalchemy.exc import IntegrityError

from stowage.domain.errors import NotFound
from stowage.domain.topology import (
    DEFAULT_ALLOCATION_RATIOS,
    HostSpec,
)
from stowage.ledger.db import READONLY
from stowage.ledger.ledger.core import LedgerCore
from stowage.ledger.ledger.topology import topology_to_json
from stowage.ledger.schema import (
    cells,
    changes,
    hosts,
    inventories,
    pcpus,
)


class Hosts(LedgerCore):
    """Registers hosts and records their service state."""

    def register_host(self, spec: HostSpec) -> int:
        """Record a host with its topology and inventories; returns its id (idempotent).

        Two agents of one host may register at once: the loser's insert meets the unique name
        (its savepoint rolls back) and it returns the winner's id.
        """
        with self.engine.begin() as conn:
            found = self._host_named(conn, spec.name)
            if found is not None:
                return found
            try:
                with conn.begin_nested():
                    host_id = self._insert_host(conn, spec)
            except IntegrityError:
                found = self._host_named(conn, spec.name)
                if found is None:
                    raise
                return found
            conn.execute(insert(changes), {"host_id": host_id, "at": self.clock()})
            return host_id

    def register_hosts(self, specs: Sequence[HostSpec]) -> list[int]:
        """Bulk registration for large simulated clouds (one transaction)."""
        with self.engine.begin() as conn:
            ids = [self._insert_host(conn, spec) for spec in specs]
            conn.execute(insert(changes), [{"host_id": h, "at": self.clock()} for h in ids])
        return ids

    @staticmethod
    def _host_named(conn: Connection, name: str) -> int | None:
        found = conn.execute(select(hosts.c.id).where(hosts.c.name == name)).scalar()
        return None if found is None else int(found)

    def _insert_host(self, conn: Connection, spec: HostSpec) -> int:
        host_id = int(
            conn.execute(
                insert(hosts).returning(hosts.c.id),
                {
                    "uuid": str(uuid.uuid5(uuid.NAMESPACE_URL, f"stowage-host:{spec.name}")),
                    "name": spec.name,
                    "availability_zone": spec.availability_zone,
                    "labels": json.dumps(dict(spec.labels), sort_keys=True),
                    "hypervisor_type": spec.hypervisor_type,
                    "architecture": spec.architecture,
                    "topology": topology_to_json(spec.topology),
                    "disabled": False,
                    "forced_down": False,
                    "last_seen": self.clock(),
                    "generation": 0,
                },
            ).scalar_one()
        )
        self._insert_host_rows(conn, host_id, spec)
        return host_id

    def _insert_host_rows(self, conn: Connection, host_id: int, spec: HostSpec) -> None:
        topo = spec.topology
        conn.execute(
            insert(cells),
            [
                {"host_id": host_id, "cell_id": c.id, "memory_mb": c.memory_mb, "memory_mb_used": 0}
                for c in topo.cells
            ],
        )
        conn.execute(
            insert(pcpus),
            [
                {
                    "host_id": host_id,
                    "cpu_id": cpu,
                    "cell_id": c.id,
                    "dedicated": cpu in topo.cpu_dedicated_set,
                }
                for c in topo.cells
                for cpu in sorted(c.cpus)
            ],
        )
        rows = []
        for rc, total in spec.totals().items():
            if total <= 0:
                continue
            rows.append(
                {
                    "host_id": host_id,
                    "resource_class": rc.value,
                    "total": total,
                    "reserved": spec.reserved.get(rc, 0),
                    "allocation_ratio": spec.allocation_ratios.get(
                        rc, DEFAULT_ALLOCATION_RATIOS[rc]
                    ),
                    "min_unit": 1,
                    "max_unit": total,
                    "step_size": 1,
                    "used": 0,
                }
            )
        conn.execute(insert(inventories), rows)

    def set_host_state(
        self,
        name: str,
        *,
        disabled: bool | None = None,
        forced_down: bool | None = None,
        last_seen: float | None = None,
        availability_zone: str | None = None,
        aggregate_metadata: Mapping[str, Iterable[str]] | None = None,
    ) -> None:
        """Change what the scheduler reads about a host; every change is in the change log."""
        values: dict[str, Any] = {}
        if availability_zone is not None:
            values["availability_zone"] = availability_zone
        if aggregate_metadata is not None:
            values["aggregate_metadata"] = json.dumps(
                {k: sorted(set(v)) for k, v in aggregate_metadata.items()}, sort_keys=True
            )
        if disabled is not None:
            values["disabled"] = disabled
        if forced_down is not None:
            values["forced_down"] = forced_down
        if last_seen is not None:
            values["last_seen"] = last_seen
        if not values:
            self.host_id(name)  # nothing to change: still a NotFound for an unknown host
            return
        with self.engine.begin() as conn:
            host_id = conn.execute(
                update(hosts).where(hosts.c.name == name).values(**values).returning(hosts.c.id)
            ).scalar()
            if host_id is None:
                raise NotFound(f"host {name!r} not found")
            conn.execute(insert(changes), {"host_id": host_id, "at": self.clock()})

    def heartbeat(self, names: Sequence[str] | None = None) -> None:
        """Record that hosts' services are alive now (all hosts when `names` is None)."""
        query = update(hosts).values(last_seen=self.clock())
        if names is not None:
            query = query.where(hosts.c.name.in_(list(names)))
        with self.engine.begin() as conn:
            conn.execute(query)

    def host_id(self, name: str) -> int:
        with self.engine.connect().execution_options(**READONLY) as conn:
            found = conn.execute(select(hosts.c.id).where(hosts.c.name == name)).scalar()
        if found is None:
            raise NotFound(f"host {name!r} not found")
        return int(found)
