"""v3 credentials (/v3/credentials) and EC2 credentials (/v3/users/{id}/credentials/OS-EC2).

Keystone's default policies: an admin manages every credential, a reader of the system reads
them, and a user manages its own; another's credential is a 404 to whom may not see it (as
Keystone answers, so that ids do not leak).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from stowage.api.common import json_body
from stowage.api.identity.policy import Caller, caller, forbid
from stowage.api.identity.views import base_of, envelope
from stowage.api.responses import JSONResponse
from stowage.ledger.objects import Document
from stowage.services.identity_credentials import Credentials, not_found

__all__ = ["router"]

router = APIRouter()


def _view(request: Request, creds: Credentials, doc: Document) -> dict[str, Any]:
    return {
        "id": doc.id,
        "user_id": doc.body["user_id"],
        "project_id": doc.body.get("project_id"),
        "type": doc.body["type"],
        "blob": creds.blob(doc),
        "links": {"self": f"{base_of(request)}/credentials/{doc.id}"},
    }


def _mine(who: Caller, doc: Document, *, write: bool) -> bool:
    if who.is_admin or doc.body["user_id"] == who.ctx.user_id:
        return True
    return not write and who.reads_all


def _seen(who: Caller, creds: Credentials, credential_id: str, *, write: bool) -> Document:
    doc = creds.credential(credential_id)
    if not _mine(who, doc, write=write):
        if who.reads_all:
            raise forbid("identity:update_credential")
        raise not_found(credential_id)  # another's: Keystone's 404
    return doc


@router.post("/v3/credentials")
async def create_credential(request: Request) -> JSONResponse:
    who = caller(request)
    fields = await envelope(request, "credential")
    if not who.is_admin and fields.get("user_id") != who.ctx.user_id:
        raise forbid("identity:create_credential")
    creds = Credentials(who.directory.cloud)
    doc = creds.create(fields)
    return JSONResponse({"credential": _view(request, creds, doc)}, status_code=201)


@router.get("/v3/credentials")
async def list_credentials(request: Request) -> JSONResponse:
    who = caller(request)
    creds = Credentials(who.directory.cloud)
    params = request.query_params
    docs = [
        d
        for d in creds.all(user_id=params.get("user_id"), type=params.get("type"))
        if _mine(who, d, write=False)
    ]
    base = base_of(request)
    return JSONResponse(
        {
            "credentials": [_view(request, creds, d) for d in docs],
            "links": {"self": f"{base}/credentials", "previous": None, "next": None},
        }
    )


@router.get("/v3/credentials/{credential_id}")
async def show_credential(request: Request, credential_id: str) -> JSONResponse:
    who = caller(request)
    creds = Credentials(who.directory.cloud)
    doc = _seen(who, creds, credential_id, write=False)
    return JSONResponse({"credential": _view(request, creds, doc)})


@router.patch("/v3/credentials/{credential_id}")
async def update_credential(request: Request, credential_id: str) -> JSONResponse:
    who = caller(request)
    creds = Credentials(who.directory.cloud)
    _seen(who, creds, credential_id, write=True)
    changes = await envelope(request, "credential")
    if not who.is_admin and changes.get("user_id", who.ctx.user_id) != who.ctx.user_id:
        raise forbid("identity:update_credential")
    doc = creds.update(credential_id, changes)
    return JSONResponse({"credential": _view(request, creds, doc)})


@router.delete("/v3/credentials/{credential_id}")
async def delete_credential(request: Request, credential_id: str) -> Response:
    who = caller(request)
    creds = Credentials(who.directory.cloud)
    _seen(who, creds, credential_id, write=True)
    creds.delete(credential_id)
    return Response(status_code=204)


# -- OS-EC2 ---------------------------------------------------------------------------------

_EC2 = "/v3/users/{user_id}/credentials/OS-EC2"


def _ec2_view(request: Request, doc: Document, blob: dict[str, Any]) -> dict[str, Any]:
    user_id = doc.body["user_id"]
    return {
        "user_id": user_id,
        "tenant_id": doc.body.get("project_id"),
        "access": blob.get("access"),
        "secret": blob.get("secret"),
        "trust_id": blob.get("trust_id"),
        "links": {
            "self": f"{base_of(request)}/users/{user_id}/credentials/OS-EC2/{blob.get('access')}"
        },
    }


def _ec2_owner(request: Request, user_id: str, action: str, *, write: bool) -> Credentials:
    """Keystone's ec2 policies: an admin, the user itself; a system reader reads."""
    who = caller(request)
    own = user_id == who.ctx.user_id
    if not (who.is_admin or own or (not write and who.reads_all)):
        raise forbid(f"identity:{action}")
    return Credentials(who.directory.cloud)


@router.post(_EC2)
async def create_ec2(request: Request, user_id: str) -> JSONResponse:
    creds = _ec2_owner(request, user_id, "ec2_create_credential", write=True)
    fields = await json_body(request) if await request.body() else {}
    tenant = fields.get("tenant_id") if isinstance(fields, dict) else None
    doc, blob = creds.create_ec2(user_id, tenant)
    return JSONResponse({"credential": _ec2_view(request, doc, blob)}, status_code=201)


@router.get(_EC2)
async def list_ec2(request: Request, user_id: str) -> JSONResponse:
    creds = _ec2_owner(request, user_id, "ec2_list_credentials", write=False)
    rows = [_ec2_view(request, d, b) for d, b in creds.ec2_of(user_id)]
    self_url = f"{base_of(request)}/users/{user_id}/credentials/OS-EC2"
    return JSONResponse({"credentials": rows, "links": {"self": self_url}})


@router.get(_EC2 + "/{access}")
async def show_ec2(request: Request, user_id: str, access: str) -> JSONResponse:
    creds = _ec2_owner(request, user_id, "ec2_get_credential", write=False)
    doc, blob = creds.ec2(user_id, access)
    return JSONResponse({"credential": _ec2_view(request, doc, blob)})


@router.delete(_EC2 + "/{access}")
async def delete_ec2(request: Request, user_id: str, access: str) -> Response:
    creds = _ec2_owner(request, user_id, "ec2_delete_credential", write=True)
    creds.delete_ec2(user_id, access)
    return Response(status_code=204)
