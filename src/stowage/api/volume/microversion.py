"""Block storage microversions (3.0 to 3.70): `OpenStack-API-Version: volume 3.x`, echoed."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.datastructures import MutableHeaders

from stowage.api.asgi import OnResponse, ResponseHeaders
from stowage.api.common import compute_error
from stowage.api.responses import JSONResponse

__all__ = ["MAX_VERSION", "MIN_VERSION", "install_microversions", "vmv"]

MIN_VERSION = (3, 0)
MAX_VERSION = (3, 70)


def _parse(raw: str) -> tuple[int, int] | None:
    text = raw.strip().lower()
    if text == "latest":
        return MAX_VERSION
    try:
        major, minor = text.split(".")
        return int(major), int(minor)
    except ValueError:
        return None


def _requested(request: Request) -> str | None:
    for part in request.headers.get("openstack-api-version", "").split(","):
        service, _, value = part.strip().partition(" ")
        if service.lower() == "volume" and value:
            return value
    return None


def vmv(request: Request) -> tuple[int, int]:
    """The request's volume microversion; compare with tuples: `vmv(request) >= (3, 27)`."""
    version: tuple[int, int] = request.state.microversion
    return version


def install_microversions(app: FastAPI) -> None:
    app.add_middleware(ResponseHeaders, enter=_negotiate)


def _negotiate(request: Request) -> Response | OnResponse:
    raw = _requested(request)
    version = MIN_VERSION if raw is None else _parse(raw)
    if version is None:
        body = compute_error(400, f"Invalid API version {raw!r}.", None, "")
        return JSONResponse(body, status_code=400)
    if not MIN_VERSION <= version <= MAX_VERSION:
        message = (
            f"Version {raw} is not supported by the API. Minimum is 3.0 and maximum is "
            f"{MAX_VERSION[0]}.{MAX_VERSION[1]}."
        )
        return JSONResponse(compute_error(406, message, None, ""), status_code=406)
    request.state.microversion = version
    echoed = f"volume {version[0]}.{version[1]}"

    def echo(status: int, headers: MutableHeaders) -> None:
        headers["OpenStack-API-Version"] = echoed
        headers["Vary"] = "OpenStack-API-Version"

    return echo
