"""Inherited role grants (Keystone's OS-INHERIT): a role a user or a group holds on a domain or
a project, inherited by the projects below it (every project of the domain, or the project's
subtree) and not held on the target itself.

Each grant is an "inherited_assignment" document whose id is derived from what it grants, so
granting twice leaves one. Revoking one revokes the tokens of the users it gave the role to.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass
from typing import Any

from stowage.domain.errors import ConflictError, NotFound
from stowage.ledger.objects import Document
from stowage.services.cloud import DEFAULT_DOMAIN, Cloud
from stowage.services.identity_groups import GroupDirectory

__all__ = ["InheritedGrant", "InheritedGrants", "inherited_role_ids"]

KIND = "inherited_assignment"


@dataclass(frozen=True, slots=True)
class InheritedGrant:
    id: str
    actor: str  # "user" or "group"
    actor_id: str
    role_id: str
    domain_id: str | None
    project_id: str | None


def _of(doc: Document) -> InheritedGrant:
    body = doc.body
    actor = "user" if body.get("user_id") else "group"
    return InheritedGrant(
        doc.id,
        actor,
        str(body.get("user_id") or body.get("group_id")),
        str(body["role_id"]),
        body.get("domain_id"),
        body.get("project_id"),
    )


class InheritedGrants:
    def __init__(self, cloud: Cloud) -> None:
        self.cloud = cloud
        self.directory = GroupDirectory(cloud)

    @staticmethod
    def _id(actor: str, actor_id: str, role_id: str, target: str) -> str:
        return hashlib.sha256(
            f"inherited:{target}\0{actor}:{actor_id}\0{role_id}".encode()
        ).hexdigest()

    @staticmethod
    def _target(domain_id: str | None, project_id: str | None) -> str:
        return f"project:{project_id}" if project_id is not None else f"domain:{domain_id}"

    def _must_exist(
        self, actor: str, actor_id: str, role_id: str, domain_id: str | None, project_id: str | None
    ) -> None:
        if actor == "user":
            self.directory.user(actor_id)
        else:
            self.directory.group(actor_id)
        self.directory.check_grantable(role_id, project_id=project_id, domain_id=domain_id)

    def grant(
        self,
        actor: str,
        actor_id: str,
        role_id: str,
        *,
        domain_id: str | None,
        project_id: str | None,
    ) -> InheritedGrant:
        self._must_exist(actor, actor_id, role_id, domain_id, project_id)
        grant_id = self._id(actor, actor_id, role_id, self._target(domain_id, project_id))
        body: dict[str, Any] = {f"{actor}_id": actor_id, "role_id": role_id}
        if project_id is not None:
            body["project_id"] = project_id
        else:
            body["domain_id"] = domain_id
        with contextlib.suppress(ConflictError):
            self.cloud.objects.create(KIND, grant_id, body)
        return InheritedGrant(grant_id, actor, actor_id, role_id, domain_id, project_id)

    def find(
        self,
        actor: str,
        actor_id: str,
        role_id: str,
        *,
        domain_id: str | None,
        project_id: str | None,
    ) -> InheritedGrant:
        """The grant, or Keystone's 404 (after the 404s of a missing actor, role or target)."""
        self._must_exist(actor, actor_id, role_id, domain_id, project_id)
        grant_id = self._id(actor, actor_id, role_id, self._target(domain_id, project_id))
        doc = self.cloud.objects.find(KIND, grant_id)
        if doc is None:
            raise NotFound(
                f"Could not find role assignment with role: {role_id}, user or group: "
                f"{actor_id}, project, domain, or system: {project_id or domain_id}.",
                code="identity.role_assignment.not_found",
            )
        return _of(doc)

    def revoke(
        self,
        actor: str,
        actor_id: str,
        role_id: str,
        *,
        domain_id: str | None,
        project_id: str | None,
    ) -> None:
        grant = self.find(actor, actor_id, role_id, domain_id=domain_id, project_id=project_id)
        self.cloud.objects.delete(KIND, grant.id)
        # The tokens it gave the role to carried it.
        for user_id in self.users_of(grant):
            self.directory.revoke_tokens(user_id=user_id)

    def grants(
        self,
        *,
        actor: str | None = None,
        actor_id: str | None = None,
        domain_id: str | None = None,
        project_id: str | None = None,
        role_id: str | None = None,
    ) -> list[InheritedGrant]:
        out = []
        for doc in self.cloud.objects.list(KIND):
            grant = _of(doc)
            if actor is not None and grant.actor != actor:
                continue
            if actor_id is not None and grant.actor_id != actor_id:
                continue
            if domain_id is not None and grant.domain_id != domain_id:
                continue
            if project_id is not None and grant.project_id != project_id:
                continue
            if role_id is not None and grant.role_id != role_id:
                continue
            out.append(grant)
        return out

    def users_of(self, grant: InheritedGrant) -> list[str]:
        if grant.actor == "user":
            return [grant.actor_id]
        return self.directory.member_ids(grant.actor_id)

    def projects_of(self, grant: InheritedGrant) -> list[Document]:
        """The projects that inherit the grant: the domain's, or those below the project."""
        if grant.project_id is not None:
            project = self.cloud.objects.find("project", grant.project_id)
            return self.directory.subtree(project) if project is not None else []
        return [
            p
            for p in self.directory.projects()
            if str(p.body.get("domain_id", DEFAULT_DOMAIN)) == grant.domain_id
        ]

    def applies_to(self, grant: InheritedGrant, project: Document) -> bool:
        if grant.domain_id is not None:
            return str(project.body.get("domain_id", DEFAULT_DOMAIN)) == grant.domain_id
        return grant.project_id in {p.id for p in self.directory.parents(project)}


def inherited_role_ids(cloud: Cloud, user_id: str, project_id: str) -> list[str]:
    """The roles the user (or its groups) inherits on the project, for its tokens."""
    docs = cloud.objects.list(KIND)
    if not docs:
        return []
    project = cloud.objects.find("project", project_id)
    if project is None:
        return []
    inherited = InheritedGrants(cloud)
    groups = {g.id for g in inherited.directory.groups_of(user_id)}
    out = []
    for doc in docs:
        grant = _of(doc)
        mine = (grant.actor == "user" and grant.actor_id == user_id) or (
            grant.actor == "group" and grant.actor_id in groups
        )
        if mine and inherited.applies_to(grant, project):
            out.append(grant.role_id)
    return out
