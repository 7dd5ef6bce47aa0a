"""What a guest's consoles show, asked of the agent on its host."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from stowage.bus.base import BusError, RemoteError, compute_topic
from stowage.domain.errors import ConflictError

if TYPE_CHECKING:
    from stowage.services.cloud import Cloud

__all__ = ["console_output"]


async def console_output(
    cloud: Cloud, instance_id: str, body: Mapping[str, Any], length: int | None
) -> str:
    """The serial console log's last `length` lines (all of it for None); ConflictError while
    the server has no running guest to ask, or its host does not answer."""
    host = body.get("host")
    if not host or body.get("vm_state") in ("building", "error") or cloud.bus is None:
        raise ConflictError(
            f"Instance {instance_id} is not ready: vm_state {body.get('vm_state')}, "
            f"host {host or 'none'}"
        )
    try:
        reply = await cloud.bus.call(
            compute_topic(str(host)),
            "console_output",
            {"instance_id": instance_id, "length": length},
            op_id="console-" + uuid.uuid4().hex,
            timeout_s=cloud.config.op_timeout_s,
        )
    except (BusError, RemoteError) as exc:
        raise ConflictError(
            f"Instance {instance_id}: its host {host} did not answer: {exc}"
        ) from None
    if not reply.get("ok"):
        raise ConflictError(f"Instance {instance_id}: {reply.get('error')}")
    return str(reply.get("output") or "")
