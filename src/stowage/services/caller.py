"""Who asks a service for something: the API's Context satisfies this, and so can the cloud."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["Caller", "SystemCaller"]


class Caller(Protocol):
    @property
    def project_id(self) -> str: ...

    @property
    def is_admin(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class SystemCaller:
    """The cloud acting for itself (bootstrap, the conductor, an agent's upload) in a project."""

    project_id: str = ""
    is_admin: bool = True
