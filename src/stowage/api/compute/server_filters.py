"""GET /servers filters and sorting beside the common ones, as Nova applies them: tags (2.26),
key_name, locked (2.73), config_drive, availability_zone, description (2.19), launched_at,
deleted, changes-before (2.66), and sort_key / sort_dir. Nothing in the query is ignored that
Nova would apply: each filter either narrows the list or is refused."""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from stowage.api.common import ApiError, Context
from stowage.api.compute.paging import query_stamp
from stowage.ledger.objects import Document

__all__ = ["all_tenants_asked", "filter_servers", "sort_servers"]

Version = tuple[int, int]

_TRUE = ("1", "t", "true", "on", "y", "yes")
_FALSE = ("0", "f", "false", "off", "n", "no")

# Filters a non-admin may use from 2.83 (before, Nova drops them for non-admins).
_USER_FILTERS_283 = frozenset(
    {
        "availability_zone",
        "config_drive",
        "key_name",
        "created_at",
        "launched_at",
        "terminated_at",
        "power_state",
        "task_state",
        "vm_state",
        "progress",
        "user_id",
    }
)


def _strict_bool(value: str, what: str) -> bool:
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ApiError(400, f"Invalid value {value!r} for {what}: a boolean is required")


def all_tenants_asked(ctx: Context, query: Any) -> bool:
    """`all_tenants` as Nova reads it: present and true (an empty value is true); a
    non-admin asking for it is refused (os_compute_api:servers:index:get_all_tenants)."""
    if "all_tenants" not in query:
        return False
    raw = query.get("all_tenants") or ""
    wanted = True if raw == "" else _strict_bool(raw, "all_tenants")
    if wanted and not ctx.is_admin:
        raise ApiError(
            403,
            "Policy doesn't allow os_compute_api:servers:index:get_all_tenants to be performed.",
        )
    return wanted


def _regex(pattern: str, value: Any) -> bool:
    """Nova's regex filters (`_regex_instance_filter`): the pattern searched in the value."""
    text = "" if value is None else str(value)
    try:
        return re.search(pattern, text) is not None
    except re.error:
        return pattern in text


def _tags(raw: str) -> set[str]:
    return {t for t in raw.split(",") if t}


def _usable(ctx: Context, name: str, version: Version) -> bool:
    """Whether Nova applies filter `name` for this caller (it drops the others silently)."""
    if ctx.is_admin:
        return True
    return version >= (2, 83) and name in _USER_FILTERS_283


def filter_servers(
    docs: list[Document],
    query: Any,
    ctx: Context,
    version: Version,
    zone_of: Callable[[dict[str, Any]], str],
) -> list[Document]:
    """The servers that pass every filter of the query that Nova applies at `version`."""
    checks: list[Callable[[Document], bool]] = []
    if "deleted" in query and ctx.is_admin and _strict_bool(query["deleted"], "deleted"):
        # Deletes are immediate here (reclaim_instance_interval = 0, records purged): there
        # is no deleted server to show.
        return []
    if version >= (2, 26):
        for key, test in (
            ("tags", lambda want, have: want <= have),
            ("tags-any", lambda want, have: bool(want & have)),
            ("not-tags", lambda want, have: not want <= have),
            ("not-tags-any", lambda want, have: not want & have),
        ):
            if key in query:
                wanted = _tags(query[key])
                checks.append(
                    lambda d, w=wanted, t=test: t(w, set(d.body.get("tags") or []))  # type: ignore[misc]
                )
    if version >= (2, 73) and "locked" in query:
        locked = _strict_bool(query["locked"], "locked")
        checks.append(lambda d: bool(d.body.get("locked")) == locked)
    if version >= (2, 19) and query.get("description") is not None:
        pattern = query["description"]
        checks.append(lambda d: _regex(pattern, d.body.get("description")))
    if version >= (2, 66) and query.get("changes-before"):
        before = query_stamp(query["changes-before"], "changes-before")
        since = query.get("changes-since")
        if since and query_stamp(since, "changes-since") > before:
            raise ApiError(
                400, "The value of changes-since must be less than or equal to changes-before."
            )
        checks.append(lambda d: d.updated_at <= before)
    for key, value_of in (
        ("key_name", lambda b: b.get("key_name")),
        ("availability_zone", zone_of),
        ("config_drive", lambda b: "True" if b.get("config_drive") else ""),
        ("launched_at", lambda b: _db_time(b.get("launched_at"))),
        ("user_id", lambda b: b.get("user_id")),
        ("vm_state", lambda b: b.get("vm_state")),
        ("task_state", lambda b: b.get("task_state")),
        ("power_state", lambda b: b.get("power_state")),
    ):
        raw = query.get(key)
        if raw is None or not _usable(ctx, key, version):
            continue
        if key == "launched_at":
            raw = raw.replace("T", " ").rstrip("Z")
        exact = key in ("user_id", "vm_state", "task_state", "power_state")
        checks.append(
            lambda d, r=raw, f=value_of, e=exact: (  # type: ignore[misc]
                str(f(d.body)) == r if e else _regex(r, f(d.body))
            )
        )
    return [d for d in docs if all(check(d) for check in checks)]


def _db_time(ts: float | None) -> str | None:
    """A time as Nova's database column shows it, which its regex filter searches."""
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S")


# Nova's VALID_SORT_KEYS, with the value each sorts by here (None: the same for every server
# here, as the column is in Nova for a cloud with no kernels, ramdisks, cells, ...).
_SORT_VALUES: dict[str, Callable[[Document], Any]] = {
    "access_ip_v4": lambda d: d.body.get("access_ipv4") or "",
    "access_ip_v6": lambda d: d.body.get("access_ipv6") or "",
    "auto_disk_config": lambda d: d.body.get("disk_config") == "AUTO",
    "availability_zone": lambda d: d.body.get("availability_zone") or "",
    "config_drive": lambda d: "True" if d.body.get("config_drive") else "",
    "created_at": lambda d: d.created_at,
    "display_description": lambda d: d.body.get("description") or "",
    "display_name": lambda d: d.body.get("name") or "",
    "host": lambda d: d.body.get("host") or "",
    "hostname": lambda d: d.body.get("hostname") or d.body.get("name") or "",
    "image_ref": lambda d: d.body.get("image_id") or "",
    "instance_type_id": lambda d: str(d.body.get("flavor", {}).get("id") or ""),
    "kernel_id": lambda d: "",
    "key_name": lambda d: d.body.get("key_name") or "",
    "launch_index": lambda d: int(d.body.get("launch_index") or 0),
    "launched_at": lambda d: float(d.body.get("launched_at") or 0.0),
    "locked_by": lambda d: d.body.get("locked_by") or "",
    "node": lambda d: d.body.get("host") or "",
    "power_state": lambda d: int(d.body.get("power_state") or 0),
    "progress": lambda d: 0,
    "project_id": lambda d: d.body.get("project_id") or "",
    "ramdisk_id": lambda d: "",
    "root_device_name": lambda d: "/dev/vda",
    "task_state": lambda d: d.body.get("task_state") or "",
    "terminated_at": lambda d: 0.0,
    "updated_at": lambda d: d.updated_at,
    "user_id": lambda d: d.body.get("user_id") or "",
    "uuid": lambda d: d.id,
    "vm_state": lambda d: d.body.get("vm_state") or "",
    "locked": lambda d: bool(d.body.get("locked")),
}
_ADMIN_SORT_KEYS = frozenset({"host", "node"})
# Nova's other valid keys, which it ignores for non-admins and which mean nothing here.
_IGNORED_SORT_KEYS = frozenset(
    {
        "architecture",
        "cell_name",
        "cleaned",
        "default_ephemeral_device",
        "default_swap_device",
        "deleted",
        "deleted_at",
        "disable_terminate",
        "ephemeral_gb",
        "ephemeral_key_uuid",
        "id",
        "key_data",
        "launched_on",
        "memory_mb",
        "os_type",
        "reservation_id",
        "root_gb",
        "shutdown_terminate",
        "user_data",
        "vcpus",
        "vm_mode",
    }
)
_FLAVOR_SORT = {
    "memory_mb": "ram",
    "vcpus": "vcpus",
    "root_gb": "disk",
    "ephemeral_gb": "ephemeral",
}


def _flavor_value(attr: str) -> Callable[[Document], Any]:
    return lambda d: int(d.body.get("flavor", {}).get(attr) or 0)


def sort_servers(
    docs: list[Document], query: Any, ctx: Context, version: Version
) -> list[Document]:
    """Sort by the query's sort_key / sort_dir pairs (Nova's default: created_at desc, then
    uuid desc); an unknown key or direction is a 400, host/node for a non-admin a 403."""
    keys = query.getlist("sort_key") if hasattr(query, "getlist") else []
    dirs = query.getlist("sort_dir") if hasattr(query, "getlist") else []
    for direction in dirs:
        if direction not in ("asc", "desc"):
            raise ApiError(400, f"Invalid input for query parameters sort_dir. Value: {direction}.")
    pairs: list[tuple[Callable[[Document], Any], bool]] = []
    for index, key in enumerate(keys):
        direction = dirs[index] if index < len(dirs) else (dirs[0] if dirs else "desc")
        if key in _SORT_VALUES:
            if key in _ADMIN_SORT_KEYS and not ctx.is_admin:
                raise ApiError(403, "Only administrators can sort servers by host or node")
            if key == "locked" and not ctx.is_admin and version < (2, 73):
                continue
            pairs.append((_SORT_VALUES[key], direction == "desc"))
        elif key in _IGNORED_SORT_KEYS:
            if not ctx.is_admin:
                continue  # Nova drops these for non-admins
            if key in _FLAVOR_SORT:
                pairs.append((_flavor_value(_FLAVOR_SORT[key]), direction == "desc"))
            elif key == "reservation_id":
                pairs.append((lambda d: d.body.get("reservation_id") or "", direction == "desc"))
            elif key == "id":
                pairs.append((lambda d: d.created_at, direction == "desc"))
            # the others are the same for every server here
        else:
            raise ApiError(400, f"Invalid input for query parameters sort_key. Value: {key}.")
    if not any(key == "uuid" for key in keys):
        pairs.append((lambda d: d.created_at, True))
        pairs.append((lambda d: d.id, True))
    ordered = list(docs)
    for value_of, descending in reversed(pairs):
        ordered.sort(key=value_of, reverse=descending)
    return ordered
