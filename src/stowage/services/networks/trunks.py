"""Trunks and their subports: Neutron's trunk and trunk-details extensions.

A trunk is a "trunk" document whose body is what Neutron returns less its status, which is
computed when it is read: ACTIVE once its parent port is bound (to a server or a host), DOWN
before. Its sub_ports are stored in it. Neutron counts trunks in no quota, and neither does
this. A port may be the parent or a subport of one trunk at most: each of a trunk's ports is
claimed by a "trunk_port" document whose id is the port's id (name = the trunk id) before the
trunk is written, so the store's primary key refuses a second trunk the port, however close
the two requests come; the claims are released after the port leaves the trunk.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from stowage.domain.errors import ConflictError
from stowage.services.caller import Caller
from stowage.services.networks.common import (
    NeutronBadRequest,
    NeutronConflict,
    NeutronNotFound,
    _bodies,
    _bool,
    _check_keys,
    _common,
    _denied,
    _invalid,
    _owned,
    _owner,
    _required,
    _save,
    _standard,
    _text,
    stamped,
)
from stowage.services.networks.port import _port

if TYPE_CHECKING:
    from stowage.services.cloud import Cloud

__all__ = [
    "add_subports",
    "create_trunk",
    "delete_trunk",
    "get_subports",
    "get_trunk",
    "list_trunks",
    "remove_subports",
    "trunk_details",
    "trunk_using",
    "update_trunk",
]

_CREATE = (
    "name",
    "description",
    "port_id",
    "sub_ports",
    "admin_state_up",
    "project_id",
    "tenant_id",
)
_UPDATE = ("name", "description", "admin_state_up")
_KNOWN = ("port_id", "sub_ports", "project_id", "tenant_id")
_SUBPORT = ("port_id", "segmentation_type", "segmentation_id")


def _not_found(trunk_id: str) -> NeutronNotFound:
    return NeutronNotFound(f"Trunk {trunk_id} could not be found.", "TrunkNotFound")


def _visible(trunk: Mapping[str, Any], caller: Caller) -> bool:
    return caller.is_admin or trunk["project_id"] == caller.project_id


def _trunk(cloud: Cloud, caller: Caller, trunk_id: str) -> dict[str, Any]:
    doc = cloud.objects.find("trunk", trunk_id)
    if doc is None or not _visible(doc.body, caller):
        raise _not_found(trunk_id)
    return doc.body


def _bound(port: Mapping[str, Any] | None) -> bool:
    return port is not None and bool(port.get("device_id") or port.get("binding:host_id"))


def _parent(cloud: Cloud, trunk: Mapping[str, Any]) -> dict[str, Any] | None:
    doc = cloud.objects.find("port", trunk["port_id"])
    return doc.body if doc is not None else None


def _render(cloud: Cloud, trunk: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(trunk)
    out["status"] = "ACTIVE" if _bound(_parent(cloud, trunk)) else "DOWN"
    out["sub_ports"] = [dict(s) for s in trunk.get("sub_ports", [])]
    return out


def trunk_using(cloud: Cloud, port_id: str) -> tuple[str, str] | None:
    """("parent" or "subport", trunk id) when the port belongs to a trunk, else None."""
    for trunk in _bodies(cloud, "trunk"):
        if trunk["port_id"] == port_id:
            return "parent", trunk["id"]
        if any(s["port_id"] == port_id for s in trunk.get("sub_ports", [])):
            return "subport", trunk["id"]
    return None


def trunk_details(cloud: Cloud, port_id: str) -> dict[str, Any] | None:
    """The parent port's `trunk_details` (the trunk-details extension)."""
    for trunk in _bodies(cloud, "trunk"):
        if trunk["port_id"] != port_id:
            continue
        subs = []
        for sub in trunk.get("sub_ports", []):
            doc = cloud.objects.find("port", sub["port_id"])
            mac = doc.body.get("mac_address") if doc is not None else None
            subs.append({**sub, "mac_address": mac})
        return {"trunk_id": trunk["id"], "sub_ports": subs}
    return None


def list_trunks(cloud: Cloud, caller: Caller) -> list[dict[str, Any]]:
    return [_render(cloud, t) for t in _bodies(cloud, "trunk") if _visible(t, caller)]


def get_trunk(cloud: Cloud, caller: Caller, trunk_id: str) -> dict[str, Any]:
    return _render(cloud, _trunk(cloud, caller, trunk_id))


def _not_in_use(cloud: Cloud, port_id: str) -> None:
    if trunk_using(cloud, port_id) is not None:
        raise _in_use(port_id)


def _in_use(port_id: str) -> NeutronConflict:
    return NeutronConflict(f"Port {port_id} is in use by another trunk.", "TrunkPortInUse")


def _claim(cloud: Cloud, trunk_id: str, port_ids: list[str]) -> None:
    """Claim the ports for the trunk: all of them, or (409 TrunkPortInUse) none."""
    made: list[str] = []
    for port_id in port_ids:
        try:
            cloud.objects.create("trunk_port", port_id, {"trunk_id": trunk_id}, name=trunk_id)
        except ConflictError:
            _release(cloud, made)
            raise _in_use(port_id) from None
        made.append(port_id)


def _release(cloud: Cloud, port_ids: list[str]) -> None:
    for port_id in port_ids:
        cloud.objects.delete("trunk_port", port_id)


def _subports(
    cloud: Cloud,
    caller: Caller,
    value: Any,
    parent_id: str,
    existing: list[dict[str, Any]],
    trunk_id: str,
) -> list[dict[str, Any]]:
    """The requested subports, checked as Neutron's trunk rules check them."""
    if not isinstance(value, list) or not all(isinstance(s, dict) for s in value):
        raise _invalid("sub_ports", f"'{value}' is not a list of subports")
    out: list[dict[str, Any]] = []
    taken = {s["segmentation_id"] for s in existing}
    for item in value:
        unknown = sorted(set(item) - set(_SUBPORT))
        if unknown:
            raise _invalid("sub_ports", f"Unrecognized attribute(s) '{', '.join(unknown)}'")
        if "port_id" not in item:
            raise _invalid("sub_ports", "a subport needs a port_id")
        if "segmentation_type" not in item or "segmentation_id" not in item:
            raise _invalid(
                "sub_ports", "segmentation_type and segmentation_id are required for a subport"
            )
        if item["segmentation_type"] != "vlan":
            raise _invalid("sub_ports", f"'{item['segmentation_type']}' is not in ['vlan']")
        seg = item["segmentation_id"]
        try:
            seg = int(seg)
        except (TypeError, ValueError):
            raise _invalid("sub_ports", f"'{item['segmentation_id']}' is not an integer") from None
        if isinstance(item["segmentation_id"], bool) or not 1 <= seg <= 4094:
            raise _invalid("sub_ports", f"'{seg}' is not in range 1 through 4094")
        port_id = _text("port_id", item["port_id"])
        if port_id == parent_id:
            raise _in_use(port_id)
        port = _port(cloud, caller, port_id)
        _owned(port, caller, "create_trunk:sub_ports")
        if any(s["port_id"] == port_id for s in out):
            raise _invalid("sub_ports", f"port {port_id} is given twice")
        if any(s["segmentation_id"] == seg for s in out):
            raise _invalid("sub_ports", f"segmentation_id {seg} is given twice")
        if seg in taken:
            raise NeutronConflict(
                f"segmentation_type vlan and segmentation_id {seg} already in use on trunk "
                f"{trunk_id}.",
                "DuplicateSubPort",
            )
        _not_in_use(cloud, port_id)
        out.append({"port_id": port_id, "segmentation_type": "vlan", "segmentation_id": seg})
    return out


def create_trunk(cloud: Cloud, caller: Caller, attrs: Mapping[str, Any]) -> dict[str, Any]:
    _check_keys(attrs, _CREATE, _KNOWN)
    project = _owner(attrs, caller)
    parent_id = _text("port_id", _required(attrs, "port_id"))
    parent = _port(cloud, caller, parent_id)
    _owned(parent, caller, "create_trunk")
    _not_in_use(cloud, parent_id)
    trunk_id = str(uuid.uuid4())
    body: dict[str, Any] = {
        "id": trunk_id,
        "name": "",
        **_standard(cloud, project),
        "port_id": parent_id,
        "admin_state_up": True,
        "sub_ports": [],
    }
    _common(attrs, body)
    if "admin_state_up" in attrs:
        body["admin_state_up"] = _bool("admin_state_up", attrs["admin_state_up"])
    body["sub_ports"] = _subports(
        cloud, caller, attrs.get("sub_ports", []), parent_id, [], trunk_id
    )
    ports = [parent_id, *(sub["port_id"] for sub in body["sub_ports"])]
    _claim(cloud, trunk_id, ports)
    try:
        cloud.objects.create("trunk", trunk_id, body, project_id=project, name=body["name"])
    except BaseException:
        _release(cloud, ports)
        raise
    return _render(cloud, body)


def _writable(cloud: Cloud, caller: Caller, trunk_id: str, action: str) -> dict[str, Any]:
    trunk = _trunk(cloud, caller, trunk_id)
    if not caller.is_admin and trunk["project_id"] != caller.project_id:
        raise _denied(action)
    return dict(trunk)


def update_trunk(
    cloud: Cloud, caller: Caller, trunk_id: str, attrs: Mapping[str, Any]
) -> dict[str, Any]:
    trunk = _writable(cloud, caller, trunk_id, "update_trunk")
    _check_keys(attrs, _UPDATE, _KNOWN)
    _common(attrs, trunk)
    if "admin_state_up" in attrs:
        trunk["admin_state_up"] = _bool("admin_state_up", attrs["admin_state_up"])
    return _render(cloud, _save(cloud, "trunk", trunk))


def delete_trunk(cloud: Cloud, caller: Caller, trunk_id: str) -> None:
    trunk = _writable(cloud, caller, trunk_id, "delete_trunk")
    parent = _parent(cloud, trunk)
    if parent is not None and str(parent.get("device_owner", "")).startswith("compute:"):
        raise NeutronConflict(f"Trunk {trunk_id} is currently in use.", "TrunkInUse")
    cloud.objects.delete("trunk", trunk_id)
    _release(cloud, [trunk["port_id"], *(sub["port_id"] for sub in trunk.get("sub_ports", []))])


def _enabled(trunk: Mapping[str, Any]) -> None:
    if not trunk["admin_state_up"]:
        raise NeutronConflict(f"Trunk {trunk['id']} is currently disabled.", "TrunkDisabled")


def _sub_ports_of(body: Any) -> Any:
    if not isinstance(body, dict) or "sub_ports" not in body:
        raise NeutronBadRequest(
            "Failed to parse request. Required attribute 'sub_ports' not specified",
            "HTTPBadRequest",
        )
    return body["sub_ports"]


def _swapped(
    cloud: Cloud,
    caller: Caller,
    trunk_id: str,
    action: str,
    change: Callable[[dict[str, Any]], dict[str, Any]],
) -> dict[str, Any]:
    """`change` applied to the trunk as stored now, written only if nobody wrote it since
    (compare-and-swap, read again and retried when another request won)."""
    for _ in range(_SWAP_TRIES):
        before = _writable(cloud, caller, trunk_id, action)
        after = stamped(cloud, change(dict(before)))
        if cloud.objects.swap("trunk", trunk_id, before, after):
            return after
    raise NeutronConflict(
        f"Trunk {trunk_id} is being changed by other requests; try again.", "TrunkConflict"
    )


_SWAP_TRIES = 20


def add_subports(cloud: Cloud, caller: Caller, trunk_id: str, body: Any) -> dict[str, Any]:
    trunk = _writable(cloud, caller, trunk_id, "add_subports")
    _enabled(trunk)
    value = _sub_ports_of(body)
    added = _subports(
        cloud, caller, value, trunk["port_id"], list(trunk.get("sub_ports", [])), trunk_id
    )
    ports = [sub["port_id"] for sub in added]
    _claim(cloud, trunk_id, ports)

    def add(current: dict[str, Any]) -> dict[str, Any]:
        _enabled(current)
        existing = list(current.get("sub_ports", []))
        # Checked again against the trunk as it is now: another request may have taken a
        # segmentation id since (the ports themselves are this request's claims).
        _subports(cloud, caller, value, current["port_id"], existing, trunk_id)
        current["sub_ports"] = existing + added
        return current

    try:
        saved = _swapped(cloud, caller, trunk_id, "add_subports", add)
    except BaseException:
        _release(cloud, ports)
        raise
    return _render(cloud, saved)


def remove_subports(cloud: Cloud, caller: Caller, trunk_id: str, body: Any) -> dict[str, Any]:
    _enabled(_writable(cloud, caller, trunk_id, "remove_subports"))
    value = _sub_ports_of(body)
    if not isinstance(value, list) or not all(
        isinstance(s, dict) and "port_id" in s for s in value
    ):
        raise _invalid("sub_ports", f"'{value}' is not a list of subports with a port_id")
    wanted = [str(item["port_id"]) for item in value]
    gone = set(wanted)

    def remove(current: dict[str, Any]) -> dict[str, Any]:
        _enabled(current)
        existing = list(current.get("sub_ports", []))
        for port_id in wanted:
            if not any(s["port_id"] == port_id for s in existing):
                raise NeutronNotFound(
                    f"SubPort on trunk {trunk_id} with parent port {port_id} could not be found.",
                    "SubPortNotFound",
                )
        current["sub_ports"] = [s for s in existing if s["port_id"] not in gone]
        return current

    saved = _swapped(cloud, caller, trunk_id, "remove_subports", remove)
    _release(cloud, sorted(gone))
    return _render(cloud, saved)


def get_subports(cloud: Cloud, caller: Caller, trunk_id: str) -> dict[str, Any]:
    return {"sub_ports": [dict(s) for s in _trunk(cloud, caller, trunk_id).get("sub_ports", [])]}
