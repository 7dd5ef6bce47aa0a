"""Compute v2.1: availability zones, from the zones of the ledger's hosts."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from stowage.api.auth import cloud_of, require_admin, require_context
from stowage.api.responses import JSONResponse
from stowage.services import compute_catalog as catalog

__all__ = ["router"]

router = APIRouter()


def _zones(request: Request) -> tuple[list[str], list[str]]:
    """Zones with an enabled compute service, then zones whose services are all disabled."""
    hosts = catalog.read_hosts(cloud_of(request))
    available: list[str] = []
    for host in hosts:
        if not host.disabled and host.availability_zone not in available:
            available.append(host.availability_zone)
    unavailable: list[str] = []
    for host in hosts:
        zone = host.availability_zone
        if host.disabled and zone not in available and zone not in unavailable:
            unavailable.append(zone)
    return available, unavailable


@router.get("/os-availability-zone")
async def list_zones(request: Request) -> JSONResponse:
    require_context(request)
    available, unavailable = _zones(request)
    info = [{"zoneName": z, "zoneState": {"available": True}, "hosts": None} for z in available]
    info += [{"zoneName": z, "zoneState": {"available": False}, "hosts": None} for z in unavailable]
    return JSONResponse({"availabilityZoneInfo": info})


@router.get("/os-availability-zone/detail")
async def list_zones_detail(request: Request) -> JSONResponse:
    require_admin(request)
    cloud = cloud_of(request)
    now = catalog.iso(cloud.clock())
    internal: dict[str, dict[str, Any]] = {}
    for service in catalog.control_services():
        internal.setdefault(service.host, {})[service.binary] = {
            "available": True,
            "active": True,
            "updated_at": now,
        }
    by_zone: dict[str, dict[str, Any]] = {}
    for host in catalog.read_hosts(cloud):
        if host.disabled:
            continue
        by_zone.setdefault(host.availability_zone, {})[host.name] = {
            "nova-compute": {
                "available": host.up,
                "active": True,
                "updated_at": catalog.iso(host.last_seen),
            }
        }
    available, unavailable = _zones(request)
    info: list[dict[str, Any]] = [
        {"zoneName": catalog.INTERNAL_ZONE, "zoneState": {"available": True}, "hosts": internal}
    ]
    info += [
        {"zoneName": z, "zoneState": {"available": True}, "hosts": by_zone.get(z, {})}
        for z in available
    ]
    info += [{"zoneName": z, "zoneState": {"available": False}, "hosts": None} for z in unavailable]
    return JSONResponse({"availabilityZoneInfo": info})
