"""Compute v2.1: os-services, nova-compute per ledger host plus the scheduler and conductor."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from stowage.api.auth import cloud_of, require_admin
from stowage.api.common import ApiError, json_body
from stowage.api.compute.microversion import mv
from stowage.api.responses import JSONResponse
from stowage.domain.errors import InvalidSpec
from stowage.services import compute_catalog as catalog
from stowage.services.compute_catalog import ControlService, HostView

__all__ = ["router"]

router = APIRouter()

_UUID_IDS = (2, 53)
_COMPUTE = "nova-compute"


def _compute_view(request: Request, host: HostView) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": host.service_uuid if mv(request) >= _UUID_IDS else host.service_id,
        "binary": _COMPUTE,
        "host": host.name,
        "zone": host.availability_zone,
        "status": "disabled" if host.disabled else "enabled",
        "state": "up" if host.up else "down",
        "updated_at": catalog.iso(host.last_seen),
        "disabled_reason": host.disabled_reason,
    }
    if mv(request) >= (2, 11):
        out["forced_down"] = host.forced_down
    return out


def _control_view(request: Request, service: ControlService, now: float) -> dict[str, Any]:
    # The scheduler and conductor run inside this process: up whenever it answers.
    out: dict[str, Any] = {
        "id": service.uuid if mv(request) >= _UUID_IDS else service.id,
        "binary": service.binary,
        "host": service.host,
        "zone": catalog.INTERNAL_ZONE,
        "status": "enabled",
        "state": "up",
        "updated_at": catalog.iso(now),
        "disabled_reason": None,
    }
    if mv(request) >= (2, 11):
        out["forced_down"] = False
    return out


_QUERY_275 = {"host", "binary"}


@router.get("/os-services")
async def list_services(request: Request) -> JSONResponse:
    require_admin(request)
    params = request.query_params
    if mv(request) >= (2, 75):
        extra = sorted(set(params) - _QUERY_275)
        if extra:
            raise ApiError(
                400,
                f"Invalid input for query parameters {extra[0]}: additional properties are "
                "not allowed",
            )
    now = cloud_of(request).clock()
    views = [_control_view(request, s, now) for s in catalog.control_services()]
    views += [_compute_view(request, h) for h in catalog.read_hosts(cloud_of(request))]
    if params.get("host"):
        views = [v for v in views if v["host"] == params["host"]]
    if params.get("binary"):
        views = [v for v in views if v["binary"] == params["binary"]]
    return JSONResponse({"services": views})


def _compute_host(request: Request, host: str, binary: str) -> HostView:
    if binary != _COMPUTE:
        raise ApiError(
            400,
            f"Updating a {binary} service is not supported. Only nova-compute services can be "
            "updated.",
        )
    found = catalog.read_hosts(cloud_of(request), [host])
    if not found:
        raise ApiError(404, f"Compute host {host} with binary {binary} could not be found.")
    return found[0]


def _apply(
    request: Request,
    host: HostView,
    *,
    disabled: bool | None = None,
    reason: str | None = None,
    forced_down: bool | None = None,
) -> HostView:
    cloud = cloud_of(request)
    if disabled is not None:
        catalog.set_disabled_reason(cloud, host, reason if disabled else None)
    cloud.ledger.set_host_state(host.name, disabled=disabled, forced_down=forced_down)
    return catalog.read_hosts(cloud, [host.name])[0]


def _reason(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not 1 <= len(value) <= 255:
        raise ApiError(
            400, "Invalid input for field/attribute disabled_reason: 1 to 255 characters"
        )
    return value


async def _legacy_update(request: Request, action: str) -> JSONResponse:
    """Before 2.53: PUT /os-services/{enable,disable,disable-log-reason,force-down}."""
    actions = {"enable", "disable", "disable-log-reason"}
    if mv(request) >= (2, 11):
        actions.add("force-down")
    if action not in actions:
        raise ApiError(404, "Unknown action")
    body = await json_body(request)
    allowed = {"host", "binary", "disabled_reason"}
    if mv(request) >= (2, 11):
        allowed.add("forced_down")
    if not isinstance(body, dict):
        raise ApiError(400, "Invalid input for field/attribute body: not an object")
    catalog.only_keys(body, allowed, "body")
    for required in ("host", "binary"):
        if not isinstance(body.get(required), str):
            raise ApiError(
                400, f"Invalid input for field/attribute {required}: a string is required"
            )
    host = _compute_host(request, body["host"], body["binary"])
    out: dict[str, Any] = {"host": body["host"], "binary": body["binary"]}
    if action == "enable":
        _apply(request, host, disabled=False)
        out["status"] = "enabled"
    elif action in ("disable", "disable-log-reason"):
        reason = _reason(body.get("disabled_reason"))
        if action == "disable-log-reason" and reason is None:
            raise ApiError(400, "Missing disabled reason field")
        _apply(request, host, disabled=True, reason=reason)
        out["status"] = "disabled"
        if reason:
            out["disabled_reason"] = reason
    else:
        if "forced_down" not in body:
            raise ApiError(400, "Missing forced_down field")
        forced = catalog.parse_bool(body["forced_down"], "forced_down")
        _apply(request, host, forced_down=forced)
        out["forced_down"] = forced
    return JSONResponse({"service": out})


def _by_uuid(request: Request, service_id: str) -> HostView | ControlService:
    try:
        uuid.UUID(service_id)
    except ValueError:
        raise ApiError(400, f"Invalid uuid {service_id}") from None
    for control in catalog.control_services():
        if control.uuid == service_id:
            return control
    for host in catalog.read_hosts(cloud_of(request)):
        if host.service_uuid == service_id:
            return host
    raise ApiError(404, f"Service {service_id} could not be found.")


@router.put("/os-services/{service_id}")
async def update_service(service_id: str, request: Request) -> JSONResponse:
    require_admin(request)
    if mv(request) < _UUID_IDS:
        return await _legacy_update(request, service_id)
    target = _by_uuid(request, service_id)
    body = await json_body(request)
    if not isinstance(body, dict):
        raise ApiError(400, "Invalid input for field/attribute body: not an object")
    catalog.only_keys(body, {"status", "disabled_reason", "forced_down"}, "body")
    if isinstance(target, ControlService):
        raise ApiError(
            400,
            f"Updating a {target.binary} service is not supported. Only nova-compute services "
            "can be updated.",
        )
    status = body.get("status")
    if "status" in body and status not in ("enabled", "disabled"):
        raise ApiError(
            400,
            f"Invalid input for field/attribute status: {status!r} is not one of "
            "'enabled', 'disabled'",
        )
    reason = _reason(body.get("disabled_reason"))
    if status == "enabled" and reason:
        raise ApiError(400, "Specifying 'disabled_reason' with status 'enabled' is invalid.")
    forced: bool | None = None
    if "forced_down" in body:
        if not isinstance(body["forced_down"], bool):
            raise ApiError(
                400, f"Invalid input for field/attribute forced_down: {body['forced_down']!r}"
            )
        forced = body["forced_down"]
    if status is None and forced is None:
        raise ApiError(
            400, "No updates were requested. Fields 'status' or 'forced_down' should be specified."
        )
    disabled = None if status is None else status == "disabled"
    try:
        host = _apply(request, target, disabled=disabled, reason=reason, forced_down=forced)
    except InvalidSpec as exc:
        raise ApiError(400, exc.message) from None
    return JSONResponse({"service": _compute_view(request, host)})


@router.delete("/os-services/{service_id}")
async def delete_service(service_id: str, request: Request) -> Response:
    require_admin(request)
    if mv(request) >= _UUID_IDS:
        target = _by_uuid(request, service_id)
    else:
        if not service_id.isdigit():
            raise ApiError(400, f"Invalid input for field/attribute id: {service_id!r}")
        found: list[HostView | ControlService] = [
            s for s in catalog.control_services() if str(s.id) == service_id
        ]
        found += [
            h for h in catalog.read_hosts(cloud_of(request)) if str(h.service_id) == service_id
        ]
        if not found:
            raise ApiError(404, f"Service {service_id} not found.")
        target = found[0]
    if isinstance(target, HostView) and target.instance_ids:
        raise ApiError(
            409,
            "Unable to delete compute service that is hosting instances. Migrate or delete the "
            "instances first.",
        )
    # The ledger keeps its hosts and this process runs the control services: neither can go.
    raise ApiError(409, f"Service {service_id} is part of this cloud and cannot be deleted.")
