"""Who asks a service for something: the API's Context satisfies this, and so can the cloud."""

from __future__ import annotations

from typing import Protocol

__all__ = ["Caller"]


class Caller(Protocol):
    @property
    def project_id(self) -> str: ...

    @property
    def is_admin(self) -> bool: ...
