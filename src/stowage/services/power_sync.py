"""Power-state sync: what the hypervisor says a guest is doing, into the server's state.

Nova's rules (`_sync_instance_power_state`): nothing is synced while a task is in flight; an
active server whose guest stopped, crashed or vanished is stopped (SHUTOFF); a stopped server
whose guest runs is stopped again on the hypervisor in Nova, so here it is only reported (the
reconciler's divergence); paused and suspended guests show as PAUSED and SUSPENDED.
Every write is a compare-and-swap on the document: a request that moved the server first wins.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from stowage.services.cloud import Cloud

__all__ = ["sync_power_states"]

log = logging.getLogger(__name__)

# Nova's power_state numbers.
NOSTATE, RUNNING, PAUSED, SHUTDOWN, SUSPENDED = 0, 1, 3, 4, 7

_STATE_POWER = {"running": RUNNING, "paused": PAUSED, "shutoff": SHUTDOWN, "suspended": SUSPENDED}


def sync_power_states(
    cloud: Cloud, host: str, running: Mapping[str, Mapping[str, Any]]
) -> list[tuple[str, str]]:
    """Apply the hypervisor's view of `host` (`Driver.running()`) to its servers.

    Returns (instance id, new status) for every server changed.
    """
    busy = {op.instance_id for op in cloud.operations.active(host=host)}
    changed: list[tuple[str, str]] = []
    for doc in cloud.objects.list("instance"):
        body = doc.body
        if body.get("host") != host or doc.id in busy or body.get("task_state") is not None:
            continue
        seen = running.get(doc.id)
        power = NOSTATE if seen is None else _STATE_POWER.get(str(seen["state"]), NOSTATE)
        vm_state = body.get("vm_state")
        after = dict(body)
        if vm_state == "active" and power in (NOSTATE, SHUTDOWN):
            after.update(status="SHUTOFF", vm_state="stopped", power_state=power)
        elif vm_state == "active" and power == PAUSED:
            after.update(status="PAUSED", vm_state="paused", power_state=PAUSED)
        elif vm_state == "active" and power == SUSPENDED:
            after.update(status="SUSPENDED", vm_state="suspended", power_state=SUSPENDED)
        elif body.get("power_state") != power and vm_state in ("stopped", "active"):
            after["power_state"] = power  # the number follows; the state stays (Nova)
        else:
            continue
        if after == body:
            continue
        with cloud.ledger.engine.begin() as conn:
            if not cloud.objects.swap_in(conn, "instance", doc.id, body, after):
                continue  # someone else moved it first
        log.warning(
            "power sync: %s on %s is %s on the hypervisor; server now %s",
            doc.id,
            host,
            "gone" if seen is None else seen["state"],
            after["status"],
        )
        changed.append((doc.id, str(after["status"])))
    return changed
