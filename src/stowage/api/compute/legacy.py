"""Compute v2.1: the older read-mostly APIs clients still call: extensions, os-hosts (to 2.42),
simple tenant usage, the instance usage audit log, the network proxies (to 2.35), and server
external events."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request

from stowage.api.auth import cloud_of, require_admin, require_context
from stowage.api.common import ApiError, Context, json_body
from stowage.api.compute.microversion import mv
from stowage.api.compute.paging import page
from stowage.api.responses import JSONResponse
from stowage.ledger.objects import Document
from stowage.services import compute_catalog as catalog
from stowage.services import networks as net

__all__ = ["router"]

router = APIRouter()

_NOT_FOUND = "The resource could not be found."

# -- extensions: Nova's fixed list since v2.1 (only names and aliases matter to clients) ----------

_EXTENSIONS = (
    ("AdminActions", "os-admin-actions"),
    ("AggregateMultiTenancyIsolation", "os-aggregates"),
    ("AvailabilityZone", "os-availability-zone"),
    ("Consoles", "os-consoles"),
    ("DiskConfig", "OS-DCF"),
    ("ExtendedAvailabilityZone", "OS-EXT-AZ"),
    ("ExtendedServerAttributes", "OS-EXT-SRV-ATTR"),
    ("ExtendedStatus", "OS-EXT-STS"),
    ("FlavorAccess", "os-flavor-access"),
    ("FlavorExtraData", "OS-FLV-EXT-DATA"),
    ("FlavorExtraSpecs", "os-flavor-extra-specs"),
    ("FlavorManage", "os-flavor-manage"),
    ("Hosts", "os-hosts"),
    ("Hypervisors", "os-hypervisors"),
    ("InstanceActions", "os-instance-actions"),
    ("Keypairs", "os-keypairs"),
    ("Migrations", "os-migrations"),
    ("Quotas", "os-quota-sets"),
    ("SecurityGroups", "os-security-groups"),
    ("ServerGroups", "os-server-groups"),
    ("Services", "os-services"),
    ("SimpleTenantUsage", "os-simple-tenant-usage"),
)


def _extension(name: str, alias: str) -> dict[str, Any]:
    return {
        "name": name,
        "alias": alias,
        "namespace": f"http://docs.openstack.org/compute/ext/fake_xml/{alias}",
        "updated": "2014-12-03T00:00:00Z",
        "description": f"{name} support.",
        "links": [],
    }


@router.get("/extensions")
async def list_extensions(request: Request) -> JSONResponse:
    require_context(request)
    return JSONResponse({"extensions": [_extension(n, a) for n, a in _EXTENSIONS]})


@router.get("/extensions/{alias}")
async def show_extension(alias: str, request: Request) -> JSONResponse:
    require_context(request)
    for name, known in _EXTENSIONS:
        if known == alias:
            return JSONResponse({"extension": _extension(name, known)})
    raise ApiError(404, _NOT_FOUND)


# -- os-hosts (removed in 2.43) -------------------------------------------------------------------


def _hosts_admin(request: Request) -> Context:
    ctx = require_admin(request)
    if mv(request) >= (2, 43):
        raise ApiError(404, _NOT_FOUND)
    return ctx


def _host_rows(request: Request) -> list[dict[str, str]]:
    cloud = cloud_of(request)
    rows = [
        {"host_name": s.host, "service": s.binary.removeprefix("nova-"), "zone": "internal"}
        for s in catalog.control_services()
    ]
    rows += [
        {"host_name": h.name, "service": "compute", "zone": h.availability_zone}
        for h in catalog.read_hosts(cloud)
    ]
    return rows


@router.get("/os-hosts")
async def list_hosts(request: Request) -> JSONResponse:
    _hosts_admin(request)
    rows = await asyncio.to_thread(_host_rows, request)
    zone = request.query_params.get("zone")
    if zone:
        rows = [r for r in rows if r["zone"] == zone]
    return JSONResponse({"hosts": rows})


def _compute_host(request: Request, name: str) -> catalog.HostView:
    hosts = catalog.read_hosts(cloud_of(request), [name])
    if not hosts:
        raise ApiError(404, f"Compute host {name} could not be found.")
    return hosts[0]


def _resource(host: str, project: str, cpu: int, memory_mb: int, disk_gb: int) -> dict[str, Any]:
    resource = {
        "host": host,
        "project": project,
        "cpu": cpu,
        "memory_mb": memory_mb,
        "disk_gb": disk_gb,
    }
    return {"resource": resource}


def _host_detail(request: Request, name: str) -> list[dict[str, Any]]:
    host = _compute_host(request, name)
    cloud = cloud_of(request)
    rows = [
        _resource(
            name,
            "(total)",
            host.total("VCPU", "PCPU"),
            host.total("MEMORY_MB"),
            host.total("DISK_GB"),
        ),
        _resource(
            name,
            "(used_now)",
            host.used("VCPU", "PCPU"),
            host.used("MEMORY_MB"),
            host.used("DISK_GB"),
        ),
    ]
    per_project: dict[str, list[int]] = {}
    for instance_id in host.instance_ids:
        doc = cloud.objects.find("instance", instance_id)
        if doc is None:
            continue
        flavor = doc.body.get("flavor") or {}
        sums = per_project.setdefault(str(doc.project_id), [0, 0, 0])
        sums[0] += int(flavor.get("vcpus", 0))
        sums[1] += int(flavor.get("ram", 0))
        sums[2] += int(flavor.get("disk", 0)) + int(flavor.get("ephemeral", 0))
    used_max = [sum(s[i] for s in per_project.values()) for i in range(3)]
    rows.append(_resource(name, "(used_max)", *used_max))
    rows += [_resource(name, project, *sums) for project, sums in sorted(per_project.items())]
    return rows


@router.get("/os-hosts/{host_name}")
async def show_host(host_name: str, request: Request) -> JSONResponse:
    _hosts_admin(request)
    return JSONResponse({"host": await asyncio.to_thread(_host_detail, request, host_name)})


@router.put("/os-hosts/{host_name}")
async def update_host(host_name: str, request: Request) -> JSONResponse:
    _hosts_admin(request)
    payload = await json_body(request)
    if not isinstance(payload, dict) or not payload:
        raise ApiError(400, "'status' or 'maintenance_mode' needed for host update")
    unknown = set(payload) - {"status", "maintenance_mode"}
    if unknown:
        raise ApiError(400, f"Additional properties are not allowed ({sorted(unknown)[0]!r})")
    for key, value in payload.items():
        if value not in ("enable", "disable"):
            raise ApiError(400, f"Invalid input for field/attribute {key}. Value: {value}.")
    await asyncio.to_thread(_compute_host, request, host_name)
    # Enabling and disabling a host is os-services' job here; maintenance mode does not exist.
    raise ApiError(501, "Use os-services to enable or disable a host; no maintenance mode.")


async def _power(request: Request, host_name: str, action: str) -> JSONResponse:
    _hosts_admin(request)
    await asyncio.to_thread(_compute_host, request, host_name)
    raise ApiError(501, f"Virt driver does not implement host {action} action.")


@router.get("/os-hosts/{host_name}/reboot")
async def reboot_host(host_name: str, request: Request) -> JSONResponse:
    return await _power(request, host_name, "reboot")


@router.get("/os-hosts/{host_name}/shutdown")
async def shutdown_host(host_name: str, request: Request) -> JSONResponse:
    return await _power(request, host_name, "shutdown")


@router.get("/os-hosts/{host_name}/startup")
async def startup_host(host_name: str, request: Request) -> JSONResponse:
    return await _power(request, host_name, "startup")


# -- simple tenant usage --------------------------------------------------------------------------


def _when(raw: str | None, what: str, default: datetime) -> datetime:
    if not raw:
        return default
    for layout in ("%Y-%m-%dT%H:%M:%S.%f", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M:%S.%f"):
        try:
            return datetime.strptime(raw.rstrip("Z"), layout).replace(tzinfo=UTC)
        except ValueError:
            continue
    raise ApiError(400, f"Invalid input for query parameters {what}. Value: {raw}.")


def _period(request: Request) -> tuple[datetime, datetime]:
    now = datetime.now(UTC)
    query = request.query_params
    start = _when(query.get("start"), "start", now)
    end = _when(query.get("end"), "end", now)
    if start > end:
        raise ApiError(400, "Invalid start time. The start time cannot occur after the end time.")
    return start, end


def _stamp(when: datetime) -> str:
    return when.strftime("%Y-%m-%dT%H:%M:%S.%f")


def _server_usage(doc: Document, start: datetime, end: datetime) -> dict[str, Any]:
    body = doc.body
    flavor = body.get("flavor") or {}
    launched = datetime.fromtimestamp(doc.created_at, UTC)
    began = max(launched, start)
    hours = max((end - began).total_seconds(), 0.0) / 3600
    return {
        "instance_id": doc.id,
        "name": body.get("name"),
        "hours": hours,
        "memory_mb": int(flavor.get("ram", 0)),
        "local_gb": int(flavor.get("disk", 0)),
        "vcpus": int(flavor.get("vcpus", 0)),
        "tenant_id": doc.project_id,
        "flavor": flavor.get("original_name") or flavor.get("name") or "",
        "started_at": _stamp(launched),
        "ended_at": None,
        "state": str(body.get("vm_state") or "active"),
        "uptime": int(max((end - launched).total_seconds(), 0)),
    }


def _usage(
    request: Request, project_id: str, docs: list[Document], start: datetime, end: datetime
) -> dict[str, Any]:
    servers = [
        _server_usage(d, start, end)
        for d in docs
        if datetime.fromtimestamp(d.created_at, UTC) <= end
    ]
    return {
        "tenant_id": project_id,
        "start": _stamp(start),
        "stop": _stamp(end),
        "total_hours": sum(s["hours"] for s in servers),
        "total_local_gb_usage": sum(s["hours"] * s["local_gb"] for s in servers),
        "total_memory_mb_usage": sum(s["hours"] * s["memory_mb"] for s in servers),
        "total_vcpus_usage": sum(s["hours"] * s["vcpus"] for s in servers),
        "server_usages": servers,
    }


@router.get("/os-simple-tenant-usage")
async def list_usage(request: Request) -> JSONResponse:
    require_admin(request)
    start, end = _period(request)
    detailed = request.query_params.get("detailed") in ("1", "true", "True")
    by_project: dict[str, list[Document]] = {}
    docs, links = _usage_page(request, cloud_of(request).objects.list("instance"), "")
    for doc in docs:
        by_project.setdefault(str(doc.project_id), []).append(doc)
    usages = []
    for project_id, docs in sorted(by_project.items()):
        usage = _usage(request, project_id, docs, start, end)
        if not detailed:
            usage.pop("server_usages")
        usages.append(usage)
    body: dict[str, Any] = {"tenant_usages": usages}
    if links:
        body["tenant_usages_links"] = links
    return JSONResponse(body)


def _usage_page(
    request: Request, docs: list[Document], project_id: str
) -> tuple[list[Document], list[dict[str, str]]]:
    """2.40: the instances a usage counts are paged by `limit` and `marker` (an instance
    uuid), oldest first; a `next` link when more remain."""
    docs = sorted(docs, key=lambda d: (d.created_at, d.id))
    if mv(request) < (2, 40):
        return docs, []
    shown, last = page(docs, request.query_params, "marker [{marker}] not found")
    if last is None:
        return shown, []
    base = cloud_of(request).config.base_url
    path = "os-simple-tenant-usage" + (f"/{project_id}" if project_id else "")
    limit = request.query_params.get("limit")
    query = "&".join(
        f"{k}={v}" for k, v in request.query_params.items() if k not in ("limit", "marker")
    )
    href = f"{base}/compute/v2.1/{path}?{query + '&' if query else ''}limit={limit}&marker={last}"
    return shown, [{"rel": "next", "href": href}]


@router.get("/os-simple-tenant-usage/")
async def usage_without_project(request: Request) -> JSONResponse:
    """A project id left empty: Nova's router answers 404, not the list."""
    require_context(request)
    raise ApiError(404, _NOT_FOUND)


@router.get("/os-simple-tenant-usage/{project_id}")
async def show_usage(project_id: str, request: Request) -> JSONResponse:
    ctx = require_context(request)
    if project_id != ctx.project_id and not ctx.is_admin:
        raise ApiError(
            403, "Policy doesn't allow os_compute_api:os-simple-tenant-usage:show to be performed."
        )
    start, end = _period(request)
    docs = cloud_of(request).objects.list("instance", project_id=project_id)
    docs, links = _usage_page(request, docs, project_id)
    body: dict[str, Any] = {"tenant_usage": _usage(request, project_id, docs, start, end)}
    if links:
        body["tenant_usage_links"] = links
    return JSONResponse(body)


# -- instance usage audit log: no periodic audit runs here, so every period is empty --------------


def _audit(request: Request, before: datetime) -> dict[str, Any]:
    hosts = [h.name for h in catalog.read_hosts(cloud_of(request))]
    end = before.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    start = (
        end.replace(year=end.year - 1, month=12)
        if end.month == 1
        else end.replace(month=end.month - 1)
    )
    return {
        "hosts_not_run": hosts,
        "log": {},
        "num_hosts": len(hosts),
        "num_hosts_done": 0,
        "num_hosts_not_run": len(hosts),
        "num_hosts_running": 0,
        "overall_status": f"0 of {len(hosts)} hosts done. 0 errors.",
        "period_beginning": start.strftime("%Y-%m-%d %H:%M:%S"),
        "period_ending": end.strftime("%Y-%m-%d %H:%M:%S"),
        "total_errors": 0,
        "total_instances": 0,
    }


@router.get("/os-instance_usage_audit_log")
async def list_audit(request: Request) -> JSONResponse:
    require_admin(request)
    body = await asyncio.to_thread(_audit, request, datetime.now(UTC))
    return JSONResponse({"instance_usage_audit_logs": body})


@router.get("/os-instance_usage_audit_log/{before}")
async def show_audit(before: str, request: Request) -> JSONResponse:
    require_admin(request)
    try:
        when = datetime.strptime(before, "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC)
    except ValueError:
        raise ApiError(400, f"Invalid timestamp for date {before}") from None
    body = await asyncio.to_thread(_audit, request, when)
    return JSONResponse({"instance_usage_audit_log": body})


# -- network proxies (removed in 2.36) ------------------------------------------------------------


def _networks(request: Request) -> tuple[Context, list[dict[str, Any]]]:
    ctx = require_context(request)
    if mv(request) >= (2, 36):
        raise ApiError(404, _NOT_FOUND)
    cloud = cloud_of(request)
    subnets = {s["id"]: s for s in net.list_subnets(cloud, ctx)}
    out = []
    for network in net.list_networks(cloud, ctx):
        cidrs = [subnets[s]["cidr"] for s in network.get("subnets") or [] if s in subnets]
        out.append(
            {
                "id": network["id"],
                "label": network.get("name") or "",
                "cidr": cidrs[0] if cidrs else None,
            }
        )
    return ctx, out


def _one(networks: list[dict[str, Any]], network_id: str) -> dict[str, Any]:
    for network in networks:
        if network["id"] == network_id:
            return network
    raise ApiError(404, "Network could not be found.")


@router.get("/os-tenant-networks")
async def list_tenant_networks(request: Request) -> JSONResponse:
    _, networks = await asyncio.to_thread(_networks, request)
    return JSONResponse({"networks": networks})


@router.get("/os-tenant-networks/{network_id}")
async def show_tenant_network(network_id: str, request: Request) -> JSONResponse:
    _, networks = await asyncio.to_thread(_networks, request)
    return JSONResponse({"network": _one(networks, network_id)})


@router.get("/os-networks")
async def list_networks(request: Request) -> JSONResponse:
    _, networks = await asyncio.to_thread(_networks, request)
    return JSONResponse({"networks": networks})


@router.get("/os-networks/{network_id}")
async def show_network(network_id: str, request: Request) -> JSONResponse:
    _, networks = await asyncio.to_thread(_networks, request)
    return JSONResponse({"network": _one(networks, network_id)})


# -- server external events (for services: neutron tells Nova a port changed) ----------------------

_EVENT_NAMES = frozenset(
    {
        "network-changed",
        "network-vif-plugged",
        "network-vif-unplugged",
        "network-vif-deleted",
        "volume-extended",
        "power-update",
        "accelerator-request-bound",
        "volume-reimaged",
    }
)


@router.post("/os-server-external-events")
async def external_events(request: Request) -> JSONResponse:
    ctx = require_context(request)
    if not ctx.roles & {"admin", "service"}:
        raise ApiError(403, "Policy doesn't allow os_compute_api:os-server-external-events:create.")
    payload = await json_body(request)
    events = payload.get("events") if isinstance(payload, dict) else None
    if not isinstance(events, list) or not events:
        raise ApiError(400, "Invalid input for field/attribute events: a non-empty list")
    cloud = cloud_of(request)
    out = []
    for event in events:
        if not isinstance(event, dict) or event.get("name") not in _EVENT_NAMES:
            raise ApiError(400, f"Invalid input for field/attribute events: {event!r}")
        found = cloud.objects.find("instance", str(event.get("server_uuid")))
        result = dict(event)
        # The simulated hosts have nothing to wait for these: a known server takes them.
        result["status"] = "completed" if found is not None else "failed"
        result["code"] = 200 if found is not None else 404
        out.append(result)
    codes = {e["code"] for e in out}
    status = 200 if codes == {200} else 404 if codes == {404} else 207
    return JSONResponse({"events": out}, status_code=status)
