"""Compute v2.1: the floating IP proxy (os-floating-ips, which 2.36 removed) and the
addFloatingIp and removeFloatingIp server actions (which 2.44 removed). The floating IPs are
the network service's; only the shapes and status codes are Nova's."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import Response

from stowage.api.auth import cloud_of, require_context
from stowage.api.common import ApiError, Context, json_body
from stowage.api.compute.microversion import mv
from stowage.api.responses import JSONResponse
from stowage.ledger.objects import Document
from stowage.services import networks as net
from stowage.services.cloud import Cloud
from stowage.services.networks import l3

__all__ = ["FLOATING_ACTIONS", "floating_action", "router"]

router = APIRouter()
T = TypeVar("T")
FLOATING_ACTIONS = frozenset({"addFloatingIp", "removeFloatingIp"})
DEFAULT_POOL = "public"  # Nova's [neutron] default_floating_pool


async def _call(func: Callable[..., T], *args: Any) -> T:
    try:
        return await asyncio.to_thread(func, *args)
    except net.NeutronNotFound as exc:
        raise ApiError(404, exc.message) from None
    except net.NetworkError as exc:
        status = {403: 403, 409: 409}.get(exc.status, 400)
        if exc.code == "OverQuota":
            raise ApiError(403, "Maximum number of floating IPs exceeded") from None
        raise ApiError(status, exc.message) from None


def _proxied(request: Request, *, write: bool = False) -> Context:
    ctx = require_context(request)
    if mv(request) >= (2, 36):
        raise ApiError(404, "The resource could not be found.")
    if write and not ctx.can_write:
        # The network service refuses a reader's change; its proxy may not make it either.
        raise ApiError(403, "Policy does not allow this action: the reader role can only read.")
    return ctx


def _view(cloud: Cloud, fip: dict[str, Any]) -> dict[str, Any]:
    network = cloud.objects.find("network", fip["floating_network_id"])
    instance_id = None
    if fip.get("port_id"):
        port = cloud.objects.find("port", fip["port_id"])
        if port is not None and str(port.body.get("device_owner", "")).startswith("compute:"):
            instance_id = port.body.get("device_id")
    return {
        "id": fip["id"],
        "ip": fip["floating_ip_address"],
        "fixed_ip": fip.get("fixed_ip_address"),
        "instance_id": instance_id,
        "pool": network.name if network is not None else None,
    }


def _own(cloud: Cloud, ctx: Context) -> list[dict[str, Any]]:
    return [f for f in l3.list_floatingips(cloud, ctx) if f["project_id"] == ctx.project_id]


@router.get("/os-floating-ips")
async def list_floating_ips(request: Request) -> JSONResponse:
    ctx = _proxied(request)
    cloud = cloud_of(request)
    fips = await _call(_own, cloud, ctx)
    return JSONResponse({"floating_ips": [_view(cloud, f) for f in fips]})


@router.get("/os-floating-ips/{fip_id}")
async def show_floating_ip(request: Request, fip_id: str) -> JSONResponse:
    ctx = _proxied(request)
    cloud = cloud_of(request)
    fip = await _call(l3.get_floatingip, cloud, ctx, fip_id)
    return JSONResponse({"floating_ip": _view(cloud, fip)})


def _allocate(cloud: Cloud, ctx: Context, pool: str) -> dict[str, Any]:
    networks = [
        n
        for n in net.list_networks(cloud, ctx)
        if n.get("router:external") and pool in (n["id"], n.get("name"))
    ]
    if not networks:
        raise net.NeutronNotFound("Floating IP pool not found.", "NotFound")
    return l3.create_floatingip(cloud, ctx, {"floating_network_id": networks[0]["id"]})


@router.post("/os-floating-ips")
async def allocate_floating_ip(request: Request) -> JSONResponse:
    ctx = _proxied(request, write=True)
    body = await json_body(request) if await request.body() else {}
    pool = body.get("pool") if isinstance(body, dict) else None
    if pool is not None and not isinstance(pool, str):
        raise ApiError(400, "Invalid input for field/attribute pool: not a string")
    cloud = cloud_of(request)
    fip = await _call(_allocate, cloud, ctx, pool or DEFAULT_POOL)
    return JSONResponse({"floating_ip": _view(cloud, fip)})


@router.delete("/os-floating-ips/{fip_id}")
async def release_floating_ip(request: Request, fip_id: str) -> Response:
    ctx = _proxied(request, write=True)
    await _call(l3.delete_floatingip, cloud_of(request), ctx, fip_id)
    return Response(status_code=202)


# -- the server actions ---------------------------------------------------------------------


def _by_address(cloud: Cloud, ctx: Context, address: Any) -> dict[str, Any]:
    if not isinstance(address, str) or not address:
        raise ApiError(400, "Invalid input for field/attribute address: required")
    for fip in l3.list_floatingips(cloud, ctx):
        if fip["floating_ip_address"] == address:
            return fip
    raise ApiError(404, f"floating IP not found for address {address}")


def _add(cloud: Cloud, ctx: Context, doc: Document, args: dict[str, Any]) -> None:
    fip = _by_address(cloud, ctx, args.get("address"))
    fixed = args.get("fixed_address")
    ports = net.ports_of(cloud, doc.id)
    if fixed is not None:
        ports = [p for p in ports if any(ip["ip_address"] == fixed for ip in p["fixed_ips"])]
        if not ports:
            raise ApiError(400, f"Specified fixed address {fixed} not assigned to instance")
    if not ports:
        raise ApiError(400, f"No nw_info cache associated with instance {doc.id}")
    attrs: dict[str, Any] = {"port_id": ports[0]["id"]}
    if fixed is not None:
        attrs["fixed_ip_address"] = fixed
    l3.update_floatingip(cloud, ctx, fip["id"], attrs)


def _remove(cloud: Cloud, ctx: Context, doc: Document, args: dict[str, Any]) -> None:
    fip = _by_address(cloud, ctx, args.get("address"))
    if not fip.get("port_id"):
        raise ApiError(400, f"Floating IP {fip['floating_ip_address']} is not associated")
    if fip["port_id"] not in {p["id"] for p in net.ports_of(cloud, doc.id)}:
        raise ApiError(
            409,
            f"Floating IP {fip['floating_ip_address']} is not associated with instance {doc.id}.",
        )
    l3.update_floatingip(cloud, ctx, fip["id"], {"port_id": None})


async def floating_action(
    request: Request, ctx: Context, doc: Document, action: str, args: Any
) -> Response:
    """addFloatingIp or removeFloatingIp, up to 2.43."""
    if mv(request) >= (2, 44):
        raise ApiError(404, "The resource could not be found.")
    if not ctx.can_write:
        raise ApiError(403, "Policy does not allow this action: the reader role can only read.")
    if not isinstance(args, dict):
        raise ApiError(400, f"Invalid input for field/attribute {action}: not an object")
    change = _add if action == "addFloatingIp" else _remove
    await _call(change, cloud_of(request), ctx, doc, args)
    return Response(status_code=202)
