"""Compute v2.1: a server's interfaces (`os-interface`: list, show, attach with a port or a
network and an optional fixed IP, detach) and the legacy addFixedIp and removeFixedIp
actions (gone at 2.44: 404 from then on), over services/interfaces.py.

An attach answers as Nova's does, once the interface is attached (Nova's is a synchronous
call to the compute host): the operation is awaited, bounded, and its outcome mapped
(Neutron's refusals with their status, a failed hot-plug 500, InterfaceAttachFailed). An
attach still going when the wait ends is answered 202 (accepted, not done) with its port and
`port_state` BUILD, as the list and show say of it until the host has plugged the NIC: never
a 200 for a plug that may yet fail.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from stowage.api.auth import cloud_of, require_context
from stowage.api.common import ApiError, Context, json_body
from stowage.api.compute.microversion import Microversion, mv
from stowage.api.responses import JSONResponse
from stowage.domain.errors import ConflictError, InvalidSpec, NotFound
from stowage.ledger.objects import Document
from stowage.ledger.operations import ACTIVE_STATES
from stowage.services import interfaces, networks
from stowage.services.cloud import Cloud

__all__ = ["FIXED_IP_ACTIONS", "fixed_ip_action", "router"]

router = APIRouter()

FIXED_IP_ACTIONS = frozenset({"addFixedIp", "removeFixedIp"})


def _interface(port: dict[str, Any], attaching: frozenset[str] = frozenset()) -> dict[str, object]:
    """Nova's interfaceAttachment; BUILD while the port's attach has not ended."""
    return {
        "port_id": port["id"],
        "net_id": port.get("network_id"),
        "mac_addr": port.get("mac_address"),
        "port_state": "BUILD" if port["id"] in attaching else port.get("status", "ACTIVE"),
        "fixed_ips": [
            {"subnet_id": ip.get("subnet_id"), "ip_address": ip.get("ip_address")}
            for ip in port.get("fixed_ips") or []
        ],
    }


def _load(request: Request, server_id: str) -> tuple[Cloud, Context, Document]:
    from stowage.api.compute.servers import load_server

    ctx = require_context(request)
    cloud = cloud_of(request)
    return cloud, ctx, load_server(cloud, ctx, server_id)


def _refused(exc: Exception) -> ApiError:
    if isinstance(exc, networks.NetworkError):
        return ApiError(exc.status, exc.message)
    if isinstance(exc, ConflictError):
        return ApiError(409, exc.message)
    if isinstance(exc, NotFound):
        return ApiError(404, exc.message)
    assert isinstance(exc, InvalidSpec)
    return ApiError(400, exc.message)


_REFUSALS = (networks.NetworkError, ConflictError, NotFound, InvalidSpec)


def _attaching(cloud: Cloud, server_id: str) -> frozenset[str]:
    """The ports of the server's attaches still going (made or bound, not yet plugged)."""
    return frozenset(
        str(op.payload["port_id"])
        for op in cloud.operations.active(instance_id=server_id)
        if op.kind == "interface-attach" and op.payload.get("port_id")
    )


@router.get("/servers/{server_id}/os-interface")
async def list_interfaces(request: Request, server_id: str) -> JSONResponse:
    cloud, _ctx, _doc = _load(request, server_id)
    ports = networks.ports_of(cloud, server_id)
    attaching = _attaching(cloud, server_id)
    return JSONResponse({"interfaceAttachments": [_interface(p, attaching) for p in ports]})


@router.get("/servers/{server_id}/os-interface/{port_id}")
async def show_interface(request: Request, server_id: str, port_id: str) -> JSONResponse:
    cloud, _ctx, _doc = _load(request, server_id)
    for port in networks.ports_of(cloud, server_id):
        if port["id"] == port_id:
            return JSONResponse(
                {"interfaceAttachment": _interface(port, _attaching(cloud, server_id))}
            )
    raise ApiError(404, f"Port {port_id} is not attached to instance {server_id}.")


def _attach_args(body: Any, version: Microversion) -> tuple[str | None, str | None, str | None]:
    """(port_id, net_id, fixed_ip) of Nova's interfaceAttachment schema."""
    if body is None:
        return None, None, None
    if not isinstance(body, dict) or set(body) - {"interfaceAttachment"}:
        raise ApiError(400, "Invalid input: the body is {'interfaceAttachment': {...}}")
    attachment = body.get("interfaceAttachment") or {}
    if not isinstance(attachment, dict):
        raise ApiError(400, "Invalid input for field/attribute interfaceAttachment")
    allowed = {"port_id", "net_id", "fixed_ips"} | ({"tag"} if version >= (2, 49) else set())
    unknown = sorted(set(attachment) - allowed)
    if unknown:
        raise ApiError(400, f"Additional properties are not allowed ({unknown[0]!r} unexpected)")
    if attachment.get("tag") is not None:
        raise ApiError(400, "Tagged interface attach is not supported by this cloud's hosts.")
    port_id, net_id = attachment.get("port_id"), attachment.get("net_id")
    for field, value in (("port_id", port_id), ("net_id", net_id)):
        if value is not None and (not isinstance(value, str) or not value):
            raise ApiError(400, f"Invalid input for field/attribute {field}: a UUID")
    if port_id and net_id:
        raise ApiError(400, "Must not input both network_id and port_id")
    fixed_ips = attachment.get("fixed_ips")
    fixed_ip = None
    if fixed_ips is not None:
        if not net_id:
            raise ApiError(400, "Must input network_id when request IP address")
        ok = isinstance(fixed_ips, list) and len(fixed_ips) == 1
        entry = fixed_ips[0] if ok else None
        if not isinstance(entry, dict) or not isinstance(entry.get("ip_address"), str):
            raise ApiError(400, "Invalid input for field/attribute fixed_ips: one ip_address")
        fixed_ip = entry["ip_address"]
    return port_id, net_id, fixed_ip


@router.post("/servers/{server_id}/os-interface")
async def attach_interface(request: Request, server_id: str) -> JSONResponse:
    cloud, ctx, doc = _load(request, server_id)
    if not ctx.can_write:
        raise ApiError(403, "Policy doesn't allow os_compute_api:os-attach-interfaces:create.")
    body = await json_body(request, required=False)
    port_id, net_id, fixed_ip = _attach_args(body, mv(request))
    try:
        op_id = await asyncio.to_thread(
            interfaces.attach_interface,
            cloud,
            ctx,
            doc.id,
            port_id=port_id,
            net_id=net_id,
            fixed_ip=fixed_ip,
            request_id=request.state.request_id,
        )
    except _REFUSALS as exc:
        raise _refused(exc) from None
    await asyncio.to_thread(cloud.operations.wait, [op_id], 2 * cloud.config.op_timeout_s + 5)
    op = await asyncio.to_thread(cloud.operations.find, op_id)
    result = (op.result if op is not None else None) or {}
    if op is not None and op.state == "failed":
        if result.get("status"):  # Neutron refused the port
            raise ApiError(int(result["status"]), str(result.get("error")))
        raise ApiError(
            500, f"Failed to attach network adapter device to {doc.id}: {result.get('error')}"
        )
    made = op.payload.get("port_id") if op is not None else None
    port = cloud.objects.find("port", str(made or port_id or ""))
    if op is not None and op.state in ACTIVE_STATES:
        # Not plugged within the wait: accepted, still going; the list shows it BUILD until
        # the host has plugged it (or it is gone, when the plug fails).
        if port is None:  # not even made yet
            pending = {"port_id": port_id, "net_id": net_id, "port_state": "BUILD"}
            return JSONResponse({"interfaceAttachment": pending}, status_code=202)
        view = _interface(dict(port.body), frozenset({port.id}))
        return JSONResponse({"interfaceAttachment": view}, status_code=202)
    if port is None:
        raise ApiError(500, f"Failed to attach network adapter device to {doc.id}: port gone")
    return JSONResponse({"interfaceAttachment": _interface(dict(port.body))})


@router.delete("/servers/{server_id}/os-interface/{port_id}")
async def detach_interface(request: Request, server_id: str, port_id: str) -> Response:
    cloud, ctx, doc = _load(request, server_id)
    if not ctx.can_write:
        raise ApiError(403, "Policy doesn't allow os_compute_api:os-attach-interfaces:delete.")
    try:
        await asyncio.to_thread(
            interfaces.detach_interface,
            cloud,
            ctx,
            doc.id,
            port_id,
            request_id=request.state.request_id,
        )
    except _REFUSALS as exc:
        raise _refused(exc) from None
    from stowage.api.compute.servers import settled

    await settled(cloud, [doc.id])
    return Response(status_code=202)


async def fixed_ip_action(
    request: Request, ctx: Context, doc: Document, action: str, args: Any
) -> Response:
    """addFixedIp {"networkId"} and removeFixedIp {"address"}, before 2.44."""
    if mv(request) >= (2, 44):
        raise ApiError(404, "The resource could not be found.")
    field = "networkId" if action == "addFixedIp" else "address"
    value = args.get(field) if isinstance(args, dict) else None
    if not isinstance(value, str) or not value or set(args) - {field}:
        raise ApiError(400, f"Invalid input for field/attribute {action}: {field} is required")
    cloud = cloud_of(request)
    call = interfaces.add_fixed_ip if action == "addFixedIp" else interfaces.remove_fixed_ip
    try:
        await asyncio.to_thread(call, cloud, ctx, doc.id, value)
    except _REFUSALS as exc:
        raise _refused(exc) from None
    return Response(status_code=202)
