"""Network v2.0 trunks (Neutron's trunk extension): the collection, and a trunk's
add_subports, remove_subports and get_subports actions."""

from __future__ import annotations

from fastapi import APIRouter, Request

from stowage.api.auth import cloud_of
from stowage.api.common import json_body
from stowage.api.network.resources import (
    _STANDARD,
    NeutronRoute,
    Reader,
    Writer,
    _creator,
    _deleter,
    _lister,
    _Resource,
    _shower,
    _updater,
)
from stowage.api.responses import JSONResponse
from stowage.services.networks import trunks

__all__ = ["TRUNKS", "router"]

router = APIRouter(route_class=NeutronRoute)

TRUNKS = _Resource(
    "trunks",
    "trunk",
    "trunks",
    "trunk",
    (*_STANDARD, "status", "admin_state_up", "port_id", "sub_ports"),
    trunks.list_trunks,
    trunks.get_trunk,
    trunks.create_trunk,
    trunks.update_trunk,
    trunks.delete_trunk,
    "Trunk {} could not be found.",
)


@router.put("/trunks/{id}/add_subports")
async def add_subports(id: str, request: Request, ctx: Writer) -> JSONResponse:
    body = await json_body(request)
    return JSONResponse(trunks.add_subports(cloud_of(request), ctx, id, body))


@router.put("/trunks/{id}/remove_subports")
async def remove_subports(id: str, request: Request, ctx: Writer) -> JSONResponse:
    body = await json_body(request)
    return JSONResponse(trunks.remove_subports(cloud_of(request), ctx, id, body))


@router.get("/trunks/{id}/get_subports")
async def get_subports(id: str, request: Request, ctx: Reader) -> JSONResponse:
    return JSONResponse(trunks.get_subports(cloud_of(request), ctx, id))


router.add_api_route("/trunks", _lister(TRUNKS), methods=["GET"])
router.add_api_route("/trunks", _creator(TRUNKS), methods=["POST"])
router.add_api_route("/trunks/{id}", _shower(TRUNKS), methods=["GET"])
router.add_api_route("/trunks/{id}", _updater(TRUNKS, trunks.update_trunk), methods=["PUT"])
router.add_api_route("/trunks/{id}", _deleter(TRUNKS), methods=["DELETE"])
