"""Regions, services and endpoints (Keystone's catalog API) and the catalog of a token."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from stowage.api.auth import cloud_of, require_context
from stowage.api.identity.policy import admin, reader_of_all
from stowage.api.identity.views import base_of, collection, envelope, keep
from stowage.api.responses import JSONResponse
from stowage.ledger.objects import Document
from stowage.services import catalog as svc

__all__ = ["router"]

router = APIRouter()
_GET_HEAD = ["GET", "HEAD"]
_HIDDEN = {"url_path"}


def _extras(doc: Document) -> dict[str, Any]:
    return {k: v for k, v in doc.body.items() if k not in _HIDDEN}


def _region_view(request: Request, doc: Document) -> dict[str, Any]:
    return {
        **_extras(doc),
        "id": doc.id,
        "description": doc.body.get("description") or "",
        "parent_region_id": doc.body.get("parent_region_id"),
        "links": {"self": f"{base_of(request)}/regions/{doc.id}"},
    }


def _service_view(request: Request, doc: Document) -> dict[str, Any]:
    return {
        **_extras(doc),
        "id": doc.id,
        "enabled": bool(doc.body.get("enabled", True)),
        "links": {"self": f"{base_of(request)}/services/{doc.id}"},
    }


def _endpoint_view(request: Request, doc: Document) -> dict[str, Any]:
    return {
        **_extras(doc),
        "id": doc.id,
        "region": doc.body.get("region_id"),
        "region_id": doc.body.get("region_id"),
        "url": svc.endpoint_url(cloud_of(request), doc),
        "enabled": bool(doc.body.get("enabled", True)),
        "links": {"self": f"{base_of(request)}/endpoints/{doc.id}"},
    }


_View = Callable[[Request, Document], dict[str, Any]]


def _page(request: Request, key: str, docs: list[Document], view: _View) -> JSONResponse:
    return JSONResponse(collection(request, key, docs, lambda d: view(request, d)))


# -- regions: anyone authenticated reads them (Keystone's get_region and list_regions) -------


@router.get("/v3/regions")
async def list_regions(request: Request) -> JSONResponse:
    require_context(request)
    docs = [
        d
        for d in svc.regions(cloud_of(request))
        if keep(request, d, {"parent_region_id": "parent_region_id"})
    ]
    return _page(request, "regions", docs, _region_view)


@router.post("/v3/regions")
async def create_region(request: Request) -> JSONResponse:
    admin(request, "create_region")
    doc = svc.create_region(cloud_of(request), await envelope(request, "region"))
    return JSONResponse({"region": _region_view(request, doc)}, status_code=201)


@router.put("/v3/regions/{region_id}")
async def create_region_with_id(request: Request, region_id: str) -> JSONResponse:
    admin(request, "create_region")
    doc = svc.create_region(cloud_of(request), await envelope(request, "region"), region_id)
    return JSONResponse({"region": _region_view(request, doc)}, status_code=201)


@router.api_route("/v3/regions/{region_id}", methods=_GET_HEAD)
async def show_region(request: Request, region_id: str) -> JSONResponse:
    require_context(request)
    doc = svc.region(cloud_of(request), region_id)
    return JSONResponse({"region": _region_view(request, doc)})


@router.patch("/v3/regions/{region_id}")
async def update_region(request: Request, region_id: str) -> JSONResponse:
    admin(request, "update_region")
    changes = await envelope(request, "region")
    doc = svc.update_region(cloud_of(request), region_id, changes)
    return JSONResponse({"region": _region_view(request, doc)})


@router.delete("/v3/regions/{region_id}")
async def delete_region(request: Request, region_id: str) -> Response:
    admin(request, "delete_region")
    svc.delete_region(cloud_of(request), region_id)
    return Response(status_code=204)


# -- services -------------------------------------------------------------------------------


@router.get("/v3/services")
async def list_services(request: Request) -> JSONResponse:
    reader_of_all(request, "list_services")
    docs = [
        d
        for d in svc.services(cloud_of(request))
        if keep(request, d, {"type": "type", "name": "name"})
    ]
    return _page(request, "services", docs, _service_view)


@router.post("/v3/services")
async def create_service(request: Request) -> JSONResponse:
    admin(request, "create_service")
    doc = svc.create_service(cloud_of(request), await envelope(request, "service"))
    return JSONResponse({"service": _service_view(request, doc)}, status_code=201)


@router.api_route("/v3/services/{service_id}", methods=_GET_HEAD)
async def show_service(request: Request, service_id: str) -> JSONResponse:
    reader_of_all(request, "get_service")
    doc = svc.service(cloud_of(request), service_id)
    return JSONResponse({"service": _service_view(request, doc)})


@router.patch("/v3/services/{service_id}")
async def update_service(request: Request, service_id: str) -> JSONResponse:
    admin(request, "update_service")
    changes = await envelope(request, "service")
    doc = svc.update_service(cloud_of(request), service_id, changes)
    return JSONResponse({"service": _service_view(request, doc)})


@router.delete("/v3/services/{service_id}")
async def delete_service(request: Request, service_id: str) -> Response:
    admin(request, "delete_service")
    svc.delete_service(cloud_of(request), service_id)
    return Response(status_code=204)


# -- endpoints ------------------------------------------------------------------------------


@router.get("/v3/endpoints")
async def list_endpoints(request: Request) -> JSONResponse:
    reader_of_all(request, "list_endpoints")
    wanted = {"interface": "interface", "service_id": "service_id", "region_id": "region_id"}
    docs = [d for d in svc.endpoints(cloud_of(request)) if keep(request, d, wanted)]
    return _page(request, "endpoints", docs, _endpoint_view)


@router.post("/v3/endpoints")
async def create_endpoint(request: Request) -> JSONResponse:
    admin(request, "create_endpoint")
    doc = svc.create_endpoint(cloud_of(request), await envelope(request, "endpoint"))
    return JSONResponse({"endpoint": _endpoint_view(request, doc)}, status_code=201)


@router.api_route("/v3/endpoints/{endpoint_id}", methods=_GET_HEAD)
async def show_endpoint(request: Request, endpoint_id: str) -> JSONResponse:
    reader_of_all(request, "get_endpoint")
    doc = svc.endpoint(cloud_of(request), endpoint_id)
    return JSONResponse({"endpoint": _endpoint_view(request, doc)})


@router.patch("/v3/endpoints/{endpoint_id}")
async def update_endpoint(request: Request, endpoint_id: str) -> JSONResponse:
    admin(request, "update_endpoint")
    changes = await envelope(request, "endpoint")
    doc = svc.update_endpoint(cloud_of(request), endpoint_id, changes)
    return JSONResponse({"endpoint": _endpoint_view(request, doc)})


@router.delete("/v3/endpoints/{endpoint_id}")
async def delete_endpoint(request: Request, endpoint_id: str) -> Response:
    admin(request, "delete_endpoint")
    svc.delete_endpoint(cloud_of(request), endpoint_id)
    return Response(status_code=204)


@router.get("/v3/auth/catalog")
async def token_catalog(request: Request) -> JSONResponse:
    ctx = require_context(request)
    return JSONResponse({"catalog": svc.catalog_of(cloud_of(request), ctx.project_id)})
