"""The use cases the simulated clients call, in one place: when a signature changes, this
file is the one edit.

Each function does what the API handler does around its service call, and nothing the
handler leaves to the client (no waiting for the result: a client polls). The quota of a
create is counted inside its own transaction (services/quotas.py).
"""

from __future__ import annotations

from typing import Any

from stowage.services import compute, migrations
from stowage.services.caller import SystemCaller
from stowage.services.cloud import Cloud

__all__ = [
    "abort_live_migration",
    "confirm_resize",
    "create",
    "delete",
    "evacuate",
    "move",
    "power",
    "rebuild",
    "revert_resize",
    "snapshot",
]


def create(
    cloud: Cloud,
    *,
    name: str,
    flavor: dict[str, Any],
    image_id: str,
    project_id: str,
    user_id: str,
    min_count: int,
    max_count: int,
    group_id: str | None,
    networks: Any,
    request_id: str,
) -> list[str]:
    build = compute.BuildRequest(
        name=name,
        flavor=flavor,
        image_id=image_id,
        project_id=project_id,
        user_id=user_id,
        min_count=min_count,
        max_count=max_count,
        group_id=group_id,
        networks=networks,
    )
    docs = compute.build_servers(cloud, build, request_id)  # QuotaExceeded: the client's 403
    return [str(d["id"]) for d in docs]


def delete(cloud: Cloud, instance_id: str) -> None:
    compute.delete_server(cloud, instance_id)


def power(cloud: Cloud, instance_id: str, action: str, request_id: str) -> None:
    compute.power_action(cloud, instance_id, action, is_admin=False, request_id=request_id)


def rebuild(cloud: Cloud, instance_id: str, image_id: str) -> None:
    compute.rebuild_server(cloud, instance_id, image_id, None)


def snapshot(cloud: Cloud, instance_id: str, project_id: str, name: str, request_id: str) -> str:
    caller = SystemCaller(project_id, is_admin=False)
    return compute.snapshot_server(cloud, caller, instance_id, name, {}, request_id)


def move(
    cloud: Cloud,
    instance_id: str,
    migration_type: str,
    *,
    user_id: str,
    project_id: str,
    new_flavor: dict[str, Any] | None,
    request_id: str,
) -> str:
    result = migrations.move(
        cloud,
        instance_id,
        migration_type,
        user_id=user_id,
        project_id=project_id,
        new_flavor=new_flavor,
        request_id=request_id,
    )
    return f"{result.status} {result.dest} {result.reason}".strip()


def evacuate(cloud: Cloud, host: str, *, user_id: str, project_id: str) -> str:
    results = migrations.evacuate_host(cloud, host, user_id=user_id, project_id=project_id)
    return " ".join(f"{iid}:{r.status}:{r.dest}" for iid, r in sorted(results.items()))


def confirm_resize(cloud: Cloud, instance_id: str) -> None:
    migrations.confirm_resize(cloud, instance_id)


def revert_resize(cloud: Cloud, instance_id: str) -> None:
    migrations.revert_resize(cloud, instance_id)


def abort_live_migration(cloud: Cloud, instance_id: str, migration_id: str) -> None:
    migrations.abort_live_migration(cloud, instance_id, migration_id)
