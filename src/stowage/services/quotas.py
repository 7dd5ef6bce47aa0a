"""Quotas as counted claims: usage is counted inside the transaction that takes it.

A project's usage is what its instance documents add up to, read while the project's quota
lock is held, in the same transaction that writes the new instances. Two creates in one
project that count therefore take turns (no interleaving can pass a limit), and there is no
usage counter that could drift from what exists. The lock is the smallest thing that
serializes the check: one project (an advisory lock on PostgreSQL; SQLite write transactions
are serialized already).

A create with nothing to count (no limit applies to it) holds the lock shared: such creates
of one project run side by side, and whoever counts (a limited create, `set_quota`) takes it
exclusively, so it waits for them and counts what they made.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Integer, and_, bindparam, cast, func, literal, or_, select
from sqlalchemy.dialects.postgresql import JSONB

from stowage.domain.errors import InvalidSpec, QuotaExceeded
from stowage.ledger.db import direct_rows
from stowage.ledger.objects import flush_inserts, group_memo
from stowage.ledger.schema import objects, server_groups
from stowage.services import identity_limits
from stowage.services.cloud import Cloud
from stowage.services.compute_catalog import DEFAULT_QUOTAS, quota_key
from stowage.services.documents import lock_key

__all__ = [
    "InstanceUsage",
    "LimitsChanged",
    "lock_project",
    "reserve_instances",
    "reserve_server_group",
    "revert_quota",
    "set_default_quotas",
    "set_quota",
]


class LimitsChanged(Exception):
    """A limit came to apply while a create held its project's quota lock shared (set between
    its first read and the lock): nothing is written; the create is tried again with the lock
    held exclusively (`reserve_instances(exclusive=True)`)."""


@dataclass(frozen=True, slots=True)
class InstanceUsage:
    instances: int
    cores: int
    ram: int
    group_members: int


def lock_project(conn: Connection, project_id: str, *, shared: bool = False) -> None:
    """Hold the project's quota lock until `conn`'s transaction ends (`shared`: beside other
    shared holders; a holder that counts takes it exclusively)."""
    lock_key(conn, f"stowage-quota:{project_id}", shared=shared)


def quota_limits_in(
    cloud: Cloud, conn: Connection, project_id: str, user_id: str | None = None
) -> dict[str, int]:
    """The project's limits (defaults, class, project and user overrides: as
    compute_catalog.quota_limits), read inside `conn`'s transaction: no second connection.
    With the unified limits driver, only where the numbers come from changes: Keystone's
    project limit, else its registered default (services/identity_limits.py). Inside a
    group write, read once for the group's creates (`group_memo`: no create writes a limit)."""
    memo = group_memo(conn)
    if memo is None:
        return _limits_in(cloud, conn, project_id, user_id)
    key = ("quota_limits", project_id, user_id)
    found = memo.get(key)
    if found is None:
        found = memo[key] = _limits_in(cloud, conn, project_id, user_id)
    return dict(found)


def _limits_in(
    cloud: Cloud, conn: Connection, project_id: str, user_id: str | None
) -> dict[str, int]:
    if identity_limits.uses_unified_limits(cloud):
        return identity_limits.compute_limits_in(
            conn, cloud.config.region, project_id, DEFAULT_QUOTAS
        )
    limits = dict(DEFAULT_QUOTAS)
    project = quota_key(project_id)
    user = quota_key(project_id, user_id) if user_id else project
    found = {
        (kind, id): body
        for kind, id, body in direct_rows(conn, _LIMITS, {"project": project, "user": user})
    }
    for key in (("quota_class", "default"), ("quota", project), ("quota", user)):
        raw = found.get(key)
        if raw is not None:
            limits.update({k: int(v) for k, v in json.loads(raw).items() if k in DEFAULT_QUOTAS})
    return limits


# The default class's overrides, the project's and the user's, in one statement built once
# (on every create: three statements built anew were a third of the create's own CPU).
_LIMITS = select(objects.c.kind, objects.c.id, objects.c.body).where(
    or_(
        and_(objects.c.kind == "quota_class", objects.c.id == "default"),
        and_(
            objects.c.kind == "quota",
            objects.c.id.in_([bindparam("project"), bindparam("user")]),
        ),
    )
)


def count_instances(
    conn: Connection, project_id: str, group_id: str | None, *, members_only: bool = False
) -> InstanceUsage:
    """What the project's instance documents use, read inside `conn`'s transaction: summed by
    the database (a create in a project of thousands of servers parsed every document in
    Python). With `members_only`, only the group's members are counted. The instances that
    the other creates of a group write hold to insert are written first (`flush_inserts`):
    counted, as each create's own were by the next."""
    flush_inserts(conn)
    mine = (objects.c.kind == "instance") & (objects.c.project_id == project_id)
    members = (
        func.count().filter(_doc_field(conn, "group_id") == group_id)
        if group_id is not None
        else literal(0)
    )
    if members_only:
        only = conn.execute(select(members).where(mine)).scalar()
        return InstanceUsage(0, 0, 0, int(only or 0))
    cores = func.coalesce(func.sum(cast(_doc_field(conn, "flavor", "vcpus"), Integer)), 0)
    ram = func.coalesce(func.sum(cast(_doc_field(conn, "flavor", "ram"), Integer)), 0)
    row = conn.execute(select(func.count(), cores, ram, members).where(mine)).one()
    return InstanceUsage(int(row[0]), int(row[1]), int(row[2]), int(row[3] or 0))


def _doc_field(conn: Connection, *path: str) -> Any:
    """One field of an object's JSON body, as text, in SQL (NULL where it is absent)."""
    if conn.dialect.name == "postgresql":
        doc: Any = cast(objects.c.body, JSONB)
        for key in path[:-1]:
            doc = doc.op("->")(key)
        return doc.op("->>")(path[-1])
    return func.json_extract(objects.c.body, "$." + ".".join(path))


def reserve_instances(
    cloud: Cloud,
    conn: Connection,
    *,
    project_id: str,
    user_id: str,
    flavor: Mapping[str, Any],
    min_count: int,
    max_count: int,
    group_id: str | None = None,
    exclusive: bool = False,
) -> int:
    """How many of `max_count` instances the project may create now, at least `min_count`.

    As Nova: as many as every quota allows, down to `min_count`; fewer than that is a
    QuotaExceeded naming the resource. The per-request ceiling counts like a quota. The
    caller creates that many instance documents in `conn` before it commits.

    The limits read first choose how the project's lock is held: exclusively when some limit
    applies (or with `exclusive`), else shared. The limits that decide are read again under
    the lock; a limit that came to apply in between raises LimitsChanged, before anything is
    written, for the caller to try again with `exclusive`.
    """
    # SQLite's write transactions are serialized already: its lock is no lock to choose.
    counts = (
        exclusive
        or conn.dialect.name != "postgresql"
        or any(_applying(quota_limits_in(cloud, conn, project_id, user_id), group_id))
    )
    lock_project(conn, project_id, shared=not counts)
    limits = quota_limits_in(cloud, conn, project_id, user_id)
    limited, members_limited = _applying(limits, group_id)
    if (limited or members_limited) and not counts:
        raise LimitsChanged(f"a quota of project {project_id} came to apply meanwhile")
    if limited or members_limited:
        used = count_instances(conn, project_id, group_id, members_only=not limited)
    else:
        used = InstanceUsage(0, 0, 0, 0)  # nothing to count against
    each = {
        "instances": 1,
        "cores": int(flavor.get("vcpus", 0) or 0),
        "ram": int(flavor.get("ram", 0) or 0),
    }
    in_use = {"instances": used.instances, "cores": used.cores, "ram": used.ram}
    allowed = min(max_count, cloud.config.max_instances_per_request)
    over: list[str] = []
    for resource, amount in each.items():
        limit = limits.get(resource, -1)
        if limit < 0 or amount == 0:
            continue
        room = max(0, (limit - in_use[resource]) // amount)
        if room < min_count:
            over.append(resource)
        allowed = min(allowed, room)
    if group_id is not None:
        limit = limits.get("server_group_members", -1)
        if limit >= 0:
            room = max(0, limit - used.group_members)
            if room < min_count:
                raise QuotaExceeded(
                    f"Quota exceeded, too many servers in group: requested {min_count}, "
                    f"but the group already has {used.group_members} of {limit} members"
                )
            allowed = min(allowed, room)
    if over:
        detail = ", ".join(
            f"{r} (requested {min_count * each[r]}, used {in_use[r]}, quota {limits[r]})"
            for r in over
        )
        raise QuotaExceeded(
            f"Quota exceeded for {', '.join(over)}: Requested {min_count}, but already used "
            f"{in_use[over[0]]} of {limits[over[0]]} {over[0]}. {detail}"
        )
    if allowed < min_count:
        raise QuotaExceeded(
            f"Requested {min_count} instances in one request; at most "
            f"{cloud.config.max_instances_per_request} are allowed per request"
        )
    return allowed


def _applying(limits: Mapping[str, int], group_id: str | None) -> tuple[bool, bool]:
    """Whether a limit of the instances, cores or RAM applies to a create under these limits,
    and whether the group's `server_group_members` does: what the create has to count."""
    limited = any(limits.get(r, -1) >= 0 for r in ("instances", "cores", "ram"))
    return limited, group_id is not None and limits.get("server_group_members", -1) >= 0


def reserve_server_group(cloud: Cloud, conn: Connection, project_id: str) -> None:
    """Refuse a new server group past the project's `server_groups` quota (inside `conn`)."""
    lock_project(conn, project_id)
    limit = quota_limits_in(cloud, conn, project_id).get("server_groups", -1)
    if limit < 0:
        return
    used = int(
        conn.execute(
            select(func.count())
            .select_from(server_groups)
            .where(server_groups.c.project_id == project_id)
        ).scalar_one()
    )
    if used + 1 > limit:
        raise QuotaExceeded(
            f"Quota exceeded, too many server groups: used {used} of {limit} server_groups"
        )


def set_quota(
    cloud: Cloud,
    project_id: str,
    user_id: str | None,
    wanted: Mapping[str, int],
    *,
    force: bool,
) -> None:
    """Override the project's (or one user's) limits. Without `force`, a limit below what the
    project uses now is InvalidSpec, checked under the project's quota lock, so a create
    cannot slip in between the check and the write."""
    key = quota_key(project_id, user_id)
    with cloud.ledger.engine.begin() as conn:
        lock_project(conn, project_id)
        if not force:
            usage = count_instances(conn, project_id, None)
            groups = int(
                conn.execute(
                    select(func.count())
                    .select_from(server_groups)
                    .where(server_groups.c.project_id == project_id)
                ).scalar_one()
            )
            used = {
                "instances": usage.instances,
                "cores": usage.cores,
                "ram": usage.ram,
                "server_groups": groups,
            }
            for resource, count in used.items():
                limit = wanted.get(resource)
                if limit is not None and 0 <= limit < count:
                    raise InvalidSpec(
                        f"Quota limit {limit} for {resource} must be greater than or equal to "
                        f"already used and reserved {count}."
                    )
        current = cloud.objects.find_in(conn, "quota", key)
        overrides = {**(current.body if current is not None else {}), **wanted}
        if current is None:
            cloud.objects.create_in(conn, "quota", key, overrides, project_id=project_id)
        else:
            cloud.objects.update_in(conn, "quota", key, overrides)


def revert_quota(cloud: Cloud, project_id: str, user_id: str | None) -> None:
    """Back to the defaults: the project's (or the user's) overrides go."""
    cloud.objects.delete("quota", quota_key(project_id, user_id))


def set_default_quotas(cloud: Cloud, wanted: Mapping[str, int]) -> None:
    """Override the defaults every project starts from (the "default" quota class)."""
    with cloud.ledger.engine.begin() as conn:
        lock_key(conn, "stowage-quota-class:default")
        current = cloud.objects.find_in(conn, "quota_class", "default")
        overrides = {**(current.body if current is not None else {}), **wanted}
        if current is None:
            cloud.objects.create_in(conn, "quota_class", "default", overrides)
        else:
            cloud.objects.update_in(conn, "quota_class", "default", overrides)
