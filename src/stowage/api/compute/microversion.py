"""Compute microversions: negotiation from either header, echoed on every response."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.datastructures import MutableHeaders

from stowage.api.asgi import OnResponse, ResponseHeaders
from stowage.api.common import compute_error
from stowage.api.responses import JSONResponse

__all__ = ["MAX_VERSION", "MIN_VERSION", "Microversion", "install_microversions", "mv"]

MIN_VERSION = (2, 1)
MAX_VERSION = (2, 96)


class Microversion(tuple[int, int]):
    """A compute microversion; compare with tuples, e.g. `mv(request) >= (2, 64)`."""

    def __str__(self) -> str:
        return f"{self[0]}.{self[1]}"


def _parse(raw: str) -> Microversion | None:
    text = raw.strip().lower()
    if text == "latest":
        return Microversion(MAX_VERSION)
    try:
        major, minor = text.split(".")
        return Microversion((int(major), int(minor)))
    except ValueError:
        return None


def requested(request: Request) -> str | None:
    header = request.headers.get("openstack-api-version", "")
    for part in header.split(","):
        service, _, value = part.strip().partition(" ")
        if service.lower() == "compute" and value:
            return value
    return request.headers.get("x-openstack-nova-api-version")


def mv(request: Request) -> Microversion:
    version: Microversion = request.state.microversion
    return version


def install_microversions(app: FastAPI) -> None:
    app.add_middleware(ResponseHeaders, enter=_negotiate)


def _negotiate(request: Request) -> Response | OnResponse:
    raw = requested(request)
    version = Microversion(MIN_VERSION) if raw is None else _parse(raw)
    if version is None or not MIN_VERSION <= version <= MAX_VERSION:
        message = (
            f"Version {raw} is not supported by the API. Minimum is "
            f"{MIN_VERSION[0]}.{MIN_VERSION[1]} and maximum is "
            f"{MAX_VERSION[0]}.{MAX_VERSION[1]}."
        )
        if version is None:
            return JSONResponse(
                compute_error(400, f"Invalid API version {raw!r}.", None, ""), status_code=400
            )
        return JSONResponse(compute_error(406, message, None, ""), status_code=406)
    request.state.microversion = version
    echoed = f"compute {version}"

    def echo(status: int, headers: MutableHeaders) -> None:
        headers["OpenStack-API-Version"] = echoed
        headers["X-OpenStack-Nova-API-Version"] = str(version)
        headers["Vary"] = "OpenStack-API-Version, X-OpenStack-Nova-API-Version"

    return echo
