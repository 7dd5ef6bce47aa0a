"""The shapes Nova's create-server schema demands, checked before any field is read."""

from __future__ import annotations

from typing import Any

from stowage.api.common import ApiError

__all__ = ["check_create_shapes"]

_TEXT_MAX = 255


def _bad(field: str, why: str) -> ApiError:
    return ApiError(400, f"Invalid input for field/attribute {field}: {why}")


def _text(value: Any, field: str, *, optional: bool = True) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str) or len(value) > _TEXT_MAX:
        raise _bad(field, f"a string of at most {_TEXT_MAX} characters is required")


def _objects(value: Any, field: str) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise _bad(field, "a list of objects is required")
    return value


def check_create_shapes(server: dict[str, Any]) -> None:
    """Types of the optional fields a build reads: lists of objects, strings, tags."""
    for nic in _networks(server.get("networks", "auto")):
        for key in ("uuid", "port", "fixed_ip", "tag"):
            if key in nic:
                _text(nic[key], f"networks.{key}")
    for mapping in _objects(server.get("block_device_mapping_v2"), "block_device_mapping_v2"):
        for key in ("uuid", "source_type", "destination_type"):
            if key in mapping:
                _text(mapping[key], f"block_device_mapping_v2.{key}")
    for group in _objects(server.get("security_groups"), "security_groups"):
        _text(group.get("name", "default"), "security_groups.name", optional=False)
    for field in ("key_name", "description", "availability_zone", "imageRef"):
        if field in server:
            _text(server[field], field)
    tags = server.get("tags")
    if tags is not None and (
        not isinstance(tags, list) or not all(isinstance(t, str) and t for t in tags)
    ):
        raise _bad("tags", "a list of non-empty strings is required")


def _networks(value: Any) -> list[dict[str, Any]]:
    if value in ("auto", "none"):
        return []
    return _objects(value, "networks")
