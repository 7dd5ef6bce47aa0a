"""Stowage's extension: the cloud on one screen (admin only), as `stowage status` shows it."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request

from stowage.api.auth import cloud_of, require_admin
from stowage.api.responses import JSONResponse
from stowage.services.dashboard import CloudStatus, cloud_status

__all__ = ["router"]

router = APIRouter()


@router.get("/os-stowage-status")
async def status(request: Request) -> JSONResponse:
    """Hosts up and down with free pCPUs, operations in flight, stuck and failed ones."""
    require_admin(request)
    summary = await asyncio.to_thread(cloud_status, cloud_of(request))
    return JSONResponse({"status": status_view(summary)})


def status_view(summary: CloudStatus) -> dict[str, Any]:
    return {
        "hosts": [
            {
                "name": card.host.name,
                "state": card.state,
                "disabled": card.host.disabled,
                "heartbeat_age_s": None
                if card.heartbeat_age_s is None
                else round(card.heartbeat_age_s, 1),
                "pcpus_free": card.pcpus_free,
                "pcpus_total": card.pcpus_total,
                "shared_load": round(card.shared_load, 2),
                "instances": len(card.host.instance_ids),
            }
            for card in summary.hosts
        ],
        "hosts_up": summary.hosts_up,
        "hosts_down": len(summary.hosts) - summary.hosts_up,
        "pcpus_free": summary.pcpus_free,
        "operations_in_flight": dict(summary.ops_in_flight),
        "stuck": [dict(op) for op in summary.stuck],
        "failed": [dict(op) for op in summary.failed],
    }
