"""Block storage views: volumes, snapshots, types and attachments as Cinder renders them at the
request's microversion; the caller's context checked against the URL's project."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from fastapi import Request

from stowage.api.auth import cloud_of, require_context
from stowage.api.common import ApiError, Context
from stowage.api.volume.microversion import vmv
from stowage.domain.errors import NotFound, QuotaExceeded, StowageError
from stowage.ledger.objects import Document
from stowage.services.volumes import InvalidVolume, VolumeQuotaExceeded, pool_host

__all__ = [
    "attachment_view",
    "context",
    "iso",
    "mapped",
    "snapshot_view",
    "type_view",
    "volume_view",
]


def iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")


def context(request: Request, project_id: str) -> Context:
    """The caller, whose token's project must be the URL's (Cinder: 400 otherwise)."""
    ctx = require_context(request)
    if project_id != ctx.project_id:
        raise ApiError(
            400,
            f"Malformed request URL: URL's project_id '{project_id}' doesn't match Context's "
            f"project_id '{ctx.project_id}'",
        )
    return ctx


def writer(request: Request, project_id: str, rule: str) -> Context:
    ctx = context(request, project_id)
    if not ctx.can_write:
        raise ApiError(403, f"Policy doesn't allow {rule} to be performed.")
    return ctx


def mapped(exc: StowageError) -> ApiError:
    """A service's refusal as Cinder's status: 400 invalid, 404, 413 over quota, 409."""
    if isinstance(exc, InvalidVolume):
        return ApiError(400, exc.message)
    if isinstance(exc, VolumeQuotaExceeded | QuotaExceeded):
        return ApiError(413, exc.message)
    if isinstance(exc, NotFound):
        return ApiError(404, exc.message)
    return ApiError(409, exc.message)


def _links(request: Request, kind: str, item_id: str, project_id: str) -> list[dict[str, str]]:
    base = cloud_of(request).config.base_url
    return [
        {"rel": "self", "href": f"{base}/volume/v3/{project_id}/{kind}/{item_id}"},
        {"rel": "bookmark", "href": f"{base}/volume/{project_id}/{kind}/{item_id}"},
    ]


def volume_view(
    request: Request, ctx: Context, doc: Document, *, brief: bool = False, changed: bool = False
) -> dict[str, Any]:
    """Cinder's volume; `changed` for the answer of a create or an update, which lacks what
    Cinder's show and detail extensions add (tenant, host and migration attributes, image
    metadata)."""
    body = doc.body
    links = _links(request, "volumes", doc.id, ctx.project_id)
    if brief:
        return {"id": doc.id, "name": body.get("name"), "links": links}
    version = vmv(request)
    attached = [
        {
            "id": doc.id,
            "attachment_id": a["id"],
            "volume_id": doc.id,
            "server_id": a.get("instance"),
            "host_name": a.get("host_name"),
            "device": a.get("mountpoint"),
            "attached_at": iso(a.get("attached_at")),
        }
        for a in (body.get("attachments") or {}).values()
        if a["status"] == "attached"
    ]
    view: dict[str, Any] = {
        "id": doc.id,
        "name": body.get("name"),
        "description": body.get("description"),
        "status": body["status"],
        "size": body["size"],
        "availability_zone": body.get("availability_zone", "nova"),
        "created_at": iso(doc.created_at),
        "updated_at": iso(doc.updated_at),
        "attachments": attached,
        "volume_type": body.get("volume_type"),
        "snapshot_id": body.get("snapshot_id"),
        "source_volid": body.get("source_volid"),
        "metadata": body.get("metadata") or {},
        "links": links,
        "user_id": body.get("user_id"),
        "bootable": "true" if body.get("bootable") else "false",
        "encrypted": False,
        "replication_status": None,
        "consistencygroup_id": None,
        "multiattach": bool(body.get("multiattach")),
        "migration_status": None,
    }
    if not changed:
        view["os-vol-tenant-attr:tenant_id"] = body.get("project_id")
    if body.get("volume_image_metadata") and not changed:
        view["volume_image_metadata"] = body["volume_image_metadata"]
    if ctx.is_admin and not changed:
        view["os-vol-host-attr:host"] = pool_host(cloud_of(request))
        view["os-vol-mig-status-attr:migstat"] = None
        view["os-vol-mig-status-attr:name_id"] = None
    if version >= (3, 13):
        view["group_id"] = None
    if version >= (3, 21) and ctx.is_admin:
        view["provider_id"] = None
    if version >= (3, 48):
        view["shared_targets"] = False
        view["service_uuid"] = None
    if version >= (3, 61) and ctx.is_admin:
        view["cluster_name"] = None
    if version >= (3, 63):
        view["volume_type_id"] = body.get("volume_type_id")
    if version >= (3, 65):
        view["consumes_quota"] = True
    return view


def snapshot_view(request: Request, doc: Document, *, changed: bool = False) -> dict[str, Any]:
    """Cinder's snapshot; `changed` for a create's or update's answer, which lacks the
    extended-snapshot-attributes extension's fields (it extends show and detail only)."""
    body = doc.body
    view: dict[str, Any] = {
        "id": doc.id,
        "name": body.get("name"),
        "description": body.get("description"),
        "status": body["status"],
        "size": body["size"],
        "volume_id": body["volume_id"],
        "created_at": iso(doc.created_at),
        "updated_at": iso(doc.updated_at),
        "metadata": body.get("metadata") or {},
    }
    if not changed:
        view["os-extended-snapshot-attributes:progress"] = body.get("progress", "0%")
        view["os-extended-snapshot-attributes:project_id"] = body.get("project_id")
    version = vmv(request)
    if version >= (3, 14):
        view["group_snapshot_id"] = None
    if version >= (3, 41):
        view["user_id"] = body.get("user_id")
    if version >= (3, 65):
        view["consumes_quota"] = True
    return view


def type_view(ctx: Context, body: dict[str, Any], *, answer_of: str = "show") -> dict[str, Any]:
    """A volume type as Cinder shows it; a create's answer (`answer_of="create"`) has no
    `qos_specs_id`, an update's neither that nor the type-access extension's field."""
    view = {
        "id": body["id"],
        "name": body["name"],
        "description": body.get("description"),
        "is_public": body.get("is_public", True),
        "os-volume-type-access:is_public": body.get("is_public", True),
        "extra_specs": dict(body.get("extra_specs") or {}) if ctx.is_admin else {},
        "qos_specs_id": None,
    }
    if answer_of in ("create", "update"):
        del view["qos_specs_id"]
    if answer_of == "update":
        del view["os-volume-type-access:is_public"]
    return view


def attachment_view(one: dict[str, Any], *, detail: bool = True) -> dict[str, Any]:
    view = {
        "id": one["id"],
        "status": one["status"],
        "instance": one.get("instance"),
        "volume_id": one["volume_id"],
    }
    if detail:
        view.update(
            {
                "attached_at": iso(one.get("attached_at")),
                "detached_at": None,
                "attach_mode": one.get("attach_mode", "rw"),
                "connection_info": one.get("connection_info"),
            }
        )
    return view
