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
    host_generations,
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
                    [host_id] = self._insert_hosts(conn, [spec])
            except IntegrityError:
                found = self._host_named(conn, spec.name)
                if found is None:
                    raise
                return found
            conn.execute(insert(changes), {"host_id": host_id, "at": self.clock()})
            return host_id

    def register_hosts(self, specs: Sequence[HostSpec]) -> list[int]:
        """Bulk registration for large simulated clouds: one transaction, one statement per
        table for all of `specs`, the same rows as `register_host` writes host by host.

        Not idempotent: a name already registered fails the whole call.
        """
        if not specs:
            return []
        with self.engine.begin() as conn:
            ids = self._insert_hosts(conn, specs)
            conn.execute(insert(changes), [{"host_id": h, "at": self.clock()} for h in ids])
        return ids

    @staticmethod
    def _host_named(conn: Connection, name: str) -> int | None:
        found = conn.execute(select(hosts.c.id).where(hosts.c.name == name)).scalar()
        return None if found is None else int(found)

    def _insert_hosts(self, conn: Connection, specs: Sequence[HostSpec]) -> list[int]:
        """The hosts' rows, then their cells, pCPUs and inventories; the new ids in order."""
        # Hosts of a simulated cloud share one topology object: serialize it once.
        topologies: dict[int, str] = {}
        rows = []
        for spec in specs:
            topology = topologies.get(id(spec.topology))
            if topology is None:
                topology = topologies[id(spec.topology)] = topology_to_json(spec.topology)
            rows.append(
                {
                    "uuid": str(uuid.uuid5(uuid.NAMESPACE_URL, f"stowage-host:{spec.name}")),
                    "name": spec.name,
                    "availability_zone": spec.availability_zone,
                    "labels": json.dumps(dict(spec.labels), sort_keys=True),
                    "hypervisor_type": spec.hypervisor_type,
                    "architecture": spec.architecture,
                    "topology": topology,
                    "disabled": False,
                    "forced_down": False,
                    "last_seen": self.clock(),
                }
            )
        ids = [
            int(i)
            for i in conn.execute(
                insert(hosts).returning(hosts.c.id, sort_by_parameter_order=True), rows
            ).scalars()
        ]
        self._bulk.insert(conn, host_generations, ("host_id", "generation"), [(i, 0) for i in ids])
        self._insert_host_parts(conn, ids, specs)
        return ids

    def _insert_host_parts(
        self, conn: Connection, ids: Sequence[int], specs: Sequence[HostSpec]
    ) -> None:
        """The cells, pCPUs and inventories of hosts whose rows are written."""
        cell_rows: list[tuple[int, int, int, int]] = []
        pcpu_rows: list[tuple[int, int, int, bool]] = []
        inventory_rows: list[tuple[Any, ...]] = []
        for host_id, spec in zip(ids, specs, strict=True):
            topo = spec.topology
            for c in topo.cells:
                cell_rows.append((host_id, c.id, c.memory_mb, 0))
                pcpu_rows.extend(
                    (host_id, cpu, c.id, cpu in topo.cpu_dedicated_set) for cpu in sorted(c.cpus)
                )
            for rc, total in spec.totals().items():
                if total <= 0:
                    continue
                ratio = spec.allocation_ratios.get(rc, DEFAULT_ALLOCATION_RATIOS[rc])
                inventory_rows.append(
                    (host_id, rc.value, total, spec.reserved.get(rc, 0), ratio, 1, total, 1, 0)
                )
        self._bulk.insert(
            conn, cells, ("host_id", "cell_id", "memory_mb", "memory_mb_used"), cell_rows
        )
        self._bulk.insert(conn, pcpus, ("host_id", "cpu_id", "cell_id", "dedicated"), pcpu_rows)
        self._bulk.insert(
            conn,
            inventories,
            (
                "host_id",
                "resource_class",
                "total",
                "reserved",
                "allocation_ratio",
                "min_unit",
                "max_unit",
                "step_size",
                "used",
            ),
            inventory_rows,
        )

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
