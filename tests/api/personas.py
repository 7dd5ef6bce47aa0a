"""A fresh project with Keystone's default personas in it: an admin, a member and a reader."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from typing import Any

from tests.api.cloudproc import RunningCloud
from tests.api.test_identity import Admin, login, osc_as, unique

__all__ = ["Personas", "personas"]

PASSWORD = "persona-secret"


@dataclass(frozen=True)
class Personas:
    cloud: RunningCloud
    project: dict[str, Any]
    users: dict[str, dict[str, Any]]  # role name -> user

    def osc(self, role: str, *args: str) -> subprocess.CompletedProcess[str]:
        """The real CLI as the persona holding `role` on the project."""
        return osc_as(self.cloud, self.users[role]["name"], PASSWORD, self.project["name"], *args)

    def token(self, role: str) -> str:
        return login(self.cloud, self.users[role]["name"], PASSWORD, self.project["name"])


def personas(cloud: RunningCloud, prefix: str = "p") -> Personas:
    admin = Admin(cloud)
    project = admin.project(unique(f"{prefix}-project"))
    users = {}
    for role in ("admin", "member", "reader"):
        user = admin.user(unique(f"{prefix}-{role}"), PASSWORD)
        admin.grant(project["id"], user["id"], role)
        users[role] = user
    return Personas(cloud, project, users)
