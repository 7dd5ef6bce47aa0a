"""Block storage v3 beside volumes: types, snapshots, attachments (3.27+), quotas, limits,
availability zones and services."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from stowage.api.auth import cloud_of
from stowage.api.common import ApiError, Context, json_body, parse_limit
from stowage.api.responses import JSONResponse
from stowage.api.volume.microversion import vmv
from stowage.api.volume.views import (
    attachment_view,
    context,
    iso,
    mapped,
    snapshot_view,
    type_view,
    writer,
)
from stowage.api.volume.volumes import VOLUME_FILTERS, offset_of, settle, sort_of
from stowage.domain.errors import StowageError
from stowage.services.volumes import attach as attach_service
from stowage.services.volumes import types as type_service
from stowage.services.volumes import volumes as service

__all__ = ["router"]

router = APIRouter()


def _admin(ctx: Context, rule: str) -> None:
    if not ctx.is_admin:
        raise ApiError(403, f"Policy doesn't allow {rule} to be performed.")


def _member(payload: Any, key: str) -> dict[str, Any]:
    if not isinstance(payload, dict) or not isinstance(payload.get(key), dict):
        raise ApiError(400, f"Missing required element '{key}' in request body.")
    found: dict[str, Any] = payload[key]
    return found


# -- volume types -----------------------------------------------------------------------------


@router.get("/types")
async def list_types(request: Request, project_id: str) -> JSONResponse:
    ctx = context(request, project_id)
    types = type_service.list_types(cloud_of(request), is_admin=ctx.is_admin)
    return JSONResponse({"volume_types": [type_view(ctx, t) for t in types]})


@router.get("/types/default")
async def default_type(request: Request, project_id: str) -> JSONResponse:
    ctx = context(request, project_id)
    if vmv(request) < (3, 62):
        raise ApiError(404, "Volume type default could not be found.")
    return JSONResponse({"volume_type": type_view(ctx, service.default_type())})


@router.get("/types/{type_id}")
async def show_type(request: Request, project_id: str, type_id: str) -> JSONResponse:
    ctx = context(request, project_id)
    try:
        found = service.find_type(cloud_of(request), type_id)
    except StowageError as exc:
        raise mapped(exc) from None
    return JSONResponse({"volume_type": type_view(ctx, found)})


@router.post("/types")
async def create_type(request: Request, project_id: str) -> JSONResponse:
    ctx = context(request, project_id)
    _admin(ctx, "volume_extension:types_manage")
    given = _member(await json_body(request), "volume_type")
    request_body = {
        "name": given.get("name"),
        "description": given.get("description"),
        "is_public": given.get("os-volume-type-access:is_public", given.get("is_public", True)),
        "extra_specs": _specs(given.get("extra_specs")),
    }
    try:
        made = type_service.create_type(cloud_of(request), request_body)
    except StowageError as exc:
        raise mapped(exc) from None
    return JSONResponse({"volume_type": type_view(ctx, made, answer_of="create")})


def _specs(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str | int | bool) for k, v in value.items()
    ):
        raise ApiError(400, "Invalid input for field/attribute extra_specs")
    return {k: str(v) for k, v in value.items()}


@router.put("/types/{type_id}")
async def update_type(request: Request, project_id: str, type_id: str) -> JSONResponse:
    ctx = context(request, project_id)
    _admin(ctx, "volume_extension:types_manage")
    given = _member(await json_body(request), "volume_type")
    changes: dict[str, Any] = {
        k: given[k] for k in ("name", "description", "is_public") if k in given
    }
    try:
        body = type_service.update_type(cloud_of(request), type_id, changes)
    except StowageError as exc:
        raise mapped(exc) from None
    return JSONResponse({"volume_type": type_view(ctx, body, answer_of="update")})


@router.delete("/types/{type_id}")
async def delete_type(request: Request, project_id: str, type_id: str) -> Response:
    ctx = context(request, project_id)
    _admin(ctx, "volume_extension:types_manage")
    try:
        type_service.delete_type(cloud_of(request), type_id)
    except StowageError as exc:
        raise mapped(exc) from None
    return Response(status_code=202)


@router.get("/types/{type_id}/extra_specs")
async def list_specs(request: Request, project_id: str, type_id: str) -> JSONResponse:
    ctx = context(request, project_id)
    _admin(ctx, "volume_extension:types_extra_specs:index")
    try:
        found = service.find_type(cloud_of(request), type_id)
    except StowageError as exc:
        raise mapped(exc) from None
    return JSONResponse({"extra_specs": found.get("extra_specs") or {}})


@router.post("/types/{type_id}/extra_specs")
async def set_specs(request: Request, project_id: str, type_id: str) -> JSONResponse:
    ctx = context(request, project_id)
    _admin(ctx, "volume_extension:types_extra_specs:create")
    payload = await json_body(request)
    if not isinstance(payload, dict) or not isinstance(payload.get("extra_specs"), dict):
        raise ApiError(400, "Malformed request body: 'extra_specs' is required")
    specs = _specs(payload["extra_specs"])
    try:
        type_service.update_type(cloud_of(request), type_id, {"extra_specs": specs})
    except StowageError as exc:
        raise mapped(exc) from None
    return JSONResponse({"extra_specs": specs})


@router.get("/types/{type_id}/extra_specs/{key}")
async def show_spec(request: Request, project_id: str, type_id: str, key: str) -> JSONResponse:
    ctx = context(request, project_id)
    _admin(ctx, "volume_extension:types_extra_specs:show")
    try:
        found = service.find_type(cloud_of(request), type_id)
    except StowageError as exc:
        raise mapped(exc) from None
    specs = found.get("extra_specs") or {}
    if key not in specs:
        raise ApiError(
            404, f"Volume Type {type_id} has no extra specs with key {key}."
        )  # fmt: skip
    return JSONResponse({key: specs[key]})


@router.put("/types/{type_id}/extra_specs/{key}")
async def update_spec(request: Request, project_id: str, type_id: str, key: str) -> JSONResponse:
    """One extra spec: the body names exactly the key of the path (Cinder's 400 else)."""
    ctx = context(request, project_id)
    _admin(ctx, "volume_extension:types_extra_specs:update")
    payload = await json_body(request)
    if not isinstance(payload, dict) or len(payload) != 1:
        raise ApiError(400, "Request body contains too many items.")
    if key not in payload:
        raise ApiError(400, "Request body and URI mismatch")
    specs = _specs(payload)
    try:
        type_service.update_type(cloud_of(request), type_id, {"extra_specs": specs})
    except StowageError as exc:
        raise mapped(exc) from None
    return JSONResponse(specs)


@router.delete("/types/{type_id}/extra_specs/{key}")
async def unset_spec(request: Request, project_id: str, type_id: str, key: str) -> Response:
    ctx = context(request, project_id)
    _admin(ctx, "volume_extension:types_extra_specs:delete")
    try:
        type_service.update_type(cloud_of(request), type_id, {"unset_spec": key})
    except StowageError as exc:
        raise mapped(exc) from None
    return Response(status_code=202)


# -- snapshots --------------------------------------------------------------------------------


@router.post("/snapshots")
async def create_snapshot(request: Request, project_id: str) -> JSONResponse:
    ctx = writer(request, project_id, "volume:create_snapshot")
    cloud = cloud_of(request)
    given = _member(await json_body(request), "snapshot")
    allowed = {
        "volume_id",
        "name",
        "description",
        "force",
        "metadata",
        "display_name",
        "display_description",
    }
    unknown = sorted(set(given) - allowed)
    if unknown:
        raise ApiError(400, f"Invalid input for field/attribute snapshot: {unknown}")
    wanted = {
        "volume_id": given.get("volume_id"),
        "name": given.get("name", given.get("display_name")),
        "description": given.get("description", given.get("display_description")),
        "force": given.get("force", False),
        "metadata": given.get("metadata") or {},
    }
    try:
        doc = service.create_snapshot(cloud, ctx, wanted)
    except StowageError as exc:
        raise mapped(exc) from None
    if doc.body["status"] == "creating":
        settle(cloud, "volume_snapshot", doc.id)
    shown = cloud.objects.find("volume_snapshot", doc.id) or doc
    return JSONResponse({"snapshot": snapshot_view(request, shown, changed=True)}, status_code=202)


_SNAPSHOT_FILTERS = ("name", "status", "volume_id")


def _list_snapshots(request: Request, project_id: str, *, detail: bool) -> JSONResponse:
    ctx = context(request, project_id)
    query = request.query_params
    filters = {k: query[k] for k in _SNAPSHOT_FILTERS if k in query}
    try:
        docs = service.list_docs(
            cloud_of(request),
            ctx,
            "volume_snapshot",
            filters=filters,
            all_projects=query.get("all_tenants", "").lower() in ("1", "true"),
            sort=sort_of(request),
            limit=parse_limit(query.get("limit"), maximum=1000),
            marker=query.get("marker"),
            offset=offset_of(request),
        )
    except StowageError as exc:
        raise mapped(exc) from None
    views = [snapshot_view(request, d) for d in docs]
    if not detail:
        brief = (
            "id",
            "name",
            "status",
            "size",
            "volume_id",
            "created_at",
            "description",
            "metadata",
            "updated_at",
        )
        views = [{k: v[k] for k in brief} for v in views]
    return JSONResponse({"snapshots": views})


@router.get("/snapshots")
async def list_snapshots(request: Request, project_id: str) -> JSONResponse:
    return _list_snapshots(request, project_id, detail=False)


@router.get("/snapshots/detail")
async def list_snapshots_detail(request: Request, project_id: str) -> JSONResponse:
    return _list_snapshots(request, project_id, detail=True)


@router.get("/snapshots/{snapshot_id}")
async def show_snapshot(request: Request, project_id: str, snapshot_id: str) -> JSONResponse:
    ctx = context(request, project_id)
    try:
        doc = service.get_snapshot(cloud_of(request), ctx, snapshot_id)
    except StowageError as exc:
        raise mapped(exc) from None
    return JSONResponse({"snapshot": snapshot_view(request, doc)})


@router.put("/snapshots/{snapshot_id}")
async def update_snapshot(request: Request, project_id: str, snapshot_id: str) -> JSONResponse:
    ctx = writer(request, project_id, "volume:update_snapshot")
    given = _member(await json_body(request), "snapshot")
    changes: dict[str, Any] = {
        k: given[k] for k in ("name", "description", "metadata") if k in given
    }
    try:
        doc = service.update_snapshot(cloud_of(request), ctx, snapshot_id, changes)
    except StowageError as exc:
        raise mapped(exc) from None
    return JSONResponse({"snapshot": snapshot_view(request, doc, changed=True)})


@router.delete("/snapshots/{snapshot_id}")
async def delete_snapshot(request: Request, project_id: str, snapshot_id: str) -> Response:
    ctx = writer(request, project_id, "volume:delete_snapshot")
    cloud = cloud_of(request)
    try:
        service.delete_snapshot(cloud, ctx, snapshot_id)
    except StowageError as exc:
        raise mapped(exc) from None
    settle(cloud, "volume_snapshot", snapshot_id)
    return Response(status_code=202)


_SNAPSHOT_STATUSES = frozenset(
    {"creating", "available", "deleting", "error", "error_deleting", "backing-up", "restoring"}
)
# os-update_snapshot_status: the status a snapshot may go to from its current one (Cinder's).
_SNAPSHOT_PROGRESSION = {
    "creating": frozenset({"creating", "available", "error"}),
    "deleting": frozenset({"deleting", "error_deleting"}),
}


@router.post("/snapshots/{snapshot_id}/action")
async def snapshot_action(request: Request, project_id: str, snapshot_id: str) -> Response:
    """An admin's os-reset_status and os-force_delete; os-update_snapshot_status, which Nova
    calls with its user's token (assisted snapshots), the snapshot's project's too."""
    ctx = context(request, project_id)
    payload = await json_body(request)
    if not isinstance(payload, dict) or len(payload) != 1:
        raise ApiError(400, "Invalid request body: the body must name exactly one action")
    action, args = next(iter(payload.items()))
    args = args if isinstance(args, dict) else {}
    if action not in ("os-reset_status", "os-force_delete", "os-update_snapshot_status"):
        raise ApiError(400, f"There is no such action: {action}")
    if action == "os-update_snapshot_status":
        if not ctx.can_write:
            raise ApiError(403, "Policy doesn't allow snapshot_extension:snapshot_actions.")
    else:
        _admin(ctx, f"volume_extension:snapshot_admin_actions:{action.removeprefix('os-')}")
    cloud = cloud_of(request)
    try:
        service.get_snapshot(cloud, ctx, snapshot_id)
        if action == "os-force_delete":
            service.delete_snapshot(cloud, ctx, snapshot_id, force=True)
            settle(cloud, "volume_snapshot", snapshot_id)
            return Response(status_code=202)
        status = args.get("status")
        if status not in _SNAPSHOT_STATUSES:
            raise ApiError(400, f"Invalid input received: Must specify a valid status ({status})")
        if action == "os-reset_status":
            service.change_snapshot(cloud, snapshot_id, None, lambda b: {**b, "status": status})
            return Response(status_code=202)
        progress = args.get("progress")
        current = service.get_snapshot(cloud, ctx, snapshot_id).body.get("status")
        if status not in _SNAPSHOT_PROGRESSION.get(str(current), frozenset()):
            raise ApiError(
                400, f"Invalid input received: Provided snapshot status {status} not allowed "
                f"for snapshot with status {current}.",
            )  # fmt: skip

        def progressed(body: dict[str, Any]) -> dict[str, Any]:
            body["status"] = status
            if isinstance(progress, str):
                body["progress"] = progress
            return body

        service.change_snapshot(cloud, snapshot_id, frozenset({str(current)}), progressed)
    except StowageError as exc:
        raise mapped(exc) from None
    return Response(status_code=202)


# -- attachments (3.27+) ----------------------------------------------------------------------


def _attachments_version(request: Request) -> None:
    if vmv(request) < (3, 27):
        raise ApiError(404, "The resource could not be found.")


@router.post("/attachments")
async def create_attachment(request: Request, project_id: str) -> JSONResponse:
    ctx = writer(request, project_id, "volume:attachment_create")
    _attachments_version(request)
    given = _member(await json_body(request), "attachment")
    mode = given.get("mode", "rw") if vmv(request) >= (3, 54) else "rw"
    try:
        one = attach_service.create_attachment(
            cloud_of(request),
            ctx,
            str(given.get("volume_uuid") or ""),
            given.get("instance_uuid"),
            given.get("connector"),
            mode,
        )
    except StowageError as exc:
        raise mapped(exc) from None
    return JSONResponse({"attachment": attachment_view(one)})


_ATTACHMENT_FILTERS = {"volume_id": "volume_id", "instance_id": "instance", "status": "status"}


def _list_attachments(request: Request, project_id: str, *, detail: bool) -> JSONResponse:
    ctx = context(request, project_id)
    _attachments_version(request)
    query = request.query_params
    found = attach_service.list_attachments(
        cloud_of(request), ctx, query.get("all_tenants", "").lower() in ("1", "true")
    )
    for key, field in _ATTACHMENT_FILTERS.items():
        if key in query:
            found = [a for a in found if str(a.get(field)) == query[key]]
    return JSONResponse({"attachments": [attachment_view(a, detail=detail) for a in found]})


@router.get("/attachments")
async def list_attachments(request: Request, project_id: str) -> JSONResponse:
    return _list_attachments(request, project_id, detail=False)


@router.get("/attachments/detail")
async def list_attachments_detail(request: Request, project_id: str) -> JSONResponse:
    return _list_attachments(request, project_id, detail=True)


@router.get("/attachments/{attachment_id}")
async def show_attachment(request: Request, project_id: str, attachment_id: str) -> JSONResponse:
    ctx = context(request, project_id)
    _attachments_version(request)
    try:
        _, one = attach_service.find_attachment(cloud_of(request), ctx, attachment_id)
    except StowageError as exc:
        raise mapped(exc) from None
    return JSONResponse({"attachment": attachment_view(one)})


@router.put("/attachments/{attachment_id}")
async def update_attachment(request: Request, project_id: str, attachment_id: str) -> JSONResponse:
    ctx = writer(request, project_id, "volume:attachment_update")
    _attachments_version(request)
    given = _member(await json_body(request), "attachment")
    try:
        one = attach_service.update_attachment(
            cloud_of(request), ctx, attachment_id, given.get("connector")
        )
    except StowageError as exc:
        raise mapped(exc) from None
    return JSONResponse({"attachment": attachment_view(one)})


@router.delete("/attachments/{attachment_id}")
async def delete_attachment(request: Request, project_id: str, attachment_id: str) -> JSONResponse:
    ctx = writer(request, project_id, "volume:attachment_delete")
    _attachments_version(request)
    try:
        attach_service.delete_attachment(cloud_of(request), ctx, attachment_id)
    except StowageError as exc:
        raise mapped(exc) from None
    return JSONResponse({"attachments": []})


@router.post("/attachments/{attachment_id}/action")
async def attachment_action(request: Request, project_id: str, attachment_id: str) -> Response:
    ctx = writer(request, project_id, "volume:attachment_complete")
    _attachments_version(request)
    payload = await json_body(request)
    if not isinstance(payload, dict) or list(payload) != ["os-complete"] or vmv(request) < (3, 44):
        raise ApiError(400, "There is no such action: only os-complete (3.44+) is known")
    try:
        attach_service.complete_attachment(cloud_of(request), ctx, attachment_id)
    except StowageError as exc:
        raise mapped(exc) from None
    return Response(status_code=204)


# -- quotas, limits, zones, services ----------------------------------------------------------


def _quota_target(ctx: Context, target: str) -> None:
    if target != ctx.project_id and not ctx.is_admin:
        raise ApiError(403, "Policy doesn't allow volume_extension:quotas:show to be performed.")


@router.get("/os-quota-sets/{target}")
async def show_quotas(request: Request, project_id: str, target: str) -> JSONResponse:
    ctx = context(request, project_id)
    _quota_target(ctx, target)
    usage = request.query_params.get("usage", "").lower() in ("true", "1")
    return JSONResponse(
        {"quota_set": type_service.quota_set(cloud_of(request), target, usage=usage)}
    )


@router.get("/os-quota-sets/{target}/defaults")
async def default_quotas(request: Request, project_id: str, target: str) -> JSONResponse:
    context(request, project_id)
    from stowage.services.volumes import DEFAULT_TYPE_NAME, DEFAULT_VOLUME_QUOTAS

    body: dict[str, Any] = {"id": target, **DEFAULT_VOLUME_QUOTAS}
    for key in ("volumes", "snapshots", "gigabytes"):
        body[f"{key}_{DEFAULT_TYPE_NAME}"] = DEFAULT_VOLUME_QUOTAS[key]
    return JSONResponse({"quota_set": body})


@router.put("/os-quota-sets/{target}")
async def update_quotas(request: Request, project_id: str, target: str) -> JSONResponse:
    ctx = context(request, project_id)
    _admin(ctx, "volume_extension:quotas:update")
    given = _member(await json_body(request), "quota_set")
    given = {k: v for k, v in given.items() if k not in ("tenant_id", "id")}
    cloud = cloud_of(request)
    try:
        type_service.set_quotas(cloud, target, given)
    except StowageError as exc:
        raise mapped(exc) from None
    body = type_service.quota_set(cloud, target, usage=False)
    body.pop("id", None)
    return JSONResponse({"quota_set": body})


@router.delete("/os-quota-sets/{target}")
async def delete_quotas(request: Request, project_id: str, target: str) -> Response:
    ctx = context(request, project_id)
    _admin(ctx, "volume_extension:quotas:delete")
    type_service.reset_quotas(cloud_of(request), target)
    return Response(status_code=200)


@router.get("/limits")
async def limits(request: Request, project_id: str) -> JSONResponse:
    ctx = context(request, project_id)
    quotas = type_service.quota_set(cloud_of(request), ctx.project_id, usage=True)
    absolute = {
        "maxTotalVolumes": quotas["volumes"]["limit"],
        "maxTotalSnapshots": quotas["snapshots"]["limit"],
        "maxTotalVolumeGigabytes": quotas["gigabytes"]["limit"],
        "maxTotalBackups": quotas["backups"]["limit"],
        "maxTotalBackupGigabytes": quotas["backup_gigabytes"]["limit"],
        "totalVolumesUsed": quotas["volumes"]["in_use"],
        "totalSnapshotsUsed": quotas["snapshots"]["in_use"],
        "totalGigabytesUsed": quotas["gigabytes"]["in_use"],
        "totalBackupsUsed": 0,
        "totalBackupGigabytesUsed": 0,
    }
    return JSONResponse({"limits": {"rate": [], "absolute": absolute}})


@router.get("/os-availability-zone")
async def availability_zones(request: Request, project_id: str) -> JSONResponse:
    context(request, project_id)
    return JSONResponse(
        {"availabilityZoneInfo": [{"zoneName": "nova", "zoneState": {"available": True}}]}
    )


@router.get("/os-services")
async def services(request: Request, project_id: str) -> JSONResponse:
    ctx = context(request, project_id)
    _admin(ctx, "volume_extension:services:index")
    cloud = cloud_of(request)
    now = iso(cloud.clock())
    from stowage.services.volumes import backend_of

    rows = [
        ("cinder-scheduler", "stowage"),
        ("cinder-volume", f"stowage@{backend_of(cloud).kind}"),
    ]
    query = request.query_params
    rows = [
        (binary, host)
        for binary, host in rows
        if query.get("binary") in (None, binary)
        # A host filter names the host, or the host of a backend (host@backend), as Cinder's.
        and query.get("host") in (None, host, host.split("@", 1)[0])
    ]
    out = []
    for binary, host in rows:
        row: dict[str, Any] = {
            "binary": binary,
            "host": host,
            "zone": "nova",
            "status": "enabled",
            "state": "up",
            "updated_at": now,
            "disabled_reason": None,
        }
        if vmv(request) >= (3, 7):
            row["cluster"] = None
        if vmv(request) >= (3, 49) and binary == "cinder-volume":
            row["backend_state"] = "up"
        out.append(row)
    return JSONResponse({"services": out})


@router.get("/scheduler-stats/get_pools")
async def get_pools(request: Request, project_id: str) -> JSONResponse:
    """The backend pools with their capacity, as the ledger holds it (admin only)."""
    ctx = context(request, project_id)
    _admin(ctx, "scheduler_extension:scheduler_stats:get_pools")
    cloud = cloud_of(request)
    from stowage.services.volumes import pool_host
    from stowage.services.volumes.volumes import pools

    detail = request.query_params.get("detail", "").lower() in ("true", "1")
    out = []
    for pool in pools(cloud):
        row: dict[str, Any] = {"name": pool_host(cloud)}
        if detail:
            row["capabilities"] = {
                "pool_name": pool.name,
                "volume_backend_name": pool.backend,
                "storage_protocol": "local",
                "vendor_name": VENDOR,
                "driver_version": DRIVER_VERSION,
                "total_capacity_gb": pool.total_gb,
                "free_capacity_gb": pool.free_gb,
                "allocated_capacity_gb": pool.used_gb,
                "reserved_percentage": 0,
                "max_over_subscription_ratio": pool.allocation_ratio,
                "thin_provisioning_support": False,
                "thick_provisioning_support": True,
                "multiattach": True,
            }
        out.append(row)
    return JSONResponse({"pools": out})


@router.get("/capabilities/{host}")
async def capabilities(request: Request, project_id: str, host: str) -> JSONResponse:
    """The backend's capabilities (admin only); `host` as get_pools names it, with or without
    its `#pool`."""
    ctx = context(request, project_id)
    _admin(ctx, "volume_extension:capabilities")
    cloud = cloud_of(request)
    from stowage.services.volumes import backend_of, pool_host

    backend_host = pool_host(cloud).split("#", 1)[0]
    if host.split("#", 1)[0] != backend_host:
        raise ApiError(404, f"Service {host} could not be found.")
    return JSONResponse(
        {
            "namespace": f"OS::Storage::Capabilities::{backend_host}",
            "vendor_name": VENDOR,
            "volume_backend_name": backend_of(cloud).kind,
            "pool_name": None,
            "driver_version": DRIVER_VERSION,
            "storage_protocol": "local",
            "display_name": None,
            "description": None,
            "visibility": None,
            "replication_targets": [],
            "properties": {},
        }
    )


VENDOR = "Stowage"
DRIVER_VERSION = "1.0.0"

# The extensions of Cinder's that this API carries (GET /extensions): their fields and
# routes are served as Cinder's are.
_EXTENSIONS = (
    ("AdminActions", "os-admin-actions", "Enable admin actions."),
    ("AvailabilityZones", "os-availability-zone", "Describe Availability Zones."),
    ("ExtendedSnapshotAttributes", "os-extended-snapshot-attributes",
     "Extended SnapshotAttributes support."),
    ("QuotaSets", "os-quota-sets", "Quota management support."),
    ("SchedulerStats", "scheduler-stats", "Scheduler stats support."),
    ("Services", "os-services", "Services support."),
    ("TypesExtraSpecs", "os-types-extra-specs", "Type extra specs support."),
    ("TypesManage", "os-types-manage", "Types manage support."),
    ("VolumeActions", "os-volume-actions", "Enable volume actions."),
    ("VolumeHostAttribute", "os-vol-host-attr", "Expose host as an attribute of a volume."),
    ("VolumeImageMetadata", "os-vol-image-meta", "Show the volume's image metadata."),
    ("VolumeMigStatusAttribute", "os-vol-mig-status-attr",
     "Expose migration_status as an attribute of a volume."),
    ("VolumeTenantAttribute", "os-vol-tenant-attr", "Expose project_id as a volume's attribute."),
    ("VolumeTypeAccess", "os-volume-type-access", "Volume type access support."),
    ("Capabilities", "capabilities", "Capabilities support."),
)  # fmt: skip


@router.get("/extensions")
async def extensions(request: Request, project_id: str) -> JSONResponse:
    context(request, project_id)
    return JSONResponse(
        {
            "extensions": [
                {
                    "alias": alias,
                    "name": name,
                    "description": description,
                    "links": [],
                    "updated": "2013-01-01T00:00:00+00:00",
                }
                for name, alias, description in _EXTENSIONS
            ]
        }
    )


@router.get("/resource_filters")
async def resource_filters(request: Request, project_id: str) -> JSONResponse:
    """The filters each list here takes (3.33+): the ones its handler reads, nothing else."""
    context(request, project_id)
    if vmv(request) < (3, 33):
        raise ApiError(404, "The resource could not be found.")
    known = {
        "volume": sorted(VOLUME_FILTERS),
        "snapshot": sorted(_SNAPSHOT_FILTERS),
        "attachment": sorted(_ATTACHMENT_FILTERS),
    }
    wanted = request.query_params.get("resource")
    rows = [
        {"resource": name, "filters": filters}
        for name, filters in known.items()
        if wanted in (None, name)
    ]
    return JSONResponse({"resource_filters": rows})
