"""Networks: create, read, update and delete, as neutron shows them."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from stowage.services.caller import Caller
from stowage.services.networks.addresses import _drop_port
from stowage.services.networks.common import (
    AVAILABILITY_ZONE,
    MTU,
    NeutronConflict,
    NeutronNotFound,
    _bodies,
    _bool,
    _check_keys,
    _common,
    _denied,
    _editable,
    _invalid,
    _owned,
    _owner,
    _save,
    _standard,
    _text,
)
from stowage.services.networks.quotas import create_counted
from stowage.services.networks.subnetpools import release_prefix

if TYPE_CHECKING:
    from stowage.services.cloud import Cloud

# -- networks ---------------------------------------------------------------------------------

_NETWORK_CREATE = (
    "name",
    "description",
    "admin_state_up",
    "shared",
    "router:external",
    "mtu",
    "port_security_enabled",
    "availability_zone_hints",
    "project_id",
    "tenant_id",
    "provider:network_type",
    "provider:physical_network",
    "provider:segmentation_id",
    "dns_domain",
    "qos_policy_id",
    "is_default",
)
_NETWORK_UPDATE = (
    "name",
    "description",
    "admin_state_up",
    "shared",
    "router:external",
    "mtu",
    "port_security_enabled",
    "dns_domain",
    "qos_policy_id",
    "is_default",
)
_NETWORK_ADMIN_FIELDS = (
    "provider:network_type",
    "provider:physical_network",
    "provider:segmentation_id",
)


def _network_visible(net: Mapping[str, Any], caller: Caller) -> bool:
    return (
        caller.is_admin
        or net["project_id"] == caller.project_id
        or bool(net.get("shared"))
        or bool(net.get("router:external"))
    )


def _render_network(
    net: Mapping[str, Any], caller: Caller, subnets: Mapping[str, list[str]]
) -> dict[str, Any]:
    out = dict(net)
    out["subnets"] = list(subnets.get(net["id"], []))
    if not caller.is_admin:
        for key in _NETWORK_ADMIN_FIELDS:
            out.pop(key, None)
    return out


def _subnets_by_network(cloud: Cloud) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for subnet in _bodies(cloud, "subnet"):
        out.setdefault(subnet["network_id"], []).append(subnet["id"])
    return out


def _network(cloud: Cloud, caller: Caller, network_id: str) -> dict[str, Any]:
    doc = cloud.objects.find("network", network_id)
    if doc is None or not _network_visible(doc.body, caller):
        raise NeutronNotFound(f"Network {network_id} could not be found.", "NetworkNotFound")
    return doc.body


def list_networks(cloud: Cloud, caller: Caller) -> list[dict[str, Any]]:
    subnets = _subnets_by_network(cloud)
    return [
        _render_network(net, caller, subnets)
        for net in _bodies(cloud, "network")
        if _network_visible(net, caller)
    ]


def get_network(cloud: Cloud, caller: Caller, network_id: str) -> dict[str, Any]:
    net = _network(cloud, caller, network_id)
    return _render_network(net, caller, _subnets_by_network(cloud))


def _network_attrs(
    attrs: Mapping[str, Any], caller: Caller, body: dict[str, Any], verb: str
) -> None:
    _common(attrs, body)
    for key in ("admin_state_up", "port_security_enabled", "is_default"):
        if key in attrs:
            body[key] = _bool(key, attrs[key])
    for key, action in (("shared", "shared"), ("router:external", "router:external")):
        if key in attrs:
            value = _bool(key, attrs[key])
            if value != body.get(key, False) and not caller.is_admin:
                raise _denied(f"{verb}_network:{action}")
            body[key] = value
    if "mtu" in attrs:
        mtu = attrs["mtu"]
        if isinstance(mtu, bool) or not isinstance(mtu, int) or not 68 <= mtu <= 9000:
            raise _invalid("mtu", f"'{mtu}' is not in range 68 through 9000")
        body["mtu"] = mtu
    if "dns_domain" in attrs:
        body["dns_domain"] = _text("dns_domain", attrs["dns_domain"] or "")
    if "qos_policy_id" in attrs and attrs["qos_policy_id"] is not None:
        raise NeutronNotFound(
            f"QoS policy {attrs['qos_policy_id']} could not be found.", "QosPolicyNotFound"
        )
    if "availability_zone_hints" in attrs:
        hints = attrs["availability_zone_hints"]
        if not isinstance(hints, list) or any(h != AVAILABILITY_ZONE for h in hints):
            raise NeutronNotFound(
                f"AvailabilityZone {hints} could not be found.", "AvailabilityZoneNotFound"
            )
        body["availability_zone_hints"] = hints
    provider = {k: attrs[k] for k in _NETWORK_ADMIN_FIELDS if k in attrs}
    if provider:
        if not caller.is_admin:
            raise _denied(f"{verb}_network:provider:network_type")
        kind = provider.get("provider:network_type", "vxlan")
        if kind not in ("flat", "vlan", "vxlan", "geneve", "gre", "local"):
            raise _invalid("provider:network_type", f"network type {kind} is not supported")
        body.update(provider)


def create_network(cloud: Cloud, caller: Caller, attrs: Mapping[str, Any]) -> dict[str, Any]:
    _check_keys(attrs, _NETWORK_CREATE)
    project = _owner(attrs, caller)
    network_id = str(uuid.uuid4())
    body: dict[str, Any] = {
        "id": network_id,
        "name": "",
        **_standard(cloud, project),
        "status": "ACTIVE",
        "admin_state_up": True,
        "shared": False,
        "router:external": False,
        "mtu": MTU,
        "port_security_enabled": True,
        "availability_zone_hints": [],
        "availability_zones": [AVAILABILITY_ZONE],
        "ipv4_address_scope": None,
        "ipv6_address_scope": None,
        "l2_adjacency": True,
        "is_default": False,
        "qos_policy_id": None,
        "dns_domain": "",
        "provider:network_type": "geneve",
        "provider:physical_network": None,
        "provider:segmentation_id": _segment_id(network_id),
    }
    _network_attrs(attrs, caller, body, "create")
    if body["provider:network_type"] in ("flat", "local"):
        body["provider:segmentation_id"] = None
    create_counted(cloud, "network", network_id, body, project_id=project, name=body["name"])
    return _render_network(body, caller, {})


def _segment_id(network_id: str) -> int:
    return 1 + int(uuid.UUID(network_id)) % 65000


def update_network(
    cloud: Cloud, caller: Caller, network_id: str, attrs: Mapping[str, Any]
) -> dict[str, Any]:
    net = _network(cloud, caller, network_id)
    new = _editable(net, caller, "update_network", attrs, _NETWORK_UPDATE, _NETWORK_CREATE)
    _network_attrs(attrs, caller, new, "update")
    return _render_network(_save(cloud, "network", new), caller, _subnets_by_network(cloud))


def delete_network(cloud: Cloud, caller: Caller, network_id: str) -> None:
    """Refused while ports other than DHCP ones use it; its subnets go with it."""
    net = _network(cloud, caller, network_id)
    _owned(net, caller, "delete_network")
    ports = [p for p in _bodies(cloud, "port") if p["network_id"] == network_id]
    if any(not p.get("device_owner", "").startswith("network:dhcp") for p in ports):
        raise NeutronConflict(
            f"Unable to complete operation on network {network_id}. There are one or more "
            "ports still in use on the network.",
            "NetworkInUse",
        )
    for port in ports:
        _drop_port(cloud, port)
    for subnet in _bodies(cloud, "subnet"):
        if subnet["network_id"] == network_id and cloud.objects.delete("subnet", subnet["id"]):
            release_prefix(cloud, subnet)
    cloud.objects.delete("network", network_id)
