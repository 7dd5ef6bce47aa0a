"""Groups of users, their members and their role grants, as Keystone's identity and assignment
backends keep them.

A "group" document is named uniquely per domain (the directory's name claims). Membership is a
"group_member" document (id "group:user", name the group's id), so adding a member twice
leaves one. A group's grant is a "group_assignment" document (project_id set for a project
grant) whose id is derived from what it grants, so granting twice leaves one. A user's roles on
a project are the union of its own grants and those of its groups; taking a user out of a
group, or a role from a group, revokes the tokens that carried it, as Keystone does.
"""

from __future__ import annotations

import contextlib
import hashlib
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stowage.domain.errors import ConflictError, NotFound
from stowage.ledger.objects import Document
from stowage.services.cloud import DEFAULT_DOMAIN, Cloud
from stowage.services.identity import (
    Forbidden,
    IdentityDirectory,
    check_name,
    check_text,
    domain_scope_key,
    implied_closure,
)

__all__ = ["GroupDirectory", "GroupGrant", "group_role_ids"]

_MEMBER = "group_member"
_GRANT = "group_assignment"
_SYSTEM_GRANT = "system_group_assignment"  # services/identity_system.py
_FIELDS = {"name", "description", "domain_id"}


@dataclass(frozen=True, slots=True)
class GroupGrant:
    """One role of one group on a project or a domain."""

    id: str
    group_id: str
    role_id: str
    project_id: str | None
    domain_id: str | None


def _grant_of(doc: Document) -> GroupGrant:
    body = doc.body
    return GroupGrant(
        doc.id, body["group_id"], body["role_id"], doc.project_id, body.get("domain_id")
    )


def group_role_ids(cloud: Cloud, user_id: str, project_id: str) -> list[str]:
    """The ids of the roles the user's groups hold on the project (for its tokens)."""
    groups = {
        d.body["group_id"] for d in cloud.objects.list(_MEMBER) if d.body["user_id"] == user_id
    }
    if not groups:
        return []
    return [
        d.body["role_id"]
        for d in cloud.objects.list(_GRANT, project_id=project_id)
        if d.body["group_id"] in groups
    ]


class GroupDirectory(IdentityDirectory):
    """The directory, with groups."""

    # -- groups -------------------------------------------------------------------------

    def group(self, group_id: str) -> Document:
        doc = self.objects.find("group", group_id)
        if doc is None:
            raise NotFound(f"Could not find group: {group_id}.", code="identity.group.not_found")
        return doc

    def groups(self) -> list[Document]:
        return self.objects.list("group")

    def create_group(self, fields: Mapping[str, Any]) -> Document:
        domain_id = str(fields.get("domain_id") or DEFAULT_DOMAIN)
        self.domain(domain_id)
        body = {
            "id": uuid.uuid4().hex,
            "name": check_name("group", fields.get("name")),
            "description": check_text("description", fields.get("description")) or "",
            "domain_id": domain_id,
            # Keystone's group schema allows other attributes: kept and shown as they came.
            "extra": {k: v for k, v in fields.items() if k not in _FIELDS | {"id", "links"}},
        }
        return self._create_named("group", body)

    def update_group(self, group_id: str, changes: Mapping[str, Any]) -> Document:
        doc = self.group(group_id)
        if "domain_id" in changes and changes["domain_id"] != doc.body.get("domain_id"):
            raise Forbidden("Cannot change the domain of a group.")
        body = dict(doc.body)
        if "name" in changes:
            body["name"] = check_name("group", changes["name"])
        if "description" in changes:
            body["description"] = check_text("description", changes["description"]) or ""
        extra = dict(body.get("extra", {}))
        for key, value in changes.items():
            if key not in _FIELDS | {"id", "links"}:
                extra[key] = value
        body["extra"] = extra
        return self._rename("group", doc, body)

    def delete_group(self, group_id: str) -> None:
        """Its memberships and grants go with it, and the tokens they gave."""
        doc = self.group(group_id)
        members = self.member_ids(group_id)
        grants = self.group_grants(group_id=group_id)
        for grant in grants:
            self.objects.delete(_GRANT, grant.id)
        for user_id in members:
            self.objects.delete(_MEMBER, f"{group_id}:{user_id}")
            if self.objects.list(_SYSTEM_GRANT):
                self.revoke_tokens(user_id=user_id, project_id="")
        # Its inherited and system grants go too.
        self._remove_group_links("group_id", group_id)
        self._delete_named("group", doc)
        for grant in grants:
            self._revoke_members(members, grant)

    # -- membership ---------------------------------------------------------------------

    def member_ids(self, group_id: str) -> list[str]:
        return [d.body["user_id"] for d in self.objects.list(_MEMBER, name=group_id)]

    def domains_of(self, user_id: str) -> list[Document]:
        """The enabled domains the user holds a role on, its own or through a group (the
        domains it may scope a token to, Keystone's /v3/auth/domains)."""
        own = {d.id: d for d in super().domains_of(user_id)}
        groups = {g.id for g in self.groups_of(user_id)}
        ids = {
            g.domain_id
            for g in self.group_grants()
            if g.group_id in groups and g.domain_id is not None and g.domain_id not in own
        }
        found = self.objects.list("domain", ids=ids) if ids else []
        more = [d for d in found if d.body.get("enabled", True)]
        return sorted([*own.values(), *more], key=lambda d: (d.created_at, d.id))

    def domain_roles_of(self, user_id: str, domain_id: str) -> tuple[str, ...]:
        """The names of the roles the user holds on the domain, its own and its groups',
        with what they imply: a domain-scoped token's roles (inherited grants are for the
        projects below, not the domain itself, as in Keystone)."""
        role_ids = [g.role_id for g in self.grants(user_id=user_id, domain_id=domain_id)]
        groups = {g.id for g in self.groups_of(user_id)}
        role_ids += [
            g.role_id for g in self.group_grants(domain_id=domain_id) if g.group_id in groups
        ]
        return tuple(sorted({r.name or "" for r in implied_closure(self.cloud, role_ids)}))

    def groups_of(self, user_id: str) -> list[Document]:
        ids = {
            d.body["group_id"] for d in self.objects.list(_MEMBER) if d.body["user_id"] == user_id
        }
        return self.objects.list("group", ids=ids) if ids else []

    def add_member(self, group_id: str, user_id: str) -> None:
        self.group(group_id)
        self.user(user_id)
        with contextlib.suppress(ConflictError):  # already a member: the same result
            self.objects.create(
                _MEMBER,
                f"{group_id}:{user_id}",
                {"group_id": group_id, "user_id": user_id},
                name=group_id,
            )

    def is_member(self, group_id: str, user_id: str) -> bool:
        self.group(group_id)
        self.user(user_id)
        return self.objects.find(_MEMBER, f"{group_id}:{user_id}") is not None

    def remove_member(self, group_id: str, user_id: str) -> None:
        if not self.is_member(group_id, user_id):
            raise NotFound(f"User {user_id} is not a member of group {group_id}.")
        self.objects.delete(_MEMBER, f"{group_id}:{user_id}")
        for grant in self.group_grants(group_id=group_id):
            self._revoke_members([user_id], grant)
        if any(d.body["group_id"] == group_id for d in self.objects.list(_SYSTEM_GRANT)):
            self.revoke_tokens(user_id=user_id, project_id="")  # its system tokens

    # -- grants -------------------------------------------------------------------------

    def group_grants(
        self,
        *,
        group_id: str | None = None,
        project_id: str | None = None,
        domain_id: str | None = None,
        role_id: str | None = None,
    ) -> list[GroupGrant]:
        out = []
        for doc in self.objects.list(_GRANT, project_id=project_id):
            grant = _grant_of(doc)
            if group_id is not None and grant.group_id != group_id:
                continue
            if domain_id is not None and grant.domain_id != domain_id:
                continue
            if role_id is not None and grant.role_id != role_id:
                continue
            out.append(grant)
        return out

    def _grant_id(
        self, group_id: str, role_id: str, project_id: str | None, domain_id: str | None
    ) -> str:
        scope = f"project:{project_id}" if project_id is not None else f"domain:{domain_id}"
        return hashlib.sha256(f"{scope}\0group:{group_id}\0{role_id}".encode()).hexdigest()

    def find_group_grant(
        self, group_id: str, role_id: str, *, project_id: str | None, domain_id: str | None
    ) -> GroupGrant | None:
        doc = self.objects.find(_GRANT, self._grant_id(group_id, role_id, project_id, domain_id))
        return _grant_of(doc) if doc is not None else None

    def grant_group(
        self, group_id: str, role_id: str, *, project_id: str | None, domain_id: str | None
    ) -> GroupGrant:
        """Idempotent, as a user's grant."""
        self.group(group_id)
        self.check_grantable(role_id, project_id=project_id, domain_id=domain_id)
        grant_id = self._grant_id(group_id, role_id, project_id, domain_id)
        body: dict[str, Any] = {"group_id": group_id, "role_id": role_id}
        if domain_id is not None:
            body["domain_id"] = domain_id
        with contextlib.suppress(ConflictError):
            self.objects.create(_GRANT, grant_id, body, project_id=project_id)
        return GroupGrant(grant_id, group_id, role_id, project_id, domain_id)

    def revoke_group(
        self, group_id: str, role_id: str, *, project_id: str | None, domain_id: str | None
    ) -> None:
        grant = self.find_group_grant(group_id, role_id, project_id=project_id, domain_id=domain_id)
        if grant is None:
            raise NotFound(
                f"Could not find role assignment with role: {role_id}, user or group: "
                f"{group_id}, project, domain, or system: {project_id or domain_id}.",
                code="identity.role_assignment.not_found",
            )
        self.objects.delete(_GRANT, grant.id)
        self._revoke_members(self.member_ids(group_id), grant)

    def _revoke_members(self, user_ids: list[str], grant: GroupGrant) -> None:
        if grant.project_id is not None:
            scope = grant.project_id
        elif grant.domain_id is not None:
            scope = domain_scope_key(grant.domain_id)
        else:
            return
        for user_id in user_ids:
            self.revoke_tokens(user_id=user_id, project_id=scope)
