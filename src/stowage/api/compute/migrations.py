"""Compute v2.1: os-migrations and servers/{id}/migrations (records written by move operations)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from stowage.api.auth import cloud_of, require_admin, require_context
from stowage.api.common import ApiError, json_body
from stowage.api.compute.microversion import Microversion, mv
from stowage.api.compute.paging import page_migrations
from stowage.api.compute.servers import load_server
from stowage.api.responses import JSONResponse
from stowage.ledger.objects import Document
from stowage.services.cloud import Cloud

router = APIRouter()

_IN_PROGRESS = {"queued", "pre-migrating", "preparing", "running", "post-migrating", "migrating"}


def _iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")


def _flavor_number(flavor_id: Any) -> int | None:
    """Nova shows its flavors' internal integer ids here; a flavor id that is a number is the
    closest thing, and one that is not shows as null."""
    return int(flavor_id) if isinstance(flavor_id, str) and flavor_id.isdigit() else None


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
        "old_instance_type_id": _flavor_number(body.get("old_flavor_id")),
        "new_instance_type_id": _flavor_number(body.get("new_flavor_id")),
        "created_at": _iso(doc.created_at),
        "updated_at": _iso(doc.updated_at),
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
    docs, links = page_migrations(docs, query, mv(request), cloud.config.base_url)
    body: dict[str, Any] = {"migrations": [migration_view(d, mv(request)) for d in docs]}
    if links:
        body["migrations_links"] = links
    return JSONResponse(body)


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
    return JSONResponse({"migrations": [_server_migration_view(d, mv(request)) for d in docs]})


_PROGRESS = (
    "memory_total_bytes",
    "memory_processed_bytes",
    "memory_remaining_bytes",
    "disk_total_bytes",
    "disk_processed_bytes",
    "disk_remaining_bytes",
)


def _server_migration_view(doc: Document, version: Microversion) -> dict[str, Any]:
    """A server's live migration with its progress, as the hypervisor last reported it."""
    view = migration_view(doc, version)
    view["server_uuid"] = doc.body["instance_uuid"]
    for key in _PROGRESS:
        view[key] = int(doc.body.get(key) or 0)
    return view


def _live_migration(request: Request, server_id: str, migration_ref: str) -> Document:
    """A server's migration by Nova's integer id (or its uuid)."""
    cloud = cloud_of(request)
    for doc in cloud.objects.list("migration"):
        body = doc.body
        if body["instance_uuid"] == server_id and migration_ref in (str(body["number"]), doc.id):
            return doc
    raise ApiError(404, f"Migration {migration_ref} for instance {server_id} could not be found.")


@router.get("/servers/{server_id}/migrations/{migration_ref}")
async def show_server_migration(
    request: Request, server_id: str, migration_ref: str
) -> JSONResponse:
    ctx = require_context(request)
    if not ctx.is_admin:
        raise ApiError(
            403, "Policy doesn't allow os_compute_api:servers:migrations:show to be performed."
        )
    load_server(cloud_of(request), ctx, server_id)
    doc = _live_migration(request, server_id, migration_ref)
    if doc.body.get("migration_type") != "live-migration" or doc.body["status"] not in _IN_PROGRESS:
        raise ApiError(
            404, f"In-progress live migration {migration_ref} is not found for server {server_id}."
        )
    return JSONResponse({"migration": _server_migration_view(doc, mv(request))})


async def _request_on_live_migration(
    request: Request, server_id: str, migration_ref: str, ask: Callable[[Cloud, str, str], None]
) -> Response:
    """Ask the conductor to abort or finish a live migration; 202 once it has had its go."""
    from stowage.api.compute.servers import settled

    ctx = require_admin(request)
    cloud = cloud_of(request)
    load_server(cloud, ctx, server_id)
    doc = _live_migration(request, server_id, migration_ref)
    await asyncio.to_thread(ask, cloud, server_id, doc.id)
    await settled(cloud, [server_id])
    return Response(status_code=202)


@router.delete("/servers/{server_id}/migrations/{migration_ref}")
async def abort_server_migration(request: Request, server_id: str, migration_ref: str) -> Response:
    """2.24: abort a live migration in progress; its destination is undone."""
    from stowage.services.migrations import abort_live_migration

    if mv(request) < (2, 24):
        raise ApiError(404, "Aborting a live migration needs microversion 2.24 or later.")
    return await _request_on_live_migration(request, server_id, migration_ref, abort_live_migration)


@router.post("/servers/{server_id}/migrations/{migration_ref}/action")
async def force_complete_server_migration(
    request: Request, server_id: str, migration_ref: str
) -> Response:
    """2.22: force an in-progress live migration to complete."""
    from stowage.services.migrations import force_complete_live_migration

    if mv(request) < (2, 22):
        raise ApiError(404, "Forcing a live migration to complete needs microversion 2.22.")
    payload = await json_body(request)
    if not isinstance(payload, dict) or "force_complete" not in payload:
        raise ApiError(400, "Invalid input: the action must be force_complete")
    return await _request_on_live_migration(
        request, server_id, migration_ref, force_complete_live_migration
    )
