"""Compute v2.1: the server life cycle Stowage does not carry out yet, refused as Nova refuses
what its driver cannot do (never accepted and dropped), and a server's interfaces
(`os-interface`: listed and shown from its ports; attach and detach refused)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from stowage.api.auth import cloud_of, require_context
from stowage.api.common import ApiError
from stowage.api.compute.microversion import Microversion
from stowage.api.compute.servers import load_server
from stowage.api.responses import JSONResponse
from stowage.ledger.objects import Document
from stowage.services import networks

__all__ = ["UNSUPPORTED_ACTIONS", "refuse_action", "router"]

router = APIRouter()

# Actions Nova has and this cloud's conductor does not drive yet: (status, why). 501 is
# Nova's answer when the virt driver lacks the feature (common.raise_feature_not_supported).
UNSUPPORTED_ACTIONS: dict[str, tuple[int, str]] = {
    "addFixedIp": (501, "Adding a fixed IP is not supported; attach a port instead."),
    "removeFixedIp": (501, "Removing a fixed IP is not supported; detach the port instead."),
}


def refuse_action(doc: Document, action: str, version: Microversion) -> None:
    """Raise the refusal of an unsupported action."""
    if action in ("addFixedIp", "removeFixedIp") and version >= (2, 44):
        raise ApiError(404, "The resource could not be found.")
    status, why = UNSUPPORTED_ACTIONS[action]
    raise ApiError(status, why)


def _interface(port: dict[str, object]) -> dict[str, object]:
    return {
        "port_id": port["id"],
        "net_id": port.get("network_id"),
        "mac_addr": port.get("mac_address"),
        "port_state": port.get("status", "ACTIVE"),
        "fixed_ips": port.get("fixed_ips") or [],
    }


@router.get("/servers/{server_id}/os-interface")
async def list_interfaces(request: Request, server_id: str) -> JSONResponse:
    ctx = require_context(request)
    cloud = cloud_of(request)
    load_server(cloud, ctx, server_id)
    ports = networks.ports_of(cloud, server_id)
    return JSONResponse({"interfaceAttachments": [_interface(p) for p in ports]})


@router.get("/servers/{server_id}/os-interface/{port_id}")
async def show_interface(request: Request, server_id: str, port_id: str) -> JSONResponse:
    ctx = require_context(request)
    cloud = cloud_of(request)
    load_server(cloud, ctx, server_id)
    for port in networks.ports_of(cloud, server_id):
        if port["id"] == port_id:
            return JSONResponse({"interfaceAttachment": _interface(port)})
    raise ApiError(404, f"Port {port_id} is not attached to instance {server_id}.")


@router.post("/servers/{server_id}/os-interface")
async def attach_interface(request: Request, server_id: str) -> JSONResponse:
    ctx = require_context(request)
    load_server(cloud_of(request), ctx, server_id)
    raise ApiError(501, "Attaching interfaces to a running server is not supported yet.")


@router.delete("/servers/{server_id}/os-interface/{port_id}")
async def detach_interface(request: Request, server_id: str, port_id: str) -> JSONResponse:
    ctx = require_context(request)
    load_server(cloud_of(request), ctx, server_id)
    raise ApiError(501, "Detaching interfaces from a running server is not supported yet.")
