"""Application credentials: a user's delegated secret for one project, with a subset of the
user's roles, an optional expiry and access rules, as Keystone keeps them.

An "application_credential" document holds the credential (its secret only as a hash); an
"app_credential_name" document, written in the same transaction, claims its name for its user
(the store's primary key refuses a second). Each token issued from a credential is recorded
("app_credential_token", id the token's audit id, name the credential's id), so that deleting
the credential revokes its tokens, and so that a request made with such a token can be held to
the credential's access rules.
"""

from __future__ import annotations

import fnmatch
import secrets
import uuid
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy.exc import IntegrityError

from stowage.domain.errors import ConflictError, InvalidSpec, NotFound
from stowage.ledger.objects import Document
from stowage.services.identity import Forbidden, Unauthorized
from stowage.services.tokens import hash_password, verify_password

if TYPE_CHECKING:
    from stowage.services.cloud import Cloud

__all__ = [
    "METHOD",
    "access_allowed",
    "access_rules_of",
    "authenticate",
    "create",
    "credential_of_token",
    "delete",
    "delete_access_rule",
    "get",
    "list_of",
    "record_token",
    "token_roles",
]

METHOD = "application_credential"
_KIND = "application_credential"
_NAME = "app_credential_name"
_TOKEN = "app_credential_token"
_REVOKED = "revoked_token"
_RULE = "access_rule"  # a user's access rule, kept past the credentials that name it
_FIELDS = {"name", "description", "secret", "expires_at", "roles", "unrestricted", "access_rules"}
_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")


def _invalid(field: str, why: str) -> InvalidSpec:
    return InvalidSpec(f"Invalid input for field 'application_credential/{field}': {why}")


def _expiry(value: Any, now: float) -> float | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise _invalid("expires_at", "a timestamp such as 2030-01-01T00:00:00Z")
    try:
        when = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise _invalid("expires_at", f"{value!r} is not a timestamp") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    ts = when.timestamp()
    if ts <= now:
        raise _invalid("expires_at", "the expiry is in the past")
    return ts


def _roles(
    cloud: Cloud, value: Any, held: Sequence[str], user_id: str, project_id: str
) -> list[dict[str, Any]]:
    """The roles asked for, each one the user holds on the project now (Keystone checks the
    assignments, so a role granted after the token was issued counts); the token's when none
    are named."""
    if value is None:
        value = [{"name": name} for name in held]
    held = [*held, *(cloud.roles_of(user_id, project_id) if project_id else ())]
    if not isinstance(value, list) or not all(isinstance(r, dict) for r in value):
        raise _invalid("roles", "a list of objects with a role's id or name")
    out: dict[str, dict[str, Any]] = {}
    for ref in value:
        role = None
        if ref.get("id"):
            role = cloud.objects.find("role", str(ref["id"]))
        elif ref.get("name"):
            role = next(iter(cloud.objects.list("role", name=str(ref["name"]))), None)
        if role is None:
            raise NotFound(f"Could not find role: {ref.get('id') or ref.get('name')}.")
        if role.name not in held:
            raise Forbidden(
                f"The user does not hold the role {role.name} on this project, so an "
                "application credential cannot carry it."
            )
        out[role.id] = {"id": role.id, "name": role.name, "domain_id": None}
    return list(out.values())


def _access_rules(value: Any) -> list[dict[str, str]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise _invalid("access_rules", "a list of {service, method, path}")
    rules = []
    for rule in value:
        if not isinstance(rule, dict) or set(rule) - {"service", "method", "path", "id"}:
            raise _invalid("access_rules", "each rule has a service, a method and a path")
        service, method, path = rule.get("service"), rule.get("method"), rule.get("path")
        if not isinstance(service, str) or not service:
            raise _invalid("access_rules/service", "required")
        if method not in _METHODS:
            raise _invalid("access_rules/method", f"one of {', '.join(_METHODS)}")
        if not isinstance(path, str) or not path.startswith("/"):
            raise _invalid("access_rules/path", "an absolute path, globs allowed")
        rules.append({"id": uuid.uuid4().hex, "service": service, "method": method, "path": path})
    return rules


def _with_ids(cloud: Cloud, user_id: str, rules: list[dict[str, str]]) -> list[dict[str, str]]:
    """Each rule with the id of the user's identical rule, if there is one (Keystone's)."""
    known = {
        (d.body["service"], d.body["method"], d.body["path"]): d.id
        for d in cloud.objects.list(_RULE, name=user_id)
    }
    return [{**r, "id": known.get((r["service"], r["method"], r["path"]), r["id"])} for r in rules]


def access_rules_of(cloud: Cloud, user_id: str) -> list[Document]:
    return cloud.objects.list(_RULE, name=user_id)


def delete_access_rule(cloud: Cloud, user_id: str, rule_id: str) -> None:
    """Refused while a credential of the user names it (Keystone's 403)."""
    doc = cloud.objects.find(_RULE, rule_id)
    if doc is None or doc.name != user_id:
        raise NotFound(f"Could not find Access Rule: {rule_id}.")
    for cred in list_of(cloud, user_id):
        if any(r["id"] == rule_id for r in cred.body.get("access_rules", [])):
            raise Forbidden(
                f"Cannot delete access rule {rule_id} because it is in use by application "
                f"credential {cred.id}."
            )
    cloud.objects.delete(_RULE, rule_id)


def create(
    cloud: Cloud,
    *,
    user_id: str,
    project_id: str,
    held_roles: Sequence[str],
    fields: Mapping[str, Any],
) -> tuple[Document, str]:
    """A new credential of `user_id` on `project_id`, and its secret (shown only now)."""
    unknown = sorted(set(fields) - _FIELDS)
    if unknown:
        raise _invalid(unknown[0], "not an attribute of an application credential")
    name = fields.get("name")
    if not isinstance(name, str) or not 1 <= len(name) <= 255:
        raise _invalid("name", "a string of 1 to 255 characters")
    description = fields.get("description")
    if description is not None and not isinstance(description, str):
        raise _invalid("description", "a string")
    secret = fields.get("secret")
    if secret is None:
        secret = secrets.token_urlsafe(64)
    if not isinstance(secret, str) or not secret:
        raise _invalid("secret", "a non-empty string")
    unrestricted = fields.get("unrestricted", False)
    if not isinstance(unrestricted, bool):
        raise _invalid("unrestricted", "a boolean")
    rules = _with_ids(cloud, user_id, _access_rules(fields.get("access_rules")))
    body = {
        "user_id": user_id,
        "project_id": project_id,
        "name": name,
        "description": description,
        "expires_at": _expiry(fields.get("expires_at"), cloud.clock()),
        "roles": _roles(cloud, fields.get("roles"), held_roles, user_id, project_id),
        "unrestricted": unrestricted,
        "access_rules": rules,
        "secret_hash": hash_password(secret),
    }
    cred_id = uuid.uuid4().hex
    try:
        with cloud.ledger.engine.begin() as conn:
            cloud.objects.create_in(conn, _NAME, f"{user_id}:{name}", {"id": cred_id})
            for rule in rules:
                if cloud.objects.find_in(conn, _RULE, rule["id"]) is None:
                    cloud.objects.create_in(conn, _RULE, rule["id"], rule, name=user_id)
            doc = cloud.objects.create_in(
                conn, _KIND, cred_id, body, project_id=project_id, name=user_id
            )
    except IntegrityError:
        raise ConflictError(
            "Conflict occurred attempting to store application_credential - Duplicate entry "
            f"found with name {name}."
        ) from None
    return doc, secret


def list_of(cloud: Cloud, user_id: str) -> list[Document]:
    return cloud.objects.list(_KIND, name=user_id)


def get(cloud: Cloud, user_id: str, cred_id: str) -> Document:
    doc = cloud.objects.find(_KIND, cred_id)
    if doc is None or doc.body.get("user_id") != user_id:
        raise NotFound(f"Could not find Application Credential: {cred_id}.")
    return doc


def delete(cloud: Cloud, user_id: str, cred_id: str) -> int:
    """Delete the credential and revoke the tokens issued from it; how many were revoked."""
    doc = get(cloud, user_id, cred_id)
    now = cloud.clock()
    revoked = 0
    for token in cloud.objects.list(_TOKEN, name=cred_id):
        expires_at = float(token.body.get("expires_at", 0.0))
        if expires_at > now:
            cloud.objects.put(_REVOKED, token.id, {"expires_at": expires_at})
            revoked += 1
        cloud.objects.delete(_TOKEN, token.id)
    with cloud.ledger.engine.begin() as conn:
        cloud.objects.delete_in(conn, _NAME, f"{user_id}:{doc.body['name']}")
        cloud.objects.delete_in(conn, _KIND, cred_id)
    return revoked


# -- authentication -------------------------------------------------------------------------

_BAD = "Invalid application credential."


def _find(cloud: Cloud, ref: Mapping[str, Any]) -> Document | None:
    if ref.get("id"):
        return cloud.objects.find(_KIND, str(ref["id"]))
    user = ref.get("user")
    if not ref.get("name") or not isinstance(user, dict):
        raise InvalidSpec(
            "Invalid input for field 'identity/application_credential': an id, or a name "
            "and its user"
        )
    user_id = user.get("id")
    if not user_id and user.get("name"):
        domain = user.get("domain") or {}
        domain_id = domain.get("id") or "default"
        if domain.get("name"):
            found = next(iter(cloud.objects.list("domain", name=str(domain["name"]))), None)
            domain_id = found.id if found is not None else ""
        users = [
            u
            for u in cloud.objects.list("user", name=str(user["name"]))
            if u.body.get("domain_id", "default") == domain_id
        ]
        user_id = users[0].id if users else None
    if not user_id:
        return None
    claim = cloud.objects.find(_NAME, f"{user_id}:{ref['name']}")
    return cloud.objects.find(_KIND, str(claim.body["id"])) if claim is not None else None


def authenticate(cloud: Cloud, ref: Any) -> Document:
    """The credential whose secret `ref` holds, or Unauthorized. Always one hash's work."""
    if not isinstance(ref, dict):
        raise InvalidSpec("Invalid input for field 'identity/application_credential': required")
    secret = ref.get("secret")
    if not isinstance(secret, str):
        raise InvalidSpec(
            "Invalid input for field 'identity/application_credential/secret': required"
        )
    doc = _find(cloud, ref)
    if doc is None:
        hash_password(secret)  # as long as a real check takes
        raise Unauthorized(_BAD)
    if not verify_password(secret, str(doc.body["secret_hash"])):
        raise Unauthorized(_BAD)
    expires_at = doc.body.get("expires_at")
    if expires_at is not None and float(expires_at) <= cloud.clock():
        raise Unauthorized("The application credential has expired.")
    return doc


def token_roles(cloud: Cloud, doc: Document) -> tuple[str, ...]:
    """The roles a token from the credential carries: its own, each still held by its user on
    its project (Keystone refuses a credential whose user lost one of them)."""
    held = set(cloud.roles_of(str(doc.body["user_id"]), str(doc.body["project_id"])))
    names = [str(r["name"]) for r in doc.body.get("roles", [])]
    missing = [n for n in names if n not in held]
    if missing:
        raise Unauthorized(
            f"The user no longer holds the roles {', '.join(missing)} of this application "
            "credential on its project."
        )
    from stowage.services.identity import with_implied

    return with_implied(cloud, names)


def record_token(cloud: Cloud, audit_id: str, doc: Document, expires_at: float) -> None:
    cloud.objects.put(_TOKEN, audit_id, {"expires_at": expires_at}, name=doc.id)


def credential_of_token(cloud: Cloud, audit_id: str) -> Document | None:
    record = cloud.objects.find(_TOKEN, audit_id)
    if record is None or not record.name:
        return None
    return cloud.objects.find(_KIND, record.name)


def access_allowed(doc: Document, service: str, method: str, path: str) -> bool:
    """Whether the credential's access rules let a token from it make this request: no rules,
    or one whose service and method match and whose path glob matches (`*` is one path
    segment, `**` any number of them), as keystonemiddleware matches them."""
    rules = doc.body.get("access_rules") or []
    if not rules:
        return True
    return any(
        r["service"] == service and r["method"] == method and _path_matches(r["path"], path)
        for r in rules
    )


def _path_matches(pattern: str, path: str) -> bool:
    want = pattern.rstrip("/").split("/")
    have = path.rstrip("/").split("/")
    return _segments(want, have)


def _segments(want: list[str], have: list[str]) -> bool:
    if not want:
        return not have
    if want[0] == "**":
        return any(_segments(want[1:], have[i:]) for i in range(len(have) + 1))
    if not have:
        return False
    return fnmatch.fnmatchcase(have[0], want[0]) and _segments(want[1:], have[1:])
