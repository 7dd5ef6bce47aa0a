"""Resource providers (the ledger's hosts), their inventories, usages, aggregates, allocations."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from stowage.api.common import ApiError
from stowage.api.placement.microversion import pv
from stowage.api.placement.query import parse_member_of, parse_required, parse_resources
from stowage.api.placement.support import (
    authorize,
    authorize_since,
    body_of,
    check_params,
    one_param,
    provider_url,
    store_of,
    valid_uuid,
)
from stowage.api.responses import JSONResponse
from stowage.services.placement import (
    LEDGER_CLASSES,
    DuplicateName,
    GenerationConflict,
    Inventory,
    InventoryInUse,
    LedgerManaged,
    PlacementNotFound,
    PlacementStore,
    Provider,
    ProviderInUse,
)

__all__ = ["provider_view", "router"]

router = APIRouter()

_MAX_INT = 2147483647
_FLOAT_MAX = 3.40282e38
_INVENTORY_INTS = ("total", "reserved", "min_unit", "max_unit", "step_size")
_MANAGED = (
    "hosts register through the ledger and are always root providers; "
    "they cannot be created, re-parented, renamed or deleted through Placement"
)


def provider_view(request: Request, provider: Provider) -> dict[str, Any]:
    version = pv(request)
    url = provider_url(request, provider.uuid)
    rels = ["inventories", "usages"]
    if version >= (1, 1):
        rels.append("aggregates")
    if version >= (1, 6):
        rels.append("traits")
    if version >= (1, 11):
        rels.append("allocations")
    data: dict[str, Any] = {
        "uuid": provider.uuid,
        "name": provider.name,
        "generation": provider.generation,
        "links": [{"rel": "self", "href": url}]
        + [{"rel": rel, "href": f"{url}/{rel}"} for rel in rels],
    }
    if version >= (1, 14):
        data["parent_provider_uuid"] = None
        data["root_provider_uuid"] = provider.uuid
    return data


# -- providers ------------------------------------------------------------------------------


def _list_params(request: Request) -> set[str]:
    version = pv(request)
    allowed = {"name", "uuid"}
    for minimum, key in (
        ((1, 3), "member_of"),
        ((1, 4), "resources"),
        ((1, 14), "in_tree"),
        ((1, 18), "required"),
    ):
        if version >= minimum:
            allowed.add(key)
    return allowed


@router.get("/resource_providers")
def list_providers(request: Request) -> JSONResponse:
    authorize(request, "placement:resource_providers:list")
    check_params(request, _list_params(request))
    store = store_of(request)
    version = pv(request)
    uuid = one_param(request, "uuid")
    in_tree = one_param(request, "in_tree")
    resources_text = one_param(request, "resources")
    wanted = parse_resources(resources_text, store) if resources_text is not None else {}
    traits = parse_required(request.query_params.getlist("required"), version, store)
    aggregates = parse_member_of(request.query_params.getlist("member_of"), version)
    uuids: list[str] | None = None
    if uuid is not None:
        uuids = [valid_uuid(uuid, "uuid")]
    if in_tree is not None:
        tree = valid_uuid(in_tree, "in_tree")
        uuids = [tree] if uuids is None or tree in uuids else []
    providers = store.providers(uuids=uuids, name=one_param(request, "name"))
    providers = [
        p
        for p in providers
        if all(rc in p.inventories and p.inventories[rc].fits(n) for rc, n in wanted.items())
    ]
    if traits.names:
        have = store.traits_of(providers)
        providers = [
            p
            for p in providers
            if traits.required <= have[p.uuid]
            and not traits.forbidden & have[p.uuid]
            and all(group & have[p.uuid] for group in traits.any_of)
        ]
    if aggregates.member_of or aggregates.forbidden:
        member = store.aggregates_of(providers)
        providers = [
            p
            for p in providers
            if all(group & member[p.uuid] for group in aggregates.member_of)
            and not aggregates.forbidden & member[p.uuid]
        ]
    return JSONResponse({"resource_providers": [provider_view(request, p) for p in providers]})


@router.post("/resource_providers")
def create_provider(request: Request) -> Response:
    authorize(request, "placement:resource_providers:create")
    raise LedgerManaged(f"Unable to create resource provider: {_MANAGED}.")


@router.get("/resource_providers/{rp_uuid}")
def show_provider(request: Request, rp_uuid: str) -> JSONResponse:
    authorize(request, "placement:resource_providers:show")
    return JSONResponse(provider_view(request, store_of(request).provider(rp_uuid)))


@router.put("/resource_providers/{rp_uuid}")
async def update_provider(request: Request, rp_uuid: str) -> JSONResponse:
    authorize(request, "placement:resource_providers:update")
    store = store_of(request)
    provider = await run_in_threadpool(store.provider, rp_uuid)
    body = await body_of(request)
    allowed = {"name", "parent_provider_uuid"} if pv(request) >= (1, 14) else {"name"}
    _object(body, "the request body", allowed, required=("name",))
    name = body["name"]
    if not isinstance(name, str) or not 1 <= len(name) <= 200:
        raise ApiError(400, "JSON does not validate: 'name' must be a string of 1 to 200 chars")
    parent = body.get("parent_provider_uuid")
    if name != provider.name:
        if await run_in_threadpool(store.providers, name=name):
            raise DuplicateName(f"Conflicting resource provider {name} already exists.")
        raise LedgerManaged(f"Unable to save resource provider {rp_uuid}: {_MANAGED}.")
    if parent is not None:
        raise LedgerManaged(f"Unable to save resource provider {rp_uuid}: {_MANAGED}.")
    return JSONResponse(provider_view(request, provider))


@router.delete("/resource_providers/{rp_uuid}")
def delete_provider(request: Request, rp_uuid: str) -> Response:
    authorize(request, "placement:resource_providers:delete")
    store = store_of(request)
    try:
        provider, held = store.provider_allocations(rp_uuid)
    except PlacementNotFound:
        raise PlacementNotFound(
            f"No resource provider with uuid {rp_uuid} found for delete"
        ) from None
    if held:
        raise ProviderInUse(
            f"Unable to delete resource provider {rp_uuid}: Resource provider has "
            f"allocations of {len({a.consumer_id for a in held})} consumer(s)."
        )
    raise LedgerManaged(f"Unable to delete resource provider {provider.uuid}: {_MANAGED}.")


# -- inventories ------------------------------------------------------------------------------


def _object(
    value: Any, where: str, allowed: set[str], *, required: tuple[str, ...] = ()
) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ApiError(400, f"JSON does not validate: {where} must be an object")
    extra = sorted(set(value) - allowed)
    if extra:
        raise ApiError(
            400,
            f"JSON does not validate: Additional properties are not allowed in {where} "
            f"({', '.join(repr(e) for e in extra)} was unexpected)",
        )
    for key in required:
        if key not in value:
            raise ApiError(400, f"JSON does not validate: '{key}' is a required property")
    return value


def _integer(value: Any, field: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"JSON does not validate: '{field}' must be an integer")
    if not minimum <= value <= _MAX_INT:
        raise ApiError(
            400, f"JSON does not validate: '{field}' must be between {minimum} and {_MAX_INT}"
        )
    return value


def _inventory(rc: str, raw: Any, *, extra: tuple[str, ...] = ()) -> Inventory:
    """One inventory from a body, with placement's defaults for what it leaves out."""
    where = f"inventory of {rc}"
    data = _object(raw, where, {*_INVENTORY_INTS, "allocation_ratio", *extra}, required=("total",))
    ints = {
        key: _integer(data[key], key, 0 if key == "reserved" else 1)
        for key in _INVENTORY_INTS
        if key in data
    }
    ratio = data.get("allocation_ratio", 1.0)
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not math.isfinite(ratio):
        raise ApiError(400, "JSON does not validate: 'allocation_ratio' must be a number")
    if not 0 <= ratio <= _FLOAT_MAX:
        raise ApiError(400, "JSON does not validate: 'allocation_ratio' is out of range")
    return Inventory(resource_class=rc, allocation_ratio=float(ratio), **ints)


def _generation(data: dict[str, Any]) -> int:
    value = data["resource_provider_generation"]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(
            400, "JSON does not validate: 'resource_provider_generation' must be an integer"
        )
    return value


def _check_inventories(
    request: Request, store: PlacementStore, rp_uuid: str, wanted: Mapping[str, Inventory]
) -> None:
    """Classes the ledger can account for, and a capacity placement accepts."""
    reserved_may_equal_total = pv(request) >= (1, 26)
    for rc, inv in sorted(wanted.items()):
        if rc not in LEDGER_CLASSES:
            if store.resource_class_exists(rc):
                raise ApiError(
                    400,
                    f"Unable to update inventory for resource provider {rp_uuid}: resource "
                    f"class {rc} cannot hold inventory here; the ledger accounts for "
                    f"{', '.join(sorted(LEDGER_CLASSES))} only.",
                )
            raise ApiError(
                400,
                f"Unknown resource class in inventory for resource provider {rp_uuid}: "
                f"No such resource class {rc}.",
            )
        if inv.capacity < 0 or (inv.capacity == 0 and not reserved_may_equal_total):
            relation = "greater than" if reserved_may_equal_total else "greater than or equal to"
            raise ApiError(
                400,
                f"Unable to update inventory for resource provider {rp_uuid}: Invalid "
                f"inventory for '{rc}' on resource provider '{rp_uuid}'. The reserved value "
                f"is {relation} total.",
            )


def _inventories_view(provider: Provider) -> dict[str, Any]:
    return {
        "resource_provider_generation": provider.generation,
        "inventories": {rc: inv.view() for rc, inv in provider.inventories.items()},
    }


def _one_view(provider: Provider, rc: str) -> dict[str, Any]:
    return {**provider.inventories[rc].view(), "resource_provider_generation": provider.generation}


@router.get("/resource_providers/{rp_uuid}/inventories")
def list_inventories(request: Request, rp_uuid: str) -> JSONResponse:
    authorize(request, "placement:resource_providers:inventories:list")
    return JSONResponse(_inventories_view(store_of(request).provider(rp_uuid)))


@router.get("/resource_providers/{rp_uuid}/inventories/{rc}")
def show_inventory(request: Request, rp_uuid: str, rc: str) -> JSONResponse:
    authorize(request, "placement:resource_providers:inventories:show")
    provider = store_of(request).provider(rp_uuid)
    if rc not in provider.inventories:
        raise PlacementNotFound(f"No inventory of class {rc} for {rp_uuid}")
    return JSONResponse(_one_view(provider, rc))


@router.put("/resource_providers/{rp_uuid}/inventories")
async def set_inventories(request: Request, rp_uuid: str) -> JSONResponse:
    authorize(request, "placement:resource_providers:inventories:update")
    store = store_of(request)
    await run_in_threadpool(store.provider, rp_uuid)
    body = _object(
        await body_of(request),
        "the request body",
        {"resource_provider_generation", "inventories"},
        required=("resource_provider_generation", "inventories"),
    )
    generation = _generation(body)
    raw = body["inventories"]
    if not isinstance(raw, dict):
        raise ApiError(400, "JSON does not validate: 'inventories' must be an object")
    wanted = {rc: _inventory(rc, item) for rc, item in raw.items()}
    await run_in_threadpool(_check_inventories, request, store, rp_uuid, wanted)
    provider = await run_in_threadpool(
        store.write_inventories, rp_uuid, generation, lambda _current: wanted
    )
    return JSONResponse(_inventories_view(provider))


@router.post("/resource_providers/{rp_uuid}/inventories")
async def create_inventory(request: Request, rp_uuid: str) -> JSONResponse:
    authorize(request, "placement:resource_providers:inventories:create")
    store = store_of(request)
    await run_in_threadpool(store.provider, rp_uuid)
    body = await body_of(request)
    if not isinstance(body, dict):
        raise ApiError(400, "JSON does not validate: the request body must be an object")
    rc = body.get("resource_class")
    if not isinstance(rc, str) or not rc:
        raise ApiError(400, "JSON does not validate: 'resource_class' is a required property")
    inventory = _inventory(rc, body, extra=("resource_class",))
    await run_in_threadpool(_check_inventories, request, store, rp_uuid, {rc: inventory})

    def add(current: Provider) -> dict[str, Inventory]:
        if rc in current.inventories:
            raise GenerationConflict(
                f"Update conflict: Inventory for {rc} on resource provider {rp_uuid} "
                "already exists."
            )
        return {**current.inventories, rc: inventory}

    provider = await run_in_threadpool(store.write_inventories, rp_uuid, None, add)
    return JSONResponse(
        _one_view(provider, rc),
        status_code=201,
        headers={"Location": f"{provider_url(request, rp_uuid)}/inventories/{rc}"},
    )


@router.put("/resource_providers/{rp_uuid}/inventories/{rc}")
async def update_inventory(request: Request, rp_uuid: str, rc: str) -> JSONResponse:
    authorize(request, "placement:resource_providers:inventories:update")
    store = store_of(request)
    await run_in_threadpool(store.provider, rp_uuid)
    body = await body_of(request)
    data = _object(
        body,
        "the request body",
        {*_INVENTORY_INTS, "allocation_ratio", "resource_provider_generation"},
        required=("resource_provider_generation", "total"),
    )
    generation = _generation(data)
    inventory = _inventory(rc, data, extra=("resource_provider_generation",))
    await run_in_threadpool(_check_inventories, request, store, rp_uuid, {rc: inventory})

    def change(current: Provider) -> dict[str, Inventory]:
        if rc not in current.inventories:
            raise ApiError(
                400,
                f"No inventory record with resource class for resource provider {rp_uuid}: "
                f"No inventory of class {rc} found",
            )
        return {**current.inventories, rc: inventory}

    provider = await run_in_threadpool(store.write_inventories, rp_uuid, generation, change)
    return JSONResponse(_one_view(provider, rc))


@router.delete("/resource_providers/{rp_uuid}/inventories/{rc}")
def delete_inventory(request: Request, rp_uuid: str, rc: str) -> Response:
    authorize(request, "placement:resource_providers:inventories:delete")
    store = store_of(request)

    def drop(current: Provider) -> dict[str, Inventory]:
        if rc not in current.inventories:
            raise PlacementNotFound(
                f"No inventory of class {rc} found for delete: resource provider {rp_uuid} "
                f"has no inventory of class {rc}"
            )
        held = current.inventories[rc]
        if held.used:
            raise InventoryInUse(
                f"Unable to delete inventory of class {rc}: Inventory for '{rc}' on "
                f"resource provider '{rp_uuid}' in use."
            )
        return {k: v for k, v in current.inventories.items() if k != rc}

    store.write_inventories(rp_uuid, None, drop)
    return Response(status_code=204)


@router.delete("/resource_providers/{rp_uuid}/inventories")
def delete_inventories(request: Request, rp_uuid: str) -> Response:
    authorize_since(request, (1, 5), "placement:resource_providers:inventories:delete", status=405)
    store_of(request).write_inventories(rp_uuid, None, lambda _current: {})
    return Response(status_code=204)


# -- usages, aggregates, allocations ------------------------------------------------------------


@router.get("/resource_providers/{rp_uuid}/usages")
def provider_usages(request: Request, rp_uuid: str) -> JSONResponse:
    authorize(request, "placement:resource_providers:usages")
    provider = store_of(request).provider(rp_uuid)
    return JSONResponse(
        {
            "resource_provider_generation": provider.generation,
            "usages": {rc: inv.used for rc, inv in provider.inventories.items()},
        }
    )


@router.get("/resource_providers/{rp_uuid}/aggregates")
def provider_aggregates(request: Request, rp_uuid: str) -> JSONResponse:
    authorize_since(request, (1, 1), "placement:resource_providers:aggregates:list")
    store = store_of(request)
    provider = store.provider(rp_uuid)
    body: dict[str, Any] = {"aggregates": sorted(store.aggregates_of([provider])[provider.uuid])}
    if pv(request) >= (1, 19):
        body["resource_provider_generation"] = provider.generation
    return JSONResponse(body)


@router.put("/resource_providers/{rp_uuid}/aggregates")
def set_provider_aggregates(request: Request, rp_uuid: str) -> Response:
    authorize_since(request, (1, 1), "placement:resource_providers:aggregates:update")
    store_of(request).provider(rp_uuid)
    raise LedgerManaged(
        "A provider's aggregates are its host's compute aggregates: change them with "
        "`openstack aggregate add host` / `remove host`."
    )


@router.get("/resource_providers/{rp_uuid}/allocations")
def provider_allocations(request: Request, rp_uuid: str) -> JSONResponse:
    authorize(request, "placement:resource_providers:allocations:list")
    try:
        provider, held = store_of(request).provider_allocations(rp_uuid)
    except PlacementNotFound:
        raise PlacementNotFound(f"Resource provider '{rp_uuid}' not found") from None
    with_generation = pv(request) >= (1, 28)
    out: dict[str, dict[str, Any]] = {}
    for alloc in held:
        entry = out.setdefault(alloc.consumer_id, {"resources": {}})
        entry["resources"][alloc.resource_class] = alloc.amount
        if with_generation:
            entry["consumer_generation"] = alloc.consumer_generation
    return JSONResponse({"allocations": out, "resource_provider_generation": provider.generation})
