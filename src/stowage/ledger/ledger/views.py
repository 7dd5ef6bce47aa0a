"""The scheduler's view of the ledger: loaded once, then refreshed from the change log."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from sqlalchemy import Connection, delete, func, select

from stowage.domain.numa import HostFree
from stowage.domain.topology import (
    HostTopology,
    ResourceClass,
)
from stowage.ledger.db import READONLY
from stowage.ledger.ledger.core import _group_from_row
from stowage.ledger.ledger.groups import Groups
from stowage.ledger.ledger.topology import topology_from_json
from stowage.ledger.schema import (
    cells,
    changes,
    consumers,
    consumers_of_instance,
    group_members,
    group_slots,
    host_generations,
    hosts,
    hosts_and_generations,
    inventories,
    pins,
    server_groups,
)
from stowage.scheduling.view import HostGroups, HostState, View


class Views(Groups):
    """Reads the ledger into the scheduler's view."""

    def load_view(self, writer: str = "") -> View:
        """A full view: used once at start; later refreshes read only what changed."""
        view = View(writer)
        with self.engine.connect().execution_options(**READONLY) as conn, conn.begin():
            view.seq = int(
                conn.execute(select(func.coalesce(func.max(changes.c.seq), 0))).scalar_one()
            )
            if self._pg:  # SQLite's refresh needs no window (see `refresh`)
                view.seen.update(
                    conn.execute(
                        select(changes.c.seq).where(changes.c.seq > view.seq - _REREAD_WINDOW)
                    ).scalars()
                )
            for row in conn.execute(select(server_groups)):
                view.add_group(_group_from_row(row._mapping))
            for state, contribution in self._read_hosts(conn, None):
                view.replace_host(state, contribution)
        view.loads = 1
        return view

    def refresh(
        self,
        view: View,
        *,
        host_ids: Iterable[int] = (),
        defer: Callable[[int], bool] | None = None,
        deferred_max: int = 64,
    ) -> int:
        """Bring `view` up to date with committed changes; returns how many hosts were read.

        The rows its own writer committed are left out: the view applied those claims
        itself. On SQLite writers take turns, so change rows commit in sequence order and a
        read sees every row up to the newest one: a refresh reads the other writers' rows
        after the view's sequence, then takes the newest as its own. Sequence numbers can
        commit out of order on PostgreSQL, so there each refresh looks a window behind the
        newest sequence it saw and skips the rows it has already seen. Changed hosts for
        which `defer` is true (another worker's shard) are only marked stale, and at most
        `deferred_max` of those are read per refresh, so a worker does not spend its time
        re-reading hosts it seldom uses; a stale host it does use costs at worst a refused
        claim and a retry.
        """
        wanted = set(host_ids)
        with self.engine.connect().execution_options(**READONLY) as conn, conn.begin():
            oldest, newest = conn.exec_driver_sql(_BOUNDS).one()
            # Rows this view never saw were pruned: it reads every host again.
            missed = oldest is not None and oldest > view.seq + 1
            if self._pg:
                changed = self._changes_windowed(conn, view)
            elif newest is not None and newest > view.seq:
                # Writers take turns: every row up to `newest` is in this read.
                changed = [
                    h for (h,) in conn.exec_driver_sql(_OTHERS, (view.seq, newest, view.writer))
                ]
                view.seq = int(newest)
            else:
                changed = []
            for host_id in changed:
                if defer is not None and defer(host_id):
                    view.stale.add(int(host_id))
                else:
                    wanted.add(int(host_id))
            while view.stale and deferred_max > 0:
                wanted.add(view.stale.pop())
                deferred_max -= 1
            view.stale -= wanted
            if missed:
                view.loads += 1
                view.stale.clear()
                for row in conn.execute(select(server_groups)):
                    view.add_group(_group_from_row(row._mapping))
                for state, contribution in self._read_hosts(conn, None):
                    view.replace_host(state, contribution)
                return len(view.hosts)
            if not wanted:
                return 0
            self._ensure_groups(conn, view, wanted)
            for state, contribution in self._read_hosts(conn, sorted(wanted)):
                view.replace_host(state, contribution)
        return len(wanted)

    def _changes_windowed(self, conn: Connection, view: View) -> list[int]:
        """PostgreSQL: the hosts of rows not seen yet, a window behind the newest seen."""
        rows = conn.execute(
            select(changes.c.seq, changes.c.host_id, changes.c.writer).where(
                changes.c.seq > max(0, view.seq - _REREAD_WINDOW)
            )
        ).all()
        out = []
        for seq, host_id, writer in rows:
            if seq in view.seen:
                continue
            view.seen.add(seq)
            view.seq = max(view.seq, seq)
            if writer and writer == view.writer:
                continue
            out.append(host_id)
        floor = view.seq - _REREAD_WINDOW
        if len(view.seen) > 4 * _REREAD_WINDOW:
            view.seen = {s for s in view.seen if s > floor}
        return out

    def prune_changes(self, *, older_than_s: float = 600.0) -> int:
        """Forget change rows older than any view still needs; returns how many went.

        A view that has not refreshed for longer than this reloads itself fully
        (see `refresh`), so nothing it needed is lost.
        """
        newest = select(func.max(changes.c.seq)).scalar_subquery()
        with self.engine.begin() as conn:
            # The newest row always stays, so a view can tell it missed pruned rows.
            return int(
                conn.execute(
                    delete(changes).where(
                        changes.c.at < self.clock() - older_than_s, changes.c.seq < newest
                    )
                ).rowcount
            )

    def refresh_liveness(self, view: View) -> None:
        """Heartbeat times and service flags of every host, in one narrow query.

        Heartbeats write no change rows (that would make every scheduler re-read every host
        at each beat); schedulers read liveness alone, often, instead.
        """
        # Plain driver rows: at 100,000 hosts the result processing was most of the cost.
        with self.engine.connect().execution_options(**READONLY) as conn:
            rows = conn.exec_driver_sql(_LIVENESS).fetchall()
        known = view.hosts
        for host_id, last_seen, forced_down, disabled in rows:
            state = known.get(host_id)
            if state is not None:
                state.last_seen = last_seen
                state.forced_down = bool(forced_down)
                state.disabled = bool(disabled)

    def ensure_group(self, view: View, group_id: str) -> None:
        if group_id in view.groups:
            return
        view.add_group(self.get_group(group_id))
        with self.engine.connect().execution_options(**READONLY) as conn, conn.begin():
            member_hosts = set(
                conn.execute(
                    select(consumers.c.host_id)
                    .select_from(
                        group_members.join(
                            consumers, consumers_of_instance(group_members.c.instance_id)
                        )
                    )
                    .where(group_members.c.group_id == group_id, consumers.c.host_id.is_not(None))
                ).scalars()
            )
            member_hosts.update(
                conn.execute(
                    select(group_slots.c.host_id).where(group_slots.c.group_id == group_id)
                ).scalars()
            )
            for state, contribution in self._read_hosts(conn, sorted(member_hosts)):
                view.replace_host(state, contribution)

    def _ensure_groups(self, conn: Connection, view: View, host_ids: set[int]) -> None:
        known = set(view.groups)
        query = select(server_groups).where(
            server_groups.c.id.in_(
                select(group_slots.c.group_id).where(group_slots.c.host_id.in_(host_ids))
            )
        )
        for row in conn.execute(query):
            if row.id not in known:
                view.add_group(_group_from_row(row._mapping))

    def _read_hosts(
        self, conn: Connection, host_ids: Sequence[int] | None
    ) -> Iterable[tuple[HostState, HostGroups]]:
        def where(col: Any) -> Any:
            return col.in_(host_ids) if host_ids is not None else True

        inv: dict[int, list[Any]] = defaultdict(list)
        for row in conn.execute(select(inventories).where(where(inventories.c.host_id))):
            inv[row.host_id].append(row)
        cell_used: dict[int, dict[int, int]] = defaultdict(dict)
        for row in conn.execute(select(cells).where(where(cells.c.host_id))):
            cell_used[row.host_id][row.cell_id] = row.memory_mb - row.memory_mb_used
        pinned: dict[int, set[int]] = defaultdict(set)
        for host_id, cpu in conn.execute(
            select(pins.c.host_id, pins.c.cpu_id).where(where(pins.c.host_id))
        ):
            pinned[host_id].add(cpu)
        contributions: dict[int, HostGroups] = defaultdict(HostGroups)
        member_query = (
            select(group_members.c.group_id, consumers.c.host_id, func.count())
            .select_from(
                group_members.join(
                    consumers, consumers.c.instance_id == group_members.c.instance_id
                )
            )
            .where(where(consumers.c.host_id), consumers.c.host_id.is_not(None))
            .group_by(group_members.c.group_id, consumers.c.host_id)
        )
        for group_id, host_id, count in conn.execute(member_query):
            contributions[host_id].members[group_id] += int(count)
        # Members are counted through consumers.instance_id, so a migration's destination
        # counts beside the instance's source.
        for row in conn.execute(
            select(
                group_slots.c.group_id,
                group_slots.c.domain,
                group_slots.c.slot,
                group_slots.c.host_id,
            ).where(where(group_slots.c.host_id))
        ):
            contributions[row.host_id].slots.append((row.group_id, row.domain, row.slot))
        for row in conn.execute(_HOSTS.where(where(hosts.c.id))):
            topo = self._topology(row.topology)
            capacity: dict[ResourceClass, int] = {}
            used: dict[ResourceClass, int] = {}
            max_unit: dict[ResourceClass, int] = {}
            for item in inv.get(row.id, []):
                if item.resource_class not in _KNOWN_CLASSES:
                    continue  # a custom class no flavor asks for yet
                rc = ResourceClass(item.resource_class)
                capacity[rc] = int((item.total - item.reserved) * item.allocation_ratio)
                used[rc] = item.used
                max_unit[rc] = item.max_unit
            free = HostFree(
                frozenset(topo.cpu_dedicated_set - pinned.get(row.id, set())),
                cell_used.get(row.id, {}),
            )
            state = HostState(
                id=row.id,
                name=row.name,
                topology=topo,
                capacity=capacity,
                used=used,
                max_unit=max_unit,
                free=free,
                availability_zone=row.availability_zone,
                labels=json.loads(row.labels),
                aggregate_metadata={
                    k: frozenset(v) for k, v in json.loads(row.aggregate_metadata).items()
                },
                hypervisor_type=row.hypervisor_type,
                architecture=row.architecture,
                disabled=bool(row.disabled),
                forced_down=bool(row.forced_down),
                last_seen=row.last_seen,
                generation=row.generation,
            )
            yield state, contributions.get(row.id, HostGroups())

    def _topology(self, text: str) -> HostTopology:
        topo = self._topologies.get(text)
        if topo is None:
            topo = self._topologies[text] = topology_from_json(text)
        return topo


_KNOWN_CLASSES = frozenset(rc.value for rc in ResourceClass)

_LIVENESS = "SELECT id, last_seen, forced_down, disabled FROM hosts"

_HOSTS = select(hosts, host_generations.c.generation).select_from(hosts_and_generations)

# The oldest and newest change rows (each subquery one step down the primary key).
_BOUNDS = "SELECT (SELECT min(seq) FROM changes), (SELECT max(seq) FROM changes)"

# SQLite: the hosts other writers changed after a view's sequence (a writer of '' is none).
_OTHERS = (
    "SELECT host_id FROM changes WHERE seq > ? AND seq <= ?"
    " AND (writer IS NULL OR writer = '' OR writer != ?)"
)


# Sequence numbers re-read behind the newest seen, to catch commits that landed out of order.
_REREAD_WINDOW = 256
