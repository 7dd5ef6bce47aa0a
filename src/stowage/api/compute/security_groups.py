"""Compute v2.1: the security group proxies (os-security-groups, os-security-group-rules and a
server's groups), which 2.36 removed. The groups are the network service's; only the shapes
and status codes are Nova's (a refused change is 400, as nova-network's were)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import Response

from stowage.api.auth import cloud_of, require_context
from stowage.api.common import ApiError, Context, json_body
from stowage.api.compute.microversion import mv
from stowage.api.compute.servers import load_server
from stowage.api.responses import JSONResponse
from stowage.services import networks as net

__all__ = ["router"]

router = APIRouter()

T = TypeVar("T")
_TEXT_MAX = 255


def _proxied(request: Request, *, write: bool = False) -> Context:
    ctx = require_context(request)
    if mv(request) >= (2, 36):
        raise ApiError(404, "The resource could not be found.")
    if write and not ctx.can_write:
        # The network service refuses a reader's change; its proxy may not make it either.
        raise ApiError(403, "Policy does not allow this action: the reader role can only read.")
    return ctx


async def _call(func: Callable[..., T], *args: Any) -> T:
    try:
        return await asyncio.to_thread(func, *args)
    except net.NeutronNotFound as exc:
        raise ApiError(404, exc.message) from None
    except net.NetworkError as exc:
        raise ApiError(403 if exc.status == 403 else 400, exc.message) from None


def _check_id(value: str) -> str:
    try:
        uuid.UUID(value)
    except ValueError:
        raise ApiError(400, f"Invalid security group id {value}.") from None
    return value


def _rule_view(rule: dict[str, Any], groups: dict[str, dict[str, Any]]) -> dict[str, Any]:
    remote = groups.get(rule.get("remote_group_id") or "")
    protocol = rule.get("protocol")
    from_port, to_port = rule.get("port_range_min"), rule.get("port_range_max")
    if protocol in ("tcp", "udp") and from_port is None:
        from_port, to_port = 1, 65535
    elif protocol == "icmp" and from_port is None:
        from_port, to_port = -1, -1
    return {
        "id": rule["id"],
        "parent_group_id": rule["security_group_id"],
        "ip_protocol": protocol,
        "from_port": from_port,
        "to_port": to_port,
        "ip_range": {"cidr": rule.get("remote_ip_prefix") or "0.0.0.0/0"} if remote is None else {},
        "group": {"name": remote.get("name"), "tenant_id": remote.get("project_id")}
        if remote is not None
        else {},
    }


def _group_view(group: dict[str, Any], groups: dict[str, dict[str, Any]]) -> dict[str, Any]:
    # Nova shows ingress rules only: egress was not a nova-network notion.
    rules = [r for r in group.get("security_group_rules") or [] if r["direction"] == "ingress"]
    return {
        "id": group["id"],
        "name": group.get("name"),
        "description": group.get("description") or "",
        "tenant_id": group.get("project_id"),
        "rules": [_rule_view(r, groups) for r in rules],
    }


def _all_groups(request: Request, ctx: Context) -> dict[str, dict[str, Any]]:
    return {g["id"]: g for g in net.list_security_groups(cloud_of(request), ctx)}


def _text(value: Any, what: str, *, empty: bool) -> str:
    if not isinstance(value, str) or len(value) > _TEXT_MAX or (not empty and not value.strip()):
        raise ApiError(
            400, f"Invalid input for field/attribute {what}: a string of at most {_TEXT_MAX}"
        )
    return value


def _group_attrs(payload: Any, *, create: bool) -> dict[str, str]:
    body = payload.get("security_group") if isinstance(payload, dict) else None
    if not isinstance(body, dict):
        raise ApiError(400, "Invalid input for field/attribute security_group: required")
    attrs: dict[str, str] = {}
    if create or "name" in body:
        attrs["name"] = _text(body.get("name"), "name", empty=False)
    if create or "description" in body:
        attrs["description"] = _text(body.get("description", ""), "description", empty=True)
    return attrs


@router.get("/os-security-groups")
async def list_groups(request: Request) -> JSONResponse:
    ctx = _proxied(request)
    groups = await _call(_all_groups, request, ctx)
    all_tenants = ctx.is_admin and "all_tenants" in request.query_params
    shown = [g for g in groups.values() if all_tenants or g.get("project_id") == ctx.project_id]
    return JSONResponse({"security_groups": [_group_view(g, groups) for g in shown]})


@router.post("/os-security-groups")
async def create_group(request: Request) -> JSONResponse:
    ctx = _proxied(request, write=True)
    attrs = _group_attrs(await json_body(request), create=True)
    group = await _call(net.create_security_group, cloud_of(request), ctx, attrs)
    groups = await _call(_all_groups, request, ctx)
    return JSONResponse({"security_group": _group_view(group, groups)})


@router.get("/os-security-groups/{group_id}")
async def show_group(group_id: str, request: Request) -> JSONResponse:
    ctx = _proxied(request)
    group = await _call(net.get_security_group, cloud_of(request), ctx, _check_id(group_id))
    groups = await _call(_all_groups, request, ctx)
    return JSONResponse({"security_group": _group_view(group, groups)})


@router.put("/os-security-groups/{group_id}")
async def update_group(group_id: str, request: Request) -> JSONResponse:
    ctx = _proxied(request, write=True)
    attrs = _group_attrs(await json_body(request), create=False)
    cloud = cloud_of(request)
    group = await _call(net.update_security_group, cloud, ctx, _check_id(group_id), attrs)
    groups = await _call(_all_groups, request, ctx)
    return JSONResponse({"security_group": _group_view(group, groups)})


@router.delete("/os-security-groups/{group_id}")
async def delete_group(group_id: str, request: Request) -> Response:
    ctx = _proxied(request, write=True)
    await _call(net.delete_security_group, cloud_of(request), ctx, _check_id(group_id))
    return Response(status_code=202)


# -- rules --------------------------------------------------------------------------------------


def _port(value: Any, what: str) -> int:
    try:
        port = int(value)
    except (TypeError, ValueError):
        raise ApiError(400, f"Invalid input for field/attribute {what}: not an integer") from None
    if not -1 <= port <= 65535:
        raise ApiError(400, f"Invalid input for field/attribute {what}: out of range")
    return port


def _rule_attrs(payload: Any) -> dict[str, Any]:
    body = payload.get("security_group_rule") if isinstance(payload, dict) else None
    if not isinstance(body, dict):
        raise ApiError(400, "Invalid input for field/attribute security_group_rule: required")
    protocol = body.get("ip_protocol")
    if protocol is not None and str(protocol).lower() not in ("tcp", "udp", "icmp"):
        raise ApiError(400, f"Invalid IP protocol {protocol}.")
    attrs: dict[str, Any] = {
        "security_group_id": _check_id(str(body.get("parent_group_id"))),
        "direction": "ingress",
        "ethertype": "IPv4",
    }
    if protocol is not None:
        protocol = str(protocol).lower()
        attrs["protocol"] = protocol
        low = _port(body.get("from_port"), "from_port")
        high = _port(body.get("to_port"), "to_port")
        if protocol == "icmp":
            if low != -1:
                attrs["port_range_min"] = low
            if high != -1:
                attrs["port_range_max"] = high
        else:
            if low < 1 or high < 1 or low > high:
                raise ApiError(400, f"Invalid port range {low}:{high}.")
            attrs["port_range_min"], attrs["port_range_max"] = low, high
    if body.get("group_id"):
        attrs["remote_group_id"] = _check_id(str(body["group_id"]))
    elif body.get("cidr"):
        attrs["remote_ip_prefix"] = str(body["cidr"])
    return attrs


@router.post("/os-security-group-rules")
async def create_rule(request: Request) -> JSONResponse:
    ctx = _proxied(request, write=True)
    attrs = _rule_attrs(await json_body(request))
    rule = await _call(net.create_security_group_rule, cloud_of(request), ctx, attrs)
    groups = await _call(_all_groups, request, ctx)
    return JSONResponse({"security_group_rule": _rule_view(rule, groups)})


@router.delete("/os-security-group-rules/{rule_id}")
async def delete_rule(rule_id: str, request: Request) -> Response:
    ctx = _proxied(request, write=True)
    await _call(net.delete_security_group_rule, cloud_of(request), ctx, rule_id)
    return Response(status_code=202)


# -- a server's groups ----------------------------------------------------------------------------


@router.get("/servers/{server_id}/os-security-groups")
async def server_groups(server_id: str, request: Request) -> JSONResponse:
    ctx = require_context(request)  # not a proxy: Nova serves it at every microversion
    doc = load_server(cloud_of(request), ctx, server_id)
    groups = await _call(_all_groups, request, ctx)
    names = set(doc.body.get("security_groups") or [])
    project = doc.body.get("project_id")
    shown = [
        g
        for g in groups.values()
        if (g["id"] in names or g.get("name") in names) and g.get("project_id") == project
    ]
    return JSONResponse({"security_groups": [_group_view(g, groups) for g in shown]})


@router.delete("/os-security-groups/")
async def delete_without_id(request: Request) -> Response:
    """A DELETE that names no security group: Nova's router answers 404, not 405."""
    _proxied(request)
    raise ApiError(404, "The resource could not be found.")
