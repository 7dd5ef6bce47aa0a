"""The JSON schemas glance serves at /v2/schemas/image(s) and /v2/schemas/member(s)."""

from __future__ import annotations

from typing import Any

from stowage.services.images import CONTAINER_FORMATS, DISK_FORMATS, MEMBER_STATUSES

__all__ = ["UUID_PATTERN", "image_schema", "images_schema", "member_schema", "members_schema"]

UUID_PATTERN = (
    "^([0-9a-fA-F]){8}-([0-9a-fA-F]){4}-([0-9a-fA-F]){4}-([0-9a-fA-F]){4}-([0-9a-fA-F]){12}$"
)


def _nullable(kind: str, description: str, **extra: Any) -> dict[str, Any]:
    return {"type": [kind, "null"], "description": description, **extra}


def _read_only(kind: str | list[str], description: str, **extra: Any) -> dict[str, Any]:
    return {"type": kind, "readOnly": True, "description": description, **extra}


def image_schema() -> dict[str, Any]:
    return {
        "name": "image",
        "additionalProperties": {"type": "string"},
        "properties": {
            "id": {
                "type": "string",
                "description": "An identifier for the image",
                "pattern": UUID_PATTERN,
            },
            "name": _nullable("string", "Descriptive name for the image", maxLength=255),
            "status": _read_only(
                "string",
                "Status of the image",
                enum=[
                    "queued",
                    "saving",
                    "active",
                    "killed",
                    "deleted",
                    "uploading",
                    "importing",
                    "pending_delete",
                    "deactivated",
                ],
            ),
            "visibility": {
                "type": "string",
                "description": "Scope of image accessibility",
                "enum": ["community", "public", "private", "shared"],
            },
            "protected": {
                "type": "boolean",
                "description": "If true, image will not be deletable.",
            },
            "os_hidden": {
                "type": "boolean",
                "description": "If true, image will not appear in default image list response.",
            },
            "checksum": _read_only(["null", "string"], "md5 hash of image contents.", maxLength=32),
            "os_hash_algo": _read_only(
                ["null", "string"], "Algorithm to calculate the os_hash_value", maxLength=64
            ),
            "os_hash_value": _read_only(
                ["null", "string"], "Hexdigest of the image contents", maxLength=128
            ),
            "owner": _nullable("string", "Owner of the image", maxLength=255),
            "size": _read_only(["null", "integer"], "Size of image file in bytes"),
            "virtual_size": _read_only(["null", "integer"], "Virtual size of image in bytes"),
            "container_format": {
                "type": ["null", "string"],
                "description": "Format of the container",
                "enum": [None, *CONTAINER_FORMATS],
            },
            "disk_format": {
                "type": ["null", "string"],
                "description": "Format of the disk",
                "enum": [None, *DISK_FORMATS],
            },
            "created_at": _read_only("string", "Date and time of image registration"),
            "updated_at": _read_only("string", "Date and time of the last image modification"),
            "tags": {
                "type": "array",
                "description": "List of strings related to the image",
                "items": {"type": "string", "maxLength": 255},
            },
            "direct_url": _read_only(
                "string", "URL to access the image file kept in external store"
            ),
            "min_ram": {
                "type": "integer",
                "description": "Amount of ram (in MB) required to boot image.",
            },
            "min_disk": {
                "type": "integer",
                "description": "Amount of disk space (in GB) required to boot image.",
            },
            "self": _read_only("string", "An image self url"),
            "file": _read_only("string", "An image file url"),
            "schema": _read_only("string", "An image schema url"),
            "locations": {
                "type": "array",
                "description": "A set of URLs to access the image file kept in external store",
                "items": {"type": "object"},
            },
        },
        "links": [
            {"rel": "self", "href": "{self}"},
            {"rel": "enclosure", "href": "{file}"},
            {"rel": "describedby", "href": "{schema}"},
        ],
    }


def images_schema() -> dict[str, Any]:
    return {
        "name": "images",
        "properties": {
            "images": {"type": "array", "items": image_schema()},
            "schema": {"type": "string"},
            "first": {"type": "string"},
            "next": {"type": "string"},
        },
        "links": [
            {"rel": "first", "href": "{first}"},
            {"rel": "next", "href": "{next}"},
            {"rel": "describedby", "href": "{schema}"},
        ],
    }


def member_schema() -> dict[str, Any]:
    return {
        "name": "member",
        "properties": {
            "created_at": {
                "type": "string",
                "description": "Date and time of image member creation",
            },
            "image_id": {
                "type": "string",
                "description": "An identifier for the image",
                "pattern": UUID_PATTERN,
            },
            "member_id": {
                "type": "string",
                "description": "An identifier for the image member (tenantId)",
            },
            "schema": {"type": "string", "readOnly": True},
            "status": {
                "type": "string",
                "description": "The status of this image member",
                "enum": list(MEMBER_STATUSES),
            },
            "updated_at": {
                "type": "string",
                "description": "Date and time of last modification of image member",
            },
        },
    }


def members_schema() -> dict[str, Any]:
    return {
        "name": "members",
        "properties": {
            "members": {"type": "array", "items": member_schema()},
            "schema": {"type": "string"},
        },
        "links": [{"rel": "describedby", "href": "{schema}"}],
    }
