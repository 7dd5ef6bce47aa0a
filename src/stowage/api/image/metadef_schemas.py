"""The JSON schemas glance serves at /v2/schemas/metadefs/*: a namespace, a resource-type
association, an object, a property and a tag, each with its list schema."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from stowage.services.metadefs import PROPERTY_TYPES

__all__ = ["METADEF_SCHEMAS"]


def _string(description: str, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "description": description, **extra}


def _stamp(description: str) -> dict[str, Any]:
    return _string(description, format="date-time", readOnly=True)


_STAMPS = {
    "created_at": _stamp("Date and time of the creation (READ-ONLY)"),
    "updated_at": _stamp("Date and time of the last modification (READ-ONLY)"),
}


def _definitions() -> dict[str, Any]:
    return {
        "positiveInteger": {"type": "integer", "minimum": 0},
        "positiveIntegerDefault0": {"allOf": [{"$ref": "#/definitions/positiveInteger"}]},
        "stringArray": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
        "property": {
            "type": "object",
            "additionalProperties": {"type": "object", **_property_body()},
        },
    }


def _property_body() -> dict[str, Any]:
    return {
        "required": ["title", "type"],
        "properties": {
            "name": {"type": "string", "maxLength": 255},
            "title": {"type": "string"},
            "description": {"type": "string"},
            "operators": {"type": "array", "items": {"type": "string"}},
            "type": {"type": "string", "enum": [*PROPERTY_TYPES, None]},
            "required": {"$ref": "#/definitions/stringArray"},
            "minimum": {"type": "number"},
            "maximum": {"type": "number"},
            "maxLength": {"$ref": "#/definitions/positiveInteger"},
            "minLength": {"$ref": "#/definitions/positiveIntegerDefault0"},
            "pattern": {"type": "string", "format": "regex"},
            "enum": {"type": "array"},
            "readonly": {"type": "boolean"},
            "default": {},
            "items": {
                "type": "object",
                "properties": {
                    "type": {"type": "string", "enum": [*PROPERTY_TYPES, None]},
                    "enum": {"type": "array"},
                },
            },
            "maxItems": {"$ref": "#/definitions/positiveInteger"},
            "minItems": {"$ref": "#/definitions/positiveIntegerDefault0"},
            "uniqueItems": {"type": "boolean", "default": False},
            "additionalItems": {"type": "boolean"},
        },
    }


def _association_properties() -> dict[str, Any]:
    return {
        "name": _string(
            "Resource type names should be aligned with Heat resource types.", maxLength=80
        ),
        "prefix": _string("Specifies the prefix to use for the given resource type.", maxLength=80),
        "properties_target": _string(
            "Some resource types allow more than one key / value pair per instance.",
            maxLength=80,
        ),
        **_STAMPS,
    }


def _object_properties() -> dict[str, Any]:
    return {
        "name": {"type": "string", "maxLength": 255},
        "description": {"type": "string"},
        "required": {"$ref": "#/definitions/stringArray"},
        "properties": {"$ref": "#/definitions/property"},
        "schema": {"type": "string", "readOnly": True},
        "self": {"type": "string", "readOnly": True},
        **_STAMPS,
    }


def namespace_schema() -> dict[str, Any]:
    return {
        "name": "namespace",
        "additionalProperties": False,
        "required": ["namespace"],
        "definitions": _definitions(),
        "properties": {
            "namespace": _string("The unique namespace text.", maxLength=80),
            "display_name": _string("The user friendly name for the namespace.", maxLength=80),
            "description": _string("Provides a user friendly description.", maxLength=500),
            "visibility": _string("Scope of namespace accessibility.", enum=["public", "private"]),
            "protected": {"type": "boolean", "description": "If true, it cannot be deleted."},
            "owner": _string("Owner of the namespace.", maxLength=255),
            **_STAMPS,
            "schema": {"type": "string", "readOnly": True},
            "self": {"type": "string", "readOnly": True},
            "resource_type_associations": {
                "type": "array",
                "items": {"type": "object", "properties": _association_properties()},
            },
            "properties": {"$ref": "#/definitions/property"},
            "objects": {
                "type": "array",
                "items": {"type": "object", "properties": _object_properties()},
            },
            "tags": {
                "type": "array",
                "items": {"type": "object", "properties": {"name": {"type": "string"}}},
            },
        },
    }


def association_schema() -> dict[str, Any]:
    return {
        "name": "resource_type_association",
        "additionalProperties": False,
        "required": ["name"],
        "properties": _association_properties(),
    }


def object_schema() -> dict[str, Any]:
    return {
        "name": "object",
        "additionalProperties": False,
        "required": ["name"],
        "definitions": _definitions(),
        "properties": _object_properties(),
    }


def property_schema() -> dict[str, Any]:
    return {"name": "property", "definitions": _definitions(), **_property_body()}


def tag_schema() -> dict[str, Any]:
    return {
        "name": "tag",
        "additionalProperties": False,
        "required": ["name"],
        "properties": {"name": {"type": "string", "maxLength": 255}, **_STAMPS},
    }


def _collection(name: str, item: dict[str, Any], key: str) -> dict[str, Any]:
    return {
        "name": name,
        "properties": {
            key: {"type": "array", "items": item},
            "first": {"type": "string"},
            "next": {"type": "string"},
            "schema": {"type": "string"},
        },
        "links": [
            {"rel": "first", "href": "{first}"},
            {"rel": "next", "href": "{next}"},
            {"rel": "describedby", "href": "{schema}"},
        ],
    }


def _properties_collection() -> dict[str, Any]:
    return {
        "name": "properties",
        "definitions": _definitions(),
        "properties": {"properties": {"$ref": "#/definitions/property"}},
    }


METADEF_SCHEMAS: dict[str, Callable[[], dict[str, Any]]] = {
    "namespace": namespace_schema,
    "namespaces": lambda: _collection("namespaces", namespace_schema(), "namespaces"),
    "resource_type": association_schema,
    "resource_types": lambda: _collection(
        "resource_type_associations", association_schema(), "resource_type_associations"
    ),
    "object": object_schema,
    "objects": lambda: _collection("objects", object_schema(), "objects"),
    "property": property_schema,
    "properties": _properties_collection,
    "tag": tag_schema,
    "tags": lambda: _collection("tags", tag_schema(), "tags"),
}
