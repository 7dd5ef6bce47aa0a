"""The service catalog as data: regions, services and endpoints, as Keystone keeps them.

Each is a document of its own kind ("region", "service", "endpoint"). The cloud's own
services are registered the first time the catalog is read, once per ledger (a "catalog_seed"
document's primary key makes the seeding happen once, whoever gets there first); an operator
may then disable, change or delete them, and add their own (a real Cinder, say). A built-in
endpoint keeps only its path (`url_path`) until someone sets its URL: it follows the cloud's
base URL, which changes when `stowage up` starts on another port.

The catalog a token carries holds the enabled services with their enabled endpoints; an URL's
`$(project_id)s` (or `$(tenant_id)s`) becomes the token's project, as Keystone substitutes it.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from stowage.domain.errors import ConflictError, InvalidSpec, NotFound
from stowage.ledger.objects import Document
from stowage.services.identity import Forbidden

if TYPE_CHECKING:
    from stowage.services.cloud import Cloud

__all__ = [
    "BUILTIN_SERVICES",
    "CatalogForbidden",
    "catalog_of",
    "create_endpoint",
    "create_region",
    "create_service",
    "delete_endpoint",
    "delete_region",
    "delete_service",
    "endpoint_url",
    "endpoints",
    "regions",
    "services",
    "update_endpoint",
    "update_region",
    "update_service",
]

INTERFACES = ("public", "internal", "admin")
# type, name, path under the cloud's base URL.
BUILTIN_SERVICES: tuple[tuple[str, str, str], ...] = (
    ("identity", "keystone", "/identity"),
    ("compute", "nova", "/compute/v2.1"),
    ("image", "glance", "/image"),
    ("network", "neutron", "/networking"),
    ("placement", "placement", "/placement"),
    ("block-storage", "cinder", "/volume/v3/$(project_id)s"),
    ("volumev3", "cinderv3", "/volume/v3/$(project_id)s"),
)


class CatalogForbidden(Forbidden):
    """Keystone's 403 (ForbiddenNotSecurity) for a region still in use."""


def _invalid(field: str, why: str) -> InvalidSpec:
    return InvalidSpec(f"Invalid input for field '{field}': {why}")


def _seed(cloud: Cloud) -> None:
    """Register each built-in service once per ledger (one marker each, so a service added
    in a later release is registered in an older ledger too, and one an operator deleted
    stays deleted)."""
    region = cloud.config.region
    seeded = set(cloud.objects.ids("catalog_seed"))  # one read, not one per service
    for kind, name, path in BUILTIN_SERVICES:
        marker = "builtin" if kind == "identity" else f"builtin:{kind}"
        if marker in seeded:
            continue
        try:
            cloud.objects.create("catalog_seed", marker, {})
        except ConflictError:
            continue  # another process seeds it
        if cloud.objects.find("region", region) is None:
            _create_quietly(cloud, "region", region, {"description": "", "parent_region_id": None})
        service_id = str(uuid.uuid5(uuid.NAMESPACE_URL, f"stowage-service:{kind}"))
        _create_quietly(
            cloud,
            "service",
            service_id,
            {"type": kind, "name": name, "description": "", "enabled": True},
        )
        for iface in INTERFACES:
            endpoint_id = str(uuid.uuid5(uuid.NAMESPACE_URL, f"stowage-ep:{kind}:{iface}"))
            body = {
                "service_id": service_id,
                "interface": iface,
                "region_id": region,
                "url_path": path,
                "enabled": True,
            }
            _create_quietly(cloud, "endpoint", endpoint_id, body)


def _create_quietly(cloud: Cloud, kind: str, id: str, body: Mapping[str, Any]) -> None:
    with contextlib.suppress(ConflictError):
        cloud.objects.create(kind, id, body, name=str(body.get("name") or ""))


def endpoint_url(cloud: Cloud, doc: Document) -> str:
    if doc.body.get("url_path") is not None:
        return f"{cloud.config.base_url}{doc.body['url_path']}"
    return str(doc.body.get("url", ""))


# -- reads ----------------------------------------------------------------------------------


def regions(cloud: Cloud) -> list[Document]:
    _seed(cloud)
    return cloud.objects.list("region")


def services(cloud: Cloud) -> list[Document]:
    _seed(cloud)
    return cloud.objects.list("service")


def endpoints(cloud: Cloud) -> list[Document]:
    _seed(cloud)
    return cloud.objects.list("endpoint")


def _found(cloud: Cloud, kind: str, id: str, label: str) -> Document:
    _seed(cloud)
    doc = cloud.objects.find(kind, id)
    if doc is None:
        raise NotFound(f"Could not find {label}: {id}.")
    return doc


def region(cloud: Cloud, region_id: str) -> Document:
    return _found(cloud, "region", region_id, "region")


def service(cloud: Cloud, service_id: str) -> Document:
    return _found(cloud, "service", service_id, "service")


def endpoint(cloud: Cloud, endpoint_id: str) -> Document:
    return _found(cloud, "endpoint", endpoint_id, "endpoint")


def catalog_of(cloud: Cloud, project_id: str | None = None) -> list[dict[str, Any]]:
    """What a token's catalog holds: enabled services with their enabled endpoints."""
    _seed(cloud)
    by_service: dict[str, list[Document]] = {}
    for ep in cloud.objects.list("endpoint"):
        if ep.body.get("enabled", True):
            by_service.setdefault(str(ep.body.get("service_id")), []).append(ep)
    out = []
    for svc in cloud.objects.list("service"):
        if not svc.body.get("enabled", True):
            continue
        out.append(
            {
                "type": svc.body.get("type"),
                "name": svc.body.get("name") or "",
                "id": svc.id,
                "endpoints": [
                    {
                        "id": ep.id,
                        "interface": ep.body.get("interface"),
                        "region": ep.body.get("region_id"),
                        "region_id": ep.body.get("region_id"),
                        "url": url,
                    }
                    for ep in by_service.get(svc.id, [])
                    # Keystone leaves out what the token's scope cannot fill in.
                    if "$(" not in (url := _substituted(endpoint_url(cloud, ep), project_id))
                ],
            }
        )
    return out


def _substituted(url: str, project_id: str | None) -> str:
    if project_id is None:
        return url
    return url.replace("$(project_id)s", project_id).replace("$(tenant_id)s", project_id)


# -- checks ---------------------------------------------------------------------------------


def _text(field: str, value: Any, *, required: bool = False, max_len: int = 255) -> str | None:
    if value is None:
        if required:
            raise _invalid(field, "required")
        return None
    if not isinstance(value, str) or len(value) > max_len:
        raise _invalid(field, f"a string of at most {max_len} characters")
    if required and not value:
        raise _invalid(field, "must not be empty")
    return value


def _bool(field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _invalid(field, f"{value!r} is not a boolean")
    return value


def _known(fields: Mapping[str, Any]) -> dict[str, Any]:
    """Keystone keeps unknown attributes of catalog entities as extras; so do we, but never
    ones that would shadow what we compute."""
    return {k: v for k, v in fields.items() if k not in {"id", "links", "url_path"}}


# -- regions --------------------------------------------------------------------------------


def _region_body(cloud: Cloud, fields: Mapping[str, Any], region_id: str) -> dict[str, Any]:
    body = _known(fields)
    body["description"] = _text("description", fields.get("description")) or ""
    parent = _text("parent_region_id", fields.get("parent_region_id"))
    if parent is not None:
        if parent == region_id:
            raise _invalid("parent_region_id", "a region cannot be its own parent")
        if cloud.objects.find("region", parent) is None:
            raise _invalid("parent_region_id", f"region {parent} does not exist")
        ancestor: str | None = parent
        while ancestor is not None:  # no cycles
            doc = cloud.objects.find("region", ancestor)
            ancestor = doc.body.get("parent_region_id") if doc is not None else None
            if ancestor == region_id:
                raise _invalid("parent_region_id", "that would make a cycle of regions")
    body["parent_region_id"] = parent
    return body


def create_region(
    cloud: Cloud, fields: Mapping[str, Any], region_id: str | None = None
) -> Document:
    _seed(cloud)
    rid = region_id or _text("id", fields.get("id")) or uuid.uuid4().hex
    if region_id is not None and fields.get("id") not in (None, region_id):
        raise _invalid("id", "differs from the URL's region id")
    body = _region_body(cloud, fields, rid)
    try:
        return cloud.objects.create("region", rid, body)
    except ConflictError:
        raise ConflictError(f"Conflict occurred attempting to store region - {rid}.") from None


def update_region(cloud: Cloud, region_id: str, changes: Mapping[str, Any]) -> Document:
    doc = region(cloud, region_id)
    merged = {**doc.body, **changes}
    body = _region_body(cloud, merged, region_id)
    return cloud.objects.update("region", region_id, body)


def delete_region(cloud: Cloud, region_id: str) -> None:
    region(cloud, region_id)
    if any(r.body.get("parent_region_id") == region_id for r in cloud.objects.list("region")):
        raise CatalogForbidden(
            f"Unable to delete region {region_id} because it or its child regions have "
            "associated endpoints."
        )
    if any(e.body.get("region_id") == region_id for e in cloud.objects.list("endpoint")):
        raise CatalogForbidden(
            f"Unable to delete region {region_id} because it or its child regions have "
            "associated endpoints."
        )
    cloud.objects.delete("region", region_id)


# -- services -------------------------------------------------------------------------------


def _service_body(fields: Mapping[str, Any]) -> dict[str, Any]:
    body = _known(fields)
    body["type"] = _text("type", fields.get("type"), required=True)
    body["name"] = _text("name", fields.get("name")) or ""
    body["description"] = _text("description", fields.get("description")) or ""
    body["enabled"] = _bool("enabled", fields.get("enabled", True))
    return body


def create_service(cloud: Cloud, fields: Mapping[str, Any]) -> Document:
    _seed(cloud)
    body = _service_body(fields)
    return cloud.objects.create("service", uuid.uuid4().hex, body, name=body["name"])


def update_service(cloud: Cloud, service_id: str, changes: Mapping[str, Any]) -> Document:
    doc = service(cloud, service_id)
    body = _service_body({**doc.body, **changes})
    return cloud.objects.update("service", service_id, body, name=body["name"])


def delete_service(cloud: Cloud, service_id: str) -> None:
    """Its endpoints go with it, as in Keystone."""
    service(cloud, service_id)
    for ep in cloud.objects.list("endpoint"):
        if ep.body.get("service_id") == service_id:
            cloud.objects.delete("endpoint", ep.id)
    cloud.objects.delete("service", service_id)


# -- endpoints ------------------------------------------------------------------------------


def _endpoint_body(cloud: Cloud, fields: Mapping[str, Any]) -> dict[str, Any]:
    body = _known(fields)
    service_id = _text("service_id", fields.get("service_id"), required=True)
    if cloud.objects.find("service", str(service_id)) is None:
        raise _invalid("service_id", f"service {service_id} does not exist")
    interface = fields.get("interface")
    if interface not in INTERFACES:
        raise _invalid("interface", f"{interface!r} is not one of {', '.join(INTERFACES)}")
    # Keystone v2's "region" is the old name of region_id; given that way, a region that does
    # not exist yet is created (as Keystone does), given as region_id it must exist.
    legacy = "region_id" not in fields and fields.get("region") is not None
    region_id = _text("region_id", fields.get("region_id", fields.get("region")))
    if region_id is not None and cloud.objects.find("region", region_id) is None:
        if not legacy:
            raise _invalid("region_id", f"region {region_id} does not exist")
        _create_quietly(cloud, "region", region_id, {"description": "", "parent_region_id": None})
    body.pop("region", None)
    body.update(
        {
            "service_id": service_id,
            "interface": interface,
            "region_id": region_id,
            "enabled": _bool("enabled", fields.get("enabled", True)),
        }
    )
    if fields.get("url_path") is None or "url" in fields:
        body["url"] = _text("url", fields.get("url"), required=True, max_len=2048)
    else:
        body["url_path"] = fields["url_path"]
    return body


def create_endpoint(cloud: Cloud, fields: Mapping[str, Any]) -> Document:
    _seed(cloud)
    body = _endpoint_body(cloud, {k: v for k, v in fields.items() if k != "url_path"})
    return cloud.objects.create("endpoint", uuid.uuid4().hex, body)


def update_endpoint(cloud: Cloud, endpoint_id: str, changes: Mapping[str, Any]) -> Document:
    doc = endpoint(cloud, endpoint_id)
    changes = {k: v for k, v in changes.items() if k != "url_path"}
    merged = {**doc.body, **changes}
    if "region_id" not in changes and changes.get("region") is not None:
        # The legacy name moves the endpoint (creating the region if need be), as on create.
        merged.pop("region_id", None)
    if "url" in changes:
        merged.pop("url_path", None)  # a built-in endpoint given a URL of its own keeps it
    body = _endpoint_body(cloud, merged)
    return cloud.objects.update("endpoint", endpoint_id, body)


def delete_endpoint(cloud: Cloud, endpoint_id: str) -> None:
    endpoint(cloud, endpoint_id)
    cloud.objects.delete("endpoint", endpoint_id)
