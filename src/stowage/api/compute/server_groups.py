"""Compute v2.1: server groups, registered in the ledger where the scheduler enforces them."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from sqlalchemy.exc import IntegrityError

from stowage.api.auth import cloud_of, require_context, require_writer
from stowage.api.common import ApiError, Context, json_body
from stowage.api.compute.microversion import mv
from stowage.api.responses import JSONResponse
from stowage.domain.errors import NotFound
from stowage.domain.groups import GroupPolicy, ServerGroup, parse_group
from stowage.services import compute_catalog as catalog
from stowage.services.groups import create_server_group

__all__ = ["router"]

router = APIRouter()

# Before 2.15 only the strict policies exist.
_STRICT = {GroupPolicy.AFFINITY.value, GroupPolicy.ANTI_AFFINITY.value}


def _view(request: Request, group: ServerGroup, members: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"id": group.id, "name": group.name}
    if mv(request) >= (2, 64):
        out["policy"] = group.policy.value
        out["rules"] = dict(group.rules)
    else:
        out["policies"] = [group.policy.value]
        out["metadata"] = {}
    out["members"] = members
    if mv(request) >= (2, 13):
        out["project_id"] = group.project_id
        out["user_id"] = group.user_id
    return out


def _get(request: Request, ctx: Context, group_id: str) -> ServerGroup:
    try:
        group = cloud_of(request).ledger.get_group(group_id)
    except NotFound:
        group = None
    if group is None or (group.project_id != ctx.project_id and not ctx.is_admin):
        raise ApiError(404, f"Instance group {group_id} could not be found.")
    return group


def _policy(request: Request, payload: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The policy and rules of a create request, in the shape its microversion uses."""
    if mv(request) >= (2, 64):
        catalog.only_keys(payload, {"name", "policy", "rules"}, "server_group")
        if "policy" not in payload:
            raise ApiError(
                400,
                "Invalid input for field/attribute server_group: 'policy' is a required property",
            )
        rules = payload.get("rules", {})
        if not isinstance(rules, dict):
            raise ApiError(400, f"Invalid input for field/attribute rules: {rules!r}")
        return str(payload["policy"]), rules
    catalog.only_keys(payload, {"name", "policies"}, "server_group")
    policies = payload.get("policies")
    if not isinstance(policies, list) or len(policies) != 1:
        raise ApiError(
            400, "Invalid input for field/attribute policies: exactly one policy is required"
        )
    policy = str(policies[0])
    if mv(request) < (2, 15) and policy not in _STRICT:
        raise ApiError(
            400,
            f"Invalid input for field/attribute policies: {policy!r} is not one of "
            "'affinity', 'anti-affinity'",
        )
    return policy, {}


def _normal_rules(group: ServerGroup, given: dict[str, Any]) -> dict[str, Any]:
    """Rules as the API returns them: max_server_per_host as an integer."""
    out: dict[str, Any] = {}
    if "max_server_per_host" in given:
        out["max_server_per_host"] = group.max_per_domain
    if "failure_domain" in given:
        out["failure_domain"] = group.failure_domain
    return out


@router.post("/os-server-groups")
async def create_group(request: Request) -> JSONResponse:
    ctx = require_writer(request)
    cloud = cloud_of(request)
    payload = catalog.member(await json_body(request), "server_group")
    if "name" not in payload:
        raise ApiError(
            400, "Invalid input for field/attribute server_group: 'name' is a required property"
        )
    name = catalog.parse_name(payload["name"], "name")
    policy, rules = _policy(request, payload)
    group = parse_group(
        str(uuid.uuid4()), name, policy, rules, project_id=ctx.project_id, user_id=ctx.user_id
    )
    group = dataclasses.replace(group, rules=_normal_rules(group, rules))
    try:
        create_server_group(cloud, group)
    except IntegrityError:
        raise ApiError(409, f"Server group {group.id} already exists.") from None
    return JSONResponse({"server_group": _view(request, group, [])})


def _offset_limit(request: Request) -> tuple[int, int | None]:
    def number(name: str) -> int | None:
        raw = request.query_params.get(name)
        if raw is None:
            return None
        try:
            value = int(raw)
        except ValueError:
            raise ApiError(400, f"{name} param must be an integer") from None
        if value < 0:
            raise ApiError(400, f"{name} param must be positive")
        return value

    return number("offset") or 0, number("limit")


@router.get("/os-server-groups")
async def list_groups(request: Request) -> JSONResponse:
    ctx = require_context(request)
    cloud = cloud_of(request)
    every = "all_projects" in request.query_params and ctx.is_admin
    groups = catalog.list_groups(cloud, None if every else ctx.project_id)
    offset, limit = _offset_limit(request)
    groups = groups[offset:]
    if limit is not None:
        groups = groups[: min(limit, 1000)]
    members = catalog.group_members_of(cloud, [g.id for g in groups])
    return JSONResponse({"server_groups": [_view(request, g, members[g.id]) for g in groups]})


@router.get("/os-server-groups/{group_id}")
async def show_group(group_id: str, request: Request) -> JSONResponse:
    ctx = require_context(request)
    group = _get(request, ctx, group_id)
    members = catalog.group_members_of(cloud_of(request), [group.id])[group.id]
    return JSONResponse({"server_group": _view(request, group, members)})


@router.delete("/os-server-groups/{group_id}")
async def delete_group(group_id: str, request: Request) -> Response:
    ctx = require_writer(request)
    group = _get(request, ctx, group_id)
    try:
        catalog.delete_group(cloud_of(request), group.id)
    except NotFound:
        raise ApiError(404, f"Instance group {group_id} could not be found.") from None
    return Response(status_code=204)
