"""Compute v2.1: hypervisors, a view of the ledger's hosts with their usage."""

from __future__ import annotations

import json
import uuid
from typing import Any

from fastapi import APIRouter, Request

from stowage.api.auth import cloud_of, require_admin
from stowage.api.common import ApiError
from stowage.api.compute.microversion import mv
from stowage.api.responses import JSONResponse
from stowage.services import compute_catalog as catalog
from stowage.services.compute_catalog import HostView

__all__ = ["router"]

router = APIRouter()

_HYPERVISOR_VERSION = 1000000
_UUID_IDS = (2, 53)
_NO_STATS = (2, 88)


def _host_ip(host: HostView) -> str:
    # What the host's agent reported; a host registered without one (a fixture's) gets a
    # TEST-NET-1 address.
    return host.host_ip or f"192.0.2.{host.id % 254 + 1}"


def _ident(request: Request, host: HostView) -> int | str:
    return host.uuid if mv(request) >= _UUID_IDS else host.id


def _servers(request: Request, host: HostView) -> list[dict[str, str]]:
    cloud = cloud_of(request)
    docs = {d.id: d for d in cloud.objects.list("instance", ids=host.instance_ids)}
    out = []
    for instance_id in host.instance_ids:
        doc = docs.get(instance_id)
        name = (doc.name or doc.body.get("name", "")) if doc is not None else ""
        out.append({"name": name, "uuid": instance_id})
    return out


def _stats(host: HostView) -> dict[str, Any]:
    vcpus = host.total("VCPU", "PCPU")
    memory_mb = host.total("MEMORY_MB")
    local_gb = host.total("DISK_GB")
    memory_used = host.used("MEMORY_MB")
    disk_used = host.used("DISK_GB")
    return {
        "vcpus": vcpus,
        "vcpus_used": host.used("VCPU", "PCPU"),
        "memory_mb": memory_mb,
        "memory_mb_used": memory_used,
        "free_ram_mb": memory_mb - memory_used,
        "local_gb": local_gb,
        "local_gb_used": disk_used,
        "free_disk_gb": local_gb - disk_used,
        "disk_available_least": local_gb - disk_used,
        "current_workload": 0,
        "running_vms": len(host.instance_ids),
    }


def _view(
    request: Request, host: HostView, *, detail: bool, with_servers: bool = False
) -> dict[str, Any]:
    version = mv(request)
    out: dict[str, Any] = {
        "id": _ident(request, host),
        "hypervisor_hostname": host.name,
        "state": "up" if host.up else "down",
        "status": "disabled" if host.disabled else "enabled",
    }
    if detail:
        out.update(
            {
                "hypervisor_type": host.hypervisor_type,
                "hypervisor_version": _HYPERVISOR_VERSION,
                "host_ip": _host_ip(host),
                "service": {
                    "host": host.name,
                    "id": host.service_uuid if version >= _UUID_IDS else host.service_id,
                    "disabled_reason": host.disabled_reason,
                },
            }
        )
        if version < _NO_STATS:
            out.update(_stats(host))
            info = host.cpu_info()
            out["cpu_info"] = info if version >= (2, 28) else json.dumps(info)
        else:
            now = cloud_of(request).clock()
            out["uptime"] = catalog.uptime_text(now) if host.up else None
    if with_servers:
        servers = _servers(request, host)
        if servers or version >= (2, 75):
            out["servers"] = servers
    return out


def _with_servers(request: Request) -> bool:
    raw = request.query_params.get("with_servers")
    if raw is None or mv(request) < _UUID_IDS:
        return False
    return catalog.parse_bool(raw, "with_servers")


def _hosts_for_list(request: Request) -> list[HostView]:
    hosts = catalog.read_hosts(cloud_of(request))
    params = request.query_params
    version = mv(request)
    pattern = params.get("hypervisor_hostname_pattern") if version >= _UUID_IDS else None
    paging = version >= (2, 33) and ("limit" in params or "marker" in params)
    if pattern is not None:
        if paging:
            raise ApiError(
                400,
                "Paging over hypervisors is not supported with hypervisor_hostname_pattern.",
            )
        hosts = [h for h in hosts if pattern in h.name]
        if not hosts:
            raise ApiError(404, f"No hypervisor matching '{pattern}' could be found.")
        return hosts
    if not paging:
        return hosts
    marker = params.get("marker")
    if marker is not None:
        idents = [str(_ident(request, h)) for h in hosts]
        if marker not in idents:
            raise ApiError(400, f"marker [{marker}] not found")
        hosts = hosts[idents.index(marker) + 1 :]
    raw = params.get("limit")
    if raw is not None:
        limit = catalog.parse_int(raw, "limit", minimum=0)
        hosts = hosts[: limit or 1000]
    return hosts


def _next(request: Request, hosts: list[HostView], collection: str) -> dict[str, Any]:
    raw = request.query_params.get("limit")
    if raw is None or mv(request) < (2, 33) or not hosts:
        return {}
    limit = int(raw) or 1000
    if len(hosts) != limit:
        return {}
    base = cloud_of(request).config.base_url
    marker = _ident(request, hosts[-1])
    href = f"{base}/compute/v2.1/{collection}?limit={limit}&marker={marker}"
    return {"hypervisors_links": [{"rel": "next", "href": href}]}


def _list(request: Request, *, detail: bool) -> JSONResponse:
    require_admin(request)
    hosts = _hosts_for_list(request)
    servers = _with_servers(request)
    body: dict[str, Any] = {
        "hypervisors": [_view(request, h, detail=detail, with_servers=servers) for h in hosts]
    }
    body.update(_next(request, hosts, "os-hypervisors/detail" if detail else "os-hypervisors"))
    return JSONResponse(body)


@router.get("/os-hypervisors")
async def list_hypervisors(request: Request) -> JSONResponse:
    return _list(request, detail=False)


@router.get("/os-hypervisors/detail")
async def list_hypervisors_detail(request: Request) -> JSONResponse:
    return _list(request, detail=True)


@router.get("/os-hypervisors/statistics")
async def statistics(request: Request) -> JSONResponse:
    require_admin(request)
    if mv(request) >= _NO_STATS:
        raise ApiError(404, "The resource could not be found.")
    totals: dict[str, int] = {}
    hosts = catalog.read_hosts(cloud_of(request))
    for host in hosts:
        for key, value in _stats(host).items():
            totals[key] = totals.get(key, 0) + value
    totals["count"] = len(hosts)
    return JSONResponse({"hypervisor_statistics": totals})


def _find(request: Request, hypervisor_id: str) -> HostView:
    if mv(request) >= _UUID_IDS:
        try:
            uuid.UUID(hypervisor_id)
        except ValueError:
            raise ApiError(400, f"Invalid uuid {hypervisor_id}") from None
    for host in catalog.read_hosts(cloud_of(request)):
        if str(_ident(request, host)) == hypervisor_id:
            return host
    raise ApiError(404, f"Hypervisor with ID '{hypervisor_id}' could not be found.")


@router.get("/os-hypervisors/{hypervisor_id}")
async def show_hypervisor(hypervisor_id: str, request: Request) -> JSONResponse:
    require_admin(request)
    host = _find(request, hypervisor_id)
    view = _view(request, host, detail=True, with_servers=_with_servers(request))
    return JSONResponse({"hypervisor": view})


@router.get("/os-hypervisors/{hypervisor_id}/uptime")
async def uptime(hypervisor_id: str, request: Request) -> JSONResponse:
    require_admin(request)
    if mv(request) >= _NO_STATS:
        raise ApiError(404, "The resource could not be found.")
    host = _find(request, hypervisor_id)
    if not host.up:
        raise ApiError(400, f"Compute service of {host.name} is unavailable at this time.")
    view = _view(request, host, detail=False)
    view["uptime"] = catalog.uptime_text(cloud_of(request).clock())
    return JSONResponse({"hypervisor": view})


def _search(request: Request, pattern: str) -> list[HostView]:
    if mv(request) >= _UUID_IDS:
        raise ApiError(404, "The resource could not be found.")
    require_admin(request)
    hosts = [h for h in catalog.read_hosts(cloud_of(request)) if pattern in h.name]
    if not hosts:
        raise ApiError(404, f"No hypervisor matching '{pattern}' could be found.")
    return hosts


@router.get("/os-hypervisors/{pattern}/search")
async def search(pattern: str, request: Request) -> JSONResponse:
    hosts = _search(request, pattern)
    return JSONResponse({"hypervisors": [_view(request, h, detail=False) for h in hosts]})


@router.get("/os-hypervisors/{pattern}/servers")
async def servers(pattern: str, request: Request) -> JSONResponse:
    hosts = _search(request, pattern)
    views = []
    for host in hosts:
        view = _view(request, host, detail=False)
        found = _servers(request, host)
        if found:
            view["servers"] = found
        views.append(view)
    return JSONResponse({"hypervisors": views})
