"""Block storage v3: what Cinder has and this cloud does not, refused with Cinder's 501
(`{"notImplemented": {"code": 501, "message": ...}}`) naming the feature, for every method,
rather than answered as an unknown path (404) or accepted and dropped.

Whole resources (backups, groups, QoS specs, transfers, messages, ...) are refused under their
first path segment; the features inside implemented resources (volume type access and
encryption, the service actions) by their own routes. This router is included after the
implemented ones, so it never shadows them (tests/api/test_volume_refusals.py enumerates both).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from stowage.api.auth import cloud_of
from stowage.api.common import ApiError, json_body
from stowage.api.responses import JSONResponse
from stowage.api.volume.views import context, mapped
from stowage.domain.errors import StowageError
from stowage.services.volumes import volumes as service

__all__ = ["NOT_HERE", "SERVICE_ACTIONS", "not_here_message", "router"]

router = APIRouter()

# Cinder's resources (a URL's first segment under /v3/{project_id}) this cloud does not have.
NOT_HERE = {
    "backups": "Volume backups are",
    "groups": "Volume groups are",
    "group_types": "Volume group types are",
    "group_snapshots": "Volume group snapshots are",
    "os-volume-transfer": "Volume transfers are",
    "volume-transfers": "Volume transfers are",
    "qos-specs": "QoS specs are",
    "manageable_volumes": "Managing existing volumes is",
    "manageable_snapshots": "Managing existing snapshots is",
    "os-volume-manage": "Managing existing volumes is",
    "os-snapshot-manage": "Managing existing snapshots is",
    "messages": "User messages are",
    "consistencygroups": "Consistency groups are",
    "cgsnapshots": "Consistency group snapshots are",
    "clusters": "Clusters of volume services are",
    "workers": "Cleaning up a volume service's resources is",
    "default-types": "Per-project default volume types are",
    "os-hosts": "The volume hosts API is",
    "os-quota-class-sets": "Quota classes are",
}
# PUT /os-services/{action}: Cinder's service actions, none of which this cloud carries out.
SERVICE_ACTIONS = {
    "enable": "Enabling and disabling volume services is",
    "disable": "Enabling and disabling volume services is",
    "disable-log-reason": "Enabling and disabling volume services is",
    "get-log": "Volume services' log levels are",
    "set-log": "Volume services' log levels are",
    "freeze": "Freezing and thawing volume hosts is",
    "thaw": "Freezing and thawing volume hosts is",
    "failover_host": "Failing over replicated backends is",
    "failover": "Failing over replicated backends is",
}
_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]


def not_here_message(feature: str) -> str:
    return f"{feature} not supported by this cloud."


def _refuse(feature: str) -> ApiError:
    return ApiError(501, not_here_message(feature))


def _admin(request: Request, project_id: str, rule: str) -> None:
    """Cinder's admin-only rules are checked before the refusal, as Cinder checks them."""
    if not context(request, project_id).is_admin:
        raise ApiError(403, f"Policy doesn't allow {rule} to be performed.")


def _type_exists(request: Request, type_id: str) -> None:
    try:
        service.find_type(cloud_of(request), type_id)
    except StowageError as exc:
        raise mapped(exc) from None


@router.put("/os-services/{action}")
async def service_action(request: Request, project_id: str, action: str) -> Response:
    _admin(request, project_id, "volume_extension:services:update")
    if action in SERVICE_ACTIONS:
        raise _refuse(SERVICE_ACTIONS[action])
    raise ApiError(404, "The resource could not be found.")


@router.post("/types/{type_id}/action")
async def type_action(request: Request, project_id: str, type_id: str) -> Response:
    """os-volume-type-access's addProjectAccess and removeProjectAccess."""
    _admin(request, project_id, "volume_extension:volume_type_access:addProjectAccess")
    payload = await json_body(request)
    if not isinstance(payload, dict) or len(payload) != 1:
        raise ApiError(400, "Invalid request body: the body must name exactly one action")
    action = next(iter(payload))
    if action not in ("addProjectAccess", "removeProjectAccess"):
        raise ApiError(400, f"There is no such action: {action}")
    raise _refuse("Access lists of private volume types are")


@router.get("/types/{type_id}/os-volume-type-access")
async def type_access(request: Request, project_id: str, type_id: str) -> JSONResponse:
    """A private type's access list: empty, since no project can be given access here (an
    admin's, as Cinder's; a public type has none, Cinder's 404)."""
    ctx = context(request, project_id)
    if not ctx.is_admin:
        raise ApiError(
            403, "Policy doesn't allow volume_extension:volume_type_access to be performed."
        )
    try:
        found = service.find_type(cloud_of(request), type_id)
    except StowageError as exc:
        raise mapped(exc) from None
    if found.get("is_public", True):
        raise ApiError(404, "Access list not available for public volume types.")
    return JSONResponse({"volume_type_access": []})


@router.get("/types/{type_id}/encryption")
async def type_encryption(request: Request, project_id: str, type_id: str) -> JSONResponse:
    """No volume type is encrypted here: Cinder's answer for a type without encryption."""
    context(request, project_id)
    _type_exists(request, type_id)
    return JSONResponse({})


@router.get("/types/{type_id}/encryption/{key}")
async def type_encryption_key(
    request: Request, project_id: str, type_id: str, key: str
) -> JSONResponse:
    context(request, project_id)
    _type_exists(request, type_id)
    raise ApiError(404, f"Volume type encryption for type {type_id} does not exist.")


@router.api_route("/types/{type_id}/encryption", methods=["POST", "PUT", "DELETE"])
@router.api_route("/types/{type_id}/encryption/{key}", methods=["POST", "PUT", "DELETE"])
async def change_encryption(
    request: Request, project_id: str, type_id: str, key: str = ""
) -> Response:
    _admin(request, project_id, "volume_extension:volume_type_encryption")
    raise _refuse("Encrypted volume types are")


@router.api_route("/{resource}", methods=_METHODS)
@router.api_route("/{resource}/{rest:path}", methods=_METHODS)
async def not_here(request: Request, project_id: str, resource: str, rest: str = "") -> Response:
    context(request, project_id)
    if resource in NOT_HERE:
        raise _refuse(NOT_HERE[resource])
    raise ApiError(404, "The resource could not be found.")
