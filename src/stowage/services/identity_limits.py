"""Keystone's unified limits: registered limits (a service's default for a resource) and
project limits (one project's own), and Nova's compute quotas read from them.

A registered limit is a "registered_limit" document, a project limit a "limit" document;
Keystone's uniqueness (one registered limit per service, region and resource; one project
limit per project, service, region and resource) is a "limit_key" document whose id is a
digest of that tuple, created in the same transaction: a duplicate fails its primary key
whoever writes it, two at once included. Keystone's model is "flat": a project's limit is
its own, unrelated to its parent's.

With `CloudConfig.quota_driver == "unified-limits"` (Nova's `[quota] driver =
nova.quota.UnifiedLimitsDriver`), the compute quotas take their limits from here: the
project's limit if it has one, else the registered default, for the compute service's
resources by Nova's names. As Nova's default `unified_limits_resource_strategy = require`
with `unified_limits_resource_list = servers`: `servers` without a registered limit is 0
(every boot is over quota until an operator registers one); any other resource without one
is unlimited.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy import Connection, select

from stowage.domain.errors import ConflictError, InvalidSpec, NotFound
from stowage.ledger.objects import Document
from stowage.ledger.schema import objects
from stowage.services import catalog
from stowage.services.cloud import Cloud
from stowage.services.identity import Forbidden, IdentityDirectory

__all__ = [
    "LEGACY_TO_UNIFIED",
    "LIMIT",
    "LIMIT_MAX",
    "MODEL",
    "REGISTERED",
    "UNIFIED_DRIVER",
    "Limits",
    "compute_limits_in",
    "uses_unified_limits",
]

UNIFIED_DRIVER = "unified-limits"
LEGACY_DRIVER = "legacy"
REGISTERED = "registered_limit"
LIMIT = "limit"
_KEY = "limit_key"
LIMIT_MAX = 2147483647
MODEL = {
    "name": "flat",
    "description": "Limit enforcement and validation does not take project hierarchy into "
    "consideration.",
}
# Nova's legacy quota names and the unified limits resource names they come from.
LEGACY_TO_UNIFIED: Mapping[str, str] = {
    "instances": "servers",
    "cores": "class:VCPU",
    "ram": "class:MEMORY_MB",
    "metadata_items": "server_metadata_items",
    "key_pairs": "server_key_pairs",
    "server_groups": "server_groups",
    "server_group_members": "server_group_members",
}
# Nova's unified_limits_resource_list default, with the "require" strategy: 0 unless registered.
REQUIRED_RESOURCES = frozenset({"servers"})

_REG_FIELDS = {"service_id", "region_id", "resource_name", "default_limit", "description"}
_LIMIT_FIELDS = {
    "service_id",
    "region_id",
    "project_id",
    "domain_id",
    "resource_name",
    "resource_limit",
    "description",
}


def uses_unified_limits(cloud: Cloud) -> bool:
    return cloud.config.quota_driver == UNIFIED_DRIVER


def _invalid(field: str, why: str) -> InvalidSpec:
    return InvalidSpec(f"Invalid input for field '{field}': {why}", code="identity.invalid")


def _not_found(kind: str, limit_id: str) -> NotFound:
    label = "registered limit" if kind == REGISTERED else "limit"
    return NotFound(f"Could not find {label}: {limit_id}.", code=f"identity.{kind}.not_found")


def _duplicate(kind: str) -> ConflictError:
    what = "registered_limit" if kind == REGISTERED else "project_limit"
    return ConflictError(f"Conflict occurred attempting to store {what} - Duplicate entry.")


def _key_id(*parts: str | None) -> str:
    return hashlib.sha256(json.dumps(list(parts)).encode()).hexdigest()


def _text(field: str, value: Any, *, required: bool = False, max_len: int = 255) -> str | None:
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value or len(value) > max_len:
        raise _invalid(field, f"{value!r} is not a string of 1 to {max_len} characters")
    return value


def _amount(field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not -1 <= value <= LIMIT_MAX:
        raise _invalid(field, f"{value!r} is not an integer from -1 to {LIMIT_MAX}")
    return value


def _description(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise _invalid("description", f"{value!r} is not of type 'string', 'null'")
    return value


def _only(fields: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(fields) - allowed - {"id", "links"})
    if unknown:
        raise _invalid(unknown[0], "Additional properties are not allowed")


class Limits:
    """Registered limits and project limits of one cloud."""

    def __init__(self, cloud: Cloud) -> None:
        self.cloud = cloud
        self.directory = IdentityDirectory(cloud)

    # -- reads --------------------------------------------------------------------------

    def get(self, kind: str, limit_id: str) -> Document:
        doc = self.cloud.objects.find(kind, limit_id)
        if doc is None:
            raise _not_found(kind, limit_id)
        return doc

    def all(self, kind: str, **filters: str | None) -> list[Document]:
        wanted = {k: v for k, v in filters.items() if v is not None}
        return [
            d
            for d in self.cloud.objects.list(kind)
            if all(d.body.get(k) == v for k, v in wanted.items())
        ]

    # -- checks ---------------------------------------------------------------------------

    def _service_and_region(self, fields: Mapping[str, Any]) -> tuple[str, str | None]:
        service_id = _text("service_id", fields.get("service_id"), required=True)
        region_id = _text("region_id", fields.get("region_id"))
        assert service_id is not None
        try:
            catalog.service(self.cloud, service_id)
        except NotFound:
            raise _invalid("service_id", f"Could not find service: {service_id}.") from None
        if region_id is not None:
            try:
                catalog.region(self.cloud, region_id)
            except NotFound:
                raise _invalid("region_id", f"Could not find region: {region_id}.") from None
        return service_id, region_id

    def _registered_body(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        _only(fields, _REG_FIELDS)
        service_id, region_id = self._service_and_region(fields)
        return {
            "service_id": service_id,
            "region_id": region_id,
            "resource_name": _text("resource_name", fields.get("resource_name"), required=True),
            "default_limit": _amount("default_limit", fields.get("default_limit")),
            "description": _description(fields.get("description")),
        }

    @staticmethod
    def _registered_key(body: Mapping[str, Any]) -> str:
        return _key_id("registered", body["service_id"], body["region_id"], body["resource_name"])

    @staticmethod
    def _limit_key(body: Mapping[str, Any]) -> str:
        return _key_id(
            "project",
            body["project_id"],
            body["service_id"],
            body["region_id"],
            body["resource_name"],
        )

    def _has_registered(self, conn: Connection, body: Mapping[str, Any]) -> bool:
        return self.cloud.objects.find_in(conn, _KEY, self._registered_key(body)) is not None

    def _add_key(self, conn: Connection, kind: str, key: str, owner: str) -> None:
        if self.cloud.objects.find_in(conn, _KEY, key) is not None:
            raise _duplicate(kind)
        self.cloud.objects.create_in(conn, _KEY, key, {"kind": kind, "owner": owner})

    # -- registered limits ----------------------------------------------------------------

    def create_registered(self, items: Iterable[Mapping[str, Any]]) -> list[Document]:
        bodies = [self._registered_body(_mapping("registered_limits", f)) for f in items]
        return self._create_all(REGISTERED, bodies, self._registered_key)

    def update_registered(self, limit_id: str, changes: Mapping[str, Any]) -> Document:
        _only(changes, _REG_FIELDS)
        with self.cloud.ledger.engine.begin() as conn:
            doc = self.cloud.objects.find_in(conn, REGISTERED, limit_id)
            if doc is None:
                raise _not_found(REGISTERED, limit_id)
            merged = {**doc.body, **changes}
            body = self._registered_body(merged)
            old_key, new_key = self._registered_key(doc.body), self._registered_key(body)
            if old_key != new_key:
                if self._referenced(conn, doc.body):
                    raise _in_use(limit_id)
                self.cloud.objects.delete_in(conn, _KEY, old_key)
                self._add_key(conn, REGISTERED, new_key, limit_id)
            self.cloud.objects.update_in(conn, REGISTERED, limit_id, body)
        return self.get(REGISTERED, limit_id)

    def delete_registered(self, limit_id: str) -> None:
        with self.cloud.ledger.engine.begin() as conn:
            doc = self.cloud.objects.find_in(conn, REGISTERED, limit_id)
            if doc is None:
                raise _not_found(REGISTERED, limit_id)
            if self._referenced(conn, doc.body):
                raise _in_use(limit_id)
            self.cloud.objects.delete_in(conn, _KEY, self._registered_key(doc.body))
            self.cloud.objects.delete_in(conn, REGISTERED, limit_id)

    def _referenced(self, conn: Connection, registered: Mapping[str, Any]) -> bool:
        """Whether a project limit needs this registered limit (Keystone refuses, 403)."""
        same = ("service_id", "region_id", "resource_name")
        return any(
            all(body.get(k) == registered.get(k) for k in same) for body in _bodies(conn, LIMIT)
        )

    # -- project limits -------------------------------------------------------------------

    def _limit_body(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        _only(fields, _LIMIT_FIELDS)
        if fields.get("domain_id") is not None:
            raise _invalid("domain_id", "domain limits are not supported; give a project_id")
        service_id, region_id = self._service_and_region(fields)
        project_id = _text("project_id", fields.get("project_id"), required=True)
        assert project_id is not None
        try:
            self.directory.project(project_id)
        except NotFound:
            raise _invalid("project_id", f"Could not find project: {project_id}.") from None
        return {
            "project_id": project_id,
            "domain_id": None,
            "service_id": service_id,
            "region_id": region_id,
            "resource_name": _text("resource_name", fields.get("resource_name"), required=True),
            "resource_limit": _amount("resource_limit", fields.get("resource_limit")),
            "description": _description(fields.get("description")),
        }

    def create_limits(self, items: Iterable[Mapping[str, Any]]) -> list[Document]:
        bodies = [self._limit_body(_mapping("limits", f)) for f in items]
        return self._create_all(LIMIT, bodies, self._limit_key)

    def update_limit(self, limit_id: str, changes: Mapping[str, Any]) -> Document:
        # Keystone's schema: only the limit and the description of a project limit change.
        _only(changes, {"resource_limit", "description"})
        doc = self.get(LIMIT, limit_id)
        body = dict(doc.body)
        if "resource_limit" in changes:
            body["resource_limit"] = _amount("resource_limit", changes["resource_limit"])
        if "description" in changes:
            body["description"] = _description(changes["description"])
        return self.cloud.objects.update(LIMIT, limit_id, body)

    def delete_limit(self, limit_id: str) -> None:
        with self.cloud.ledger.engine.begin() as conn:
            doc = self.cloud.objects.find_in(conn, LIMIT, limit_id)
            if doc is None:
                raise _not_found(LIMIT, limit_id)
            self.cloud.objects.delete_in(conn, _KEY, self._limit_key(doc.body))
            self.cloud.objects.delete_in(conn, LIMIT, limit_id)

    # -- both -----------------------------------------------------------------------------

    def _create_all(self, kind: str, bodies: list[dict[str, Any]], key_of: Any) -> list[Document]:
        """All of a request's limits or none: one transaction, each with its key."""
        if not bodies:
            raise _invalid(f"{kind}s", "[] should be non-empty")
        made = []
        with self.cloud.ledger.engine.begin() as conn:
            for body in bodies:
                if kind == LIMIT and not self._has_registered(conn, body):
                    raise Forbidden(
                        "Unable to create a limit that has no corresponding registered limit.",
                        code="identity.limit.no_reference",
                    )
                limit_id = uuid.uuid4().hex
                self._add_key(conn, kind, key_of(body), limit_id)
                made.append(
                    self.cloud.objects.create_in(
                        conn, kind, limit_id, body, project_id=body.get("project_id")
                    )
                )
        return made


def _mapping(field: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _invalid(field, f"{value!r} is not of type 'object'")
    return value


def _in_use(limit_id: str) -> Forbidden:
    return Forbidden(
        f"Unable to update or delete registered limit {limit_id} because there are project "
        "limits associated with it.",
        code="identity.registered_limit.in_use",
    )


def _bodies(conn: Connection, kind: str) -> list[dict[str, Any]]:
    rows = conn.execute(select(objects.c.body).where(objects.c.kind == kind)).scalars()
    return [json.loads(raw) for raw in rows]


# -- Nova's compute quotas ----------------------------------------------------------------


def _compute_service_ids(conn: Connection) -> set[str]:
    rows = conn.execute(
        select(objects.c.id, objects.c.body).where(objects.c.kind == "service")
    ).all()
    return {row.id for row in rows if json.loads(row.body).get("type") == "compute"}


def _pick(found: list[dict[str, Any]], region: str, field: str) -> int | None:
    """The region's own limit before one of no region."""
    mine = [b for b in found if b.get("region_id") == region]
    anywhere = [b for b in found if b.get("region_id") is None]
    for candidates in (mine, anywhere):
        if candidates:
            return int(candidates[0][field])
    return None


def compute_limits_in(
    conn: Connection, region: str, project_id: str | None, legacy: Iterable[str]
) -> dict[str, int]:
    """Nova's quota limits (by its legacy names, every one of `legacy`) from unified limits,
    read inside `conn`'s transaction: the project's limit, else the registered default;
    with neither, 0 for a required resource (`servers`) and unlimited (-1) for the others,
    as for a legacy name with no unified resource (personality files, nova-network's)."""
    services = _compute_service_ids(conn)
    registered = [
        b
        for b in _bodies(conn, REGISTERED)
        if b.get("service_id") in services and b.get("region_id") in (None, region)
    ]
    own = (
        [
            b
            for b in _bodies(conn, LIMIT)
            if b.get("project_id") == project_id
            and b.get("service_id") in services
            and b.get("region_id") in (None, region)
        ]
        if project_id is not None
        else []
    )
    limits: dict[str, int] = {}
    for name in legacy:
        resource = LEGACY_TO_UNIFIED.get(name)
        if resource is None:
            limits[name] = -1
            continue
        project = _pick(
            [b for b in own if b["resource_name"] == resource], region, "resource_limit"
        )
        default = _pick(
            [b for b in registered if b["resource_name"] == resource], region, "default_limit"
        )
        if project is not None:
            limits[name] = project
        elif default is not None:
            limits[name] = default
        else:
            limits[name] = 0 if resource in REQUIRED_RESOURCES else -1
    return limits
