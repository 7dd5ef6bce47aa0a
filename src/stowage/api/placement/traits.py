"""Traits, a provider's traits, and resource classes."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from stowage.api.common import ApiError
from stowage.api.placement.microversion import pv
from stowage.api.placement.support import (
    authorize_since,
    body_of,
    check_params,
    one_param,
    prefix,
    store_of,
)
from stowage.api.responses import JSONResponse
from stowage.services.placement import (
    GenerationConflict,
    PlacementNotFound,
    Provider,
    valid_custom_name,
)

__all__ = ["router"]

router = APIRouter()

_INVALID_TRAIT = (
    "The trait is invalid. A valid trait must be no longer than 255 characters, start with "
    'the prefix "CUSTOM_" and use following characters: "A"-"Z", "0"-"9" and "_"'
)
_INVALID_CLASS = (
    "JSON does not validate: 'name' must start with CUSTOM_ and use only the characters "
    '"A"-"Z", "0"-"9" and "_", in at most 255 characters'
)


# -- traits -----------------------------------------------------------------------------------


@router.get("/traits")
def list_traits(request: Request) -> JSONResponse:
    authorize_since(request, (1, 6), "placement:traits:list")
    check_params(request, {"name", "associated"})
    store = store_of(request)
    names = store.all_traits()
    name = one_param(request, "name")
    if name is not None:
        op, sep, value = name.partition(":")
        if not sep or op not in ("in", "startswith"):
            raise ApiError(
                400,
                "Badly formatted name parameter. Expected name query string parameter in "
                f'form: ?name=[in|startswith]:[name1,name2|prefix]. Got: "{name}"',
            )
        if op == "in":
            wanted = set(value.split(","))
            names = [n for n in names if n in wanted]
        else:
            names = [n for n in names if n.startswith(value)]
    associated = one_param(request, "associated")
    if associated is not None:
        if associated.lower() not in ("true", "false"):
            raise ApiError(400, 'The query parameter "associated" only accepts "true" or "false"')
        used = store.associated_traits()
        keep = associated.lower() == "true"
        names = [n for n in names if (n in used) == keep]
    return JSONResponse({"traits": names})


@router.get("/traits/{name}")
def show_trait(request: Request, name: str) -> Response:
    authorize_since(request, (1, 6), "placement:traits:show")
    if not store_of(request).trait_exists(name):
        raise PlacementNotFound(f"No such trait(s): {name}.")
    return Response(status_code=204)


@router.put("/traits/{name}")
def put_trait(request: Request, name: str) -> Response:
    authorize_since(request, (1, 6), "placement:traits:update")
    if not valid_custom_name(name):
        raise ApiError(400, _INVALID_TRAIT)
    created = store_of(request).create_trait(name)
    return Response(
        status_code=201 if created else 204,
        headers={"Location": f"{prefix(request)}/traits/{name}"},
    )


@router.delete("/traits/{name}")
def delete_trait(request: Request, name: str) -> Response:
    authorize_since(request, (1, 6), "placement:traits:delete")
    store_of(request).delete_trait(name)
    return Response(status_code=204)


# -- a provider's traits --------------------------------------------------------------------


def _provider_traits(request: Request, provider: Provider) -> dict[str, Any]:
    traits = store_of(request).traits_of([provider])[provider.uuid]
    return {"traits": sorted(traits), "resource_provider_generation": provider.generation}


@router.get("/resource_providers/{rp_uuid}/traits")
def list_provider_traits(request: Request, rp_uuid: str) -> JSONResponse:
    authorize_since(request, (1, 6), "placement:resource_providers:traits:list")
    try:
        provider = store_of(request).provider(rp_uuid)
    except PlacementNotFound:
        raise PlacementNotFound(f"No resource provider with uuid {rp_uuid} found") from None
    return JSONResponse(_provider_traits(request, provider))


@router.put("/resource_providers/{rp_uuid}/traits")
async def set_provider_traits(request: Request, rp_uuid: str) -> JSONResponse:
    authorize_since(request, (1, 6), "placement:resource_providers:traits:update")
    store = store_of(request)
    body = await body_of(request)
    if not isinstance(body, dict):
        raise ApiError(400, "JSON does not validate: the request body must be an object")
    extra = sorted(set(body) - {"traits", "resource_provider_generation"})
    if extra:
        raise ApiError(
            400,
            "JSON does not validate: Additional properties are not allowed "
            f"({', '.join(repr(e) for e in extra)} was unexpected)",
        )
    for key in ("traits", "resource_provider_generation"):
        if key not in body:
            raise ApiError(400, f"JSON does not validate: '{key}' is a required property")
    traits, generation = body["traits"], body["resource_provider_generation"]
    if not isinstance(traits, list) or not all(isinstance(t, str) and t for t in traits):
        raise ApiError(400, "JSON does not validate: 'traits' must be a list of trait names")
    if len(set(traits)) != len(traits):
        raise ApiError(400, "JSON does not validate: 'traits' has non-unique elements")
    if isinstance(generation, bool) or not isinstance(generation, int):
        raise ApiError(
            400, "JSON does not validate: 'resource_provider_generation' must be an integer"
        )
    current = await run_in_threadpool(store.provider, rp_uuid)
    if current.generation != generation:
        raise GenerationConflict(
            "Resource provider's generation already changed. Please update the generation "
            "and try again."
        )
    unknown = await run_in_threadpool(store.unknown_traits, traits)
    if unknown:
        raise ApiError(400, f"No such trait(s): {', '.join(unknown)}")
    provider = await run_in_threadpool(store.set_traits, rp_uuid, generation, traits)
    return JSONResponse(await run_in_threadpool(_provider_traits, request, provider))


@router.delete("/resource_providers/{rp_uuid}/traits")
def delete_provider_traits(request: Request, rp_uuid: str) -> Response:
    authorize_since(request, (1, 6), "placement:resource_providers:traits:delete")
    store = store_of(request)
    store.provider(rp_uuid)
    store.set_traits(rp_uuid, None, [])
    return Response(status_code=204)


# -- resource classes -----------------------------------------------------------------------


def _class_view(request: Request, name: str) -> dict[str, Any]:
    href = f"{prefix(request)}/resource_classes/{name}"
    return {"name": name, "links": [{"rel": "self", "href": href}]}


@router.get("/resource_classes")
def list_resource_classes(request: Request) -> JSONResponse:
    authorize_since(request, (1, 2), "placement:resource_classes:list")
    names = store_of(request).resource_classes()
    return JSONResponse({"resource_classes": [_class_view(request, n) for n in names]})


@router.get("/resource_classes/{name}")
def show_resource_class(request: Request, name: str) -> JSONResponse:
    authorize_since(request, (1, 2), "placement:resource_classes:show")
    if not store_of(request).resource_class_exists(name):
        raise PlacementNotFound(f"No such resource class {name}.")
    return JSONResponse(_class_view(request, name))


@router.post("/resource_classes")
async def create_resource_class(request: Request) -> Response:
    authorize_since(request, (1, 2), "placement:resource_classes:create")
    body = await body_of(request)
    if not isinstance(body, dict) or "name" not in body:
        raise ApiError(400, "JSON does not validate: 'name' is a required property")
    if set(body) != {"name"}:
        raise ApiError(400, "JSON does not validate: only 'name' is allowed in the body")
    name = body["name"]
    if not isinstance(name, str) or not valid_custom_name(name):
        raise ApiError(400, _INVALID_CLASS)
    await run_in_threadpool(store_of(request).create_resource_class, name, exist_ok=False)
    return Response(
        status_code=201, headers={"Location": f"{prefix(request)}/resource_classes/{name}"}
    )


@router.put("/resource_classes/{name}")
async def put_resource_class(request: Request, name: str) -> Response:
    authorize_since(request, (1, 2), "placement:resource_classes:update")
    store = store_of(request)
    location = {"Location": f"{prefix(request)}/resource_classes/{name}"}
    if pv(request) >= (1, 7):
        if not valid_custom_name(name):
            raise ApiError(400, _INVALID_CLASS)
        created = await run_in_threadpool(store.create_resource_class, name, exist_ok=True)
        return Response(status_code=201 if created else 204, headers=location)
    # Below 1.7, PUT renames a custom class.
    body = await body_of(request)
    if not isinstance(body, dict) or set(body) != {"name"}:
        raise ApiError(400, "JSON does not validate: 'name' is a required property")
    new_name = body["name"]
    if not isinstance(new_name, str) or not valid_custom_name(new_name):
        raise ApiError(400, _INVALID_CLASS)
    await run_in_threadpool(store.rename_resource_class, name, new_name)
    return JSONResponse(_class_view(request, new_name))


@router.delete("/resource_classes/{name}")
def delete_resource_class(request: Request, name: str) -> Response:
    authorize_since(request, (1, 2), "placement:resource_classes:delete")
    store_of(request).delete_resource_class(name)
    return Response(status_code=204)
