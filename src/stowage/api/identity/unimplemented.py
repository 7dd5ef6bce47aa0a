"""Keystone core APIs this identity service does not offer, refused with Keystone's 501.

Keystone answers 404 for the routes of an extension it does not load (OS-EP-FILTER, OS-TRUST,
OS-OAUTH1, OS-FEDERATION, OS-REVOKE, OS-SIMPLE-CERT): those fall through to the
404 every unknown route gets. The routes below are core API: a request for one is understood
and not carried out, so it is a 501, never a 404 that reads as "no such thing" nor an answer
that pretends.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from stowage.api.auth import require_context
from stowage.api.common import identity_error
from stowage.api.responses import JSONResponse

__all__ = ["router"]

router = APIRouter()

_ALL = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"]
# Core Keystone v3 routes not served here (see docs/compatibility.md).
_PATHS = (
    "/v3/domains/{domain_id}/config",
    "/v3/domains/{domain_id}/config/{group}",
    "/v3/domains/{domain_id}/config/{group}/{option}",
    "/v3/domains/config/default",
    "/v3/domains/config/{group}/default",
)


async def _not_implemented(request: Request) -> JSONResponse:
    require_context(request)
    message = "The action you have requested has not been implemented."
    return JSONResponse(identity_error(501, message, None, ""), status_code=501)


for _path in _PATHS:
    router.add_api_route(_path, _not_implemented, methods=_ALL)
