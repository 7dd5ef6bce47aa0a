"""Domain errors, each with a stable code that is never reused."""

from __future__ import annotations

__all__ = [
    "ConflictError",
    "InvalidSpec",
    "NotFound",
    "QuotaExceeded",
    "StowageError",
]


class StowageError(Exception):
    """Base of every handled error; `code` is stable and names the failure."""

    code = "stowage.error"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return self.message


class InvalidSpec(StowageError):
    """A flavor extra spec, image property or topology that cannot be honoured as written."""

    code = "spec.invalid"


class NotFound(StowageError):
    """A named thing (host, group, consumer) does not exist."""

    code = "not_found"


class ConflictError(StowageError):
    """A claim lost a race or broke an invariant the ledger enforces."""

    code = "claim.conflict"


class QuotaExceeded(StowageError):
    """A request that would take a project past one of its quotas (compute: 403)."""

    code = "quota.exceeded"
