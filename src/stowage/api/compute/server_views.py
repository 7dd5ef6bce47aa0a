"""Compute v2.1: the server views update, rebuild and detail lists answer with; metadata checks."""

from __future__ import annotations

import ipaddress
import re
from typing import Any

from stowage.api.common import ApiError, Context
from stowage.api.compute.keypairs import _doc_id as keypair_doc_id
from stowage.ledger.objects import Document
from stowage.services import compute_catalog as catalog
from stowage.services import networks as net
from stowage.services.cloud import Cloud

__all__ = [
    "action_view",
    "check_create",
    "check_metadata",
    "check_resize_quota",
    "detail_list_view",
    "matches_more",
    "omit_unset",
]

# What PUT /servers/{id} and the rebuild action show below 2.75 (Nova's show() with every
# extension off): no extended status, zone, host, usage, volumes, key or security groups.
_ACTION_FIELDS = frozenset(
    {
        "id",
        "name",
        "status",
        "tenant_id",
        "user_id",
        "metadata",
        "hostId",
        "image",
        "flavor",
        "created",
        "updated",
        "addresses",
        "accessIPv4",
        "accessIPv6",
        "links",
        "OS-DCF:diskConfig",
        "progress",
        "fault",
        "locked",
        "description",
        "tags",
        "trusted_image_certificates",
        "server_groups",
        "locked_reason",
    }
)


# Nova shows `progress` only while a server is in one of these states.
_PROGRESS_STATUSES = frozenset(
    {"ACTIVE", "BUILD", "REBUILD", "RESIZE", "VERIFY_RESIZE", "MIGRATING"}
)


def action_view(
    view: dict[str, Any],
    version: tuple[int, int],
    *,
    rebuild: bool,
    admin_pass: str | None = None,
    user_data: str | None = None,
) -> dict[str, Any]:
    """The server as an update (or a rebuild, which also tells the new admin password)
    returns it at `version`."""
    if version >= (2, 75):
        shown = dict(view)
    else:
        shown = {k: v for k, v in view.items() if k in _ACTION_FIELDS}
        shown["addresses"] = {
            network: [{"version": a["version"], "addr": a["addr"]} for a in entries]
            for network, entries in (view.get("addresses") or {}).items()
        }
        if rebuild and version >= (2, 54):
            shown["key_name"] = view.get("key_name")
    if rebuild:
        shown.pop("OS-EXT-SRV-ATTR:user_data", None)
    if shown.get("status") not in _PROGRESS_STATUSES:
        shown.pop("progress", None)
    if rebuild and version >= (2, 57):
        shown["user_data"] = user_data
    if rebuild and admin_pass is not None:
        shown["adminPass"] = admin_pass
    return shown


def omit_unset(view: dict[str, Any]) -> dict[str, Any]:
    """What Nova leaves out of a server it shows: `progress` outside the states that have
    one, and `security_groups` when the server has none."""
    if view.get("status") not in _PROGRESS_STATUSES:
        view.pop("progress", None)
    if not view.get("security_groups"):
        view.pop("security_groups", None)
    return view


def detail_list_view(view: dict[str, Any]) -> dict[str, Any]:
    """A server in GET /servers/detail: as shown alone, less its group (2.71 shows it only
    on GET /servers/{id}, update and rebuild)."""
    return {k: v for k, v in view.items() if k != "server_groups"}


_META_KEY_MAX = 255
_META_VALUE_MAX = 255


def check_metadata(value: Any, *, field: str = "metadata") -> dict[str, str]:
    """Nova's metadata schema: an object of 1-255 character keys to strings of at most 255."""
    if not isinstance(value, dict):
        raise ApiError(400, f"Invalid input for field/attribute {field}: not an object")
    for key, item in value.items():
        if not isinstance(key, str) or not 1 <= len(key) <= _META_KEY_MAX:
            raise ApiError(
                400,
                f"Invalid input for field/attribute {field}: keys must be 1 to "
                f"{_META_KEY_MAX} characters",
            )
        if not isinstance(item, str) or len(item) > _META_VALUE_MAX:
            raise ApiError(
                400,
                f"Invalid input for field/attribute {field}: the value of {key} must be a "
                f"string of at most {_META_VALUE_MAX} characters",
            )
    return dict(value)


def _count(value: Any, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ApiError(400, f"Invalid input for field/attribute {what}. Value: {value}.")
    if isinstance(value, str) and not value.isdigit():
        raise ApiError(400, f"Invalid input for field/attribute {what}. Value: {value}.")


def _access_ip(value: Any, what: str, version: int) -> None:
    try:
        parsed = ipaddress.ip_address(value)
    except (TypeError, ValueError):
        parsed = None
    if parsed is None or parsed.version != version:
        raise ApiError(
            400, f"Invalid input for field/attribute {what}. Value: {value}. Not an IPv{version}"
        )


def check_create(
    cloud: Cloud, ctx: Context, server: dict[str, Any], flavor: Any, image: Document | None
) -> None:
    """The create checks Nova makes before it accepts a build: counts, access addresses, the
    key pair, the security groups, and that `image` (the `imageRef` one, already read) fits
    the flavor."""
    for what in ("min_count", "max_count"):
        if what in server:
            _count(server[what], what)
    for what, version in (("accessIPv4", 4), ("accessIPv6", 6)):
        if server.get(what):
            _access_ip(server[what], what, version)
    metadata = server.get("metadata") or {}
    limit = catalog.quota_limits(cloud, ctx.project_id)["metadata_items"] if metadata else -1
    if isinstance(metadata, dict) and 0 <= limit < len(metadata):
        raise ApiError(403, f"Quota exceeded for metadata_items: maximum {limit} items")
    key_name = server.get("key_name")
    if key_name and cloud.objects.find("keypair", keypair_doc_id(ctx.user_id, key_name)) is None:
        raise ApiError(400, "Invalid key_name provided.")
    wanted = [g.get("name") for g in server.get("security_groups") or [] if isinstance(g, dict)]
    if wanted:
        known = {n for g in net.list_security_groups(cloud, ctx) for n in (g["id"], g["name"])}
        missing = [n for n in wanted if n not in known]
        if missing:
            raise ApiError(
                400, f"Security group {missing[0]} not found for project {ctx.project_id}."
            )
    if image is not None:
        if int(image.body.get("min_ram") or 0) > int(flavor.get("ram", 0)):
            raise ApiError(400, "Flavor's memory is too small for requested image.")
        disk = int(flavor.get("disk", 0))
        if disk and int(image.body.get("min_disk") or 0) > disk:
            raise ApiError(400, "Flavor's disk is too small for requested image.")


def matches_more(body: dict[str, Any], query: Any) -> bool:
    """The list filters beside the common ones: reservation_id, and `ip`/`ip6` as regular
    expressions over the server's addresses (Nova matches them the same way)."""
    reservation = query.get("reservation_id")
    if reservation and body.get("reservation_id") != reservation:
        return False
    for key, version in (("ip", 4), ("ip6", 6)):
        pattern = query.get(key)
        if not pattern:
            continue
        addresses = [
            a["addr"]
            for entries in (body.get("addresses") or {}).values()
            for a in entries
            if a.get("version") == version
        ]
        try:
            if not any(re.search(pattern, a) for a in addresses):
                return False
        except re.error:
            if pattern not in addresses:
                return False
    return True


def check_resize_quota(cloud: Cloud, project_id: str, old: Any, new: Any) -> None:
    """A resize that would take the project over its cores or RAM quota is refused (403)."""
    limits = catalog.quota_limits(cloud, project_id)
    used = catalog.quota_usage(cloud, project_id)
    over = [
        resource
        for resource, key in (("cores", "vcpus"), ("ram", "ram"))
        if limits[resource] >= 0
        and used[resource] + int(new.get(key, 0)) - int(old.get(key, 0)) > limits[resource]
    ]
    if over:
        raise ApiError(403, f"Quota exceeded for {', '.join(over)}: resize to {new.get('id')}")
