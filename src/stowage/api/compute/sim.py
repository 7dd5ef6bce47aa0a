"""Stowage's extension: control the simulated hypervisors of a running cloud (admin only).

`GET /os-stowage-sim` shows every host's agent (running or stopped, what its hypervisor
runs, with pins); `POST /os-stowage-sim/{host}/action` takes one of `{"stop": {}}`,
`{"start": {}}`, `{"fault": {"operation", "step", "action": fail|hang|crash, "times"}}`,
`{"slow-disk": {"seconds": S}}`, `{"latency": {"operation", "step", "seconds"}}` (that step takes
S seconds, then goes on), `{"clear": {}}`, and `{"repin": {"instance_id", "pins"}}`
(change an instance's pins behind the ledger's back, for the reconciler to find). The
controls reach the agent over the bus, on a topic it serves even while "stopped".
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from stowage.api.auth import cloud_of, require_admin
from stowage.api.common import ApiError, json_body, on_loop
from stowage.api.responses import JSONResponse
from stowage.bus.base import BusError, RemoteError
from stowage.services.compute import instance_hosts
from stowage.services.migrations import host_is_up

router = APIRouter()

_CONTROL_TIMEOUT_S = 10.0
_ACTIONS = {
    "repin": "repin",
    "stop": "stop",
    "start": "start",
    "fault": "fault",
    "slow-disk": "slow_disk",
    "latency": "latency",
    "clear": "clear",
}


async def control(request: Request, host: str, method: str, payload: dict[str, Any]) -> Any:
    from stowage.bus.base import control_topic

    cloud = cloud_of(request)
    if host not in set(instance_hosts(cloud).values()):
        raise ApiError(404, f"Compute host {host} could not be found.")
    if cloud.bus is None:
        raise ApiError(409, "This API process has no bus to the agents.")
    try:
        return await cloud.bus.call(
            control_topic(host),
            method,
            payload,
            op_id=f"{request.state.request_id}:{host}",
            timeout_s=_CONTROL_TIMEOUT_S,
        )
    except RemoteError as exc:
        raise ApiError(400, f"{host}: {exc.message}") from None
    except BusError as exc:
        raise ApiError(503, f"The agent of {host} does not answer: {exc}") from None


@router.get("/os-stowage-sim")
@on_loop  # awaits the agents over the bus
async def show(request: Request) -> JSONResponse:
    require_admin(request)
    cloud = cloud_of(request)
    out = []
    for name in sorted(instance_hosts(cloud).values()):
        agent = await control(request, name, "show", {})
        agent["service_up"] = host_is_up(cloud, name)
        out.append(agent)
    return JSONResponse({"hosts": out})


@router.post("/os-stowage-sim/{host}/action")
@on_loop  # awaits the agents over the bus
async def act(request: Request, host: str) -> JSONResponse:
    require_admin(request)
    cloud = cloud_of(request)
    if host not in set(instance_hosts(cloud).values()):
        raise ApiError(404, f"Compute host {host} could not be found.")
    payload = await json_body(request)
    if not isinstance(payload, dict) or len(payload) != 1:
        raise ApiError(400, "The body must name exactly one action: " + ", ".join(_ACTIONS))
    action, args = next(iter(payload.items()))
    if action not in _ACTIONS:
        raise ApiError(400, f"Unknown action {action!r}; one of: {', '.join(_ACTIONS)}")
    args = args if isinstance(args, dict) else {}
    if action == "fault":
        for field in ("operation", "step"):
            if not isinstance(args.get(field), str):
                raise ApiError(400, f"Invalid input for field/attribute {field}: required")
        if args.get("action", "fail") not in ("fail", "hang", "crash"):
            raise ApiError(400, "Invalid input for field/attribute action: fail, hang or crash")
    if action == "repin":
        pins = args.get("pins")
        if not isinstance(args.get("instance_id"), str) or not isinstance(pins, dict):
            raise ApiError(400, "Invalid input for field/attribute pins: {vCPU: pCPU} required")
        if not all(str(k).isdigit() and isinstance(v, int) for k, v in pins.items()):
            raise ApiError(400, "Invalid input for field/attribute pins: {vCPU: pCPU} required")
    if action == "latency":
        for field in ("operation", "step"):
            if not isinstance(args.get(field), str):
                raise ApiError(400, f"Invalid input for field/attribute {field}: required")
    if action in ("slow-disk", "latency"):
        seconds = args.get("seconds")
        if not isinstance(seconds, int | float) or isinstance(seconds, bool) or seconds < 0:
            raise ApiError(400, "Invalid input for field/attribute seconds: a number >= 0")
    agent = await control(request, host, _ACTIONS[action], args)
    if action == "start":
        # Back at once, as a restarted service's first heartbeat would say.
        cloud.ledger.heartbeat([host])
    cloud.kick()
    return JSONResponse({"host": agent})
