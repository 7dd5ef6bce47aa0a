"""Compute v2.1: host aggregates; an aggregate's availability zone becomes its hosts' zone."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from stowage.api.auth import cloud_of, require_admin
from stowage.api.common import ApiError, json_body
from stowage.api.compute.microversion import mv
from stowage.api.responses import JSONResponse
from stowage.domain.errors import ConflictError, InvalidSpec
from stowage.ledger.objects import Document
from stowage.services import aggregates
from stowage.services import compute_catalog as catalog

__all__ = ["router"]

router = APIRouter()

_ZONE_KEY = "availability_zone"


def _view(request: Request, doc: Document, *, full: bool = True) -> dict[str, Any]:
    body = doc.body
    out: dict[str, Any] = {
        "id": int(doc.id),
        "name": body["name"],
        "availability_zone": body.get("metadata", {}).get(_ZONE_KEY),
        "created_at": catalog.iso(doc.created_at),
        "updated_at": catalog.iso(doc.updated_at) if doc.updated_at != doc.created_at else None,
        "deleted": False,
        "deleted_at": None,
    }
    if full:
        out["hosts"] = list(body.get("hosts", []))
        out["metadata"] = dict(body.get("metadata", {}))
    if mv(request) >= (2, 41):
        out["uuid"] = body["uuid"]
    return out


def _get(request: Request, aggregate_id: str) -> Document:
    doc = None
    if aggregate_id.isdigit():
        doc = cloud_of(request).objects.find("aggregate", str(int(aggregate_id)))
    if doc is None:
        raise ApiError(404, f"Aggregate {aggregate_id} could not be found.")
    return doc


def _zone(value: Any) -> str | None:
    if value is None:
        return None
    zone = catalog.parse_name(value, _ZONE_KEY)
    if ":" in zone:
        raise ApiError(400, "Invalid input for field/attribute availability_zone: ':' not allowed")
    if zone == catalog.INTERNAL_ZONE:
        raise ApiError(
            400,
            f"Aggregates cannot use the availability zone {zone!r}, which is the internal "
            "zone of the control services.",
        )
    return zone


def _check_zone(request: Request, doc: Document, zone: str | None, hosts: list[str]) -> None:
    """A host is in one zone: refuse a zone that differs from one its other aggregates give."""
    if zone is None:
        return
    others = [d.body for d in cloud_of(request).objects.list("aggregate") if d.id != doc.id]
    given = catalog.host_zones_from_aggregates(others)
    clashes = sorted({z for h in hosts for z in given.get(h, set()) if z != zone})
    if clashes:
        raise ApiError(
            400,
            f"Cannot update aggregate {doc.id}. Reason: One or more hosts already in "
            f"availability zone(s) {clashes}.",
        )


def _change(
    request: Request,
    doc: Document,
    change: Callable[[dict[str, Any]], dict[str, Any]],
    *,
    hosts: list[str] | None = None,
) -> Document:
    """Apply `change` to the aggregate as it is now; the document as written."""
    body = aggregates.change_aggregate(cloud_of(request), doc.id, change, hosts=hosts or [])
    return Document(
        doc.kind, doc.id, doc.project_id, body.get("name"), doc.created_at, doc.updated_at, body
    )


def _name_free(request: Request, name: str, keep: str | None = None) -> None:
    for other in cloud_of(request).objects.list("aggregate", name=name):
        if other.id != keep:
            raise ApiError(409, f"Aggregate {name} already exists.")


@router.get("/os-aggregates")
async def list_aggregates(request: Request) -> JSONResponse:
    require_admin(request)
    docs = sorted(cloud_of(request).objects.list("aggregate"), key=lambda d: int(d.id))
    return JSONResponse({"aggregates": [_view(request, d) for d in docs]})


@router.post("/os-aggregates")
async def create_aggregate(request: Request) -> JSONResponse:
    require_admin(request)
    cloud = cloud_of(request)
    payload = catalog.member(await json_body(request), "aggregate")
    catalog.only_keys(payload, {"name", _ZONE_KEY}, "aggregate")
    if "name" not in payload:
        raise ApiError(400, "Invalid input for field/attribute aggregate: 'name' is required")
    name = catalog.parse_name(payload["name"], "name")
    zone = _zone(payload.get(_ZONE_KEY))
    _name_free(request, name)
    body = {
        "name": name,
        "uuid": str(uuid.uuid4()),
        "hosts": [],
        "metadata": {_ZONE_KEY: zone} if zone else {},
    }
    try:
        doc = aggregates.create_aggregate(cloud, body)
    except ConflictError as exc:
        raise ApiError(409, str(exc)) from None
    return JSONResponse({"aggregate": _view(request, doc, full=False)})


@router.get("/os-aggregates/{aggregate_id}")
async def show_aggregate(aggregate_id: str, request: Request) -> JSONResponse:
    require_admin(request)
    return JSONResponse({"aggregate": _view(request, _get(request, aggregate_id))})


@router.put("/os-aggregates/{aggregate_id}")
async def update_aggregate(aggregate_id: str, request: Request) -> JSONResponse:
    require_admin(request)
    payload = catalog.member(await json_body(request), "aggregate")
    catalog.only_keys(payload, {"name", _ZONE_KEY}, "aggregate")
    if not payload:
        raise ApiError(400, "Invalid input for field/attribute aggregate: name or zone required")
    doc = _get(request, aggregate_id)
    name = None
    if "name" in payload:
        name = catalog.parse_name(payload["name"], "name")
        _name_free(request, name, keep=doc.id)
    zone = _zone(payload[_ZONE_KEY]) if _ZONE_KEY in payload else None

    def change(body: dict[str, Any]) -> dict[str, Any]:
        metadata = dict(body.get("metadata", {}))
        if name is not None:
            body["name"] = name
        if _ZONE_KEY in payload:
            _check_zone(request, doc, zone, list(body.get("hosts", [])))
            if zone:
                metadata[_ZONE_KEY] = zone
            else:
                metadata.pop(_ZONE_KEY, None)
        return dict(body, metadata=metadata)

    return JSONResponse({"aggregate": _view(request, _change(request, doc, change))})


@router.delete("/os-aggregates/{aggregate_id}")
async def delete_aggregate(aggregate_id: str, request: Request) -> Response:
    require_admin(request)
    doc = _get(request, aggregate_id)
    try:
        deleted = aggregates.delete_aggregate(cloud_of(request), doc.id)
    except InvalidSpec as exc:
        raise ApiError(400, str(exc)) from None
    if not deleted:
        raise ApiError(404, f"Aggregate {aggregate_id} could not be found.")
    return Response(status_code=200)


def _host_arg(payload: Any, action: str) -> str:
    if not isinstance(payload, dict) or not isinstance(payload.get("host"), str):
        raise ApiError(
            400, f"Invalid input for field/attribute {action}: 'host' is a required property"
        )
    catalog.only_keys(payload, {"host"}, action)
    host: str = payload["host"]
    return host


def _add_host(request: Request, doc: Document, host: str) -> Document:
    cloud = cloud_of(request)
    if not catalog.read_hosts(cloud, [host]):
        raise ApiError(404, f"Compute host {host} could not be found.")

    def change(body: dict[str, Any]) -> dict[str, Any]:
        hosts = list(body.get("hosts", []))
        if host in hosts:
            raise ApiError(409, f"Aggregate {doc.id} already has host {host}.")
        zone = body.get("metadata", {}).get(_ZONE_KEY)
        try:
            _check_zone(request, doc, zone, [host])
        except ApiError as exc:
            raise ApiError(
                400, exc.message.replace("Cannot update aggregate", "Cannot add host to aggregate")
            ) from None
        return dict(body, hosts=[*hosts, host])

    return _change(request, doc, change)


class _NotInAggregate(Exception):
    """`_remove_host`'s change found the host absent: its 404 is chosen after the change's
    transaction ends (whether the host exists is read from the ledger, on a connection of
    its own)."""


def _remove_host(request: Request, doc: Document, host: str) -> Document:

    def change(body: dict[str, Any]) -> dict[str, Any]:
        hosts = list(body.get("hosts", []))
        if host not in hosts:
            raise _NotInAggregate
        hosts.remove(host)
        return dict(body, hosts=hosts)

    try:
        return _change(request, doc, change, hosts=[host])
    except _NotInAggregate:
        pass
    if not catalog.read_hosts(cloud_of(request), [host]):
        raise ApiError(404, f"Compute host {host} could not be found.")
    raise ApiError(404, f"Cannot remove host {host} in aggregate {doc.id}")


def _set_metadata(request: Request, doc: Document, payload: Any) -> Document:
    if not isinstance(payload, dict) or not isinstance(payload.get("metadata"), dict):
        raise ApiError(
            400, "Invalid input for field/attribute set_metadata: 'metadata' is required"
        )
    catalog.only_keys(payload, {"metadata"}, "set_metadata")
    wanted: dict[str, str | None] = {}
    for key, value in payload["metadata"].items():
        if not isinstance(key, str) or not 1 <= len(key) <= 255:
            raise ApiError(400, f"Invalid input for field/attribute metadata: key {key!r}")
        if value is None:
            wanted[key] = None
            continue
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise ApiError(400, f"Invalid input for field/attribute {key}: {value!r}")
        text = str(value)
        if key == _ZONE_KEY:
            text = _zone(text) or ""
        elif len(text) > 255:
            raise ApiError(400, f"Invalid input for field/attribute {key}: longer than 255")
        wanted[key] = text

    def change(body: dict[str, Any]) -> dict[str, Any]:
        metadata = dict(body.get("metadata", {}))
        for key, value in wanted.items():
            if value is None:
                metadata.pop(key, None)
            else:
                metadata[key] = value
        _check_zone(request, doc, metadata.get(_ZONE_KEY), list(body.get("hosts", [])))
        return dict(body, metadata=metadata)

    return _change(request, doc, change)


@router.post("/os-aggregates/{aggregate_id}/action")
async def aggregate_action(aggregate_id: str, request: Request) -> JSONResponse:
    require_admin(request)
    body = await json_body(request)
    if not isinstance(body, dict) or len(body) != 1:
        raise ApiError(400, "Malformed request body: one action expected")
    action, payload = next(iter(body.items()))
    if action not in ("add_host", "remove_host", "set_metadata"):
        raise ApiError(400, f"There is no such action: {action}")
    doc = _get(request, aggregate_id)
    if action == "add_host":
        doc = _add_host(request, doc, _host_arg(payload, action))
    elif action == "remove_host":
        doc = _remove_host(request, doc, _host_arg(payload, action))
    else:
        doc = _set_metadata(request, doc, payload)
    return JSONResponse({"aggregate": _view(request, doc)})


@router.post("/os-aggregates/{aggregate_id}/images")
async def cache_images(aggregate_id: str, request: Request) -> Response:
    """2.81: ask the aggregate's hosts to cache images; simulated hosts have nothing to fetch."""
    if mv(request) < (2, 81):
        raise ApiError(404, "The resource could not be found.")
    require_admin(request)
    body = await json_body(request)
    cache = body.get("cache") if isinstance(body, dict) else None
    if not isinstance(cache, list) or not cache:
        raise ApiError(400, "Invalid input for field/attribute cache: a list of images is required")
    for item in cache:
        if not isinstance(item, dict) or not isinstance(item.get("id"), str):
            raise ApiError(400, f"Invalid input for field/attribute cache: {item!r}")
    _get(request, aggregate_id)
    return Response(status_code=202)
