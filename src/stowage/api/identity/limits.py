"""Keystone's unified limits: /v3/registered_limits, /v3/limits and /v3/limits/model.

Keystone's default policies: anyone authenticated lists and reads registered limits; an
admin or a reader of the system reads every project limit, and anyone else those of the
projects it holds a role on (another project's limit is a 403, as Keystone's policy); only an
admin creates, changes and deletes either.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from stowage.api.common import ApiError, json_body
from stowage.api.identity.policy import Caller, admin, caller, forbid
from stowage.api.identity.views import base_of, envelope
from stowage.api.responses import JSONResponse
from stowage.ledger.objects import Document
from stowage.services.identity_limits import LIMIT, MODEL, REGISTERED, Limits

__all__ = ["router"]

router = APIRouter()

_REG_VIEW = ("service_id", "region_id", "resource_name", "default_limit", "description")
_LIMIT_VIEW = (
    "project_id",
    "domain_id",
    "service_id",
    "region_id",
    "resource_name",
    "resource_limit",
    "description",
)


def _view(request: Request, doc: Document) -> dict[str, Any]:
    fields, path = (
        (_REG_VIEW, "registered_limits") if doc.kind == REGISTERED else (_LIMIT_VIEW, "limits")
    )
    body = {"id": doc.id, **{f: doc.body.get(f) for f in fields}}
    body["links"] = {"self": f"{base_of(request)}/{path}/{doc.id}"}
    return body


def _listed(request: Request, path: str, docs: list[Document]) -> JSONResponse:
    return JSONResponse(
        {
            path: [_view(request, d) for d in docs],
            "links": {"self": f"{base_of(request)}/{path}", "previous": None, "next": None},
        }
    )


async def _items(request: Request, key: str) -> list[Any]:
    body = await json_body(request)
    items = body.get(key) if isinstance(body, dict) else None
    if not isinstance(items, list):
        raise ApiError(400, f"Invalid input for field '{key}': a JSON array is required.")
    return items


def _filters(request: Request, *names: str) -> dict[str, str | None]:
    return {n: request.query_params.get(n) for n in names}


# -- registered limits ----------------------------------------------------------------------


@router.post("/v3/registered_limits")
async def create_registered_limits(request: Request) -> JSONResponse:
    who = admin(request, "create_registered_limits")
    made = Limits(who.directory.cloud).create_registered(await _items(request, "registered_limits"))
    return JSONResponse({"registered_limits": [_view(request, d) for d in made]}, status_code=201)


@router.get("/v3/registered_limits")
async def list_registered_limits(request: Request) -> JSONResponse:
    who = caller(request)
    filters = _filters(request, "service_id", "region_id", "resource_name")
    docs = Limits(who.directory.cloud).all(REGISTERED, **filters)
    return _listed(request, "registered_limits", docs)


@router.get("/v3/registered_limits/{limit_id}")
async def show_registered_limit(request: Request, limit_id: str) -> JSONResponse:
    who = caller(request)
    doc = Limits(who.directory.cloud).get(REGISTERED, limit_id)
    return JSONResponse({"registered_limit": _view(request, doc)})


@router.patch("/v3/registered_limits/{limit_id}")
async def update_registered_limit(request: Request, limit_id: str) -> JSONResponse:
    who = admin(request, "update_registered_limit")
    changes = await envelope(request, "registered_limit")
    doc = Limits(who.directory.cloud).update_registered(limit_id, changes)
    return JSONResponse({"registered_limit": _view(request, doc)})


@router.delete("/v3/registered_limits/{limit_id}")
async def delete_registered_limit(request: Request, limit_id: str) -> Response:
    who = admin(request, "delete_registered_limit")
    Limits(who.directory.cloud).delete_registered(limit_id)
    return Response(status_code=204)


# -- project limits -------------------------------------------------------------------------


def _sees(who: Caller, doc: Document) -> bool:
    return who.reads_all or doc.body.get("project_id") in who.project_ids()


@router.get("/v3/limits/model")
async def limits_model(request: Request) -> JSONResponse:
    caller(request)
    return JSONResponse({"model": dict(MODEL)})


@router.post("/v3/limits")
async def create_limits(request: Request) -> JSONResponse:
    who = admin(request, "create_limits")
    made = Limits(who.directory.cloud).create_limits(await _items(request, "limits"))
    return JSONResponse({"limits": [_view(request, d) for d in made]}, status_code=201)


@router.get("/v3/limits")
async def list_limits(request: Request) -> JSONResponse:
    who = caller(request)
    filters = _filters(request, "service_id", "region_id", "resource_name", "project_id")
    docs = [d for d in Limits(who.directory.cloud).all(LIMIT, **filters) if _sees(who, d)]
    return _listed(request, "limits", docs)


@router.get("/v3/limits/{limit_id}")
async def show_limit(request: Request, limit_id: str) -> JSONResponse:
    who = caller(request)
    doc = Limits(who.directory.cloud).get(LIMIT, limit_id)
    if not _sees(who, doc):
        raise forbid("identity:get_limit")  # another project's (Keystone's policy: a 403)
    return JSONResponse({"limit": _view(request, doc)})


@router.patch("/v3/limits/{limit_id}")
async def update_limit(request: Request, limit_id: str) -> JSONResponse:
    who = admin(request, "update_limit")
    changes = await envelope(request, "limit")
    doc = Limits(who.directory.cloud).update_limit(limit_id, changes)
    return JSONResponse({"limit": _view(request, doc)})


@router.delete("/v3/limits/{limit_id}")
async def delete_limit(request: Request, limit_id: str) -> Response:
    who = admin(request, "delete_limit")
    Limits(who.directory.cloud).delete_limit(limit_id)
    return Response(status_code=204)
