"""Networks, subnets and ports in the document store (in progress)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stowage.services.cloud import Cloud

__all__ = ["bootstrap_networks"]


def bootstrap_networks(cloud: Cloud, projects: Mapping[str, str]) -> None:
    """The default network a fresh cloud starts with (filled in by the network work)."""
