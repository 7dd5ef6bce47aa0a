"""Identity's directory: domains, projects, users, roles and role grants, as Keystone keeps them."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from stowage.domain.errors import ConflictError, InvalidSpec, NotFound, StowageError
from stowage.ledger.objects import Document
from stowage.services.cloud import DEFAULT_DOMAIN, Cloud
from stowage.services.tokens import hash_password, verify_password

__all__ = [
    "IMPLIED_ROLES",
    "Forbidden",
    "Grant",
    "IdentityDirectory",
    "Unauthorized",
    "domain_scope_key",
]

# Keystone's default inference rules (keystone-manage bootstrap): each role implies the next.
# They are data ("role_inference" documents, services/cloud.py's bootstrap seeds them); a cloud
# made before they were has no marker document, and these apply until a rule is changed.
IMPLIED_ROLES: dict[str, tuple[str, ...]] = {
    "admin": ("manager",),
    "manager": ("member",),
    "member": ("reader",),
}
INFERENCE = "role_inference"  # id "prior:implied"
INFERENCES_STORED = "role_inferences_stored"  # id "all": the rules are the documents
PROHIBITED_IMPLIED = frozenset({"admin"})  # keystone's [assignment] prohibited_implied_role


def inference_id(prior_id: str, implied_id: str) -> str:
    return f"{prior_id}:{implied_id}"


def _default_rules(roles: Iterable[Document]) -> list[tuple[str, str]]:
    by_name = {d.name: d.id for d in roles if d.body.get("domain_id") is None}
    return [
        (by_name[prior], by_name[implied])
        for prior, implies in IMPLIED_ROLES.items()
        for implied in implies
        if prior in by_name and implied in by_name
    ]


def inference_rules(cloud: Cloud, roles: Iterable[Document] | None = None) -> list[tuple[str, str]]:
    """(prior role id, implied role id) of every inference rule."""
    if cloud.objects.find(INFERENCES_STORED, "all") is None:
        return _default_rules(cloud.objects.list("role") if roles is None else roles)
    return [
        (str(d.body["prior_role_id"]), str(d.body["implied_role_id"]))
        for d in cloud.objects.list(INFERENCE)
    ]


def domain_scope_key(domain_id: str) -> str:
    """What a domain-scoped token is recorded under in place of a project id, so that the
    loss of a role on the domain revokes it as the loss of one on a project does."""
    return f"domain:{domain_id}"


def implied_closure(cloud: Cloud, role_ids: Iterable[str]) -> list[Document]:
    """The roles of `role_ids` and every role they imply, followed to the end; a
    domain-specific role is left out (it only carries what it implies, as in Keystone)."""
    roles = {d.id: d for d in cloud.objects.list("role")}
    implies: dict[str, list[str]] = {}
    for prior, implied in inference_rules(cloud, roles.values()):
        implies.setdefault(prior, []).append(implied)
    seen: dict[str, None] = {}
    pending = [r for r in role_ids if r in roles]
    while pending:
        role_id = pending.pop(0)
        if role_id in seen:
            continue
        seen[role_id] = None
        pending += [i for i in implies.get(role_id, ()) if i in roles and i not in seen]
    return [roles[r] for r in seen if roles[r].body.get("domain_id") is None]


def with_implied(cloud: Cloud, names: Iterable[str]) -> tuple[str, ...]:
    """Global role names with every role they imply, followed to the end, sorted."""
    by_name = {d.name: d.id for d in cloud.objects.list("role") if d.body.get("domain_id") is None}
    wanted = list(names)
    ids = [by_name[n] for n in wanted if n in by_name]
    out = {d.name or "" for d in implied_closure(cloud, ids)}
    return tuple(sorted(out | {n for n in wanted if n not in by_name}))


# keystone-manage bootstrap makes its roles immutable; ours are the same set.
BOOTSTRAP_ROLES = frozenset({"admin", "manager", "member", "reader"})

NAME_MAX = {"domain": 64, "project": 64, "user": 255, "role": 255, "group": 64}
TAGS_MAX = 80
TAG_MAX_CHARS = 255
PROJECT_DEPTH_MAX = 5  # keystone's [resource] max_project_tree_depth
PASSWORD_MAX_CHARS = 4096
USER_OPTIONS = {
    "ignore_change_password_upon_first_use": bool,
    "ignore_password_expiry": bool,
    "ignore_lockout_failure_attempts": bool,
    "lock_password": bool,
    "ignore_user_inactivity": bool,
    "multi_factor_auth_enabled": bool,
    "multi_factor_auth_rules": list,
}
RESOURCE_OPTIONS = {"immutable": bool}
_NAME_CLAIM = "identity_name"
# Kinds that name users, groups, projects and roles (services/identity_groups.py keeps the
# first three, the inherited grants of OS-INHERIT the last): they go with what they name.
_GROUP = "group"
_GROUP_MEMBER = "group_member"
_GROUP_GRANT = "group_assignment"
_INHERITED = "inherited_assignment"
_SYSTEM_GROUP_GRANT = "system_group_assignment"  # services/identity_system.py
_CREDENTIAL = "credential"  # services/identity_credentials.py: a user's or project's goes too
_CLAIM_STALE_S = 60.0  # a claim whose object never came is free after this long
_ISSUED = "issued_token"  # audit id -> user and project, until the token expires
_REVOKED = "revoked_token"  # what api.auth checks on every request
_FAILURES = "auth_failures"  # user id -> failed password logins in a row, and the last one's time
_UNAUTHENTICATED = "The request you have made requires authentication."


@functools.cache
def _dummy_hash() -> str:
    """A hash to check a password against when there is no user: every failed login costs
    the same, so the time of an answer does not tell which user names exist."""
    return hash_password(uuid.uuid4().hex)


class Forbidden(StowageError):
    """Keystone's ForbiddenNotSecurity: the request is understood and refused (403)."""

    code = "identity.forbidden"


class Unauthorized(StowageError):
    """Credentials that do not authenticate (401)."""

    code = "identity.unauthorized"


@dataclass(frozen=True, slots=True)
class Grant:
    """One role of one user on a project or a domain."""

    id: str
    user_id: str
    role_id: str
    project_id: str | None
    domain_id: str | None


def _invalid(field: str, why: str) -> InvalidSpec:
    return InvalidSpec(f"Invalid input for field '{field}': {why}", code="identity.invalid")


def _not_found(kind: str, key: str) -> NotFound:
    return NotFound(f"Could not find {kind}: {key}.", code=f"identity.{kind}.not_found")


# -- field validation ---------------------------------------------------------------------


def check_name(kind: str, value: Any) -> str:
    if not isinstance(value, str):
        raise _invalid("name", f"{value!r} is not of type 'string'")
    if not value.strip():
        raise _invalid("name", "must not be empty or blank")
    if len(value) > NAME_MAX[kind]:
        raise _invalid("name", f"is longer than {NAME_MAX[kind]} characters")
    return value


def check_bool(field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _invalid(field, f"{value!r} is not of type 'boolean'")
    return value


def check_text(field: str, value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise _invalid(field, f"{value!r} is not of type 'string', 'null'")
    return value


def check_id(field: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > 64:
        raise _invalid(field, f"{value!r} is not a valid id")
    return value


def check_tags(value: Any) -> list[str]:
    if not isinstance(value, list):
        raise _invalid("tags", f"{value!r} is not of type 'array'")
    if len(value) > TAGS_MAX:
        raise _invalid("tags", f"has more than {TAGS_MAX} items")
    out: list[str] = []
    for tag in value:
        if not isinstance(tag, str) or not tag or len(tag) > TAG_MAX_CHARS:
            raise _invalid("tags", f"{tag!r} is not a string of 1 to {TAG_MAX_CHARS} characters")
        if "," in tag or "/" in tag:
            raise _invalid("tags", f"{tag!r} must not contain ',' or '/'")
        if tag not in out:
            out.append(tag)
    return out


def check_options(
    value: Any, allowed: Mapping[str, type], current: Mapping[str, Any]
) -> dict[str, Any]:
    """Merge `value` into `current`; a null value removes the option, as in Keystone."""
    if not isinstance(value, dict):
        raise _invalid("options", f"{value!r} is not of type 'object'")
    merged = dict(current)
    for key, option in value.items():
        if key not in allowed:
            raise _invalid("options", f"unknown option {key!r}")
        if option is None:
            merged.pop(key, None)
        elif not isinstance(option, allowed[key]):
            raise _invalid(f"options/{key}", f"{option!r} is not of type {allowed[key].__name__}")
        else:
            merged[key] = option
    return merged


def check_password(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise _invalid("password", "is not of type 'string', 'null'")
    if len(value) > PASSWORD_MAX_CHARS:
        raise _invalid("password", f"is longer than {PASSWORD_MAX_CHARS} characters")
    return value


def _claim_id(kind: str, domain_id: str | None, name: str) -> str:
    """One row per (kind, domain, name): the primary key makes names unique under races."""
    return hashlib.sha256(f"{kind}\0{domain_id or ''}\0{name}".encode()).hexdigest()


class IdentityDirectory:
    """Keystone's resource, identity and assignment backends over the cloud's document store."""

    def __init__(self, cloud: Cloud) -> None:
        self.cloud = cloud
        self.objects = cloud.objects

    def _found(self, kind: str, key: str) -> Document:
        """The document, or Keystone's 404 naming what is missing."""
        doc = self.objects.find(kind, key)
        if doc is None:
            raise _not_found(kind, key)
        return doc

    # -- names --------------------------------------------------------------------------

    def _scope_of(self, kind: str, body: Mapping[str, Any]) -> str | None:
        if kind == "domain":
            return None
        if kind == "role":
            return body.get("domain_id")
        return str(body.get("domain_id") or DEFAULT_DOMAIN)

    def _name_taken(self, kind: str, domain_id: str | None, name: str, *, but: str = "") -> bool:
        for doc in self.objects.list(kind, name=name):
            if doc.id != but and self._scope_of(kind, doc.body) == domain_id:
                return True
        return False

    def _claim_name(self, kind: str, domain_id: str | None, name: str, owner: str) -> None:
        where = f" at domain ID {domain_id}" if domain_id else ""
        message = (
            f"Conflict occurred attempting to store {kind} - "
            f"Duplicate entry found with name {name}{where}."
        )
        if self._name_taken(kind, domain_id, name, but=owner):
            raise ConflictError(message, code=f"identity.{kind}.duplicate")
        claim = _claim_id(kind, domain_id, name)
        try:
            self.objects.create(_NAME_CLAIM, claim, {"kind": kind, "owner": owner})
        except ConflictError:
            held = self.objects.find(_NAME_CLAIM, claim)
            if held is not None and held.body.get("owner") == owner:
                return
            if held is None:
                raise ConflictError(message, code=f"identity.{kind}.duplicate") from None
            holder = self.objects.find(kind, str(held.body.get("owner", "")))
            orphan = holder is None or holder.name != name
            if orphan and held.updated_at < self.cloud.clock() - _CLAIM_STALE_S:
                # Left by a request that died between its writes: take it over.
                self.objects.put(_NAME_CLAIM, claim, {"kind": kind, "owner": owner})
                return
            raise ConflictError(message, code=f"identity.{kind}.duplicate") from None

    def _release_name(self, kind: str, domain_id: str | None, name: str, owner: str) -> None:
        claim = _claim_id(kind, domain_id, name)
        held = self.objects.find(_NAME_CLAIM, claim)
        if held is not None and held.body.get("owner") == owner:
            self.objects.delete(_NAME_CLAIM, claim)

    def _create_named(
        self, kind: str, body: dict[str, Any], *, project_id: str | None = None
    ) -> Document:
        scope = self._scope_of(kind, body)
        self._claim_name(kind, scope, body["name"], body["id"])
        try:
            return self.objects.create(
                kind, body["id"], body, project_id=project_id, name=body["name"]
            )
        except Exception:
            self._release_name(kind, scope, body["name"], body["id"])
            raise

    def _rename(self, kind: str, doc: Document, body: dict[str, Any]) -> Document:
        scope = self._scope_of(kind, doc.body)
        old, new = doc.body.get("name", doc.name or ""), body["name"]
        if old != new:
            self._claim_name(kind, scope, new, doc.id)
        try:
            updated = self.objects.update(kind, doc.id, body, name=new)
        except Exception:
            if old != new:
                self._release_name(kind, scope, new, doc.id)
            raise
        if old != new:
            self._release_name(kind, scope, old, doc.id)
        return updated

    def _delete_named(self, kind: str, doc: Document) -> None:
        self.objects.delete(kind, doc.id)
        self._release_name(kind, self._scope_of(kind, doc.body), doc.name or "", doc.id)

    # -- domains ------------------------------------------------------------------------

    def domain(self, domain_id: str) -> Document:
        return self._found("domain", domain_id)

    def domains(self) -> list[Document]:
        return self.objects.list("domain")

    def create_domain(self, fields: Mapping[str, Any]) -> Document:
        name = check_name("domain", fields.get("name"))
        domain_id = uuid.uuid4().hex
        explicit = fields.get("explicit_domain_id")
        if explicit is not None:
            domain_id = check_id("explicit_domain_id", explicit) or domain_id
            if self.objects.find("domain", domain_id) is not None:
                raise ConflictError(
                    f"Conflict occurred attempting to store domain - Duplicate ID, {domain_id}.",
                    code="identity.domain.duplicate",
                )
        body = {
            "id": domain_id,
            "name": name,
            "description": check_text("description", fields.get("description")) or "",
            "enabled": check_bool("enabled", fields.get("enabled", True)),
            "tags": check_tags(fields.get("tags", [])),
            "options": check_options(fields.get("options", {}), RESOURCE_OPTIONS, {}),
        }
        return self._create_named("domain", body)

    def update_domain(self, domain_id: str, changes: Mapping[str, Any]) -> Document:
        doc = self.domain(domain_id)
        body = dict(doc.body)
        self._refuse_if_immutable("domain", doc, changes)
        for key, value in changes.items():
            if key == "name":
                body["name"] = check_name("domain", value)
            elif key == "description":
                body["description"] = check_text("description", value)
            elif key == "enabled":
                body["enabled"] = check_bool("enabled", value)
                if not body["enabled"] and doc.id == DEFAULT_DOMAIN:
                    raise Forbidden("The default domain cannot be disabled.")
            elif key == "tags":
                body["tags"] = check_tags(value)
            elif key == "options":
                body["options"] = check_options(value, RESOURCE_OPTIONS, body.get("options", {}))
            elif key != "id":
                raise _invalid(key, "Additional properties are not allowed")
        updated = self._rename("domain", doc, body)
        if not body.get("enabled", True):
            self._revoke_domain_tokens(doc.id)
        return updated

    def _revoke_domain_tokens(self, domain_id: str) -> None:
        for project in self.objects.list("project"):
            if project.body.get("domain_id") == domain_id:
                self.revoke_tokens(project_id=project.id)
        for user in self.objects.list("user"):
            if user.body.get("domain_id") == domain_id:
                self.revoke_tokens(user_id=user.id)

    def delete_domain(self, domain_id: str) -> None:
        """Keystone's cascade: the domain's projects, users, roles and grants go with it."""
        doc = self.domain(domain_id)
        if doc.id == DEFAULT_DOMAIN:
            raise Forbidden("The default domain cannot be deleted.")
        if doc.body.get("enabled", True):
            raise Forbidden("Cannot delete a domain that is enabled, please disable it first.")
        self._refuse_if_immutable("domain", doc, {})
        for project in self._leaves_first(
            [p for p in self.objects.list("project") if p.body.get("domain_id") == doc.id]
        ):
            self._remove_project(project)
        for user in self.objects.list("user"):
            if user.body.get("domain_id") == doc.id:
                self._remove_user(user)
        for role in self.objects.list("role"):
            if role.body.get("domain_id") == doc.id:
                self._remove_role(role)
        for group in self.objects.list(_GROUP):
            if group.body.get("domain_id") == doc.id:
                self._remove_group_links("group_id", group.id)
                self._delete_named(_GROUP, group)
        for grant in self.grants():
            if grant.domain_id == doc.id:
                self.objects.delete("assignment", grant.id)
        for kind in (_GROUP_GRANT, _INHERITED):
            for link in self.objects.list(kind):
                if link.body.get("domain_id") == doc.id:
                    self.objects.delete(kind, link.id)
        self._delete_named("domain", doc)

    def _remove_group_links(self, field: str, value: str) -> None:
        """The memberships and group grants (and inherited grants) naming a user, group,
        project or role that goes: Keystone deletes them with it."""
        kinds = (_GROUP_MEMBER, _GROUP_GRANT, _INHERITED, _CREDENTIAL, _SYSTEM_GROUP_GRANT)
        for kind in kinds:
            for link in self.objects.list(kind):
                if link.body.get(field) == value or (
                    field == "project_id" and link.project_id == value
                ):
                    self.objects.delete(kind, link.id)
                    if kind == _GROUP_GRANT and link.project_id:
                        # Its members' tokens on the project carried the role.
                        for member in self.objects.list(_GROUP_MEMBER, name=link.body["group_id"]):
                            self.revoke_tokens(
                                user_id=str(member.body["user_id"]), project_id=link.project_id
                            )

    # -- projects -----------------------------------------------------------------------

    def project(self, project_id: str) -> Document:
        return self._found("project", project_id)

    def projects(self) -> list[Document]:
        return self.objects.list("project")

    def create_project(
        self, fields: Mapping[str, Any], *, default_domain: str = DEFAULT_DOMAIN
    ) -> Document:
        known = {"name", "description", "enabled", "domain_id", "parent_id", "is_domain", "tags"}
        name = check_name("project", fields.get("name"))
        if check_bool("is_domain", fields.get("is_domain", False)):
            raise InvalidSpec(
                "Invalid input for field 'is_domain': projects acting as domains are not "
                "supported here; create a domain instead.",
                code="identity.invalid",
            )
        parent_id = check_id("parent_id", fields.get("parent_id"))
        domain_id = check_id("domain_id", fields.get("domain_id"))
        parent = None
        if parent_id is not None and self.objects.find("domain", parent_id) is None:
            parent = self.objects.find("project", parent_id)
            if parent is None:
                raise _invalid("parent_id", f"Could not find project: {parent_id}.")
        if parent is not None:
            parent_domain = str(parent.body.get("domain_id", DEFAULT_DOMAIN))
            if domain_id is not None and domain_id != parent_domain:
                raise _invalid(
                    "domain_id", f"the parent {parent.id} is in another domain ({parent_domain})"
                )
            domain_id = parent_domain
            if not parent.body.get("enabled", True):
                raise Forbidden(
                    f"Cannot create project, since its parent ({parent.id}) is disabled."
                )
            if len(self.parents(parent)) + 2 > PROJECT_DEPTH_MAX:
                raise Forbidden(
                    f"Max hierarchy depth reached for {parent.id} branch "
                    f"(max_project_tree_depth is {PROJECT_DEPTH_MAX})."
                )
        domain_id = domain_id or parent_id or default_domain
        domain = self.objects.find("domain", domain_id)
        if domain is None:
            raise _invalid("domain_id", f"Could not find domain: {domain_id}.")
        if parent_id is not None and parent is None and parent_id != domain_id:
            raise _invalid("parent_id", f"the domain {parent_id} is not the project's domain")
        options = check_options(fields.get("options", {}), RESOURCE_OPTIONS, {})
        project_id = uuid.uuid4().hex
        body: dict[str, Any] = {
            "id": project_id,
            "name": name,
            "domain_id": domain_id,
            "parent_id": parent.id if parent is not None else domain_id,
            "description": check_text("description", fields.get("description")) or "",
            "enabled": check_bool("enabled", fields.get("enabled", True)),
            "is_domain": False,
            "tags": check_tags(fields.get("tags", [])),
            "options": options,
            "extra": _extras(fields, known | {"options", "id"}),
        }
        return self._create_named("project", body, project_id=project_id)

    def update_project(self, project_id: str, changes: Mapping[str, Any]) -> Document:
        doc = self.project(project_id)
        self._refuse_if_immutable("project", doc, changes)
        body = dict(doc.body)
        extra = dict(body.get("extra", {}))
        for key, value in changes.items():
            if key == "name":
                body["name"] = check_name("project", value)
            elif key == "description":
                body["description"] = check_text("description", value)
            elif key == "enabled":
                body["enabled"] = check_bool("enabled", value)
            elif key == "tags":
                body["tags"] = check_tags(value)
            elif key == "options":
                body["options"] = check_options(value, RESOURCE_OPTIONS, body.get("options", {}))
            elif key in {"domain_id", "parent_id", "is_domain"}:
                if value != body.get(key, False if key == "is_domain" else None):
                    raise _invalid(key, f"update of {key} is not allowed")
            elif key != "id":
                extra[key] = value
        disabling = body.get("enabled", True) is False and doc.body.get("enabled", True)
        if disabling and any(c.body.get("enabled", True) for c in self.children(doc)):
            raise Forbidden(
                f"Cannot disable project {doc.id}, since its subtree contains enabled projects."
            )
        if body.get("enabled", True) and not doc.body.get("enabled", True):
            parent = self.objects.find("project", str(body.get("parent_id") or ""))
            if parent is not None and not parent.body.get("enabled", True):
                raise Forbidden(f"Cannot enable project {doc.id}, since its parent is disabled.")
        body["extra"] = extra
        updated = self._rename("project", doc, body)
        if disabling:
            self.revoke_tokens(project_id=doc.id)
        return updated

    def delete_project(self, project_id: str) -> None:
        doc = self.project(project_id)
        self._refuse_if_immutable("project", doc, {})
        if self.children(doc):
            raise Forbidden(
                f"Cannot delete the project {doc.id}, since it is not a leaf in the hierarchy."
            )
        self._remove_project(doc)

    def _remove_project(self, doc: Document) -> None:
        for grant in self.grants(project_id=doc.id):
            self.objects.delete("assignment", grant.id)
        self._remove_group_links("project_id", doc.id)
        self._delete_named("project", doc)
        self.revoke_tokens(project_id=doc.id)

    def children(self, project: Document) -> list[Document]:
        return [p for p in self.objects.list("project") if p.body.get("parent_id") == project.id]

    def parents(self, project: Document) -> list[Document]:
        """The project's ancestors that are projects, nearest first (the domain is not one)."""
        out: list[Document] = []
        seen = {project.id}
        parent_id = project.body.get("parent_id")
        while parent_id and parent_id not in seen:
            parent = self.objects.find("project", str(parent_id))
            if parent is None:
                break
            out.append(parent)
            seen.add(parent.id)
            parent_id = parent.body.get("parent_id")
        return out

    def subtree(self, project: Document) -> list[Document]:
        everything = self.objects.list("project")
        out: list[Document] = []
        frontier = [project.id]
        while frontier:
            found = [p for p in everything if p.body.get("parent_id") in frontier]
            out.extend(found)
            frontier = [p.id for p in found]
        return out

    def _leaves_first(self, projects: list[Document]) -> list[Document]:
        depth = {p.id: len(self.parents(p)) for p in projects}
        return sorted(projects, key=lambda p: -depth[p.id])

    # -- users --------------------------------------------------------------------------

    def user(self, user_id: str) -> Document:
        return self._found("user", user_id)

    def users(self) -> list[Document]:
        return self.objects.list("user")

    def create_user(
        self, fields: Mapping[str, Any], *, default_domain: str = DEFAULT_DOMAIN
    ) -> Document:
        known = {"name", "domain_id", "enabled", "password", "default_project_id", "description"}
        name = check_name("user", fields.get("name"))
        domain_id = check_id("domain_id", fields.get("domain_id")) or default_domain
        self.domain(domain_id)  # Keystone's DomainNotFound: a 404
        password = check_password(fields.get("password"))
        user_id = uuid.uuid4().hex
        body: dict[str, Any] = {
            "id": user_id,
            "name": name,
            "domain_id": domain_id,
            "enabled": check_bool("enabled", fields.get("enabled", True)),
            "password_hash": hash_password(password) if password is not None else "",
            "default_project_id": self._default_project(fields.get("default_project_id")),
            "description": check_text("description", fields.get("description")),
            "options": check_options(fields.get("options", {}), USER_OPTIONS, {}),
            "extra": _extras(fields, known | {"options", "id", "federated"}),
        }
        return self._create_named("user", body)

    def _default_project(self, value: Any) -> str | None:
        project_id = check_id("default_project_id", value)
        if project_id is not None and self.objects.find("project", project_id) is None:
            raise _invalid("default_project_id", f"Could not find project: {project_id}.")
        return project_id

    def update_user(self, user_id: str, changes: Mapping[str, Any]) -> Document:
        doc = self.user(user_id)
        body = dict(doc.body)
        extra = dict(body.get("extra", {}))
        for key, value in changes.items():
            if key == "name":
                body["name"] = check_name("user", value)
            elif key == "enabled":
                body["enabled"] = check_bool("enabled", value)
                if value:
                    self.objects.delete(_FAILURES, doc.id)  # enabling unlocks, as in Keystone
            elif key == "password":
                password = check_password(value)
                body["password_hash"] = hash_password(password) if password is not None else ""
            elif key == "default_project_id":
                body["default_project_id"] = self._default_project(value)
            elif key == "description":
                body["description"] = check_text("description", value)
            elif key == "options":
                body["options"] = check_options(value, USER_OPTIONS, body.get("options", {}))
            elif key == "domain_id":
                if value != body.get("domain_id", DEFAULT_DOMAIN):
                    raise _invalid("domain_id", "update of domain_id is not allowed")
            elif key not in {"id", "federated"}:
                extra[key] = value
        body["extra"] = extra
        updated = self._rename("user", doc, body)
        if "password" in changes or not body.get("enabled", True):
            self.revoke_tokens(user_id=doc.id)
        return updated

    def change_password(self, user_id: str, original: Any, password: Any) -> None:
        """The user's own change: the original password must match, checked as a login is
        (the same work whether the user exists, failures counted towards a lockout)."""
        if not isinstance(original, str):
            raise _invalid("original_password", f"{original!r} is not of type 'string'")
        doc = self.password_login(self.objects.find("user", user_id), original)
        new = check_password(password)
        if new is None:
            raise _invalid("password", "is required")
        body = dict(doc.body, password_hash=hash_password(new))
        self.objects.update("user", doc.id, body)
        self.revoke_tokens(user_id=doc.id)

    def delete_user(self, user_id: str) -> None:
        self._remove_user(self.user(user_id))

    def _remove_user(self, doc: Document) -> None:
        # The user goes first: its tokens stop working at once (auth refuses missing users).
        self._delete_named("user", doc)
        self.objects.delete(_FAILURES, doc.id)
        for grant in self.grants(user_id=doc.id):
            self.objects.delete("assignment", grant.id)
        self._remove_group_links("user_id", doc.id)
        self.revoke_tokens(user_id=doc.id)

    # -- roles --------------------------------------------------------------------------

    def role(self, role_id: str) -> Document:
        return self._found("role", role_id)

    def roles(self) -> list[Document]:
        return self.objects.list("role")

    def create_role(self, fields: Mapping[str, Any]) -> Document:
        name = check_name("role", fields.get("name"))
        domain_id = check_id("domain_id", fields.get("domain_id"))
        if domain_id is not None and self.objects.find("domain", domain_id) is None:
            raise _invalid("domain_id", f"Could not find domain: {domain_id}.")
        role_id = uuid.uuid4().hex
        body = {
            "id": role_id,
            "name": name,
            "domain_id": domain_id,
            "description": check_text("description", fields.get("description")),
            "options": check_options(fields.get("options", {}), RESOURCE_OPTIONS, {}),
        }
        return self._create_named("role", body)

    def update_role(self, role_id: str, changes: Mapping[str, Any]) -> Document:
        doc = self.role(role_id)
        self._refuse_if_immutable("role", doc, changes)
        body = dict(doc.body)
        body["options"] = role_options(doc)
        for key, value in changes.items():
            if key == "name":
                body["name"] = check_name("role", value)
            elif key == "description":
                body["description"] = check_text("description", value)
            elif key == "options":
                body["options"] = check_options(value, RESOURCE_OPTIONS, body["options"])
            elif key == "domain_id":
                if value != body.get("domain_id"):
                    raise _invalid("domain_id", "update of domain_id is not allowed")
            elif key != "id":
                raise _invalid(key, "Additional properties are not allowed")
        return self._rename("role", doc, body)

    def delete_role(self, role_id: str) -> None:
        doc = self.role(role_id)
        self._refuse_if_immutable("role", doc, {})
        self._remove_role(doc)

    def _remove_role(self, doc: Document) -> None:
        for grant in self.grants(role_id=doc.id):
            self.objects.delete("assignment", grant.id)
            self._revoke_for(grant)
        self._remove_group_links("role_id", doc.id)
        self._remove_rules_of(doc.id)
        self._delete_named("role", doc)

    # -- implied roles (role inference rules) ------------------------------------------

    def _store_rules(self) -> None:
        """From the first change on, the rules are their documents, seeded with what applied
        until then (a cloud made before the rules were data)."""
        if self.objects.find(INFERENCES_STORED, "all") is not None:
            return
        for prior, implied in _default_rules(self.objects.list("role")):
            with contextlib.suppress(ConflictError):
                self.objects.create(
                    INFERENCE,
                    inference_id(prior, implied),
                    {"prior_role_id": prior, "implied_role_id": implied},
                )
        with contextlib.suppress(ConflictError):
            self.objects.create(INFERENCES_STORED, "all", {})

    def implied_rule(self, prior_id: str, implied_id: str) -> tuple[Document, Document]:
        """The two roles of an inference rule, or Keystone's 404 when there is no such rule."""
        prior, implied = self.role(prior_id), self.role(implied_id)
        if (prior.id, implied.id) not in inference_rules(self.cloud):
            raise NotFound(
                f"{prior_id} does not imply {implied_id}.",
                code="identity.implied_role.not_found",
            )
        return prior, implied

    def implied_by(self, prior_id: str) -> tuple[Document, list[Document]]:
        """A role and the roles it implies directly."""
        prior = self.role(prior_id)
        ids = [i for p, i in inference_rules(self.cloud) if p == prior.id]
        return prior, self.objects.list("role", ids=set(ids)) if ids else []

    def create_implied_role(self, prior_id: str, implied_id: str) -> tuple[Document, Document]:
        """PUT /v3/roles/{prior}/implies/{implied}: idempotent, as in Keystone."""
        prior, implied = self.role(prior_id), self.role(implied_id)
        if implied.body.get("domain_id") is None and implied.name in PROHIBITED_IMPLIED:
            raise Forbidden(f"{implied.id} is not permitted to be an implied role.")
        if prior.body.get("domain_id") is None and implied.body.get("domain_id") is not None:
            raise Forbidden(
                f"Global role {prior.id} cannot imply domain-specific role {implied.id}."
            )
        if prior.id in {d.id for d in self._closure_all(implied.id)}:
            raise Forbidden(f"{prior.id} implying {implied.id} would make a cycle of roles.")
        self._store_rules()
        with contextlib.suppress(ConflictError):
            self.objects.create(
                INFERENCE,
                inference_id(prior.id, implied.id),
                {"prior_role_id": prior.id, "implied_role_id": implied.id},
            )
        return prior, implied

    def _closure_all(self, role_id: str) -> list[Document]:
        """The role and all it implies, domain-specific ones included."""
        implies: dict[str, list[str]] = {}
        for p, i in inference_rules(self.cloud):
            implies.setdefault(p, []).append(i)
        seen: dict[str, None] = {}
        pending = [role_id]
        while pending:
            current = pending.pop()
            if current not in seen:
                seen[current] = None
                pending += implies.get(current, [])
        return self.objects.list("role", ids=set(seen))

    def delete_implied_role(self, prior_id: str, implied_id: str) -> None:
        prior, implied = self.implied_rule(prior_id, implied_id)
        self._store_rules()
        self.objects.delete(INFERENCE, inference_id(prior.id, implied.id))

    def _remove_rules_of(self, role_id: str) -> None:
        if not any(role_id in rule for rule in inference_rules(self.cloud)):
            return
        self._store_rules()
        for doc in self.objects.list(INFERENCE):
            if role_id in (doc.body.get("prior_role_id"), doc.body.get("implied_role_id")):
                self.objects.delete(INFERENCE, doc.id)

    def role_by_name(self, name: str) -> Document | None:
        for doc in self.objects.list("role", name=name):
            if doc.body.get("domain_id") is None:
                return doc
        return None

    def _refuse_if_immutable(self, kind: str, doc: Document, changes: Mapping[str, Any]) -> None:
        options = role_options(doc) if kind == "role" else doc.body.get("options", {})
        if not options.get("immutable"):
            return
        # The one change an immutable resource accepts is the removal of the flag.
        if set(changes) == {"options"} and not (changes["options"] or {}).get("immutable", True):
            return
        raise Forbidden(
            f"{kind.capitalize()} {doc.id} is immutable: unset the immutable option first."
        )

    # -- grants -------------------------------------------------------------------------

    def grants(
        self,
        *,
        user_id: str | None = None,
        project_id: str | None = None,
        domain_id: str | None = None,
        role_id: str | None = None,
    ) -> list[Grant]:
        docs = self.objects.list("assignment", project_id=project_id)
        out = []
        for doc in docs:
            grant = _grant(doc)
            if user_id is not None and grant.user_id != user_id:
                continue
            if domain_id is not None and grant.domain_id != domain_id:
                continue
            if role_id is not None and grant.role_id != role_id:
                continue
            out.append(grant)
        return out

    def find_grant(
        self, user_id: str, role_id: str, *, project_id: str | None, domain_id: str | None
    ) -> Grant | None:
        for grant in self.grants(
            user_id=user_id, role_id=role_id, project_id=project_id, domain_id=domain_id
        ):
            if grant.project_id == project_id and grant.domain_id == domain_id:
                return grant
        return None

    def check_grantable(
        self, role_id: str, *, project_id: str | None, domain_id: str | None
    ) -> None:
        """The role exists, and a domain-specific role is granted only inside its domain."""
        role = self.role(role_id)
        if project_id is not None:
            target_domain = str(self.project(project_id).body.get("domain_id", DEFAULT_DOMAIN))
        else:
            target_domain = self.domain(str(domain_id)).id
        role_domain = role.body.get("domain_id")
        if role_domain is not None and role_domain != target_domain:
            raise Forbidden(
                f"Domain-specific role {role.id} of domain {role_domain} cannot be granted "
                f"on a target in domain {target_domain}."
            )

    def grant(
        self, user_id: str, role_id: str, *, project_id: str | None, domain_id: str | None
    ) -> Grant:
        """Idempotent: granting a role twice leaves one grant."""
        self.user(user_id)
        self.check_grantable(role_id, project_id=project_id, domain_id=domain_id)
        existing = self.find_grant(user_id, role_id, project_id=project_id, domain_id=domain_id)
        if existing is not None:
            return existing
        scope = f"project:{project_id}" if project_id is not None else f"domain:{domain_id}"
        grant_id = hashlib.sha256(f"{scope}\0{user_id}\0{role_id}".encode()).hexdigest()
        body: dict[str, Any] = {"user_id": user_id, "role_id": role_id}
        if project_id is not None:
            body["project_id"] = project_id
        else:
            body["domain_id"] = domain_id
        # A concurrent grant of the same role may win the insert: the result is the same.
        with contextlib.suppress(ConflictError):
            self.objects.create("assignment", grant_id, body, project_id=project_id)
        return Grant(grant_id, user_id, role_id, project_id, domain_id)

    def revoke(
        self, user_id: str, role_id: str, *, project_id: str | None, domain_id: str | None
    ) -> None:
        grant = self.find_grant(user_id, role_id, project_id=project_id, domain_id=domain_id)
        if grant is None:
            raise NotFound(
                f"Could not find role assignment with role: {role_id}, user or group: "
                f"{user_id}, project, domain, or system: {project_id or domain_id}.",
                code="identity.role_assignment.not_found",
            )
        self.objects.delete("assignment", grant.id)
        self._revoke_for(grant)

    def _revoke_for(self, grant: Grant) -> None:
        """A token carries its roles: one whose grant is gone must go too."""
        if grant.project_id is not None:
            self.revoke_tokens(user_id=grant.user_id, project_id=grant.project_id)
        elif grant.domain_id is not None:
            self.revoke_tokens(user_id=grant.user_id, project_id=domain_scope_key(grant.domain_id))

    def effective(self, grants: Iterable[Grant]) -> Iterator[tuple[Grant, Grant | None]]:
        """Each grant, then the roles it implies (by the inference rules), each paired with the
        grant it came from; a domain-specific role is left out, what it implies is not."""
        roles = {doc.id: doc for doc in self.objects.list("role")}
        implies: dict[str, list[str]] = {}
        for prior, implied in inference_rules(self.cloud, roles.values()):
            implies.setdefault(prior, []).append(implied)
        for grant in grants:
            role = roles.get(grant.role_id)
            if role is None or role.body.get("domain_id") is None:
                yield grant, None
            seen = {grant.role_id}
            frontier = [grant.role_id]
            while frontier:
                for implied_id in implies.get(frontier.pop(0), ()):
                    implied_role = roles.get(implied_id)
                    if implied_role is None or implied_id in seen:
                        continue
                    seen.add(implied_id)
                    frontier.append(implied_id)
                    if implied_role.body.get("domain_id") is not None:
                        continue
                    yield (
                        Grant(
                            grant.id, grant.user_id, implied_id, grant.project_id, grant.domain_id
                        ),
                        grant,
                    )

    def projects_of(self, user_id: str, *, enabled_only: bool = False) -> list[Document]:
        """Projects on which the user holds a role, oldest first."""
        ids = {g.project_id for g in self.grants(user_id=user_id) if g.project_id is not None}
        projects = self.objects.list("project", ids=ids) if ids else []
        if not enabled_only:
            return projects
        return [
            p
            for p in projects
            if p.body.get("enabled", True) and self._domain_enabled(p.body.get("domain_id"))
        ]

    def domains_of(self, user_id: str) -> list[Document]:
        ids = {g.domain_id for g in self.grants(user_id=user_id) if g.domain_id is not None}
        return [d for d in self.objects.list("domain", ids=ids) if d.body.get("enabled", True)]

    def _domain_enabled(self, domain_id: Any) -> bool:
        domain = self.objects.find("domain", str(domain_id or DEFAULT_DOMAIN))
        return domain is not None and bool(domain.body.get("enabled", True))

    # -- token revocation ---------------------------------------------------------------

    def record_token(self, audit_id: str, user_id: str, project_id: str, expires_at: float) -> None:
        """Remember who a token is for, so that later changes can revoke it as Keystone does."""
        now = self.cloud.clock()
        for doc in self.objects.list(_ISSUED, project_id=project_id):
            if float(doc.body.get("expires_at", 0.0)) <= now:
                self.objects.delete(_ISSUED, doc.id)  # keeps the record to live tokens
        self.objects.put(
            _ISSUED,
            audit_id,
            {"user_id": user_id, "project_id": project_id, "expires_at": expires_at},
            project_id=project_id,
        )

    def revoke_token(self, audit_id: str, expires_at: float) -> None:
        """Revoke one token (DELETE /v3/auth/tokens): refused from now until it expires."""
        self.objects.put(_REVOKED, audit_id, {"expires_at": expires_at})
        self.objects.delete(_ISSUED, audit_id)

    def revoke_tokens(self, *, user_id: str | None = None, project_id: str | None = None) -> int:
        """Revoke the live tokens of a user, of a project, or of a user on a project."""
        now = self.cloud.clock()
        revoked = 0
        for doc in self.objects.list(_ISSUED, project_id=project_id):
            expires_at = float(doc.body.get("expires_at", 0.0))
            if expires_at <= now:
                self.objects.delete(_ISSUED, doc.id)  # expired: nothing left to revoke
                continue
            if user_id is not None and doc.body.get("user_id") != user_id:
                continue
            self.objects.put(_REVOKED, doc.id, {"expires_at": expires_at})
            self.objects.delete(_ISSUED, doc.id)
            revoked += 1
        return revoked

    # -- authentication -----------------------------------------------------------------

    def password_login(self, user: Document | None, password: str) -> Document:
        """The user whose password this is, or Unauthorized. Always one password hash's work;
        with `[security_compliance] lockout_failure_attempts` set, that many failures in a row
        lock the account for `lockout_duration` seconds (0: until an admin enables it again),
        unless the user has the option `ignore_lockout_failure_attempts`."""
        if user is None:
            verify_password(password, _dummy_hash())
            raise Unauthorized(_UNAUTHENTICATED)
        stored = str(user.body.get("password_hash") or "")
        if self._locked(user):
            verify_password(password, _dummy_hash())
            raise Unauthorized(f"The account is locked for user: {user.id}.")
        if not (verify_password(password, stored or _dummy_hash()) and stored):
            self._record_failure(user)
            raise Unauthorized(_UNAUTHENTICATED)
        if self.objects.find(_FAILURES, user.id) is not None:
            self.objects.delete(_FAILURES, user.id)
        return user

    def _lockout_applies(self, user: Document) -> bool:
        options = user.body.get("options") or {}
        attempts = self.cloud.config.lockout_failure_attempts
        return attempts > 0 and options.get("ignore_lockout_failure_attempts") is not True

    def _locked(self, user: Document) -> bool:
        if not self._lockout_applies(user):
            return False
        failures = self.objects.find(_FAILURES, user.id)
        if failures is None:
            return False
        if int(failures.body.get("count", 0)) < self.cloud.config.lockout_failure_attempts:
            return False
        duration = self.cloud.config.lockout_duration_s
        if duration > 0 and self.cloud.clock() >= float(failures.body.get("at", 0.0)) + duration:
            self.objects.delete(_FAILURES, user.id)  # the lockout is over: count afresh
            return False
        return True

    def _record_failure(self, user: Document) -> None:
        if not self._lockout_applies(user):
            return
        for _ in range(20):  # concurrent failures each count: compare-and-swap the counter
            now = self.cloud.clock()
            current = self.objects.find(_FAILURES, user.id)
            if current is None:
                with contextlib.suppress(ConflictError):
                    self.objects.create(_FAILURES, user.id, {"count": 1, "at": now})
                    return
                continue
            new = {"count": int(current.body.get("count", 0)) + 1, "at": now}
            if self.objects.swap(_FAILURES, user.id, current.body, new):
                return

    def check_user_may_log_in(self, user: Document) -> None:
        if not user.body.get("enabled", True):
            raise Unauthorized(f"User {user.id} is disabled.")
        if not self._domain_enabled(user.body.get("domain_id")):
            raise Unauthorized(f"The domain of user {user.id} is disabled.")

    def check_project_usable(self, project: Document) -> None:
        if not project.body.get("enabled", True):
            raise Unauthorized(f"Project {project.id} is disabled.")
        if not self._domain_enabled(project.body.get("domain_id")):
            raise Unauthorized(f"The domain of project {project.id} is disabled.")


def role_options(doc: Document) -> dict[str, Any]:
    """A bootstrap role without options of its own is immutable, as keystone-manage makes it."""
    if "options" in doc.body:
        return dict(doc.body["options"])
    if doc.name in BOOTSTRAP_ROLES and doc.body.get("domain_id") is None:
        return {"immutable": True}
    return {}


def _grant(doc: Document) -> Grant:
    body = doc.body
    project_id = body.get("project_id") or doc.project_id
    return Grant(
        id=doc.id,
        user_id=str(body.get("user_id", "")),
        role_id=str(body.get("role_id", "")),
        project_id=str(project_id) if project_id else None,
        domain_id=None if project_id else str(body.get("domain_id") or "") or None,
    )


def _extras(fields: Mapping[str, Any], known: set[str]) -> dict[str, Any]:
    """Keystone keeps attributes it does not know and returns them as they came."""
    return {k: v for k, v in fields.items() if k not in known and k != "links"}
