"""Compute v2.1: os-migrations and servers/{id}/migrations (records written by move operations)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from stowage.api.auth import cloud_of, require_admin, require_context
from stowage.api.common import ApiError
from stowage.api.compute.microversion import Microversion, mv
from stowage.api.compute.servers import load_server
from stowage.ledger.objects import Document

router = APIRouter()

_IN_PROGRESS = {"queued", "pre-migrating", "preparing", "running", "post-migrating", "migrating"}


def _iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")


def migration_view(doc: Document, version: Microversion) -> dict[str, Any]:
    body = doc.body
    view: dict[str, Any] = {
        "id": body["number"],
        "source_node": body.get("source_compute"),
        "dest_node": body.get("dest_compute"),
        "source_compute": body.get("source_compute"),
        "dest_compute": body.get("dest_compute"),
        "dest_host": body.get("dest_host") or body.get("dest_compute"),
        "status": body["status"],
        "instance_uuid": body["instance_uuid"],
        "old_instance_type_id": body.get("old_flavor_id"),
        "new_instance_type_id": body.get("new_flavor_id"),
        "created_at": _iso(doc.created_at),
        "updated_at": _iso(doc.updated_at),
        "source_region": "RegionOne",
        "dest_region": "RegionOne",
    }
    if version >= (2, 23):
        view["migration_type"] = body.get("migration_type", "migration")
    if version >= (2, 59):
        view["uuid"] = doc.id
    if version >= (2, 80):
        view["user_id"] = body.get("user_id")
        view["project_id"] = body.get("project_id")
    return view


@router.get("/os-migrations")
async def list_migrations(request: Request) -> JSONResponse:
    require_admin(request)
    cloud = cloud_of(request)
    query = request.query_params
    docs = cloud.objects.list("migration")
    for key, field in (
        ("instance_uuid", "instance_uuid"),
        ("status", "status"),
        ("migration_type", "migration_type"),
        ("source_compute", "source_compute"),
        ("host", None),
    ):
        wanted = query.get(key)
        if not wanted:
            continue
        if field is None:
            docs = [
                d
                for d in docs
                if wanted in (d.body.get("source_compute"), d.body.get("dest_compute"))
            ]
        else:
            docs = [d for d in docs if str(d.body.get(field)) == wanted]
    docs.sort(key=lambda d: (d.created_at, d.id), reverse=True)
    return JSONResponse({"migrations": [migration_view(d, mv(request)) for d in docs]})


@router.get("/servers/{server_id}/migrations")
async def list_server_migrations(request: Request, server_id: str) -> JSONResponse:
    ctx = require_context(request)
    if not ctx.is_admin:
        raise ApiError(
            403, "Policy doesn't allow os_compute_api:servers:migrations:index to be performed."
        )
    cloud = cloud_of(request)
    load_server(cloud, ctx, server_id)
    docs = [
        d
        for d in cloud.objects.list("migration")
        if d.body["instance_uuid"] == server_id
        and d.body.get("migration_type") == "live-migration"
        and d.body["status"] in _IN_PROGRESS
    ]
    return JSONResponse({"migrations": [migration_view(d, mv(request)) for d in docs]})
