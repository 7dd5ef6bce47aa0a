"""The security groups of a server: those a new server asks for (names or ids), as the names
Nova shows, and the groups added to and removed from a running one."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stowage.domain.errors import ConflictError, InvalidSpec, NotFound
from stowage.services import networks as net
from stowage.services.caller import Caller
from stowage.services.documents import lock_key
from stowage.services.instances import write_instance

if TYPE_CHECKING:
    from stowage.services.cloud import Cloud

__all__ = ["change_server_group", "security_group_names"]


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


def change_server_group(
    cloud: Cloud, caller: Caller, server_id: str, ref: str, *, add: bool
) -> None:
    """addSecurityGroup / removeSecurityGroup: the group (a name or id of the server's
    project) joins or leaves every port of the server and the server's `security_groups`,
    all in one transaction: a failure leaves ports and server as they were."""
    server = cloud.objects.find("instance", server_id)
    if server is None:
        raise NotFound(f"Instance {server_id} could not be found.")
    project = str(server.body.get("project_id"))
    group = next(
        (
            g
            for g in net.list_security_groups(cloud, caller)
            if g.get("project_id") == project and ref in (g["id"], g["name"])
        ),
        None,
    )
    if group is None:
        raise NotFound(f"Security group {ref} not found for project {project}.")
    port_ids = [p["id"] for p in net.ports_of(cloud, server_id)]
    with cloud.ledger.engine.begin() as conn:
        lock_key(conn, f"stowage-server-groups:{server_id}")
        current = cloud.objects.find_in(conn, "instance", server_id)
        if current is None:
            raise NotFound(f"Instance {server_id} could not be found.")
        ports = [
            doc
            for doc in (cloud.objects.find_in(conn, "port", port_id) for port_id in port_ids)
            if doc is not None and doc.body.get("device_id") == server_id
        ]
        names = list(current.body.get("security_groups") or [])
        has = group["name"] in names or any(
            group["id"] in doc.body.get("security_groups", []) for doc in ports
        )
        if add and has:
            raise InvalidSpec(f"Security group {ref} is already associated with the instance.")
        if not add and not has:
            raise InvalidSpec(f"Security group {ref} not associated with the instance.")
        for doc in ports:
            ids = [g for g in doc.body.get("security_groups", []) if g != group["id"]]
            port = net.stamped(
                cloud, {**doc.body, "security_groups": [*ids, group["id"]] if add else ids}
            )
            if not cloud.objects.swap_in(conn, "port", doc.id, doc.body, port):
                raise ConflictError(f"Port {doc.id} changed while its groups were set; try again")
        after = dict(current.body)
        after["security_groups"] = (
            [*names, group["name"]] if add else [n for n in names if n != group["name"]]
        )
        write_instance(cloud, server_id, current.body, after, conn=conn)
