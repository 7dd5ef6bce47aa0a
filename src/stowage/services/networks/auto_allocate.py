"""Auto-allocated topology (get-me-a-network): one network, one IPv4 subnet and a router to
the default external network per project, made on first request.

The topology is a document of kind "auto_allocated_topology" whose id is derived from the
project, so the store refuses a second one: two concurrent first requests both build, the one
whose claim loses removes what it built and answers with the winner's.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from stowage.domain.errors import ConflictError
from stowage.services.caller import Caller
from stowage.services.networks import l3
from stowage.services.networks.common import (
    NeutronConflict,
    NeutronNotFound,
    _As,
    _bodies,
    _denied,
    _uuid5,
)
from stowage.services.networks.network import create_network, delete_network
from stowage.services.networks.subnet import create_subnet
from stowage.services.networks.subnetpools import default_pool

if TYPE_CHECKING:
    from stowage.services.cloud import Cloud

KIND = "auto_allocated_topology"
# The subnet is carved from the default IPv4 subnet pool, as Neutron's; without one, it is this
# fixed private CIDR (projects' networks may overlap, as in Neutron).
CIDR = "10.128.0.0/24"
DRY_RUN = "dry-run=pass"


def _topology_id(project_id: str) -> str:
    return _uuid5("auto-allocated-topology", project_id)


def _authorized(caller: Caller, project_id: str, action: str) -> None:
    if not caller.is_admin and caller.project_id != project_id:
        raise _denied(action)


def _default_external(cloud: Cloud) -> dict[str, Any]:
    """The external network marked is_default, else the bootstrap's `public`."""
    external = [n for n in _bodies(cloud, "network") if n.get("router:external")]
    for net in sorted(external, key=lambda n: (not n.get("is_default"), n.get("name") != "public")):
        if net.get("is_default") or net.get("name") == "public":
            return net
    raise NeutronConflict(
        "Deployment error: No default router:external network.", "AutoAllocationFailure"
    )


def _response(project_id: str, network_id: str) -> dict[str, Any]:
    return {"id": network_id, "tenant_id": project_id, "project_id": project_id}


def _existing(cloud: Cloud, project_id: str) -> dict[str, Any] | None:
    doc = cloud.objects.find(KIND, _topology_id(project_id))
    return None if doc is None else doc.body


def get_auto_allocated_topology(
    cloud: Cloud, caller: Caller, project_id: str, *, dry_run: bool = False, writer: bool = True
) -> dict[str, Any]:
    """The project's topology, made if it has none (a reader may only see an existing one)."""
    _authorized(caller, project_id, "get_auto_allocated_topology")
    if dry_run:
        _default_external(cloud)
        return {"id": DRY_RUN, "tenant_id": project_id, "project_id": project_id}
    found = _existing(cloud, project_id)
    if found is not None:
        return _response(project_id, found["network_id"])
    if not writer:
        raise _denied("create_auto_allocated_topology")
    return _build(cloud, project_id)


def _build(cloud: Cloud, project_id: str) -> dict[str, Any]:
    external = _default_external(cloud)
    acting = _As(project_id, True)
    net = create_network(cloud, acting, {"name": "auto_allocated_network"})
    router: dict[str, Any] | None = None
    try:
        where = {"use_default_subnetpool": True} if default_pool(cloud, 4) else {"cidr": CIDR}
        subnet = create_subnet(
            cloud,
            acting,
            {
                "name": "auto_allocated_subnet_v4",
                "network_id": net["id"],
                "ip_version": 4,
                **where,
            },
        )
        router = l3.create_router(
            cloud,
            acting,
            {
                "name": "auto_allocated_router",
                "external_gateway_info": {"network_id": external["id"]},
            },
        )
        l3.add_router_interface(cloud, acting, router["id"], {"subnet_id": subnet["id"]})
        body = {
            "project_id": project_id,
            "network_id": net["id"],
            "subnet_id": subnet["id"],
            "router_id": router["id"],
        }
        cloud.objects.create(KIND, _topology_id(project_id), body, project_id=project_id)
    except BaseException as exc:
        _teardown(cloud, acting, net["id"], router["id"] if router else None)
        if isinstance(exc, ConflictError) and not isinstance(exc, NeutronConflict):
            won = _existing(cloud, project_id)
            if won is not None:
                return _response(project_id, won["network_id"])
        raise
    return _response(project_id, net["id"])


def _teardown(cloud: Cloud, acting: Caller, network_id: str, router_id: str | None) -> None:
    if router_id is not None:
        for subnet in _bodies(cloud, "subnet"):
            if subnet["network_id"] == network_id:
                with contextlib.suppress(NeutronNotFound):
                    l3.remove_router_interface(
                        cloud, acting, router_id, {"subnet_id": subnet["id"]}
                    )
        l3.delete_router(cloud, acting, router_id)
    delete_network(cloud, acting, network_id)


def delete_auto_allocated_topology(cloud: Cloud, caller: Caller, project_id: str) -> None:
    """The router, subnet and network go; refused (409) while a server's port is on it."""
    _authorized(caller, project_id, "delete_auto_allocated_topology")
    found = _existing(cloud, project_id)
    if found is None:
        raise NeutronNotFound(
            f"Auto Allocated Topology for project {project_id} could not be found.", "NotFound"
        )
    network_id = found["network_id"]
    busy = [
        p
        for p in _bodies(cloud, "port")
        if p["network_id"] == network_id
        and not str(p.get("device_owner", "")).startswith("network:")
    ]
    if busy:
        raise NeutronConflict(
            f"Unable to complete operation on network {network_id}. There are one or more "
            "ports still in use on the network.",
            "NetworkInUse",
        )
    _teardown(cloud, _As(project_id, True), network_id, found["router_id"])
    cloud.objects.delete(KIND, _topology_id(project_id))
