"""Image v2 metadata definitions (`/v2/metadefs`): namespaces, their objects, properties,
tags and resource-type associations, the resource types, and their JSON schemas."""

from __future__ import annotations

from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from stowage.api.auth import cloud_of, require_context
from stowage.api.common import ApiError, Context, json_body, parse_limit
from stowage.api.image.images import LIMIT_DEFAULT, LIMIT_MAX, ImageRoute
from stowage.api.image.metadef_schemas import METADEF_SCHEMAS
from stowage.api.responses import JSONResponse
from stowage.services import metadefs as svc

__all__ = ["router"]

router = APIRouter(route_class=ImageRoute)
# Glance's metadef policies are checked by the service (reads: anyone who may see the
# namespace; writes: admin), so a reader's write is a 403 there too.
Caller = Annotated[Context, Depends(require_context)]
NAMESPACES = "/metadefs/namespaces"
NAMESPACE = "/metadefs/namespaces/{namespace}"


def _json(body: Any, status: int = 200) -> JSONResponse:
    return JSONResponse(body, status_code=status)


async def _object_body(request: Request) -> dict[str, Any]:
    body = await json_body(request)
    if not isinstance(body, dict):
        raise ApiError(400, "Request body must be a JSON object.")
    return body


# -- namespaces -------------------------------------------------------------------------------


@router.get(NAMESPACES)
async def list_namespaces(request: Request, ctx: Caller) -> JSONResponse:
    params = request.query_params
    types = params.get("resource_types")
    limit = parse_limit(params.get("limit"), maximum=LIMIT_MAX)
    query = svc.NamespaceQuery(
        visibility=params.get("visibility"),
        resource_types=[t.strip() for t in types.split(",") if t.strip()] if types else None,
        sort_key=params.get("sort_key", "created_at"),
        sort_dir=params.get("sort_dir", "desc"),
        limit=LIMIT_DEFAULT if limit is None else limit,
        marker=params.get("marker"),
    )
    page, more = svc.list_namespaces(cloud_of(request), ctx, query)
    body: dict[str, Any] = {
        "namespaces": [svc.render_namespace(ns, contents=False) for ns in page],
        "first": f"/v2{NAMESPACES}",
        "schema": "/v2/schemas/metadefs/namespaces",
    }
    if more:
        following = [(k, v) for k, v in params.multi_items() if k != "marker"]
        following.append(("marker", page[-1]["namespace"]))
        body["next"] = f"/v2{NAMESPACES}?{urlencode(following)}"
    return _json(body)


@router.post(NAMESPACES)
async def create_namespace(request: Request, ctx: Caller) -> JSONResponse:
    body = svc.create_namespace(cloud_of(request), ctx, await _object_body(request))
    return _json(svc.render_namespace(body, contents=True), 201)


@router.get(NAMESPACE)
async def show_namespace(namespace: str, request: Request, ctx: Caller) -> JSONResponse:
    body = svc.get_namespace(cloud_of(request), ctx, namespace)
    resource_type = request.query_params.get("resource_type")
    return _json(svc.render_namespace(body, contents=True, resource_type=resource_type))


@router.put(NAMESPACE)
async def update_namespace(namespace: str, request: Request, ctx: Caller) -> JSONResponse:
    cloud = cloud_of(request)
    body = svc.update_namespace(cloud, ctx, namespace, await _object_body(request))
    return _json(svc.render_namespace(body, contents=False))


@router.delete(NAMESPACE)
async def delete_namespace(namespace: str, request: Request, ctx: Caller) -> Response:
    svc.delete_namespace(cloud_of(request), ctx, namespace)
    return Response(status_code=204)


# -- objects ----------------------------------------------------------------------------------


@router.get(NAMESPACE + "/objects")
async def list_objects(namespace: str, request: Request, ctx: Caller) -> JSONResponse:
    body = svc.get_namespace(cloud_of(request), ctx, namespace)
    objects = [svc.render_object(namespace, k, v) for k, v in body["objects"].items()]
    return _json({"objects": objects, "schema": "v2/schemas/metadefs/objects"})


@router.post(NAMESPACE + "/objects")
async def create_object(namespace: str, request: Request, ctx: Caller) -> JSONResponse:
    cloud = cloud_of(request)
    return _json(svc.add_object(cloud, ctx, namespace, await _object_body(request)), 201)


@router.get(NAMESPACE + "/objects/{name}")
async def show_object(namespace: str, name: str, request: Request, ctx: Caller) -> JSONResponse:
    found = svc.get_part(cloud_of(request), ctx, namespace, "objects", name)
    return _json(svc.render_object(namespace, name, found))


@router.put(NAMESPACE + "/objects/{name}")
async def update_object(namespace: str, name: str, request: Request, ctx: Caller) -> JSONResponse:
    cloud = cloud_of(request)
    return _json(svc.update_object(cloud, ctx, namespace, name, await _object_body(request)))


@router.delete(NAMESPACE + "/objects/{name}")
async def delete_object(namespace: str, name: str, request: Request, ctx: Caller) -> Response:
    svc.delete_namespace_part(cloud_of(request), ctx, namespace, "objects", name)
    return Response(status_code=204)


# -- properties -------------------------------------------------------------------------------


@router.get(NAMESPACE + "/properties")
async def list_properties(namespace: str, request: Request, ctx: Caller) -> JSONResponse:
    body = svc.get_namespace(cloud_of(request), ctx, namespace)
    properties = {k: svc.render_property(k, v) for k, v in body["properties"].items()}
    return _json({"properties": properties})


@router.post(NAMESPACE + "/properties")
async def create_property(namespace: str, request: Request, ctx: Caller) -> JSONResponse:
    cloud = cloud_of(request)
    return _json(svc.add_property(cloud, ctx, namespace, await _object_body(request)), 201)


@router.get(NAMESPACE + "/properties/{name}")
async def show_property(namespace: str, name: str, request: Request, ctx: Caller) -> JSONResponse:
    found = svc.get_part(cloud_of(request), ctx, namespace, "properties", name)
    return _json(svc.render_property(name, found))


@router.put(NAMESPACE + "/properties/{name}")
async def update_property(namespace: str, name: str, request: Request, ctx: Caller) -> JSONResponse:
    cloud = cloud_of(request)
    return _json(svc.update_property(cloud, ctx, namespace, name, await _object_body(request)))


@router.delete(NAMESPACE + "/properties/{name}")
async def delete_property(namespace: str, name: str, request: Request, ctx: Caller) -> Response:
    svc.delete_namespace_part(cloud_of(request), ctx, namespace, "properties", name)
    return Response(status_code=204)


# -- tags -------------------------------------------------------------------------------------


@router.get(NAMESPACE + "/tags")
async def list_tags(namespace: str, request: Request, ctx: Caller) -> JSONResponse:
    body = svc.get_namespace(cloud_of(request), ctx, namespace)
    return _json({"tags": [svc.render_tag(k, v) for k, v in body["tags"].items()]})


@router.post(NAMESPACE + "/tags")
async def create_tags(namespace: str, request: Request, ctx: Caller) -> JSONResponse:
    append = request.headers.get("x-openstack-append", "").lower() in ("true", "1", "yes")
    body = await _object_body(request)
    tags = svc.replace_tags(cloud_of(request), ctx, namespace, body, append=append)
    return _json({"tags": tags}, 201)


@router.delete(NAMESPACE + "/tags")
async def delete_tags(namespace: str, request: Request, ctx: Caller) -> Response:
    svc.delete_namespace_part(cloud_of(request), ctx, namespace, "tags", None)
    return Response(status_code=204)


@router.post(NAMESPACE + "/tags/{name}")
async def create_tag(namespace: str, name: str, request: Request, ctx: Caller) -> JSONResponse:
    return _json(svc.add_tag(cloud_of(request), ctx, namespace, name), 201)


@router.get(NAMESPACE + "/tags/{name}")
async def show_tag(namespace: str, name: str, request: Request, ctx: Caller) -> JSONResponse:
    found = svc.get_part(cloud_of(request), ctx, namespace, "tags", name)
    return _json(svc.render_tag(name, found))


@router.put(NAMESPACE + "/tags/{name}")
async def update_tag(namespace: str, name: str, request: Request, ctx: Caller) -> JSONResponse:
    cloud = cloud_of(request)
    return _json(svc.update_tag(cloud, ctx, namespace, name, await _object_body(request)))


@router.delete(NAMESPACE + "/tags/{name}")
async def delete_tag(namespace: str, name: str, request: Request, ctx: Caller) -> Response:
    svc.delete_namespace_part(cloud_of(request), ctx, namespace, "tags", name)
    return Response(status_code=204)


# -- resource types ---------------------------------------------------------------------------


@router.get("/metadefs/resource_types")
async def list_resource_types(request: Request, ctx: Caller) -> JSONResponse:
    return _json({"resource_types": svc.list_resource_types(cloud_of(request))})


@router.get(NAMESPACE + "/resource_types")
async def list_associations(namespace: str, request: Request, ctx: Caller) -> JSONResponse:
    body = svc.get_namespace(cloud_of(request), ctx, namespace)
    associations = body["resource_type_associations"]
    return _json(
        {
            "resource_type_associations": [
                svc.render_association(k, v) for k, v in associations.items()
            ]
        }
    )


@router.post(NAMESPACE + "/resource_types")
async def associate(namespace: str, request: Request, ctx: Caller) -> JSONResponse:
    cloud = cloud_of(request)
    return _json(svc.associate(cloud, ctx, namespace, await _object_body(request)), 201)


@router.delete(NAMESPACE + "/resource_types/{name}")
async def dissociate(namespace: str, name: str, request: Request, ctx: Caller) -> Response:
    svc.dissociate(cloud_of(request), ctx, namespace, name)
    return Response(status_code=204)


# -- schemas ----------------------------------------------------------------------------------


@router.get("/schemas/metadefs/{name}")
async def metadef_schema(name: str, ctx: Caller) -> JSONResponse:
    schema = METADEF_SCHEMAS.get(name)
    if schema is None:
        raise ApiError(404, f"No schema metadefs/{name}.")
    return _json(schema())
