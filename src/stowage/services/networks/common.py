"""What every network resource shares: its errors, identifiers, documents and request checks."""

from __future__ import annotations

import ipaddress
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from stowage.domain.errors import ConflictError, InvalidSpec, NotFound, StowageError
from stowage.services.caller import Caller

if TYPE_CHECKING:
    from stowage.services.cloud import Cloud


MTU = 1450
AVAILABILITY_ZONE = "nova"
MAC_PREFIX = "fa:16:3e"
_NAMESPACE = uuid.UUID("6a1d5c0e-9d1b-4a55-8f1e-2a63c1f0b7aa")


@dataclass(frozen=True, slots=True)
class _As:
    project_id: str
    is_admin: bool = False


class NetworkError(StowageError):
    """A refused network request: `status` is neutron's HTTP status, `code` its error type."""

    status = 400

    def __init__(self, message: str, kind: str, *, status: int | None = None) -> None:
        super().__init__(message, code=kind)
        if status is not None:
            self.status = status


class NeutronNotFound(NetworkError, NotFound):
    status = 404


class NeutronConflict(NetworkError, ConflictError):
    status = 409


class NeutronBadRequest(NetworkError, InvalidSpec):
    status = 400


class NeutronForbidden(NetworkError):
    status = 403


def _invalid(attr: str, reason: str) -> NeutronBadRequest:
    return NeutronBadRequest(f"Invalid input for {attr}. Reason: {reason}.", "HTTPBadRequest")


def _denied(action: str) -> NeutronForbidden:
    return NeutronForbidden(f"rule:{action} is disallowed by policy", "PolicyNotAuthorized")


def _now(cloud: Cloud) -> str:
    return datetime.fromtimestamp(cloud.clock(), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _uuid5(*parts: str) -> str:
    return str(uuid.uuid5(_NAMESPACE, "/".join(parts)))


def _standard(cloud: Cloud, project_id: str) -> dict[str, Any]:
    """The standard attributes every neutron resource carries."""
    now = _now(cloud)
    return {
        "project_id": project_id,
        "tenant_id": project_id,
        "description": "",
        "tags": [],
        "created_at": now,
        "updated_at": now,
        "revision_number": 1,
    }


def stamped(cloud: Cloud, body: dict[str, Any]) -> dict[str, Any]:
    """`body` as a write stores it: updated now, its revision number one up."""
    body["updated_at"] = _now(cloud)
    body["revision_number"] = int(body.get("revision_number", 0)) + 1
    return body


def _save(cloud: Cloud, kind: str, body: dict[str, Any]) -> dict[str, Any]:
    stamped(cloud, body)
    cloud.objects.update(kind, body["id"], body, name=body.get("name") or "")
    return body


def _bodies(cloud: Cloud, kind: str) -> list[dict[str, Any]]:
    return [doc.body for doc in cloud.objects.list(kind)]


# -- request checking -------------------------------------------------------------------------


_READ_ONLY = ("id", "status", "created_at", "updated_at", "revision_number", "tags")


def _check_keys(
    attrs: Mapping[str, Any], allowed: Iterable[str], known: Iterable[str] = ()
) -> None:
    """Neutron's refusals: a known attribute that may not be written here is read-only."""
    unknown = sorted(set(attrs) - set(allowed))
    if not unknown:
        return
    read_only = [key for key in unknown if key in set(known) | set(_READ_ONLY)]
    if read_only:
        raise NeutronBadRequest(
            f"Cannot update read-only attribute {read_only[0]}", "HTTPBadRequest"
        )
    raise NeutronBadRequest(f"Unrecognized attribute(s) '{', '.join(unknown)}'", "HTTPBadRequest")


def _required(attrs: Mapping[str, Any], key: str) -> Any:
    if key not in attrs:
        raise NeutronBadRequest(
            f"Failed to parse request. Required attribute '{key}' not specified",
            "HTTPBadRequest",
        )
    return attrs[key]


def _bool(attr: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    raise _invalid(attr, f"'{value}' cannot be converted to boolean")


def _text(attr: str, value: Any, max_len: int = 255) -> str:
    if not isinstance(value, str):
        raise _invalid(attr, f"'{value}' is not a valid string")
    if len(value) > max_len:
        raise _invalid(attr, f"'{value}' exceeds maximum length of {max_len}")
    return value


def _owner(attrs: Mapping[str, Any], caller: Caller) -> str:
    project = attrs.get("project_id", attrs.get("tenant_id"))
    if project is None or (project == "" and not caller.is_admin):
        project = caller.project_id
    if "project_id" in attrs and "tenant_id" in attrs and attrs["project_id"] != attrs["tenant_id"]:
        raise _invalid("project_id", "project_id and tenant_id do not match")
    project = _text("project_id", project)
    if project != caller.project_id and not caller.is_admin:
        raise NeutronBadRequest(
            "Specifying 'project_id' or 'tenant_id' other than the authenticated project in "
            "request requires admin privileges",
            "HTTPBadRequest",
        )
    return project


def _common(attrs: Mapping[str, Any], body: dict[str, Any]) -> None:
    """name and description, present on every resource here."""
    if "name" in attrs:
        body["name"] = _text("name", attrs["name"] if attrs["name"] is not None else "")
    if "description" in attrs:
        body["description"] = _text("description", attrs["description"] or "", 255)


IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def _owned(body: Mapping[str, Any], caller: Caller, action: str) -> None:
    if not caller.is_admin and body["project_id"] != caller.project_id:
        raise _denied(action)


def _editable(
    body: Mapping[str, Any],
    caller: Caller,
    action: str,
    attrs: Mapping[str, Any],
    allowed: Iterable[str],
    known: Iterable[str],
) -> dict[str, Any]:
    """A copy of `body` to change: refused unless the caller owns it and may write `attrs`."""
    _owned(body, caller, action)
    _check_keys(attrs, allowed, known)
    return dict(body)


def _address(attr: str, value: Any, version: int | None = None) -> IPAddress:
    try:
        address = ipaddress.ip_address(str(value))
    except ValueError:
        raise _invalid(attr, f"'{value}' is not a valid IP address") from None
    if version is not None and address.version != version:
        raise _invalid(attr, f"'{value}' is not an IPv{version} address")
    return address
