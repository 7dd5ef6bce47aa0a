"""Compute v2.1: servers (create, list, detail, show, update, delete), actions, topology."""

from __future__ import annotations

import asyncio
import re
import secrets
import time
from concurrent.futures import Future
from datetime import datetime
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from stowage.api.auth import cloud_of, require_context
from stowage.api.common import ApiError, Context, json_body, json_of, on_loop
from stowage.api.compute.create_schema import check_create_shapes
from stowage.api.compute.floating_ips import FLOATING_ACTIONS, floating_action
from stowage.api.compute.microversion import mv
from stowage.api.compute.server_actions import EXTRA_ACTIONS, extra_action
from stowage.api.compute.server_fields import (
    CREATE_FIELDS,
    REBUILD_FIELDS,
    UPDATE_FIELDS,
    apply_common_fields,
    check_action_args,
    check_group,
    check_lock,
    check_nics,
    check_refused,
    check_unknown,
    create_extras,
    hostname_of,
    locked_by,
    pinned_host,
    rebuild_changes,
    shown_host,
)
from stowage.api.compute.server_filters import all_tenants_asked, filter_servers, sort_servers
from stowage.api.compute.server_views import (
    action_view,
    check_create,
    check_metadata,
    check_resize_quota,
    detail_list_view,
    matches_more,
    omit_unset,
)
from stowage.api.responses import JSONResponse
from stowage.domain.errors import InvalidSpec, NotFound
from stowage.ledger.objects import Document
from stowage.services import instances
from stowage.services.cloud import Cloud
from stowage.services.compute import (
    BuildRequest,
    build_servers_soon,
    change_instance,
    check_build,
    commit_build,
    delete_server,
    instance_topology,
    power_action,
    rebuild_server,
    record_action,
    snapshot_server,
)
from stowage.services.compute_catalog import visible_flavor, visible_flavor_of
from stowage.services.images import properties_of
from stowage.services.migrations import confirm_resize, move, revert_resize
from stowage.services.server_security_groups import security_group_names

router = APIRouter()

_NAME_MAX = 255


def _iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    # time.gmtime and a format: datetime's strftime was a seventh of a detail list's time.
    t = time.gmtime(ts)
    return (
        f"{t.tm_year:04d}-{t.tm_mon:02d}-{t.tm_mday:02d}T"
        f"{t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d}Z"
    )


def _visible(ctx: Context, doc: Document, *, all_tenants: bool = False) -> bool:
    return doc.project_id == ctx.project_id or (ctx.is_admin and all_tenants)


def load_server(cloud: Cloud, ctx: Context, server_id: str) -> Document:
    """The server, or a 404 (also for another project's server: its existence is not told)."""
    doc = cloud.objects.find("instance", server_id)
    if doc is None or not (doc.project_id == ctx.project_id or ctx.is_admin):
        raise ApiError(404, f"Instance {server_id} could not be found.")
    return doc


def _links(request: Request, kind: str, item_id: str) -> list[dict[str, str]]:
    base = cloud_of(request).config.base_url
    return [
        {"rel": "self", "href": f"{base}/compute/v2.1/{kind}/{item_id}"},
        {"rel": "bookmark", "href": f"{base}/compute/{kind}/{item_id}"},
    ]


def _flavor_view(request: Request, flavor: dict[str, Any]) -> dict[str, Any]:
    if mv(request) >= (2, 47):
        view = {
            "vcpus": flavor["vcpus"],
            "ram": flavor["ram"],
            "disk": flavor["disk"],
            "ephemeral": flavor.get("ephemeral", 0),
            "swap": flavor.get("swap", 0),
            "original_name": flavor["name"],
        }
        if mv(request) >= (2, 47):
            view["extra_specs"] = dict(flavor.get("extra_specs") or {})
        return view
    return {"id": flavor["id"], "links": _links(request, "flavors", flavor["id"])}


def server_view(
    request: Request, ctx: Context, doc: Document, *, brief: bool = False
) -> dict[str, Any]:
    body = doc.body
    if brief:
        return {"id": doc.id, "name": body["name"], "links": _links(request, "servers", doc.id)}
    version = mv(request)
    host = shown_host(cloud_of(request), doc)
    view: dict[str, Any] = {
        "id": doc.id,
        "name": body["name"],
        "status": body["status"],
        "tenant_id": body["project_id"],
        "user_id": body["user_id"],
        "metadata": body.get("metadata") or {},
        "hostId": _host_id(body["project_id"], host),
        "image": {"id": body["image_id"], "links": _links(request, "images", body["image_id"])}
        if body.get("image_id")
        else "",
        "flavor": _flavor_view(request, body["flavor"]),
        "created": _iso(doc.created_at),
        "updated": _iso(doc.updated_at),
        "addresses": body.get("addresses") or {},
        "accessIPv4": body.get("access_ipv4") or "",
        "accessIPv6": body.get("access_ipv6") or "",
        "links": _links(request, "servers", doc.id),
        "OS-DCF:diskConfig": body.get("disk_config") or "MANUAL",
        "progress": 0,
        "OS-EXT-AZ:availability_zone": body.get("availability_zone") or "nova",
        "config_drive": "True" if body.get("config_drive") else "",
        "key_name": body.get("key_name"),
        "OS-SRV-USG:launched_at": _iso(body.get("launched_at")),
        "OS-SRV-USG:terminated_at": None,
        "security_groups": [{"name": n} for n in body.get("security_groups") or []],
        "OS-EXT-STS:task_state": body.get("task_state"),
        "OS-EXT-STS:vm_state": body["vm_state"],
        "OS-EXT-STS:power_state": body["power_state"],
        "os-extended-volumes:volumes_attached": [
            {"id": d["volume_id"], "delete_on_termination": bool(d.get("delete_on_termination"))}
            if version >= (2, 3)
            else {"id": d["volume_id"]}
            for d in body.get("block_devices") or []
            if not d.get("attaching")
        ],
    }
    omit_unset(view)
    if ctx.is_admin:
        view["OS-EXT-SRV-ATTR:host"] = host
        view["OS-EXT-SRV-ATTR:hypervisor_hostname"] = host
        # The guest's name on its hypervisor, as the libvirt driver names the domain.
        view["OS-EXT-SRV-ATTR:instance_name"] = "instance-" + doc.id
        if version >= (2, 3):
            view.update(
                {
                    "OS-EXT-SRV-ATTR:hostname": hostname_of(body),
                    "OS-EXT-SRV-ATTR:reservation_id": body.get("reservation_id"),
                    "OS-EXT-SRV-ATTR:launch_index": body.get("launch_index", 0),
                    "OS-EXT-SRV-ATTR:kernel_id": "",
                    "OS-EXT-SRV-ATTR:ramdisk_id": "",
                    "OS-EXT-SRV-ATTR:root_device_name": "/dev/vda",
                    "OS-EXT-SRV-ATTR:user_data": body.get("user_data"),
                }
            )
    elif version >= (2, 90):
        view["OS-EXT-SRV-ATTR:hostname"] = hostname_of(body)
    if body["status"] == "ERROR" and body.get("fault"):
        fault = dict(body["fault"])
        fault["created"] = _iso(fault.get("created"))
        if not ctx.is_admin:
            fault.pop("details", None)
        view["fault"] = fault
    if version >= (2, 9):
        view["locked"] = bool(body.get("locked"))
    if version >= (2, 16):
        view["host_status"] = "UP" if host else ""
    if version >= (2, 19):
        view["description"] = body.get("description")
    if version >= (2, 26):
        view["tags"] = list(body.get("tags") or [])
    if version >= (2, 63):
        view["trusted_image_certificates"] = None
    if version >= (2, 71):
        view["server_groups"] = [body["group_id"]] if body.get("group_id") else []
    if version >= (2, 73):
        view["locked_reason"] = body.get("locked_reason")
    if version >= (2, 96):
        view["pinned_availability_zone"] = body.get("availability_zone")
    return view


def _host_id(project_id: str, host: str | None) -> str:
    if not host:
        return ""
    import hashlib

    return hashlib.sha224((project_id + host).encode()).hexdigest()


def _one(value: Any, field: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ApiError(
            400,
            f"Invalid input for field/attribute {field}. "
            f"Value: {value}. {value!r} is not an integer",
        ) from None
    if number < 1:
        raise ApiError(
            400,
            f"Invalid input for field/attribute {field}. "
            f"Value: {value}. {number} is less than the minimum of 1",
        )
    return number


def _parse_create(request: Request, cloud: Cloud, ctx: Context, body: Any) -> BuildRequest:
    if not isinstance(body, dict) or not isinstance(body.get("server"), dict):
        raise ApiError(
            400, "Invalid input for field/attribute server: 'server' is a required property"
        )
    server = body["server"]
    version = mv(request)
    check_unknown(server, CREATE_FIELDS, version)
    check_create_shapes(server)
    extras = create_extras(server, version)
    name = server.get("name")
    if not isinstance(name, str) or not name.strip() or len(name) > _NAME_MAX:
        raise ApiError(
            400, "Invalid input for field/attribute name: a name of 1 to 255 characters is required"
        )
    flavor_ref = server.get("flavorRef")
    if flavor_ref is None:
        raise ApiError(
            400, "Invalid input for field/attribute flavorRef: 'flavorRef' is a required property"
        )
    flavor_id = str(flavor_ref).rstrip("/").rsplit("/", 1)[-1]
    image_ref = server.get("imageRef") or ""
    bdms = server.get("block_device_mapping_v2") or []
    if not image_ref:
        image_ref = next((b.get("uuid") for b in bdms if b.get("source_type") == "image"), "")
    image_id = str(image_ref).rstrip("/").rsplit("/", 1)[-1] if image_ref else ""
    # The flavor and the image in one read (checked in that order, as before).
    wanted = [("flavor", flavor_id)] + ([("image", image_id)] if image_id else [])
    found = cloud.objects.find_each(wanted)
    try:
        flavor = visible_flavor_of(
            found.get(("flavor", flavor_id)), flavor_id, ctx.project_id, ctx.is_admin
        )
    except NotFound:
        raise ApiError(400, f"Flavor {flavor_ref} could not be found.") from None
    image_properties: dict[str, str] = {}
    image: Document | None = None
    if image_ref:
        image = bootable_image_of(found.get(("image", image_id)), ctx, image_id)
        image_properties = {
            k: str(v) for k, v in properties_of(image.body).items() if isinstance(v, str | int)
        }
        image_ref = image_id
    elif not bdms:
        raise ApiError(
            400,
            "Invalid input for field/attribute imageRef: an image or a "
            "block device mapping is required",
        )
    min_count = _one(server.get("min_count", 1), "min_count")
    max_count = _one(server.get("max_count", min_count), "max_count")
    if min_count > max_count:
        raise ApiError(400, "min_count must be <= max_count")
    hints = body.get("OS-SCH-HNT:scheduler_hints") or body.get("os:scheduler_hints") or {}
    if not isinstance(hints, dict):
        raise ApiError(400, "Invalid input for field/attribute scheduler_hints: not an object")
    check_create(cloud, ctx, server, flavor.body, image if server.get("imageRef") else None)
    zone, force_host = _parse_zone(ctx, server.get("availability_zone"))
    force_host = pinned_host(cloud, ctx, server, force_host)
    if extras["hostname"] is not None and max_count > 1:
        raise ApiError(400, "Cannot specify hostname when creating multiple servers")
    group = hints.get("group")
    if isinstance(group, list):
        group = group[0] if group else None
    check_group(cloud, ctx, str(group) if group else None)
    networks = check_nics(cloud, ctx, server.get("networks"), version)
    return BuildRequest(
        name=name,
        flavor=dict(flavor.body),
        image_id=image_ref,
        project_id=ctx.project_id,
        user_id=ctx.user_id,
        min_count=min_count,
        max_count=max_count,
        availability_zone=zone,
        force_host=force_host,
        group_id=str(group) if group else None,
        same_host=_as_list(hints.get("same_host")),
        different_host=_as_list(hints.get("different_host")),
        networks=networks,
        metadata=check_metadata(server.get("metadata") or {}),
        key_name=server.get("key_name"),
        description=server.get("description"),
        security_groups=security_group_names(cloud, ctx, server.get("security_groups")),
        hints=dict(hints),
        image_properties=image_properties,
        tags=list(server.get("tags") or []),
        is_admin=ctx.is_admin,
        **extras,
    )


def bootable_image(cloud: Cloud, ctx: Context, image_id: str) -> Document:
    """An active image the caller may boot from, or Nova's 400."""
    return bootable_image_of(cloud.objects.find("image", image_id), ctx, image_id)


def bootable_image_of(image: Document | None, ctx: Context, image_id: str) -> Document:
    """`bootable_image` of the image document `image` already read (None: there is none)."""
    visible = image is not None and (
        ctx.is_admin
        or image.body.get("visibility") in ("public", "community")
        or image.body.get("owner") == ctx.project_id
    )
    if image is None or not visible:
        raise ApiError(400, f"Image {image_id} could not be found.")
    if image.body.get("status") != "active":
        raise ApiError(400, f"Image {image_id} is not active.")
    return image


def _as_list(value: Any) -> list[str]:
    if value is None:
        return []
    return [str(v) for v in value] if isinstance(value, list) else [str(value)]


def _parse_zone(ctx: Context, raw: Any) -> tuple[str | None, str | None]:
    if not raw:
        return None, None
    zone, _, rest = str(raw).partition(":")
    host = rest.partition(":")[0] or None
    if host is not None and not ctx.is_admin:
        raise ApiError(
            403, "Policy doesn't allow os_compute_api:servers:create:forced_host to be performed."
        )
    return zone or None, host


@router.post("/servers")
@on_loop  # its reads, checks and any commit of its own in the thread pool; a group's here
async def create_server(request: Request) -> JSONResponse:
    raw = await request.body()
    payload, made = await run_in_threadpool(_create, request, raw)
    try:
        docs = made if isinstance(made, list) else await asyncio.wrap_future(made)
    except (InvalidSpec, NotFound) as exc:
        raise ApiError(400, str(exc)) from None
    await settled(cloud_of(request), [d["id"] for d in docs])
    first = docs[0]
    body: dict[str, Any] = {
        "server": {
            "id": first["id"],
            "links": _links(request, "servers", first["id"]),
            "OS-DCF:diskConfig": "MANUAL",
            "security_groups": [{"name": n} for n in first["security_groups"]],
            "adminPass": payload["server"].get("adminPass") or secrets.token_urlsafe(9),
        }
    }
    if payload["server"].get("return_reservation_id"):
        body = {"reservation_id": first["reservation_id"]}
    return JSONResponse(body, status_code=202)


def _create(
    request: Request, raw: bytes
) -> tuple[Any, list[dict[str, Any]] | Future[list[dict[str, Any]]]]:
    """A create's caller, body and request checked, in a thread (they read the ledger), and
    its commit: the body, and the instances made, or where the store groups its writes
    (`stowage up`) the future of the group commit the create joined, for the event loop to
    await without a thread waiting for it (`build_servers_soon`)."""
    ctx = require_context(request)
    if not ctx.can_write:
        raise ApiError(403, "Policy doesn't allow os_compute_api:servers:create to be performed.")
    cloud = cloud_of(request)
    payload = json_of(raw)
    build = _parse_create(request, cloud, ctx, payload)
    request_id = request.state.request_id
    try:
        check_build(cloud, build)
        soon = build_servers_soon(cloud, build, request_id)
        return payload, soon if soon is not None else commit_build(cloud, build, request_id)
    except (InvalidSpec, NotFound) as exc:
        raise ApiError(400, str(exc)) from None


def _list(request: Request, *, detail: bool) -> JSONResponse:
    ctx = require_context(request)
    cloud = cloud_of(request)
    query = request.query_params
    all_tenants = all_tenants_asked(ctx, query)
    project = query.get("project_id") or query.get("tenant_id")
    if project and all_tenants:  # Nova ignores the project filter without all_tenants
        docs = cloud.objects.list("instance", project_id=project)
    elif all_tenants:
        docs = cloud.objects.list("instance")
    else:
        docs = cloud.objects.list("instance", project_id=ctx.project_id)
    docs = [d for d in docs if _matches(d, query, ctx)]
    version = mv(request)
    docs = filter_servers(docs, query, ctx, version, lambda b: b.get("availability_zone") or "nova")
    docs = sort_servers(docs, query, ctx, version)
    marker = query.get("marker")
    if marker:
        ids = [d.id for d in docs]
        if marker not in ids:
            raise ApiError(400, f"marker [{marker}] not found")
        docs = docs[ids.index(marker) + 1 :]
    limit = query.get("limit")
    links = []
    if limit is not None:
        count = _limit(limit)
        more = len(docs) > count
        docs = docs[:count]
        if more and docs:
            base = cloud.config.base_url
            kind = "servers/detail" if detail else "servers"
            links = [
                {
                    "rel": "next",
                    "href": f"{base}/compute/v2.1/{kind}?limit={count}&marker={docs[-1].id}",
                }
            ]
    servers = [
        detail_list_view(server_view(request, ctx, d))
        if detail
        else server_view(request, ctx, d, brief=True)
        for d in docs
    ]
    body: dict[str, Any] = {"servers": servers}
    if links:
        body["servers_links"] = links
    return JSONResponse(body)


def _limit(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ApiError(400, f"Invalid input for query parameters limit. Value: {raw}.") from None
    if value < 0:
        raise ApiError(400, f"Invalid input for query parameters limit. Value: {raw}.")
    return value


def _matches(doc: Document, query: Any, ctx: Context) -> bool:
    body = doc.body
    if not matches_more(body, query):
        return False
    name = query.get("name")
    if name:
        try:
            if not re.search(name, body["name"]):
                return False
        except re.error:
            if name != body["name"]:
                return False
    status = query.get("status")
    if status and body["status"].lower() != status.lower():
        return False
    host = query.get("host")
    if host and ctx.is_admin and body.get("host") != host:
        return False
    flavor = query.get("flavor")
    if flavor and body["flavor"].get("id") != flavor:
        return False
    image = query.get("image")
    if image and body.get("image_id") != image:
        return False
    since = query.get("changes-since")
    if since:
        try:
            stamp = datetime.fromisoformat(since.replace("Z", "+00:00")).timestamp()
        except ValueError:
            raise ApiError(
                400, f"Invalid input for query parameters changes-since. Value: {since}."
            ) from None
        if doc.updated_at < stamp:
            return False
    return True


@router.get("/servers")
async def list_servers(request: Request) -> JSONResponse:
    return await asyncio.to_thread(_list, request, detail=False)


@router.get("/servers/detail")
async def list_servers_detail(request: Request) -> JSONResponse:
    return await asyncio.to_thread(_list, request, detail=True)


@router.get("/servers/{server_id}")
async def show_server(request: Request, server_id: str) -> JSONResponse:
    ctx = require_context(request)
    doc = load_server(cloud_of(request), ctx, server_id)
    return JSONResponse({"server": server_view(request, ctx, doc)})


@router.put("/servers/{server_id}")
async def update_server(request: Request, server_id: str) -> JSONResponse:
    ctx = require_context(request)
    if not ctx.can_write:
        raise ApiError(403, "Policy doesn't allow os_compute_api:servers:update to be performed.")
    cloud = cloud_of(request)
    doc = load_server(cloud, ctx, server_id)
    payload = await json_body(request)
    server = payload.get("server") if isinstance(payload, dict) else None
    if not isinstance(server, dict):
        raise ApiError(400, "Invalid input for field/attribute server: 'server' is required")
    check_unknown(server, UPDATE_FIELDS, mv(request))
    body = dict(doc.body)
    apply_common_fields(body, server, mv(request))
    if "name" in server:
        name = server["name"]
        if not isinstance(name, str) or not name.strip() or len(name) > _NAME_MAX:
            raise ApiError(400, "Invalid input for field/attribute name")
        body["name"] = name
    if "description" in server:
        body["description"] = server["description"]
    instances.update_server(cloud, server_id, doc.body, body)
    updated = cloud.objects.get("instance", server_id)
    view = action_view(server_view(request, ctx, updated), mv(request), rebuild=False)
    return JSONResponse({"server": view})


@router.delete("/servers/{server_id}")
async def remove_server(request: Request, server_id: str) -> Response:
    ctx = require_context(request)
    if not ctx.can_write:
        raise ApiError(403, "Policy doesn't allow os_compute_api:servers:delete to be performed.")
    cloud = cloud_of(request)
    doc = load_server(cloud, ctx, server_id)
    if doc.body.get("locked") and not ctx.is_admin:
        raise ApiError(409, f"Instance {server_id} is locked")
    if cloud.config.reclaim_instance_interval_s > 0 and doc.body.get("vm_state") != "soft-delete":
        from stowage.services.soft_delete import soft_delete_server

        await asyncio.to_thread(soft_delete_server, cloud, server_id, request.state.request_id)
    else:
        await asyncio.to_thread(delete_server, cloud, server_id)
    record_action(cloud, server_id, "delete", ctx.user_id, ctx.project_id, request.state.request_id)
    await settled(cloud, [server_id])
    return Response(status_code=204)


_POWER_ACTIONS = {"os-stop", "os-start", "reboot", "pause", "unpause", "suspend", "resume"}


async def settled(cloud: Cloud, instance_ids: list[str]) -> None:
    """Wait (bounded by the cloud's `api_wait_s`, 0 by default) for the instances'
    operations to end. The compute API answers 202 either way, as Nova does, as soon as the
    request is committed; a cloud started with a wait lets scripts that do not poll read
    the simulated cloud's quick operations as finished."""
    if cloud.config.api_wait_s > 0:
        await asyncio.to_thread(
            cloud.operations.wait_instances, instance_ids, cloud.config.api_wait_s
        )


_ADMIN_ACTIONS = {"os-resetState", "os-migrateLive", "migrate", "evacuate"}
# Nova's @check_instance_lock: a locked server refuses these to anyone but an admin.
_LOCK_CHECKED = {
    "resize",
    "confirmResize",
    "revertResize",
    "rebuild",
    "createBackup",
    "shelve",
    "unshelve",
}
# Nova's defaults: moving servers between hosts is for admins; resizing is for owners.


@router.post("/servers/{server_id}/action")
async def server_action(request: Request, server_id: str) -> Response:
    ctx = require_context(request)
    cloud = cloud_of(request)
    doc = load_server(cloud, ctx, server_id)
    payload = await json_body(request)
    if not isinstance(payload, dict) or len(payload) != 1:
        raise ApiError(400, "Invalid action: the body must name exactly one action")
    action, args = next(iter(payload.items()))
    if action in _ADMIN_ACTIONS and not ctx.is_admin:
        raise ApiError(403, f"Policy doesn't allow os_compute_api:{action} to be performed.")
    check_action_args(action, args, mv(request))
    if not ctx.can_write:
        raise ApiError(403, f"Policy doesn't allow os_compute_api:{action} to be performed.")
    rid = request.state.request_id
    if action in _POWER_ACTIONS:
        name = await asyncio.to_thread(
            power_action, cloud, server_id, action, is_admin=ctx.is_admin, request_id=rid
        )
        record_action(cloud, server_id, name, ctx.user_id, ctx.project_id, rid)
        await settled(cloud, [server_id])
        return Response(status_code=202)
    if doc.body.get("locked") and not ctx.is_admin and action in _LOCK_CHECKED:
        raise ApiError(409, f"Instance {server_id} is locked")
    if action in ("lock", "unlock"):
        body = dict(doc.body)
        check_lock(ctx, doc.body, action)
        body["locked"] = action == "lock"
        reason = (args or {}).get("locked_reason") if isinstance(args, dict) else None
        body["locked_reason"] = reason if action == "lock" else None
        body["locked_by"] = locked_by(ctx, doc.body) if action == "lock" else None
        change_instance(
            cloud,
            server_id,
            doc.body,
            body,
            action=action,
            user_id=ctx.user_id,
            project_id=ctx.project_id,
            request_id=rid,
        )
        return Response(status_code=202)
    if action == "os-resetState":
        state = (args or {}).get("state") if isinstance(args, dict) else None
        if state not in ("active", "error"):
            raise ApiError(
                400,
                "Invalid input for field/attribute state. Value must be one of 'active', 'error'",
            )
        body = dict(doc.body)
        body["status"] = state.upper()
        body["vm_state"] = state
        body["task_state"] = None
        change_instance(
            cloud,
            server_id,
            doc.body,
            body,
            action="resetState",
            user_id=ctx.user_id,
            project_id=ctx.project_id,
            request_id=rid,
        )
        return Response(status_code=202)
    if action in _MOVES:
        return await _move_action(request, ctx, doc, action, args)
    if action == "createImage":
        return await _create_image(request, ctx, doc, args)
    if action == "rebuild":
        return await _rebuild(request, ctx, doc, args)
    if action in EXTRA_ACTIONS:
        return await extra_action(request, ctx, doc, action, args)
    from stowage.api.compute.consoles import CONSOLE_ACTIONS, console_action

    if action in CONSOLE_ACTIONS:
        return await console_action(request, ctx, doc, action, args)
    if action in FLOATING_ACTIONS:
        return await floating_action(request, ctx, doc, action, args)
    from stowage.api.compute.interfaces import FIXED_IP_ACTIONS, fixed_ip_action
    from stowage.api.compute.shelving import SHELVE_ACTIONS, shelve_action

    if action in SHELVE_ACTIONS:
        return await shelve_action(request, ctx, doc, action, args)
    from stowage.api.compute.guest_actions import GUEST_ACTIONS, guest_action

    if action in GUEST_ACTIONS:
        return await guest_action(request, ctx, doc, action, args)

    if action in FIXED_IP_ACTIONS:
        return await fixed_ip_action(request, ctx, doc, action, args)
    raise ApiError(400, f"There is no such action: {action}")


async def _create_image(request: Request, ctx: Context, doc: Document, args: Any) -> Response:
    cloud = cloud_of(request)
    args = args if isinstance(args, dict) else {}
    name = args.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ApiError(400, "Invalid input for field/attribute name: a snapshot needs a name")
    metadata = args.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise ApiError(400, "Invalid input for field/attribute metadata: not an object")
    rid = request.state.request_id
    image_id = await asyncio.to_thread(snapshot_server, cloud, ctx, doc.id, name, metadata, rid)
    record_action(cloud, doc.id, "createImage", ctx.user_id, ctx.project_id, rid)
    await settled(cloud, [doc.id])
    location = f"{cloud.config.base_url}/image/v2/images/{image_id}"
    if mv(request) >= (2, 45):
        return JSONResponse({"image_id": image_id}, status_code=202)
    return Response(status_code=202, headers={"Location": location})


async def _rebuild(request: Request, ctx: Context, doc: Document, args: Any) -> Response:
    cloud = cloud_of(request)
    args = args if isinstance(args, dict) else {}
    ref = args.get("imageRef")
    if not ref:
        raise ApiError(400, "Invalid input for field/attribute imageRef: required")
    version = mv(request)
    check_unknown(args, REBUILD_FIELDS, version)
    check_refused(args, rebuild=True)
    image_id = bootable_image(cloud, ctx, str(ref).rstrip("/").rsplit("/", 1)[-1]).id
    changes = rebuild_changes(cloud, ctx, doc.body, args, version)
    await asyncio.to_thread(
        rebuild_server, cloud, doc.id, image_id, args.get("name"), changes=changes
    )
    record_action(cloud, doc.id, "rebuild", ctx.user_id, ctx.project_id, request.state.request_id)
    await settled(cloud, [doc.id])
    updated = cloud.objects.get("instance", doc.id)
    password = str(args.get("adminPass") or secrets.token_urlsafe(9))
    view = action_view(
        server_view(request, ctx, updated),
        mv(request),
        rebuild=True,
        admin_pass=password,
        user_data=updated.body.get("user_data"),
    )
    return JSONResponse({"server": view}, status_code=202)


_MOVES = {"evacuate", "os-migrateLive", "migrate", "resize", "confirmResize", "revertResize"}


async def _move_action(
    request: Request, ctx: Context, doc: Document, action: str, args: Any
) -> Response:
    cloud = cloud_of(request)
    server_id = doc.id
    args = args if isinstance(args, dict) else {}
    rid = request.state.request_id
    if action == "confirmResize":
        await asyncio.to_thread(confirm_resize, cloud, server_id)
        record_action(cloud, server_id, "confirmResize", ctx.user_id, ctx.project_id, rid)
        await settled(cloud, [server_id])
        return Response(status_code=204)
    if action == "revertResize":
        await asyncio.to_thread(revert_resize, cloud, server_id)
        record_action(cloud, server_id, "revertResize", ctx.user_id, ctx.project_id, rid)
        await settled(cloud, [server_id])
        return Response(status_code=202)
    kind = {
        "evacuate": "evacuation",
        "os-migrateLive": "live-migration",
        "migrate": "migration",
        "resize": "resize",
    }[action]
    dest = args.get("host")
    if dest is not None and not isinstance(dest, str):
        raise ApiError(400, "Invalid input for field/attribute host.")
    new_flavor = None
    if action == "resize":
        ref = args.get("flavorRef")
        if ref is None:
            raise ApiError(400, "Invalid input for field/attribute flavorRef: required")
        try:
            new_flavor = dict(visible_flavor(cloud, str(ref), ctx.project_id, ctx.is_admin).body)
        except NotFound:
            raise ApiError(400, f"Flavor {ref} could not be found.") from None
        if new_flavor["id"] == doc.body["flavor"]["id"]:
            raise ApiError(400, "When resizing, instances must change flavor!")
        check_resize_quota(cloud, doc.body["project_id"], doc.body["flavor"], new_flavor)
    await asyncio.to_thread(
        move,
        cloud,
        server_id,
        kind,
        user_id=ctx.user_id,
        project_id=ctx.project_id,
        dest=dest,
        new_flavor=new_flavor,
        request_id=rid,
        target_state="stopped" if action == "evacuate" and mv(request) >= (2, 95) else None,
    )
    await settled(cloud, [server_id])
    if action == "evacuate":
        return Response(status_code=200)
    return Response(status_code=202)


@router.get("/servers/{server_id}/topology")
async def server_topology(request: Request, server_id: str) -> JSONResponse:
    ctx = require_context(request)
    if mv(request) < (2, 78):
        raise ApiError(404, "The resource could not be found.")
    cloud = cloud_of(request)
    load_server(cloud, ctx, server_id)
    nodes = await asyncio.to_thread(instance_topology, cloud, server_id)
    if not ctx.is_admin:
        nodes = [
            {k: v for k, v in n.items() if k not in ("host_node", "cpu_pinning")} for n in nodes
        ]
    return JSONResponse({"nodes": nodes, "pagesize_kb": None})
