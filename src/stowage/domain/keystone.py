"""What a client sends Keystone to log in: pure data, shared by every caller of the identity API
(the CLI, the dashboard, agents fetching images, the benchmarks)."""

from __future__ import annotations

from typing import Any

__all__ = ["password_login"]


def password_login(
    user: str, password: str, project: str, domain: str = "Default"
) -> dict[str, Any]:
    """The body of `POST /v3/auth/tokens`: a password login of `user` scoped to `project`, both
    in `domain`."""
    return {
        "auth": {
            "identity": {
                "methods": ["password"],
                "password": {
                    "user": {"name": user, "domain": {"name": domain}, "password": password}
                },
            },
            "scope": {"project": {"name": project, "domain": {"name": domain}}},
        }
    }
