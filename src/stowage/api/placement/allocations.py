"""Allocations (the ledger's claims, read-only here), usages and allocation candidates."""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from stowage.api.common import ApiError
from stowage.api.placement.microversion import Version, pv
from stowage.api.placement.query import parse_member_of, parse_required, parse_resources
from stowage.api.placement.support import (
    authorize,
    authorize_since,
    check_params,
    one_param,
    store_of,
    valid_uuid,
)
from stowage.api.responses import JSONResponse
from stowage.services.placement import (
    Allocation,
    Candidate,
    LedgerManaged,
    PlacementNotFound,
    PlacementStore,
    RequestGroup,
    candidates,
)

__all__ = ["router"]

router = APIRouter()

_BAD_VALUE = "placement.query.bad_value"
_MISSING_VALUE = "placement.query.missing_value"
_LEDGER_OWNS = (
    "allocations are the ledger's claims: Stowage's scheduler writes them in one "
    "transaction with the NUMA cells, pCPUs and group slots they own, and compute releases "
    "them; Placement shows them and does not change them"
)


# -- allocations ------------------------------------------------------------------------------


@router.get("/allocations/{consumer_id}")
def consumer_allocations(request: Request, consumer_id: str) -> JSONResponse:
    authorize(request, "placement:allocations:list")
    version = pv(request)
    held = store_of(request).consumer_allocations(consumer_id)
    per_provider: dict[str, dict[str, Any]] = {}
    for alloc in held:
        entry = per_provider.setdefault(
            alloc.provider_uuid, {"generation": alloc.provider_generation, "resources": {}}
        )
        entry["resources"][alloc.resource_class] = alloc.amount
    body: dict[str, Any] = {"allocations": per_provider}
    if held and version >= (1, 12):
        first = held[0]
        body["project_id"] = first.project_id
        body["user_id"] = first.user_id
        if version >= (1, 28):
            body["consumer_generation"] = first.consumer_generation
        if version >= (1, 38):
            body["consumer_type"] = first.consumer_type
    return JSONResponse(body)


@router.put("/allocations/{consumer_id}")
def set_allocations(request: Request, consumer_id: str) -> Response:
    authorize(request, "placement:allocations:update")
    raise LedgerManaged(f"Unable to set allocations for consumer {consumer_id}: {_LEDGER_OWNS}.")


@router.post("/allocations")
def post_allocations(request: Request) -> Response:
    authorize_since(request, (1, 13), "placement:allocations:manage", status=405)
    raise LedgerManaged(f"Unable to set allocations: {_LEDGER_OWNS}.")


@router.delete("/allocations/{consumer_id}")
def delete_allocations(request: Request, consumer_id: str) -> Response:
    authorize(request, "placement:allocations:delete")
    if not store_of(request).consumer_allocations(consumer_id):
        raise PlacementNotFound(f"No allocations for consumer '{consumer_id}'")
    raise LedgerManaged(f"Unable to delete allocations for consumer {consumer_id}: {_LEDGER_OWNS}.")


@router.post("/reshaper")
def reshape(request: Request) -> Response:
    authorize_since(request, (1, 30), "placement:reshaper:reshape")
    raise LedgerManaged(f"Unable to reshape: {_LEDGER_OWNS}.")


# -- usages -------------------------------------------------------------------------------------

_CONSUMER_TYPE = re.compile(r"^([A-Z0-9_]+|all|unknown)$")


@router.get("/usages")
def total_usages(request: Request) -> JSONResponse:
    authorize_since(request, (1, 9), "placement:usages")
    version = pv(request)
    allowed = {"project_id", "user_id"} | ({"consumer_type"} if version >= (1, 38) else set())
    check_params(request, allowed)
    project_id = one_param(request, "project_id")
    if not project_id:
        raise ApiError(
            400,
            "Invalid query string parameters: 'project_id' is a required property",
            code=_MISSING_VALUE,
        )
    user_id = one_param(request, "user_id")
    consumer_type = one_param(request, "consumer_type")
    if consumer_type is not None and not _CONSUMER_TYPE.match(consumer_type):
        raise ApiError(
            400,
            f"Invalid query string parameters: consumer_type {consumer_type!r} is not a "
            "consumer type, 'all' or 'unknown'",
            code=_BAD_VALUE,
        )
    held = store_of(request).project_allocations(project_id, user_id)
    if version < (1, 38):
        return JSONResponse({"usages": _sums(held)})
    return JSONResponse({"usages": _usages_by_type(held, consumer_type)})


def _sums(held: list[Allocation]) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for alloc in held:
        out[alloc.resource_class] += alloc.amount
    return dict(sorted(out.items()))


def _usages_by_type(held: list[Allocation], consumer_type: str | None) -> dict[str, Any]:
    """From 1.38: per consumer type, with how many consumers hold something."""
    groups: dict[str, list[Allocation]] = defaultdict(list)
    for alloc in held:
        if consumer_type in (None, alloc.consumer_type):
            groups[alloc.consumer_type].append(alloc)
        elif consumer_type == "all":
            groups["all"].append(alloc)
    # Every consumer here has a type, so 'unknown' finds none.
    return {
        kind: {"consumer_count": len({a.consumer_id for a in allocs}), **_sums(allocs)}
        for kind, allocs in sorted(groups.items())
    }


# -- allocation candidates ------------------------------------------------------------------

_GROUP_KEYS = ("resources", "required", "member_of", "in_tree")
_NUMBERED = re.compile(r"^[1-9][0-9]*$")
_NAMED = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def _candidate_params(version: Version) -> tuple[set[str], set[str]]:
    """Plain and suffixable query keys of GET /allocation_candidates at `version`."""
    plain = {"resources"}
    for minimum, key in (
        ((1, 16), "limit"),
        ((1, 17), "required"),
        ((1, 21), "member_of"),
        ((1, 25), "group_policy"),
        ((1, 31), "in_tree"),
        ((1, 35), "root_required"),
        ((1, 36), "same_subtree"),
    ):
        if version >= minimum:
            plain.add(key)
    suffixed = {k for k in _GROUP_KEYS if k in plain} if version >= (1, 25) else set()
    return plain, suffixed


def _split_key(key: str, version: Version) -> tuple[str, str] | None:
    """('resources', '1') for 'resources1'; None for keys of no request group."""
    for base in _GROUP_KEYS:
        if key == base:
            return base, ""
        if key.startswith(base):
            suffix = key[len(base) :]
            pattern = _NAMED if version >= (1, 33) else _NUMBERED
            if not pattern.match(suffix):
                raise ApiError(
                    400,
                    f"Invalid query string parameters: {key!r} has an invalid request group suffix",
                    code=_BAD_VALUE,
                )
            return base, suffix
    return None


def _groups(request: Request, store: PlacementStore) -> list[RequestGroup]:
    version = pv(request)
    keys: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for key in request.query_params:
        split = _split_key(key, version)
        if split is not None:
            base, suffix = split
            keys[suffix][base] = request.query_params.getlist(key)
    orphans = sorted(
        f"{base}{suffix}"
        for suffix, parts in keys.items()
        if suffix and "resources" not in parts
        for base in parts
    )
    if orphans:
        raise ApiError(
            400,
            "All traits parameters must be associated with resources. Found the following "
            f"orphaned traits keys: {', '.join(orphans)}",
            code=_BAD_VALUE,
        )
    if not any("resources" in parts for parts in keys.values()):
        message = (
            "There must be at least one resources or resources[$S] parameter."
            if version >= (1, 25)
            else "Invalid query string parameters: 'resources' is a required property"
        )
        raise ApiError(400, message, code=_MISSING_VALUE)
    groups = []
    for suffix, parts in sorted(keys.items()):
        resources = {}
        if "resources" in parts:
            if len(parts["resources"]) > 1:
                raise ApiError(
                    400,
                    f"Query parameter 'resources{suffix}' is allowed only once.",
                    code="placement.query.duplicate_key",
                )
            resources = parse_resources(parts["resources"][0], store, key=f"resources{suffix}")
        traits = parse_required(parts.get("required", []), version, store, key=f"required{suffix}")
        aggregates = parse_member_of(parts.get("member_of", []), version, key=f"member_of{suffix}")
        in_tree = parts.get("in_tree", [])
        if len(in_tree) > 1:
            raise ApiError(
                400,
                f"Query parameter 'in_tree{suffix}' is allowed only once.",
                code="placement.query.duplicate_key",
            )
        groups.append(
            RequestGroup(
                suffix=suffix,
                resources=resources,
                required=traits.required,
                forbidden=traits.forbidden,
                any_of=traits.any_of,
                member_of=aggregates.member_of,
                forbidden_aggregates=aggregates.forbidden,
                in_tree=valid_uuid(in_tree[0], f"in_tree{suffix}") if in_tree else None,
            )
        )
    return groups


def _limit(request: Request) -> int | None:
    text = one_param(request, "limit")
    if text is None:
        return None
    if not _NUMBERED.match(text):
        raise ApiError(
            400,
            f"Invalid query string parameters: limit must be a positive integer, got {text!r}",
            code=_BAD_VALUE,
        )
    return int(text)


def _group_policy(request: Request, groups: list[RequestGroup]) -> bool:
    """True for isolate; the policy is required once two numbered groups are given."""
    policy = one_param(request, "group_policy")
    if policy is None:
        if sum(1 for g in groups if g.suffix) > 1:
            raise ApiError(
                400,
                'The "group_policy" parameter is required when specifying more than one '
                '"resources{N}" parameter.',
                code=_MISSING_VALUE,
            )
        return False
    if policy not in ("none", "isolate"):
        raise ApiError(
            400,
            f"Invalid query string parameters: group_policy must be 'none' or 'isolate', "
            f"got {policy!r}",
            code=_BAD_VALUE,
        )
    return policy == "isolate"


def _same_subtree(request: Request, groups: list[RequestGroup]) -> None:
    """Every provider is a whole tree here, so same_subtree only has to name real groups."""
    known = {g.suffix for g in groups if g.suffix}
    for value in request.query_params.getlist("same_subtree"):
        for suffix in value.split(","):
            if suffix not in known:
                raise ApiError(
                    400,
                    f"Real suffixes should be specified in same_subtree: {suffix!r} names no "
                    "request group",
                    code=_BAD_VALUE,
                )


@router.get("/allocation_candidates")
def allocation_candidates(request: Request) -> JSONResponse:
    authorize_since(request, (1, 10), "placement:allocation_candidates:list")
    version = pv(request)
    plain, suffixed = _candidate_params(version)
    check_params(request, plain, suffixed=suffixed)
    store = store_of(request)
    groups = _groups(request, store)
    isolate = _group_policy(request, groups)
    limit = _limit(request)
    _same_subtree(request, groups)
    root = parse_required(
        request.query_params.getlist("root_required"), version, store, key="root_required"
    )
    if root.any_of:
        raise ApiError(400, "root_required does not take the in: form", code=_BAD_VALUE)
    providers = store.providers()
    picks = candidates(
        providers,
        store.traits_of(providers),
        store.aggregates_of(providers),
        groups,
        isolate=isolate,
        root_required=root.required,
        root_forbidden=root.forbidden,
    )
    if limit is not None:
        picks = picks[:limit]
    traits = store.traits_of([c.provider for c in picks]) if version >= (1, 17) else {}
    requested = {rc for g in groups for rc in g.resources}
    return JSONResponse(
        {
            "allocation_requests": [_request_view(c, version) for c in picks],
            "provider_summaries": {
                c.provider.uuid: _summary(c, version, requested, traits) for c in picks
            },
        }
    )


def _request_view(candidate: Candidate, version: Version) -> dict[str, Any]:
    uuid = candidate.provider.uuid
    resources = dict(sorted(candidate.resources.items()))
    if version < (1, 12):
        return {"allocations": [{"resource_provider": {"uuid": uuid}, "resources": resources}]}
    view: dict[str, Any] = {"allocations": {uuid: {"resources": resources}}}
    if version >= (1, 34):
        view["mappings"] = dict(candidate.mappings)
    return view


def _summary(
    candidate: Candidate,
    version: Version,
    requested: set[str],
    traits: dict[str, frozenset[str]],
) -> dict[str, Any]:
    provider = candidate.provider
    shown = {
        rc: inv for rc, inv in provider.inventories.items() if version >= (1, 27) or rc in requested
    }
    summary: dict[str, Any] = {
        "resources": {rc: {"capacity": inv.capacity, "used": inv.used} for rc, inv in shown.items()}
    }
    if version >= (1, 17):
        summary["traits"] = sorted(traits.get(provider.uuid, frozenset()))
    if version >= (1, 29):
        summary["parent_provider_uuid"] = None
        summary["root_provider_uuid"] = provider.uuid
    return summary
