"""Neutron's quotas: per-project limits on networks, subnets, ports, groups and rules.

A project's limits are Neutron's defaults overlaid with what an admin set (a document of kind
"network_quota" whose id is the project's); its usage is the count of the documents it owns,
read when asked: there is no counter that could drift. A create counts and writes in one
transaction holding the project's network quota lock (an advisory lock on PostgreSQL; SQLite's
write transactions begin IMMEDIATE, one at a time), so two creates in one project take turns
and cannot pass a limit together.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, func, select
from sqlalchemy.exc import IntegrityError

from stowage.domain.errors import ConflictError
from stowage.ledger.objects import Document
from stowage.ledger.schema import objects
from stowage.services.caller import Caller
from stowage.services.networks.common import NetworkError

if TYPE_CHECKING:
    from stowage.services.cloud import Cloud

__all__ = [
    "DEFAULT_QUOTAS",
    "create_counted",
    "default_quota",
    "delete_quota",
    "list_quotas",
    "quota_details",
    "show_quota",
    "update_quota",
]

# Neutron's defaults (neutron/conf/quota.py), for the resources this network service serves.
DEFAULT_QUOTAS: dict[str, int] = {
    "network": 100,
    "subnet": 100,
    "port": 500,
    "router": 10,
    "floatingip": 50,
    "security_group": 10,
    "security_group_rule": 100,
}
# The document kind each quota counts.
_KINDS = {
    "network": "network",
    "subnet": "subnet",
    "port": "port",
    "router": "router",
    "floatingip": "floatingip",
    "security_group": "security_group",
    "security_group_rule": "security_group_rule",
}
_KIND = "network_quota"
# The quota-check-limit extension: check_limit refuses a limit below the usage; force (the
# default) sets it anyway.
_FLAGS = ("check_limit", "force")


def _forbidden(action: str) -> NetworkError:
    return NetworkError(f"rule:{action} is disallowed by policy", "PolicyNotAuthorized", status=403)


def _bad(message: str) -> NetworkError:
    return NetworkError(message, "HTTPBadRequest", status=400)


def _may_read(caller: Caller, project_id: str) -> None:
    # Neutron's get_quota: an admin, or a reader of that very project.
    if not caller.is_admin and caller.project_id != project_id:
        raise _forbidden("get_quota")


def limits_of(cloud: Cloud, project_id: str) -> dict[str, int]:
    limits = dict(DEFAULT_QUOTAS)
    doc = cloud.objects.find(_KIND, project_id)
    if doc is not None:
        limits.update({k: int(v) for k, v in doc.body.items() if k in DEFAULT_QUOTAS})
    return limits


def usage_of(cloud: Cloud, project_id: str) -> dict[str, int]:
    return {
        resource: len(cloud.objects.list(kind, project_id=project_id))
        for resource, kind in _KINDS.items()
    }


def show_quota(cloud: Cloud, caller: Caller, project_id: str) -> dict[str, int]:
    _may_read(caller, project_id)
    return limits_of(cloud, project_id)


def default_quota(cloud: Cloud, caller: Caller, project_id: str) -> dict[str, int]:
    _may_read(caller, project_id)
    return dict(DEFAULT_QUOTAS)


def quota_details(cloud: Cloud, caller: Caller, project_id: str) -> dict[str, dict[str, int]]:
    _may_read(caller, project_id)
    limits = limits_of(cloud, project_id)
    used = usage_of(cloud, project_id)
    return {r: {"limit": limits[r], "used": used[r], "reserved": 0} for r in DEFAULT_QUOTAS}


def list_quotas(cloud: Cloud, caller: Caller) -> list[dict[str, Any]]:
    """The projects whose limits differ from the defaults (Neutron's GET /quotas)."""
    if not caller.is_admin:
        return [] if caller.project_id is None else _own(cloud, caller.project_id)
    out = []
    for doc in cloud.objects.list(_KIND):
        out.append({**limits_of(cloud, doc.id), "project_id": doc.id, "tenant_id": doc.id})
    return out


def _own(cloud: Cloud, project_id: str) -> list[dict[str, Any]]:
    if cloud.objects.find(_KIND, project_id) is None:
        return []
    return [{**limits_of(cloud, project_id), "project_id": project_id, "tenant_id": project_id}]


def _checked(changes: Any) -> dict[str, int]:
    if not isinstance(changes, Mapping):
        raise _bad("Unable to find 'quota' in request body")
    unknown = sorted(k for k in changes if k not in DEFAULT_QUOTAS and k not in _FLAGS)
    if unknown:
        raise _bad(f"Unrecognized attribute(s) '{', '.join(unknown)}'")
    out: dict[str, int] = {}
    for key, value in changes.items():
        if key in _FLAGS:
            if not isinstance(value, bool):
                raise _bad(f"Invalid input for {key}. Reason: '{value}' is not a boolean.")
            continue
        try:
            number = int(value)
        except (TypeError, ValueError):
            raise _bad(f"Invalid input for {key}. Reason: '{value}' is not an integer.") from None
        if isinstance(value, bool) or number < -1:
            raise _bad(f"Invalid input for {key}. Reason: '{value}' should be >= -1.")
        out[key] = number
    return out


def update_quota(cloud: Cloud, caller: Caller, project_id: str, changes: Any) -> dict[str, int]:
    if not caller.is_admin:
        raise _forbidden("update_quota")
    checked = _checked(changes)
    if changes.get("check_limit") is True and changes.get("force") is not True:
        used = usage_of(cloud, project_id)
        under = sorted(r for r, n in checked.items() if 0 <= n < used[r])
        if under:
            raise NetworkError(
                f"Change would make usage greater than the limit for the following "
                f"resources: {under}",
                "InvalidQuotaValue",
                status=409,
            )
    doc = cloud.objects.find(_KIND, project_id)
    body = {**(doc.body if doc is not None else {}), **checked}
    cloud.objects.put(_KIND, project_id, body, project_id=project_id)
    return limits_of(cloud, project_id)


def delete_quota(cloud: Cloud, caller: Caller, project_id: str) -> None:
    """Back to the defaults."""
    if not caller.is_admin:
        raise _forbidden("delete_quota")
    cloud.objects.delete(_KIND, project_id)


def over_quota(resource: str) -> NetworkError:
    return NetworkError(f"Quota exceeded for resources: ['{resource}'].", "OverQuota", status=409)


def _limit_in(conn: Connection, project_id: str, resource: str) -> int:
    raw = conn.execute(
        select(objects.c.body).where(objects.c.kind == _KIND, objects.c.id == project_id)
    ).scalar()
    overrides = json.loads(raw) if raw is not None else {}
    return int(overrides.get(resource, DEFAULT_QUOTAS[resource]))


def _count_in(conn: Connection, project_id: str, kind: str) -> int:
    query = select(func.count()).where(objects.c.kind == kind, objects.c.project_id == project_id)
    return int(conn.execute(query).scalar() or 0)


def lock_quotas(conn: Connection, project_id: str) -> None:
    """Hold the project's network quotas until `conn`'s transaction ends."""
    # Late: services.quotas imports the cloud, which imports this package.
    from stowage.services.quotas import lock_project

    lock_project(conn, f"network:{project_id}")


def create_counted(
    cloud: Cloud,
    resource: str,
    doc_id: str,
    body: Mapping[str, Any],
    *,
    project_id: str,
    name: str | None = None,
) -> Document:
    """Create the document of one `resource` owned by `project_id`, unless the project's quota
    of it is used up (Neutron's 409 OverQuota): counted and written in one transaction."""
    kind = _KINDS[resource]
    try:
        with cloud.objects.writing() as conn:  # a transaction of its own, or the caller's
            if project_id:  # "": a port of no project (a gateway's, a floating IP's)
                lock_quotas(conn, project_id)
                limit = _limit_in(conn, project_id, resource)
                if limit >= 0 and _count_in(conn, project_id, kind) >= limit:
                    raise over_quota(resource)
            return cloud.objects.create_in(
                conn, kind, doc_id, body, project_id=project_id, name=name
            )
    except IntegrityError:
        raise ConflictError(f"{kind} {doc_id} already exists") from None
