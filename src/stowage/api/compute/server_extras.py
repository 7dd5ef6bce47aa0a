"""Compute v2.1: a server's tags (2.26), addresses (/ips), password and diagnostics."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from stowage.api.auth import cloud_of, require_admin, require_context, require_writer
from stowage.api.common import ApiError, Context, json_body
from stowage.api.compute.microversion import mv
from stowage.api.compute.servers import load_server
from stowage.api.responses import JSONResponse
from stowage.ledger.objects import Document
from stowage.services import instances

__all__ = ["router"]

router = APIRouter()

_TAGS_MAX = 50
_TAG_MAX = 60


# -- tags -------------------------------------------------------------------------------------


def _tagged(request: Request, server_id: str, *, write: bool) -> tuple[Context, Document]:
    ctx = require_context(request)
    if mv(request) < (2, 26):
        raise ApiError(404, "The resource could not be found.")
    if write and not ctx.can_write:
        raise ApiError(
            403, "Policy doesn't allow os_compute_api:os-server-tags:update to be performed."
        )
    return ctx, load_server(cloud_of(request), ctx, server_id)


def _check_tag(tag: Any) -> str:
    if not isinstance(tag, str) or not 1 <= len(tag) <= _TAG_MAX or "/" in tag or "," in tag:
        raise ApiError(
            400,
            f"Invalid input for field/attribute tags: {tag!r} must be 1 to {_TAG_MAX} "
            "characters without '/' or ','",
        )
    return tag


def _save_tags(request: Request, doc: Document, tags: list[str]) -> None:
    if len(tags) > _TAGS_MAX:
        raise ApiError(400, f"The number of tags exceeded the per-server limit {_TAGS_MAX}")
    instances.set_tags(cloud_of(request), doc.id, doc.body, tags)


@router.get("/servers/{server_id}/tags")
async def list_tags(server_id: str, request: Request) -> JSONResponse:
    _, doc = _tagged(request, server_id, write=False)
    return JSONResponse({"tags": list(doc.body.get("tags") or [])})


@router.put("/servers/{server_id}/tags")
async def replace_tags(server_id: str, request: Request) -> JSONResponse:
    _, doc = _tagged(request, server_id, write=True)
    payload = await json_body(request)
    raw = payload.get("tags") if isinstance(payload, dict) else None
    if not isinstance(raw, list):
        raise ApiError(400, "Invalid input for field/attribute tags: 'tags' is required")
    tags = list(dict.fromkeys(_check_tag(t) for t in raw))
    _save_tags(request, doc, tags)
    return JSONResponse({"tags": tags})


@router.delete("/servers/{server_id}/tags")
async def clear_tags(server_id: str, request: Request) -> Response:
    _, doc = _tagged(request, server_id, write=True)
    _save_tags(request, doc, [])
    return Response(status_code=204)


@router.get("/servers/{server_id}/tags/{tag}")
async def check_tag(server_id: str, tag: str, request: Request) -> Response:
    _, doc = _tagged(request, server_id, write=False)
    if tag not in (doc.body.get("tags") or []):
        raise ApiError(404, f"Tag '{tag}' could not be found for instance {server_id}.")
    return Response(status_code=204)


@router.put("/servers/{server_id}/tags/{tag}")
async def add_tag(server_id: str, tag: str, request: Request) -> Response:
    _, doc = _tagged(request, server_id, write=True)
    tags = list(doc.body.get("tags") or [])
    if tag in tags:
        return Response(status_code=204)
    _save_tags(request, doc, [*tags, _check_tag(tag)])
    base = cloud_of(request).config.base_url
    location = f"{base}/compute/v2.1/servers/{server_id}/tags/{tag}"
    return Response(status_code=201, headers={"Location": location})


@router.delete("/servers/{server_id}/tags/{tag}")
async def remove_tag(server_id: str, tag: str, request: Request) -> Response:
    _, doc = _tagged(request, server_id, write=True)
    tags = list(doc.body.get("tags") or [])
    if tag not in tags:
        raise ApiError(404, f"Tag '{tag}' could not be found for instance {server_id}.")
    tags.remove(tag)
    _save_tags(request, doc, tags)
    return Response(status_code=204)


# -- addresses ----------------------------------------------------------------------------------


def _addresses(request: Request, server_id: str) -> dict[str, list[dict[str, Any]]]:
    ctx = require_context(request)
    doc = load_server(cloud_of(request), ctx, server_id)
    return {
        network: [{"version": a["version"], "addr": a["addr"]} for a in entries]
        for network, entries in (doc.body.get("addresses") or {}).items()
    }


@router.get("/servers/{server_id}/ips")
async def list_ips(server_id: str, request: Request) -> JSONResponse:
    return JSONResponse({"addresses": _addresses(request, server_id)})


@router.get("/servers/{server_id}/ips/{network}")
async def show_ips(server_id: str, network: str, request: Request) -> JSONResponse:
    addresses = _addresses(request, server_id)
    if network not in addresses:
        raise ApiError(404, "Network does not exist")
    return JSONResponse({network: addresses[network]})


# -- password (set by a guest agent through the metadata service, which Stowage has not) -------


@router.get("/servers/{server_id}/os-server-password")
async def show_password(server_id: str, request: Request) -> JSONResponse:
    ctx = require_context(request)
    doc = load_server(cloud_of(request), ctx, server_id)
    return JSONResponse({"password": str(doc.body.get("password") or "")})


@router.delete("/servers/{server_id}/os-server-password")
async def clear_password(server_id: str, request: Request) -> Response:
    ctx = require_writer(request)
    cloud = cloud_of(request)
    doc = load_server(cloud, ctx, server_id)
    instances.clear_password(cloud, server_id, doc.body)
    return Response(status_code=204)


# -- diagnostics (admin): what the record knows; a simulated guest has no counters ---------------

_NIC_COUNTERS = ("octets", "errors", "drop", "packets", "rate")
_DIAGNOSTIC_STATES = {
    "ACTIVE": "running",
    "PAUSED": "paused",
    "SUSPENDED": "suspended",
    "SHUTOFF": "shutdown",
    "ERROR": "crashed",
}


@router.get("/servers/{server_id}/diagnostics")
async def diagnostics(server_id: str, request: Request) -> JSONResponse:
    ctx = require_admin(request)
    doc = load_server(cloud_of(request), ctx, server_id)
    body = doc.body
    flavor = body.get("flavor") or {}
    if mv(request) < (2, 48):
        return JSONResponse({"cpu0_time": 0, "memory": int(flavor.get("ram", 0)) * 1024})
    ports = [a for entries in (body.get("addresses") or {}).values() for a in entries]
    macs = [a.get("OS-EXT-IPS-MAC:mac_addr") for a in ports]
    counters = dict.fromkeys((f"{way}_{what}" for way in ("rx", "tx") for what in _NIC_COUNTERS), 0)
    vcpus = int(flavor.get("vcpus", 0))
    return JSONResponse(
        {
            "state": _DIAGNOSTIC_STATES.get(str(body.get("status")), "pending"),
            "driver": "libvirt",
            "hypervisor": "stowage",
            "hypervisor_os": "linux",
            "uptime": 0,
            "config_drive": bool(body.get("config_drive")),
            "num_cpus": vcpus,
            "num_nics": len(macs),
            "num_disks": 1,
            "memory_details": {"maximum": int(flavor.get("ram", 0)), "used": 0},
            "cpu_details": [{"id": i, "time": 0, "utilisation": 0} for i in range(vcpus)],
            "nic_details": [{"mac_address": mac, **counters} for mac in macs],
            "disk_details": [
                {
                    "read_bytes": 0,
                    "read_requests": 0,
                    "write_bytes": 0,
                    "write_requests": 0,
                    "errors_count": 0,
                }
            ],
        }
    )
