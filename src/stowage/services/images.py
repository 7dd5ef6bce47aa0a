"""Images: metadata in the document store, data in the state directory (in progress)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stowage.services.cloud import Cloud

__all__ = ["bootstrap_images"]


def bootstrap_images(cloud: Cloud, owner: str) -> None:
    """The small image a fresh cloud starts with (filled in by the image service work)."""
