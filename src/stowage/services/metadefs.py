"""Glance's metadata definitions: namespaces with their objects, properties, tags and
resource-type associations, one document of kind "metadef_namespace" per namespace.

The document's id is the namespace's name, so the database's key keeps names unique (a
rename writes the new document and deletes the old one in one transaction). Everything
inside a namespace lives in its body and is changed by compare-and-swap of the whole
namespace (`modify_document`), so two writers never lose each other's objects or tags.
Resource types are documents of kind "metadef_resource_type" keyed by name; the cloud starts
with Glance's usual ones, and associating a namespace with a new name creates it, as in Glance.

Policies as Glance's defaults: anyone reads a public namespace and its contents, a private one
only its owner's project (and an admin); only an admin writes. A protected namespace and what
it holds cannot be deleted (403) until `protected` is turned off.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy.exc import IntegrityError

from stowage.domain.errors import ConflictError
from stowage.services.caller import Caller
from stowage.services.documents import modify_document
from stowage.services.images import ImageConflict, ImageForbidden, ImageInvalid, ImageNotFound

if TYPE_CHECKING:
    from stowage.services.cloud import Cloud

__all__ = [
    "DEFAULT_RESOURCE_TYPES",
    "PROPERTY_TYPES",
    "NamespaceQuery",
    "add_object",
    "add_property",
    "add_tag",
    "associate",
    "bootstrap_metadefs",
    "create_namespace",
    "delete_namespace",
    "delete_namespace_part",
    "dissociate",
    "get_namespace",
    "get_part",
    "list_namespaces",
    "list_resource_types",
    "render_association",
    "render_namespace",
    "render_object",
    "render_property",
    "render_tag",
    "replace_tags",
    "update_namespace",
    "update_object",
    "update_property",
    "update_tag",
]

KIND = "metadef_namespace"
RESOURCE_TYPE_KIND = "metadef_resource_type"
DEFAULT_RESOURCE_TYPES = (
    "OS::Glance::Image",
    "OS::Cinder::Volume",
    "OS::Nova::Flavor",
    "OS::Nova::Aggregate",
    "OS::Nova::Server",
)
VISIBILITIES = ("public", "private")
PROPERTY_TYPES = ("array", "boolean", "integer", "number", "object", "string")
NAMESPACE_MAX = 80
NAME_MAX = 255
DESCRIPTION_MAX = 500
# The namespace's parts as they sit in the body, keyed by name.
PARTS = ("objects", "properties", "tags", "resource_type_associations")
SORT_KEYS = ("created_at", "updated_at", "namespace", "display_name")


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _invalid(detail: str, schema: str = "namespace") -> ImageInvalid:
    return ImageInvalid(f"Provided object does not match schema '{schema}': {detail}")


def _text(body: Mapping[str, Any], key: str, limit: int, schema: str) -> str | None:
    value = body.get(key)
    if value is not None and (not isinstance(value, str) or len(value) > limit):
        raise _invalid(f"{key} must be a string of at most {limit} characters", schema)
    return value


def _name(body: Mapping[str, Any], key: str, limit: int, schema: str) -> str:
    value = _text(body, key, limit, schema)
    if not value:
        raise _invalid(f"'{key}' is a required property", schema)
    return value


# -- reading ----------------------------------------------------------------------------------


def _readable(body: Mapping[str, Any], caller: Caller) -> bool:
    return (
        caller.is_admin
        or body.get("visibility") == "public"
        or body.get("owner") == caller.project_id
    )


def _load(cloud: Cloud, caller: Caller, namespace: str) -> dict[str, Any]:
    doc = cloud.objects.find(KIND, namespace)
    if doc is None or not _readable(doc.body, caller):
        raise ImageNotFound(f"Metadata definition namespace={namespace} was not found.")
    return doc.body


def _must_admin(caller: Caller) -> None:
    if not caller.is_admin:
        raise ImageForbidden("You are not authorized to complete this action.")


def get_namespace(cloud: Cloud, caller: Caller, namespace: str) -> dict[str, Any]:
    """The stored body of a namespace the caller may read, or 404."""
    return _load(cloud, caller, namespace)


class NamespaceQuery:
    """A namespace list request: visibility, resource types (any of), sort, page."""

    def __init__(
        self,
        *,
        visibility: str | None = None,
        resource_types: list[str] | None = None,
        sort_key: str = "created_at",
        sort_dir: str = "desc",
        limit: int = 20,
        marker: str | None = None,
    ) -> None:
        if visibility is not None and visibility not in VISIBILITIES:
            raise ImageInvalid(f"Invalid visibility value: {visibility}")
        if sort_key not in SORT_KEYS:
            raise ImageInvalid(f"Invalid sort key: {sort_key}")
        if sort_dir not in ("asc", "desc"):
            raise ImageInvalid(f"Invalid sort direction: {sort_dir}")
        self.visibility = visibility
        self.resource_types = resource_types or []
        self.sort_key = sort_key
        self.sort_dir = sort_dir
        self.limit = limit
        self.marker = marker


def list_namespaces(
    cloud: Cloud, caller: Caller, query: NamespaceQuery
) -> tuple[list[dict[str, Any]], bool]:
    """One page of the namespaces the caller may read, and whether another may follow."""
    bodies = [
        doc.body
        for doc in cloud.objects.list(KIND)
        if _readable(doc.body, caller)
        and (query.visibility is None or doc.body.get("visibility") == query.visibility)
        and (
            not query.resource_types
            or any(t in doc.body["resource_type_associations"] for t in query.resource_types)
        )
    ]
    bodies.sort(key=lambda b: b["namespace"])
    bodies.sort(key=lambda b: b.get(query.sort_key) or "", reverse=query.sort_dir == "desc")
    if query.marker is not None:
        names = [b["namespace"] for b in bodies]
        if query.marker not in names:
            raise ImageNotFound(f"Metadata definition namespace={query.marker} was not found.")
        bodies = bodies[names.index(query.marker) + 1 :]
    page = bodies[: query.limit]
    return page, len(page) == query.limit and query.limit > 0


def list_resource_types(cloud: Cloud) -> list[dict[str, Any]]:
    return [doc.body for doc in cloud.objects.list(RESOURCE_TYPE_KIND)]


# -- rendering --------------------------------------------------------------------------------


def _drop_none(out: dict[str, Any]) -> dict[str, Any]:
    """Glance leaves unset optional fields out of a metadef rather than showing null."""
    return {k: v for k, v in out.items() if v is not None}


def render_association(name: str, part: Mapping[str, Any]) -> dict[str, Any]:
    return _drop_none({"name": name, **part})


def render_object(namespace: str, name: str, part: Mapping[str, Any]) -> dict[str, Any]:
    return _drop_none(
        {
            "name": name,
            **part,
            "schema": "/v2/schemas/metadefs/object",
            "self": f"/v2/metadefs/namespaces/{namespace}/objects/{name}",
        }
    )


def render_property(name: str, part: Mapping[str, Any]) -> dict[str, Any]:
    return _drop_none({"name": name, **part})


def render_tag(name: str, part: Mapping[str, Any]) -> dict[str, Any]:
    return {"name": name, **part}


def render_namespace(
    body: Mapping[str, Any], *, contents: bool, resource_type: str | None = None
) -> dict[str, Any]:
    """A namespace as glance shows it: in a list without its objects, properties and tags.
    For a `resource_type` it is associated with, property names carry that association's
    prefix (Glance's show with `?resource_type=`: `hw:` before a flavor's properties)."""
    name = body["namespace"]
    association = body["resource_type_associations"].get(resource_type or "") or {}
    prefix = str(association.get("prefix") or "")
    out: dict[str, Any] = {
        key: body.get(key)
        for key in (
            "namespace",
            "display_name",
            "description",
            "visibility",
            "protected",
            "owner",
            "created_at",
            "updated_at",
        )
    }
    associations = body["resource_type_associations"]
    if associations:
        out["resource_type_associations"] = [
            render_association(k, v) for k, v in associations.items()
        ]
    if contents:
        if body["properties"]:
            out["properties"] = {
                prefix + k: _drop_none(dict(v)) for k, v in body["properties"].items()
            }
        if body["objects"]:
            out["objects"] = [
                {
                    x: ({prefix + p: d for p, d in y.items()} if x == "properties" else y)
                    for x, y in render_object(name, k, v).items()
                    if x not in ("schema", "self", "created_at", "updated_at")
                }
                for k, v in body["objects"].items()
            ]
        if body["tags"]:
            out["tags"] = [{"name": k} for k in body["tags"]]
    out["schema"] = "/v2/schemas/metadefs/namespace"
    out["self"] = f"/v2/metadefs/namespaces/{name}"
    return _drop_none(out)


# -- parts ------------------------------------------------------------------------------------


def _stamped(cloud: Cloud, part: dict[str, Any], old: Mapping[str, Any] | None) -> dict[str, Any]:
    now = _iso(cloud.clock())
    part["created_at"] = now if old is None else old["created_at"]
    part["updated_at"] = now
    return part


def _property(body: Any) -> tuple[str, dict[str, Any]]:
    """A property definition (Glance's metadef property schema: a name, title and type)."""
    if not isinstance(body, Mapping):
        raise _invalid("a property must be an object", "property")
    name = _name(body, "name", NAME_MAX, "property")
    title = _name(body, "title", NAME_MAX, "property")
    kind = body.get("type")
    if kind not in PROPERTY_TYPES:
        raise _invalid(f"{kind!r} is not one of {list(PROPERTY_TYPES)} (type)", "property")
    _text(body, "description", DESCRIPTION_MAX, "property")
    enum = body.get("enum")
    if enum is not None and (not isinstance(enum, list) or len(set(map(repr, enum))) < len(enum)):
        raise _invalid("enum must be a list of distinct values", "property")
    part = {k: v for k, v in body.items() if k != "name"}
    part["title"] = title
    return name, part


def _object(body: Any) -> tuple[str, dict[str, Any]]:
    if not isinstance(body, Mapping):
        raise _invalid("an object must be a JSON object", "object")
    name = _name(body, "name", NAME_MAX, "object")
    description = _text(body, "description", DESCRIPTION_MAX, "object")
    required = body.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise _invalid("required must be a list of property names", "object")
    properties = body.get("properties", {})
    if not isinstance(properties, Mapping):
        raise _invalid("properties must be an object", "object")
    checked = dict(_property({**v, "name": k}) for k, v in properties.items())
    return name, {"description": description, "required": required, "properties": checked}


def _tag(body: Any) -> str:
    if not isinstance(body, Mapping):
        raise _invalid("a tag must be an object", "tag")
    return _name(body, "name", NAME_MAX, "tag")


def _association(body: Any) -> tuple[str, dict[str, Any]]:
    if not isinstance(body, Mapping):
        raise _invalid("an association must be an object", "resource_type_association")
    name = _name(body, "name", NAME_MAX, "resource_type_association")
    prefix = _text(body, "prefix", 80, "resource_type_association")
    target = _text(body, "properties_target", NAME_MAX, "resource_type_association")
    return name, {"prefix": prefix, "properties_target": target}


def _namespace_fields(body: Any, caller: Caller) -> dict[str, Any]:
    """The namespace's own fields from a create or update body, checked; as Glance, what an
    update leaves out takes the create's default (private, unprotected, the caller's)."""
    if not isinstance(body, Mapping):
        raise _invalid("the body must be a JSON object")
    visibility = body.get("visibility", "private")
    if visibility not in VISIBILITIES:
        raise _invalid(f"{visibility!r} is not one of {list(VISIBILITIES)} (visibility)")
    protected = body.get("protected", False)
    if not isinstance(protected, bool):
        raise _invalid(f"{protected!r} is not of type 'boolean' (protected)")
    return {
        "namespace": _name(body, "namespace", NAMESPACE_MAX, "namespace"),
        "display_name": _text(body, "display_name", NAMESPACE_MAX, "namespace"),
        "description": _text(body, "description", DESCRIPTION_MAX, "namespace"),
        "visibility": visibility,
        "protected": protected,
        "owner": _text(body, "owner", NAME_MAX, "namespace") or caller.project_id,
    }


def _ensure_resource_types(cloud: Cloud, names: list[str]) -> None:
    for name in names:
        if cloud.objects.find(RESOURCE_TYPE_KIND, name) is None:
            now = _iso(cloud.clock())
            # A concurrent association may make the same type first: that one stands.
            with contextlib.suppress(ConflictError):
                cloud.objects.create(
                    RESOURCE_TYPE_KIND,
                    name,
                    {"name": name, "created_at": now, "updated_at": now},
                    name=name,
                )


# -- namespaces -------------------------------------------------------------------------------


def create_namespace(cloud: Cloud, caller: Caller, request: Any) -> dict[str, Any]:
    """A new namespace, with any objects, properties, tags and associations it names."""
    _must_admin(caller)
    fields = _namespace_fields(request, caller)
    owner = fields["owner"]
    now = _iso(cloud.clock())
    body: dict[str, Any] = {
        **fields,
        "created_at": now,
        "updated_at": now,
        "objects": {},
        "properties": {},
        "tags": {},
        "resource_type_associations": {},
    }
    for raw in _list_of(request, "resource_type_associations"):
        name, part = _association(raw)
        body["resource_type_associations"][name] = _stamped(cloud, part, None)
    for raw in _list_of(request, "objects"):
        name, part = _object(raw)
        body["objects"][name] = _stamped(cloud, part, None)
    properties = request.get("properties") or {}
    if not isinstance(properties, Mapping):
        raise _invalid("properties must be an object")
    for key, raw in properties.items():
        name, part = _property({**raw, "name": key} if isinstance(raw, Mapping) else raw)
        body["properties"][name] = part
    for raw in _list_of(request, "tags"):
        body["tags"][_tag(raw)] = _stamped(cloud, {}, None)
    _ensure_resource_types(cloud, list(body["resource_type_associations"]))
    try:
        cloud.objects.create(
            KIND, body["namespace"], body, project_id=owner, name=body["namespace"]
        )
    except ConflictError:
        raise _taken(body["namespace"]) from None
    return body


def _taken(namespace: str) -> ImageConflict:
    return ImageConflict(f"Metadata definition namespace={namespace} already exists.")


def _list_of(request: Mapping[str, Any], key: str) -> list[Any]:
    value = request.get(key) or []
    if not isinstance(value, list):
        raise _invalid(f"{key} must be a list")
    return value


def update_namespace(cloud: Cloud, caller: Caller, namespace: str, request: Any) -> dict[str, Any]:
    """Replace the namespace's own fields (Glance's PUT); a new `namespace` renames it."""
    _must_admin(caller)
    _load(cloud, caller, namespace)
    fields = _namespace_fields(request, caller)
    now = _iso(cloud.clock())
    if fields["namespace"] == namespace:
        return modify_document(cloud, KIND, namespace, lambda b: {**b, **fields, "updated_at": now})
    # The new name's document and the old one's removal commit together; the key on the
    # document's id refuses a name taken meanwhile, and the whole rename with it.
    try:
        with cloud.ledger.engine.begin() as conn:
            current = cloud.objects.find_in(conn, KIND, namespace)
            if current is None:
                raise ImageNotFound(f"Metadata definition namespace={namespace} was not found.")
            if cloud.objects.find_in(conn, KIND, fields["namespace"]) is not None:
                raise _taken(fields["namespace"])
            new = {**current.body, **fields, "updated_at": now}
            cloud.objects.create_in(
                conn, KIND, new["namespace"], new, project_id=new["owner"], name=new["namespace"]
            )
            cloud.objects.delete_in(conn, KIND, namespace)
    except IntegrityError:
        raise _taken(fields["namespace"]) from None
    return new


def delete_namespace(cloud: Cloud, caller: Caller, namespace: str) -> None:
    _must_admin(caller)
    body = _load(cloud, caller, namespace)
    if body.get("protected"):
        raise ImageForbidden(f"Namespace {namespace} is protected and cannot be deleted.")
    with cloud.ledger.engine.begin() as conn:
        current = cloud.objects.find_in(conn, KIND, namespace)
        if current is not None and current.body.get("protected"):
            raise ImageForbidden(f"Namespace {namespace} is protected and cannot be deleted.")
        cloud.objects.delete_in(conn, KIND, namespace)


# -- what a namespace holds -------------------------------------------------------------------

_LABELS = {
    "objects": "Metadata definition object",
    "properties": "Metadata definition property",
    "tags": "Metadata definition tag",
    "resource_type_associations": "Metadata definition resource-type association",
}


def _change_part(
    cloud: Cloud,
    caller: Caller,
    namespace: str,
    part: str,
    change: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    """Apply `change` to one map of the namespace (objects, properties, tags or associations)
    as it is now, by compare-and-swap of the namespace; an admin's write only."""
    _must_admin(caller)
    _load(cloud, caller, namespace)
    now = _iso(cloud.clock())

    def apply(body: dict[str, Any]) -> dict[str, Any]:
        new = copy.deepcopy(body)
        change(new[part])
        new["updated_at"] = now
        return new

    return modify_document(cloud, KIND, namespace, apply)


def get_part(cloud: Cloud, caller: Caller, namespace: str, part: str, name: str) -> dict[str, Any]:
    """One object, property or tag of a namespace the caller may read, or 404."""
    items = _load(cloud, caller, namespace)[part]
    if name not in items:
        raise _missing(part, name, namespace)
    return items[name]  # type: ignore[no-any-return]


def _missing(part: str, name: str, namespace: str) -> ImageNotFound:
    return ImageNotFound(f"{_LABELS[part]} {name} was not found in namespace={namespace}.")


def _exists(part: str, name: str, namespace: str) -> ImageConflict:
    return ImageConflict(f"{_LABELS[part]} {name} already exists in namespace={namespace}.")


def _add(
    cloud: Cloud, caller: Caller, namespace: str, part: str, name: str, value: dict[str, Any]
) -> dict[str, Any]:
    def change(items: dict[str, Any]) -> None:
        if name in items:
            raise _exists(part, name, namespace)
        items[name] = value if part == "properties" else _stamped(cloud, dict(value), None)

    return _change_part(cloud, caller, namespace, part, change)[part][name]  # type: ignore[no-any-return]


def _replace(
    cloud: Cloud,
    caller: Caller,
    namespace: str,
    part: str,
    name: str,
    new_name: str,
    value: dict[str, Any],
) -> dict[str, Any]:
    """Replace (and perhaps rename) one item; the other items keep their place."""

    def change(items: dict[str, Any]) -> None:
        if name not in items:
            raise _missing(part, name, namespace)
        if new_name != name and new_name in items:
            raise _exists(part, new_name, namespace)
        old = items[name]
        stamped = value if part == "properties" else _stamped(cloud, dict(value), old)
        replaced = {
            (new_name if k == name else k): (stamped if k == name else v) for k, v in items.items()
        }
        items.clear()
        items.update(replaced)

    return _change_part(cloud, caller, namespace, part, change)[part][new_name]  # type: ignore[no-any-return]


def delete_namespace_part(
    cloud: Cloud, caller: Caller, namespace: str, part: str, name: str | None
) -> None:
    """Remove one object, property, tag or association (`name`), or every tag (None)."""

    def change(items: dict[str, Any]) -> None:
        if name is None:
            items.clear()
        elif items.pop(name, None) is None:
            raise _missing(part, name, namespace)

    body = _load(cloud, caller, namespace)
    _must_admin(caller)
    if body.get("protected"):
        what = "namespace's contents" if name is None else f"{part[:-1]} {name}"
        raise ImageForbidden(f"Namespace {namespace} is protected: its {what} cannot be deleted.")
    _change_part(cloud, caller, namespace, part, change)


def add_object(cloud: Cloud, caller: Caller, namespace: str, request: Any) -> dict[str, Any]:
    name, part = _object(request)
    return render_object(namespace, name, _add(cloud, caller, namespace, "objects", name, part))


def update_object(
    cloud: Cloud, caller: Caller, namespace: str, name: str, request: Any
) -> dict[str, Any]:
    new_name, part = _object(request)
    stored = _replace(cloud, caller, namespace, "objects", name, new_name, part)
    return render_object(namespace, new_name, stored)


def add_property(cloud: Cloud, caller: Caller, namespace: str, request: Any) -> dict[str, Any]:
    name, part = _property(request)
    return render_property(name, _add(cloud, caller, namespace, "properties", name, part))


def update_property(
    cloud: Cloud, caller: Caller, namespace: str, name: str, request: Any
) -> dict[str, Any]:
    new_name, part = _property(request)
    return render_property(
        new_name, _replace(cloud, caller, namespace, "properties", name, new_name, part)
    )


def add_tag(cloud: Cloud, caller: Caller, namespace: str, name: str) -> dict[str, Any]:
    _name({"name": name}, "name", NAME_MAX, "tag")
    return render_tag(name, _add(cloud, caller, namespace, "tags", name, {}))


def update_tag(
    cloud: Cloud, caller: Caller, namespace: str, name: str, request: Any
) -> dict[str, Any]:
    new_name = _tag(request)
    return render_tag(new_name, _replace(cloud, caller, namespace, "tags", name, new_name, {}))


def replace_tags(
    cloud: Cloud, caller: Caller, namespace: str, request: Any, *, append: bool
) -> list[dict[str, Any]]:
    """Glance's POST of tags: they replace the namespace's tags, or join them with
    X-Openstack-Append; a name given twice, or (appending) one already there, is a 409."""
    if not isinstance(request, Mapping):
        raise _invalid("the body must be a JSON object", "tags")
    names = [_tag(raw) for raw in _list_of(request, "tags")]
    if len(set(names)) < len(names):
        raise ImageConflict(f"Duplicate tags in the request for namespace={namespace}.")

    def change(items: dict[str, Any]) -> None:
        if not append:
            items.clear()
        for name in names:
            if name in items:
                raise _exists("tags", name, namespace)
            items[name] = _stamped(cloud, {}, None)

    tags = _change_part(cloud, caller, namespace, "tags", change)["tags"]
    return [render_tag(name, tags[name]) for name in names]


def associate(cloud: Cloud, caller: Caller, namespace: str, request: Any) -> dict[str, Any]:
    name, part = _association(request)
    _must_admin(caller)
    _load(cloud, caller, namespace)
    _ensure_resource_types(cloud, [name])
    stored = _add(cloud, caller, namespace, "resource_type_associations", name, part)
    return render_association(name, stored)


def dissociate(cloud: Cloud, caller: Caller, namespace: str, name: str) -> None:
    delete_namespace_part(cloud, caller, namespace, "resource_type_associations", name)


# -- bootstrap --------------------------------------------------------------------------------


def bootstrap_metadefs(cloud: Cloud) -> None:
    """Glance's usual resource types, which a namespace is associated with."""
    _ensure_resource_types(cloud, list(DEFAULT_RESOURCE_TYPES))
