"""Ports: fixed IPs and MACs claimed before the port is written, released after it is gone."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from stowage.services.caller import Caller
from stowage.services.networks.addresses import (
    _allocate_ips,
    _claim_mac,
    _drop_port,
    _ip_requests,
    _release_ips,
    _valid_mac,
)
from stowage.services.networks.common import (
    NeutronBadRequest,
    NeutronConflict,
    NeutronNotFound,
    _bodies,
    _bool,
    _check_keys,
    _common,
    _denied,
    _editable,
    _invalid,
    _owner,
    _required,
    _save,
    _standard,
    _text,
    _uuid5,
)
from stowage.services.networks.network import _network
from stowage.services.networks.quotas import create_counted
from stowage.services.networks.security_groups import ensure_default_security_group

if TYPE_CHECKING:
    from stowage.services.cloud import Cloud

# -- ports ------------------------------------------------------------------------------------

_PORT_CREATE = (
    "name",
    "description",
    "network_id",
    "admin_state_up",
    "mac_address",
    "fixed_ips",
    "device_id",
    "device_owner",
    "security_groups",
    "port_security_enabled",
    "allowed_address_pairs",
    "extra_dhcp_opts",
    "binding:host_id",
    "binding:profile",
    "binding:vnic_type",
    "project_id",
    "tenant_id",
    "qos_policy_id",
)
_PORT_UPDATE = (
    "name",
    "description",
    "admin_state_up",
    "fixed_ips",
    "device_id",
    "device_owner",
    "security_groups",
    "port_security_enabled",
    "allowed_address_pairs",
    "extra_dhcp_opts",
    "binding:host_id",
    "binding:profile",
    "binding:vnic_type",
    "qos_policy_id",
)
_PORT_ADMIN_FIELDS = (
    "binding:host_id",
    "binding:profile",
    "binding:vif_type",
    "binding:vif_details",
)
_VNIC_TYPES = (
    "normal",
    "direct",
    "macvtap",
    "baremetal",
    "direct-physical",
    "virtio-forwarder",
    "smart-nic",
    "vdpa",
    "remote-managed",
)


def _port_visible(cloud: Cloud, port: Mapping[str, Any], caller: Caller) -> bool:
    if caller.is_admin or port["project_id"] == caller.project_id:
        return True
    net = cloud.objects.find("network", port["network_id"])
    return net is not None and net.body["project_id"] == caller.project_id


def _render_port(port: Mapping[str, Any], caller: Caller) -> dict[str, Any]:
    out = {key: value for key, value in port.items() if not key.startswith("_")}
    if not caller.is_admin:
        for key in _PORT_ADMIN_FIELDS:
            out.pop(key, None)
    return out


def _port(cloud: Cloud, caller: Caller, port_id: str) -> dict[str, Any]:
    doc = cloud.objects.find("port", port_id)
    if doc is None or not _port_visible(cloud, doc.body, caller):
        raise NeutronNotFound(f"Port {port_id} could not be found.", "PortNotFound")
    return doc.body


def list_ports(cloud: Cloud, caller: Caller) -> list[dict[str, Any]]:
    owned_nets = {
        n["id"] for n in _bodies(cloud, "network") if n["project_id"] == caller.project_id
    }
    return [
        _render_port(p, caller)
        for p in _bodies(cloud, "port")
        if caller.is_admin or p["project_id"] == caller.project_id or p["network_id"] in owned_nets
    ]


def get_port(cloud: Cloud, caller: Caller, port_id: str) -> dict[str, Any]:
    out = _render_port(_port(cloud, caller, port_id), caller)
    from stowage.services.networks.trunks import trunk_details  # late: trunks imports this

    details = trunk_details(cloud, port_id)
    if details is not None:
        out["trunk_details"] = details
    return out


def _network_subnets(cloud: Cloud, network_id: str) -> dict[str, dict[str, Any]]:
    return {s["id"]: s for s in _bodies(cloud, "subnet") if s["network_id"] == network_id}


def _security_groups(cloud: Cloud, value: Any, project_id: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _invalid("security_groups", f"'{value}' is not a list of ids")
    for group_id in value:
        doc = cloud.objects.find("security_group", group_id)
        if doc is None or doc.body["project_id"] != project_id:
            raise NeutronNotFound(
                f"Security group {group_id} does not exist", "SecurityGroupNotFound"
            )
    return list(dict.fromkeys(value))


def _port_attrs(
    cloud: Cloud, attrs: Mapping[str, Any], caller: Caller, body: dict[str, Any]
) -> None:
    """Every port attribute but network, MAC and addresses, checked and set on `body`."""
    _common(attrs, body)
    if "admin_state_up" in attrs:
        body["admin_state_up"] = _bool("admin_state_up", attrs["admin_state_up"])
    for key in ("device_id", "device_owner"):
        if key in attrs:
            body[key] = _text(key, attrs[key] or "")
    if "port_security_enabled" in attrs:
        body["port_security_enabled"] = _bool(
            "port_security_enabled", attrs["port_security_enabled"]
        )
    if "security_groups" in attrs:
        body["security_groups"] = _security_groups(
            cloud, attrs["security_groups"] or [], body["project_id"]
        )
    if not body["port_security_enabled"] and body["security_groups"]:
        if "security_groups" in attrs:
            raise NeutronConflict(
                f"Port {body['id']} has security group associated. Cannot disable port "
                "security or IP address until security group is removed",
                "PortSecurityAndIPRequiredForSecurityGroups",
            )
        body["security_groups"] = []
    for key in ("allowed_address_pairs", "extra_dhcp_opts"):
        if key in attrs:
            if not isinstance(attrs[key], list):
                raise _invalid(key, f"'{attrs[key]}' is not a list")
            body[key] = attrs[key]
    if "qos_policy_id" in attrs and attrs["qos_policy_id"] is not None:
        raise NeutronNotFound(
            f"QoS policy {attrs['qos_policy_id']} could not be found.", "QosPolicyNotFound"
        )
    if "binding:vnic_type" in attrs:
        if attrs["binding:vnic_type"] not in _VNIC_TYPES:
            raise _invalid("binding:vnic_type", f"'{attrs['binding:vnic_type']}' is not valid")
        body["binding:vnic_type"] = attrs["binding:vnic_type"]
    for key in ("binding:host_id", "binding:profile"):
        if key in attrs:
            if not caller.is_admin:
                raise _denied(f"create_port:{key}")
            body[key] = attrs[key] if key == "binding:profile" else _text(key, attrs[key] or "")
    bound = bool(body.get("binding:host_id"))
    body["binding:vif_type"] = "ovs" if bound else "unbound"
    body["binding:vif_details"] = {"port_filter": True, "connectivity": "l2"} if bound else {}
    body["status"] = "ACTIVE" if body["device_id"] and body["admin_state_up"] else "DOWN"


def create_port(
    cloud: Cloud,
    caller: Caller,
    attrs: Mapping[str, Any],
    *,
    private: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A new port; `private` fields (named `_...`, never shown) are written with it."""
    _check_keys(attrs, _PORT_CREATE)
    network_id = _text("network_id", _required(attrs, "network_id"))
    net = _network(cloud, caller, network_id)
    net_owner = caller.is_admin or net["project_id"] == caller.project_id
    if not net_owner and not net.get("shared"):
        raise _denied("create_port")
    project = _owner(attrs, caller)
    subnets = _network_subnets(cloud, network_id)
    requests = None
    if "fixed_ips" in attrs:
        requests = _ip_requests(attrs["fixed_ips"], network_id, subnets)
        if not net_owner and any(r.ip_address is not None for r in requests):
            raise _denied("create_port:fixed_ips:ip_address")
    mac = None
    if attrs.get("mac_address") is not None:
        if not net_owner:
            raise _denied("create_port:mac_address")
        mac = _valid_mac(attrs["mac_address"])
    port_id = str(uuid.uuid4())
    body: dict[str, Any] = {
        "id": port_id,
        "name": "",
        **_standard(cloud, project),
        "network_id": network_id,
        "admin_state_up": True,
        "status": "DOWN",
        "mac_address": "",
        "fixed_ips": [],
        "device_id": "",
        "device_owner": "",
        "security_groups": [],
        "port_security_enabled": bool(net.get("port_security_enabled", True)),
        "allowed_address_pairs": [],
        "extra_dhcp_opts": [],
        "binding:host_id": "",
        "binding:profile": {},
        "binding:vif_type": "unbound",
        "binding:vif_details": {},
        "binding:vnic_type": "normal",
        "ip_allocation": "immediate",
        "dns_name": "",
        "qos_policy_id": None,
        "qos_network_policy_id": None,
        "resource_request": None,
        "propagate_uplink_status": False,
    }
    wants_groups = "security_groups" in attrs
    if body["port_security_enabled"] and not wants_groups:
        body["security_groups"] = [ensure_default_security_group(cloud, project)]
    _port_attrs(cloud, attrs, caller, body)
    if body["device_owner"].startswith("network:") and not wants_groups:
        body["security_groups"] = []
    body.update({k: v for k, v in (private or {}).items() if k.startswith("_")})
    body["mac_address"] = _claim_mac(cloud, network_id, mac, port_id)
    try:
        body["fixed_ips"] = _allocate_ips(cloud, network_id, port_id, requests, subnets)
        try:
            create_counted(cloud, "port", port_id, body, project_id=project, name=body["name"])
        except BaseException:
            _release_ips(cloud, body["fixed_ips"])
            raise
    except BaseException:
        cloud.objects.delete("mac_allocation", _uuid5("mac", network_id, body["mac_address"]))
        raise
    return _render_port(body, caller)


def update_port(
    cloud: Cloud, caller: Caller, port_id: str, attrs: Mapping[str, Any]
) -> dict[str, Any]:
    port = _port(cloud, caller, port_id)
    new = _editable(
        port, caller, "update_port", attrs, (*_PORT_UPDATE, "mac_address"), _PORT_CREATE
    )
    _port_attrs(cloud, attrs, caller, new)
    if attrs.get("mac_address") is not None:
        mac = _valid_mac(attrs["mac_address"])
        if mac != port["mac_address"]:
            return _change_mac(cloud, caller, port, new, mac, attrs)
    if "fixed_ips" in attrs:
        subnets = _network_subnets(cloud, port["network_id"])
        requests = _ip_requests(attrs["fixed_ips"], port["network_id"], subnets)
        new["fixed_ips"] = _allocate_ips(
            cloud, port["network_id"], port_id, requests, subnets, keep=port["fixed_ips"]
        )
        kept = {(ip["subnet_id"], ip["ip_address"]) for ip in new["fixed_ips"]}
        try:
            saved = _save(cloud, "port", new)
        except BaseException:
            _release_ips(
                cloud,
                [ip for ip in new["fixed_ips"] if ip not in port["fixed_ips"]],
            )
            raise
        _release_ips(
            cloud,
            [ip for ip in port["fixed_ips"] if (ip["subnet_id"], ip["ip_address"]) not in kept],
        )
        if str(saved.get("device_owner", "")).startswith("compute:") and saved.get("device_id"):
            from stowage.services.networks.devices import refresh_server_addresses

            refresh_server_addresses(cloud, str(saved["device_id"]))
        return _render_port(saved, caller)
    return _render_port(_save(cloud, "port", new), caller)


def _change_mac(
    cloud: Cloud,
    caller: Caller,
    port: Mapping[str, Any],
    new: dict[str, Any],
    mac: str,
    attrs: Mapping[str, Any],
) -> dict[str, Any]:
    """An admin's MAC change (neutron's update_port:mac_address is admin only) of a port not
    bound to a host (ML2's PortBound otherwise): the new MAC is claimed on the network before
    the port is written, the old one released after."""
    if not caller.is_admin:
        raise _denied("update_port:mac_address")
    if port.get("binding:vif_type", "unbound") not in ("unbound", "binding_failed"):
        raise NeutronConflict(
            f"Unable to complete operation on port {port['id']}, port is already bound, port "
            f"type: {port['binding:vif_type']}, old_mac {port['mac_address']}, new_mac {mac}.",
            "PortBound",
        )
    if "fixed_ips" in attrs:
        # One change at a time keeps the claims' rollback simple; neutron clients send them apart.
        raise NeutronBadRequest(
            "Bad port request: change mac_address and fixed_ips in separate requests.",
            "BadRequest",
        )
    network_id = port["network_id"]
    new["mac_address"] = _claim_mac(cloud, network_id, mac, port["id"])
    try:
        saved = _save(cloud, "port", new)
    except BaseException:
        cloud.objects.delete("mac_allocation", _uuid5("mac", network_id, mac))
        raise
    cloud.objects.delete("mac_allocation", _uuid5("mac", network_id, port["mac_address"]))
    return _render_port(saved, caller)


def delete_port(cloud: Cloud, caller: Caller, port_id: str) -> None:
    port = _port(cloud, caller, port_id)
    if not caller.is_admin and port["project_id"] != caller.project_id:
        net = cloud.objects.find("network", port["network_id"])
        if net is None or net.body["project_id"] != caller.project_id:
            raise _denied("delete_port")
    from stowage.services.networks.trunks import trunk_using  # late: trunks imports this

    using = trunk_using(cloud, port_id)
    if using is not None:
        role, trunk_id = using
        kind = "PortInUseAsTrunkParent" if role == "parent" else "PortInUseAsSubPort"
        what = "a parent port" if role == "parent" else "a subport"
        raise NeutronConflict(f"Port {port_id} is currently {what} for trunk {trunk_id}.", kind)
    _drop_port(cloud, port)
    if str(port.get("device_owner", "")).startswith("compute:") and port.get("device_id"):
        # The server's addresses lose the port's, as Nova's on network-vif-deleted.
        from stowage.services.networks.devices import refresh_server_addresses

        refresh_server_addresses(cloud, str(port["device_id"]))
