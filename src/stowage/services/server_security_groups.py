"""The security groups a new server asks for (names or ids), as the names Nova shows."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stowage.domain.errors import InvalidSpec
from stowage.services import networks as net
from stowage.services.caller import Caller

if TYPE_CHECKING:
    from stowage.services.cloud import Cloud

__all__ = ["security_group_names"]


def security_group_names(cloud: Cloud, caller: Caller, requested: Any) -> list[str]:
    """Names of the groups `requested` ([{"name": name or id}], Nova's request) names, as
    Nova shows them in a server's `security_groups`; ["default"] when none is asked for.
    An unknown group is refused as Nova refuses it (400)."""
    wanted = [str(g.get("name", "default")) for g in requested or [] if isinstance(g, dict)]
    if not wanted:
        return ["default"]
    if wanted == ["default"]:
        return wanted
    groups = net.list_security_groups(cloud, caller)
    own = [g for g in groups if g.get("project_id") == caller.project_id]
    names = []
    for ref in wanted:
        by_id = next((g for g in groups if g["id"] == ref), None)
        if by_id is not None:
            names.append(str(by_id["name"]))
        elif ref == "default" or any(g["name"] == ref for g in own):
            names.append(ref)
        else:
            raise InvalidSpec(f"Unable to find security_group with name or id '{ref}'")
    return list(dict.fromkeys(names))
