"""Neutron's quotas: per-project limits on networks, subnets, ports, groups and rules.

A project's limits are Neutron's defaults overlaid with what an admin set (a document of kind
"network_quota" whose id is the project's); its usage is the count of the documents it owns,
read when asked: there is no counter that could drift. A create takes the project's network
quota lock (an advisory lock on PostgreSQL, a process lock besides) while it counts and
writes, so two creates in one project take turns and cannot pass a limit together.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from stowage.services.caller import Caller
from stowage.services.networks import NetworkError
from stowage.services.quotas import lock_project

if TYPE_CHECKING:
    from stowage.services.cloud import Cloud

__all__ = [
    "DEFAULT_QUOTAS",
    "default_quota",
    "delete_quota",
    "guarded_create",
    "list_quotas",
    "quota_details",
    "show_quota",
    "update_quota",
]

# Neutron's defaults (neutron/conf/quota.py), for the resources this network service serves:
# no routers or floating IPs (no L3 extension is advertised), so no quota for them.
DEFAULT_QUOTAS: dict[str, int] = {
    "network": 100,
    "subnet": 100,
    "port": 500,
    "security_group": 10,
    "security_group_rule": 100,
}
# The document kind each quota counts.
_KINDS = {
    "network": "network",
    "subnet": "subnet",
    "port": "port",
    "security_group": "security_group",
    "security_group_rule": "security_group_rule",
}
_KIND = "network_quota"
# The quota-check-limit extension: check_limit refuses a limit below the usage; force (the
# default) sets it anyway.
_FLAGS = ("check_limit", "force")
_process_lock = threading.Lock()
T = TypeVar("T")


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


@contextlib.contextmanager
def _project_lock(cloud: Cloud, project_id: str) -> Iterator[None]:
    with _process_lock, cloud.ledger.engine.connect() as conn:
        lock_project(conn, f"network:{project_id}")
        yield
        conn.rollback()


def over_quota(resource: str) -> NetworkError:
    return NetworkError(f"Quota exceeded for resources: ['{resource}'].", "OverQuota", status=409)


def guarded_create(cloud: Cloud, project_id: str, resource: str, create: Callable[[], T]) -> T:
    """Run `create` (which makes one `resource` owned by `project_id`) unless the project's
    quota is used up: a 409 OverQuota as Neutron's."""
    with _project_lock(cloud, project_id):
        limit = limits_of(cloud, project_id)[resource]
        if limit >= 0 and len(cloud.objects.list(_KINDS[resource], project_id=project_id)) >= limit:
            raise over_quota(resource)
        return create()


def _owner_of(caller: Caller, attrs: Mapping[str, Any]) -> str:
    # As networks._owner: an admin may create for another project; the service refuses others.
    owner = attrs.get("project_id") or attrs.get("tenant_id")
    return str(owner) if owner and caller.is_admin else caller.project_id


def counted(
    resource: str,
    create: Callable[[Cloud, Caller, Mapping[str, Any]], dict[str, Any]],
) -> Callable[[Cloud, Caller, Mapping[str, Any]], dict[str, Any]]:
    """`create` (a network service's creator) that first checks `resource`'s quota."""

    def checked(cloud: Cloud, caller: Caller, attrs: Mapping[str, Any]) -> dict[str, Any]:
        project = _owner_of(caller, attrs) if isinstance(attrs, Mapping) else caller.project_id
        return guarded_create(cloud, project, resource, lambda: create(cloud, caller, attrs))

    return checked
