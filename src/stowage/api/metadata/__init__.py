"""The metadata service on the API port: `/openstack/<version>/...` and the EC2-style
`/latest/meta-data/...`, for the instance a metadata proxy names.

As Nova's metadata API behind Neutron's proxy: the instance is the `X-Instance-ID` header,
signed by `X-Instance-ID-Signature` (HMAC-SHA256 of the id with the shared secret in
`<state_dir>/metadata_secret`). On the simulated driver a test (or an operator) addresses a
server that way; on libvirt the proxy in front of the guest's network does.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from stowage.api.auth import cloud_of
from stowage.api.common import ApiError, api_app, compute_error, include_routes, install_common
from stowage.api.responses import JSONResponse
from stowage.domain.errors import NotFound
from stowage.services import guest_metadata as service
from stowage.services.cloud import Cloud

__all__ = [
    "create_ec2_metadata_app",
    "create_openstack_metadata_app",
    "start_metadata_service",
]

_FILES = ("meta_data.json", "network_data.json", "user_data", "vendor_data.json",
          "vendor_data2.json")  # fmt: skip


def _instance_id(request: Request) -> str:
    instance_id = request.headers.get("x-instance-id")
    signature = request.headers.get("x-instance-id-signature")
    if not instance_id:
        raise ApiError(400, "X-Instance-ID header is missing from request.")
    if not signature:
        raise ApiError(400, "X-Instance-ID-Signature header is missing from request.")
    expected = service.signature_of(service.metadata_secret(cloud_of(request)), instance_id)
    if not hmac.compare_digest(expected, signature):
        raise ApiError(403, "Invalid proxy request signature.")
    return instance_id


openstack = APIRouter()


@openstack.get("/")
async def versions(request: Request) -> PlainTextResponse:
    _instance_id(request)
    return PlainTextResponse("\n".join([*service.OPENSTACK_VERSIONS, "latest"]))


def _version(version: str) -> None:
    if version != "latest" and version not in service.OPENSTACK_VERSIONS:
        raise ApiError(404, f"Metadata version {version} could not be found.")


@openstack.get("/{version}")
@openstack.get("/{version}/")
async def listing(request: Request, version: str) -> PlainTextResponse:
    cloud = cloud_of(request)
    instance_id = _instance_id(request)
    _version(version)
    data = await asyncio.to_thread(_user_data, cloud, instance_id)
    names = [n for n in _FILES if n != "user_data" or data is not None]
    return PlainTextResponse("\n".join(names))


def _user_data(cloud: Cloud, instance_id: str) -> bytes | None:
    try:
        return service.user_data(cloud, instance_id)
    except NotFound as exc:
        raise ApiError(404, exc.message) from None


@openstack.get("/{version}/{name}")
async def document(request: Request, version: str, name: str) -> Response:
    cloud = cloud_of(request)
    instance_id = _instance_id(request)
    _version(version)
    if name == "user_data":
        data = await asyncio.to_thread(_user_data, cloud, instance_id)
        if data is None:
            raise ApiError(404, "The instance has no user data.")
        return Response(data, media_type="application/octet-stream")
    if name not in _FILES:
        raise ApiError(404, f"{name} could not be found.")
    try:
        content = await asyncio.to_thread(service.openstack_metadata, cloud, instance_id)
    except NotFound as exc:
        raise ApiError(404, exc.message) from None
    return JSONResponse(content[name])


ec2 = APIRouter()


@ec2.get("/user-data")
async def ec2_user_data(request: Request) -> Response:
    data = await asyncio.to_thread(_user_data, cloud_of(request), _instance_id(request))
    if data is None:
        raise ApiError(404, "The instance has no user data.")
    return Response(data, media_type="application/octet-stream")


@ec2.get("/meta-data")
@ec2.get("/meta-data/{path:path}")
async def ec2_meta_data(request: Request, path: str = "") -> PlainTextResponse:
    cloud = cloud_of(request)
    instance_id = _instance_id(request)
    try:
        node: Any = await asyncio.to_thread(service.ec2_metadata, cloud, instance_id)
    except NotFound as exc:
        raise ApiError(404, exc.message) from None
    for part in [p for p in path.split("/") if p]:
        if not isinstance(node, dict):
            raise ApiError(404, f"{path} could not be found.")
        key = next((k for k in node if k == part or k.split("=", 1)[0] == part), None)
        if key is None:
            raise ApiError(404, f"{path} could not be found.")
        node = node[key]
    if isinstance(node, dict):
        return PlainTextResponse(
            "\n".join(k + "/" if isinstance(v, dict) else k for k, v in node.items())
        )
    return PlainTextResponse(node if isinstance(node, str) else json.dumps(node))


def _app(cloud: Cloud, router: APIRouter) -> FastAPI:
    app = api_app()
    app.state.cloud = cloud
    install_common(app, compute_error)
    include_routes(app, router)
    return app


def start_metadata_service(cloud: Cloud) -> None:
    """At the API's start: the shared secret is made now, so a proxy can read it before the
    first guest asks."""
    service.metadata_secret(cloud)


def create_openstack_metadata_app(cloud: Cloud) -> FastAPI:
    return _app(cloud, openstack)


def create_ec2_metadata_app(cloud: Cloud) -> FastAPI:
    return _app(cloud, ec2)
