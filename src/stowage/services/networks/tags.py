"""Tags on network resources (the standard-attr tag extension)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stowage.services.caller import Caller
from stowage.services.networks.common import _invalid, _owned, _save
from stowage.services.networks.network import _network
from stowage.services.networks.port import _port
from stowage.services.networks.security_groups import _group
from stowage.services.networks.subnet import _subnet
from stowage.services.networks.subnetpools import _pool

if TYPE_CHECKING:
    from stowage.services.cloud import Cloud

# -- tags -------------------------------------------------------------------------------------

_TAGGABLE = {
    "network": _network,
    "subnet": _subnet,
    "port": _port,
    "security_group": _group,
    "subnetpool": _pool,
}


def set_tags(cloud: Cloud, caller: Caller, kind: str, resource_id: str, tags: Any) -> list[str]:
    """Replace a resource's tags (neutron's standard-attr-tag)."""
    body = _TAGGABLE[kind](cloud, caller, resource_id)
    _owned(body, caller, f"update_{kind}:tags")
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise _invalid("tags", f"'{tags}' is not a list of strings")
    for tag in tags:
        if not tag or len(tag) > 255 or "," in tag:
            raise _invalid("tags", f"'{tag}' is not a valid tag")
    new = dict(body)
    new["tags"] = sorted(set(tags))
    _save(cloud, kind, new)
    return list(new["tags"])


def tags_of(cloud: Cloud, caller: Caller, kind: str, resource_id: str) -> list[str]:
    return list(_TAGGABLE[kind](cloud, caller, resource_id).get("tags", []))
