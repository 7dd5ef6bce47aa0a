"""/v3/policies: an admin writes them, a reader of the system reads them (Keystone's)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from stowage.api.identity.policy import admin, reader_of_all
from stowage.api.identity.views import base_of, envelope
from stowage.api.responses import JSONResponse
from stowage.ledger.objects import Document
from stowage.services import identity_policies as svc

__all__ = ["router"]

router = APIRouter()


def _view(request: Request, doc: Document) -> dict[str, Any]:
    return {**doc.body, "id": doc.id, "links": {"self": f"{base_of(request)}/policies/{doc.id}"}}


@router.post("/v3/policies")
async def create_policy(request: Request) -> JSONResponse:
    who = admin(request, "create_policy")
    doc = svc.create(who.directory.cloud, await envelope(request, "policy"))
    return JSONResponse({"policy": _view(request, doc)}, status_code=201)


@router.get("/v3/policies")
async def list_policies(request: Request) -> JSONResponse:
    who = reader_of_all(request, "list_policies")
    wanted = request.query_params.get("type")
    docs = [d for d in svc.list_all(who.directory.cloud) if not wanted or d.body["type"] == wanted]
    base = base_of(request)
    return JSONResponse(
        {
            "policies": [_view(request, d) for d in docs],
            "links": {"self": f"{base}/policies", "previous": None, "next": None},
        }
    )


@router.get("/v3/policies/{policy_id}")
async def show_policy(request: Request, policy_id: str) -> JSONResponse:
    who = reader_of_all(request, "get_policy")
    return JSONResponse({"policy": _view(request, svc.get(who.directory.cloud, policy_id))})


@router.patch("/v3/policies/{policy_id}")
async def update_policy(request: Request, policy_id: str) -> JSONResponse:
    who = admin(request, "update_policy")
    changes = await envelope(request, "policy")
    return JSONResponse(
        {"policy": _view(request, svc.update(who.directory.cloud, policy_id, changes))}
    )


@router.delete("/v3/policies/{policy_id}")
async def delete_policy(request: Request, policy_id: str) -> Response:
    svc.delete(admin(request, "delete_policy").directory.cloud, policy_id)
    return Response(status_code=204)
