"""Who may read and change identity resources: Keystone's defaults for project-scoped tokens,
and a system-scoped reader who reads everything.

Admins manage everything. Anyone else reads only what is theirs: their own user, the
projects they hold a role on, the domains of those, their own role assignments, and the
roles (which are not secret). Showing another's user or project is a 403, as in Keystone;
lists leave out what the caller may not see instead of refusing the whole list.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from stowage.api.auth import cloud_of, require_context
from stowage.api.common import ApiError, Context
from stowage.services.cloud import DEFAULT_DOMAIN
from stowage.services.identity import IdentityDirectory

__all__ = ["Caller", "admin", "caller", "directory", "forbid", "reader_of_all"]


def directory(request: Request) -> IdentityDirectory:
    return IdentityDirectory(cloud_of(request))


def forbid(action: str) -> ApiError:
    return ApiError(403, f"You are not authorized to perform the requested action: {action}.")


@dataclass(frozen=True, slots=True)
class Caller:
    """The caller's context and what of the directory is its own."""

    ctx: Context
    directory: IdentityDirectory

    @property
    def is_admin(self) -> bool:
        return self.ctx.is_admin

    @property
    def is_system(self) -> bool:
        """A system-scoped token: it carries roles and no project (an unscoped one, neither)."""
        return self.ctx.project_id == "" and bool(self.ctx.roles)

    @property
    def reads_all(self) -> bool:
        """An admin, or a reader of the system (Keystone's SYSTEM_READER)."""
        return self.is_admin or (self.is_system and "reader" in self.ctx.roles)

    def project_ids(self) -> set[str]:
        own = {p.id for p in self.directory.projects_of(self.ctx.user_id)}
        return own | {self.ctx.project_id}

    def domain_ids(self) -> set[str]:
        ids = set()
        user = self.directory.objects.find("user", self.ctx.user_id)
        if user is not None:
            ids.add(str(user.body.get("domain_id", DEFAULT_DOMAIN)))
        for project in self.directory.objects.list("project", ids=self.project_ids()):
            ids.add(str(project.body.get("domain_id", DEFAULT_DOMAIN)))
        return ids

    def may_see_user(self, user_id: str) -> bool:
        return self.reads_all or user_id == self.ctx.user_id

    def may_see_project(self, project_id: str) -> bool:
        return self.reads_all or project_id in self.project_ids()

    def may_see_domain(self, domain_id: str) -> bool:
        return self.reads_all or domain_id in self.domain_ids()


def caller(request: Request) -> Caller:
    return Caller(require_context(request), directory(request))


def reader_of_all(request: Request, action: str) -> Caller:
    """The caller, if it is an admin or the system's reader; otherwise a 403 naming the rule."""
    who = caller(request)
    if not who.reads_all:
        raise forbid(f"identity:{action}")
    return who


def admin(request: Request, action: str) -> Caller:
    """The caller, if it is an admin; otherwise a 403 naming Keystone's policy rule."""
    ctx = require_context(request)
    if not ctx.is_admin:
        raise forbid(f"identity:{action}")
    return Caller(ctx, directory(request))
