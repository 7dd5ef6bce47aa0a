"""Role grants on the system (Keystone's system scope): a "system_assignment" document per
(user, role), whose id is derived from them so that granting twice leaves one. A token scoped
to the system carries these roles (and those they imply) and no project."""

from __future__ import annotations

import contextlib
import hashlib

from stowage.domain.errors import ConflictError, NotFound
from stowage.services.cloud import Cloud
from stowage.services.identity import IdentityDirectory, implied_closure

__all__ = [
    "grant_group_system",
    "grant_system",
    "group_system_role_ids",
    "has_group_system_grant",
    "has_system_grant",
    "missing_grant",
    "revoke_group_system",
    "revoke_system",
    "system_role_ids",
    "system_roles_of",
]

_KIND = "system_assignment"
GROUP_KIND = "system_group_assignment"

# Per holder of a grant: its document kind, the body's field naming the holder, and the
# prefix of the holder in the document's id (as first written, so stored grants keep theirs).
_HOLDERS = {"user": (_KIND, "user_id", ""), "group": (GROUP_KIND, "group_id", "group:")}


def _id(holder: str, holder_id: str, role_id: str) -> str:
    prefix = _HOLDERS[holder][2]
    return hashlib.sha256(f"system:all\0{prefix}{holder_id}\0{role_id}".encode()).hexdigest()


def missing_grant(holder_id: str, role_id: str) -> NotFound:
    """Keystone's answer for a system grant that is not there."""
    return NotFound(
        f"Could not find role assignment with role: {role_id}, user or group: {holder_id}, "
        "project, domain, or system: all.",
        code="identity.role_assignment.not_found",
    )


def _grants(cloud: Cloud, holder: str, holder_id: str | None) -> list[tuple[str, str]]:
    kind, field, _ = _HOLDERS[holder]
    return [
        (d.body[field], d.body["role_id"])
        for d in cloud.objects.list(kind)
        if holder_id is None or d.body[field] == holder_id
    ]


def _has(cloud: Cloud, holder: str, holder_id: str, role_id: str) -> bool:
    return cloud.objects.find(_HOLDERS[holder][0], _id(holder, holder_id, role_id)) is not None


def _grant(cloud: Cloud, holder: str, holder_id: str, role_id: str) -> None:
    kind, field, _ = _HOLDERS[holder]
    body = {field: holder_id, "role_id": role_id}
    with contextlib.suppress(ConflictError):
        cloud.objects.create(kind, _id(holder, holder_id, role_id), body)


def _revoke(cloud: Cloud, holder: str, holder_id: str, role_id: str) -> None:
    if not cloud.objects.delete(_HOLDERS[holder][0], _id(holder, holder_id, role_id)):
        raise missing_grant(holder_id, role_id)


def system_role_ids(cloud: Cloud, user_id: str | None = None) -> list[tuple[str, str]]:
    """(user id, role id) of the system grants, of one user or of all."""
    return _grants(cloud, "user", user_id)


def has_system_grant(cloud: Cloud, user_id: str, role_id: str) -> bool:
    return _has(cloud, "user", user_id, role_id)


def grant_system(cloud: Cloud, user_id: str, role_id: str) -> None:
    directory = IdentityDirectory(cloud)
    directory.user(user_id)
    directory.role(role_id)
    _grant(cloud, "user", user_id, role_id)


def revoke_system(cloud: Cloud, user_id: str, role_id: str) -> None:
    _revoke(cloud, "user", user_id, role_id)
    # Its system-scoped tokens carried the role: they go (recorded with no project).
    IdentityDirectory(cloud).revoke_tokens(user_id=user_id, project_id="")


def group_system_role_ids(cloud: Cloud, group_id: str | None = None) -> list[tuple[str, str]]:
    """(group id, role id) of the groups' system grants, of one group or of all."""
    return _grants(cloud, "group", group_id)


def has_group_system_grant(cloud: Cloud, group_id: str, role_id: str) -> bool:
    return _has(cloud, "group", group_id, role_id)


def grant_group_system(cloud: Cloud, group_id: str, role_id: str) -> None:
    from stowage.services.identity_groups import GroupDirectory

    directory = GroupDirectory(cloud)
    directory.group(group_id)
    directory.role(role_id)
    _grant(cloud, "group", group_id, role_id)


def revoke_group_system(cloud: Cloud, group_id: str, role_id: str) -> None:
    from stowage.services.identity_groups import GroupDirectory

    _revoke(cloud, "group", group_id, role_id)
    directory = GroupDirectory(cloud)
    for member in directory.member_ids(group_id):  # their system tokens carried the role
        directory.revoke_tokens(user_id=member, project_id="")


def system_roles_of(cloud: Cloud, user_id: str) -> tuple[str, ...]:
    """The names of the user's system roles (its own and its groups') and of the roles they
    imply."""
    held = [role_id for _user, role_id in system_role_ids(cloud, user_id)]
    groups = {
        d.body["group_id"]
        for d in cloud.objects.list("group_member")
        if d.body["user_id"] == user_id
    }
    held += [role_id for group, role_id in group_system_role_ids(cloud) if group in groups]
    return tuple(sorted({role.name or "" for role in implied_closure(cloud, held)}))
