"""Security groups and their rules, with each project's default group."""

from __future__ import annotations

import contextlib
import ipaddress
import uuid
from collections.abc import Iterable, Mapping
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
    _editable,
    _invalid,
    _owned,
    _owner,
    _required,
    _save,
    _standard,
    _text,
    _uuid5,
)
from stowage.services.networks.quotas import create_counted

if TYPE_CHECKING:
    from stowage.services.cloud import Cloud

# -- security groups --------------------------------------------------------------------------

_GROUP_CREATE = ("name", "description", "project_id", "tenant_id", "stateful")
_GROUP_UPDATE = ("name", "description", "stateful")
_RULE_CREATE = (
    "security_group_id",
    "direction",
    "ethertype",
    "protocol",
    "port_range_min",
    "port_range_max",
    "remote_ip_prefix",
    "remote_group_id",
    "remote_address_group_id",
    "description",
    "project_id",
    "tenant_id",
)
_PROTOCOLS = {
    "ah": 51,
    "dccp": 33,
    "egp": 8,
    "esp": 50,
    "gre": 47,
    "icmp": 1,
    "icmpv6": 58,
    "igmp": 2,
    "ipip": 4,
    "ipv6-encap": 41,
    "ipv6-frag": 44,
    "ipv6-icmp": 58,
    "ipv6-nonxt": 59,
    "ipv6-opts": 60,
    "ipv6-route": 43,
    "ospf": 89,
    "pgm": 113,
    "rsvp": 46,
    "sctp": 132,
    "tcp": 6,
    "udp": 17,
    "udplite": 136,
    "vrrp": 112,
}
_PORTED = ("tcp", "udp", "sctp", "dccp", "udplite", "6", "17", "132", "33", "136")


def _group_visible(group: Mapping[str, Any], caller: Caller) -> bool:
    return caller.is_admin or group["project_id"] == caller.project_id


def _render_group(group: Mapping[str, Any], rules: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    out = dict(group)
    out["security_group_rules"] = [dict(r) for r in rules if r["security_group_id"] == group["id"]]
    return out


def _new_rule(
    cloud: Cloud,
    group_id: str,
    project_id: str,
    direction: str,
    ethertype: str,
    rule_id: str | None = None,
    **values: Any,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": rule_id or str(uuid.uuid4()),
        **_standard(cloud, project_id),
        "security_group_id": group_id,
        "direction": direction,
        "ethertype": ethertype,
        "protocol": None,
        "port_range_min": None,
        "port_range_max": None,
        "remote_ip_prefix": None,
        "normalized_cidr": None,
        "remote_group_id": None,
        "remote_address_group_id": None,
        "belongs_to_default_sg": False,
    }
    body.pop("tags")
    body.update(values)
    return body


def ensure_default_security_group(cloud: Cloud, project_id: str) -> str:
    """The project's "default" group, created with neutron's default rules on first use."""
    group_id = _uuid5("default-security-group", project_id)
    if cloud.objects.find("security_group", group_id) is not None:
        return group_id
    body = {
        "id": group_id,
        "name": "default",
        **_standard(cloud, project_id),
        "description": "Default security group",
        "stateful": True,
        "shared": False,
    }
    try:
        cloud.objects.create(
            "security_group", group_id, body, project_id=project_id, name="default"
        )
    except ConflictError:
        return group_id
    for direction in ("egress", "ingress"):
        for ethertype in ("IPv4", "IPv6"):
            remote = group_id if direction == "ingress" else None
            rule = _new_rule(
                cloud,
                group_id,
                project_id,
                direction,
                ethertype,
                rule_id=_uuid5("default-rule", group_id, direction, ethertype),
                remote_group_id=remote,
                belongs_to_default_sg=True,
            )
            with contextlib.suppress(ConflictError):
                cloud.objects.create("security_group_rule", rule["id"], rule, project_id=project_id)
    return group_id


def list_security_groups(cloud: Cloud, caller: Caller) -> list[dict[str, Any]]:
    ensure_default_security_group(cloud, caller.project_id)
    rules = _bodies(cloud, "security_group_rule")
    return [
        _render_group(g, rules)
        for g in _bodies(cloud, "security_group")
        if _group_visible(g, caller)
    ]


def _group(cloud: Cloud, caller: Caller, group_id: str) -> dict[str, Any]:
    doc = cloud.objects.find("security_group", group_id)
    if doc is None or not _group_visible(doc.body, caller):
        raise NeutronNotFound(f"Security group {group_id} does not exist", "SecurityGroupNotFound")
    return doc.body


def get_security_group(cloud: Cloud, caller: Caller, group_id: str) -> dict[str, Any]:
    ensure_default_security_group(cloud, caller.project_id)
    return _render_group(_group(cloud, caller, group_id), _bodies(cloud, "security_group_rule"))


def create_security_group(cloud: Cloud, caller: Caller, attrs: Mapping[str, Any]) -> dict[str, Any]:
    _check_keys(attrs, _GROUP_CREATE)
    project = _owner(attrs, caller)
    ensure_default_security_group(cloud, project)
    group_id = str(uuid.uuid4())
    body: dict[str, Any] = {
        "id": group_id,
        "name": "",
        **_standard(cloud, project),
        "stateful": True,
        "shared": False,
    }
    _common(attrs, body)
    if body["name"] == "default":
        raise NeutronConflict(
            "Default security group already exists.", "SecurityGroupDefaultAlreadyExists"
        )
    if "stateful" in attrs:
        body["stateful"] = _bool("stateful", attrs["stateful"])
    rules = [
        _new_rule(cloud, group_id, project, "egress", ethertype) for ethertype in ("IPv4", "IPv6")
    ]
    create_counted(cloud, "security_group", group_id, body, project_id=project, name=body["name"])
    for rule in rules:
        cloud.objects.create("security_group_rule", rule["id"], rule, project_id=project)
    return _render_group(body, rules)


def update_security_group(
    cloud: Cloud, caller: Caller, group_id: str, attrs: Mapping[str, Any]
) -> dict[str, Any]:
    group = _group(cloud, caller, group_id)
    new = _editable(group, caller, "update_security_group", attrs, _GROUP_UPDATE, _GROUP_CREATE)
    _common(attrs, new)
    if group["name"] == "default" and new["name"] != "default":
        raise NeutronConflict(
            "Updating default security group not allowed.", "SecurityGroupCannotUpdateDefault"
        )
    if "stateful" in attrs:
        new["stateful"] = _bool("stateful", attrs["stateful"])
    return _render_group(_save(cloud, "security_group", new), _bodies(cloud, "security_group_rule"))


def delete_security_group(cloud: Cloud, caller: Caller, group_id: str) -> None:
    group = _group(cloud, caller, group_id)
    _owned(group, caller, "delete_security_group")
    if group_id == _uuid5("default-security-group", group["project_id"]) and not caller.is_admin:
        raise NeutronConflict(
            "Insufficient rights for removing default security group.",
            "SecurityGroupCannotRemoveDefault",
        )
    if any(group_id in p.get("security_groups", []) for p in _bodies(cloud, "port")):
        raise NeutronConflict(f"Security Group {group_id} in use.", "SecurityGroupInUse")
    # Its own rules go, and so do other groups' rules that name it as their remote group.
    for rule in _bodies(cloud, "security_group_rule"):
        if group_id in (rule["security_group_id"], rule.get("remote_group_id")):
            cloud.objects.delete("security_group_rule", rule["id"])
    cloud.objects.delete("security_group", group_id)


def list_security_group_rules(cloud: Cloud, caller: Caller) -> list[dict[str, Any]]:
    ensure_default_security_group(cloud, caller.project_id)
    return [dict(r) for r in _bodies(cloud, "security_group_rule") if _group_visible(r, caller)]


def _rule(cloud: Cloud, caller: Caller, rule_id: str) -> dict[str, Any]:
    doc = cloud.objects.find("security_group_rule", rule_id)
    if doc is None or not _group_visible(doc.body, caller):
        raise NeutronNotFound(
            f"Security group rule {rule_id} does not exist", "SecurityGroupRuleNotFound"
        )
    return doc.body


def get_security_group_rule(cloud: Cloud, caller: Caller, rule_id: str) -> dict[str, Any]:
    return dict(_rule(cloud, caller, rule_id))


def _rule_protocol(attrs: Mapping[str, Any]) -> str | None:
    protocol = attrs.get("protocol")
    if protocol is None or protocol in ("any", "0"):
        return None
    text = str(protocol).lower()
    if text in _PROTOCOLS or (text.isdigit() and 0 <= int(text) <= 255):
        return text
    raise NeutronBadRequest(
        f"Security group rule protocol {protocol} not supported. Only protocol values "
        f"{sorted(_PROTOCOLS)} and integer representations [0 to 255] are supported.",
        "SecurityGroupRuleInvalidProtocol",
    )


def _rule_ports(attrs: Mapping[str, Any], protocol: str | None) -> tuple[int | None, int | None]:
    low, high = attrs.get("port_range_min"), attrs.get("port_range_max")
    for key, value in (("port_range_min", low), ("port_range_max", high)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise _invalid(key, f"'{value}' is not an integer")
    if low is None and high is None:
        return None, None
    if protocol is None:
        raise NeutronBadRequest(
            "Must also specify protocol if port range is given.",
            "SecurityGroupProtocolRequiredWithPorts",
        )
    if protocol in _PORTED:
        if low is None or high is None or not 1 <= low <= high <= 65535:
            raise NeutronBadRequest(
                "For TCP/UDP protocols, port_range_min must be <= port_range_max",
                "SecurityGroupInvalidPortRange",
            )
        return low, high
    for key, value in (("port_range_min", low), ("port_range_max", high)):
        if value is not None and not 0 <= value <= 255:
            raise NeutronBadRequest(
                f"Invalid value for ICMP {key}: {value}. It must be 0 to 255.",
                "SecurityGroupInvalidIcmpValue",
            )
    return low, high


def create_security_group_rule(
    cloud: Cloud, caller: Caller, attrs: Mapping[str, Any]
) -> dict[str, Any]:
    _check_keys(attrs, _RULE_CREATE)
    group = _group(cloud, caller, _text("security_group_id", _required(attrs, "security_group_id")))
    _owned(group, caller, "create_security_group_rule")
    direction = _required(attrs, "direction")
    if direction not in ("ingress", "egress"):
        raise _invalid("direction", f"{direction} is not in ['ingress', 'egress']")
    ethertype = attrs.get("ethertype") or "IPv4"
    if ethertype not in ("IPv4", "IPv6"):
        raise _invalid("ethertype", f"{ethertype} is not in ['IPv4', 'IPv6']")
    protocol = _rule_protocol(attrs)
    low, high = _rule_ports(attrs, protocol)
    prefix, remote_group = attrs.get("remote_ip_prefix"), attrs.get("remote_group_id")
    if prefix is not None and remote_group is not None:
        raise NeutronBadRequest(
            "Only remote_ip_prefix or remote_group_id may be provided.",
            "SecurityGroupRemoteGroupAndRemoteIpPrefix",
        )
    if attrs.get("remote_address_group_id") is not None:
        raise NeutronNotFound(
            f"Address group {attrs['remote_address_group_id']} could not be found.",
            "AddressGroupNotFound",
        )
    normalized = None
    if prefix is not None:
        try:
            normalized = str(ipaddress.ip_network(str(prefix), strict=False))
        except ValueError:
            raise _invalid("remote_ip_prefix", f"'{prefix}' is not a valid CIDR") from None
        if ipaddress.ip_network(normalized).version != int(ethertype[-1]):
            raise NeutronBadRequest(
                f"Conflicting value ethertype {ethertype} for CIDR {prefix}",
                "SecurityGroupRuleParameterConflict",
            )
    if remote_group is not None:
        _group(cloud, caller, str(remote_group))
    rule = _new_rule(
        cloud,
        group["id"],
        group["project_id"],
        direction,
        ethertype,
        protocol=protocol,
        port_range_min=low,
        port_range_max=high,
        remote_ip_prefix=prefix,
        normalized_cidr=normalized,
        remote_group_id=remote_group,
        description=_text("description", attrs.get("description") or ""),
        belongs_to_default_sg=group["name"] == "default",
    )
    signature = (
        "direction",
        "ethertype",
        "protocol",
        "port_range_min",
        "port_range_max",
        "normalized_cidr",
        "remote_group_id",
    )
    for other in _bodies(cloud, "security_group_rule"):
        if other["security_group_id"] == group["id"] and all(
            other.get(k) == rule.get(k) for k in signature
        ):
            raise NeutronConflict(
                f"Security group rule already exists. Rule id is {other['id']}.",
                "SecurityGroupRuleExists",
            )
    create_counted(cloud, "security_group_rule", rule["id"], rule, project_id=group["project_id"])
    return rule


def delete_security_group_rule(cloud: Cloud, caller: Caller, rule_id: str) -> None:
    rule = _rule(cloud, caller, rule_id)
    _owned(rule, caller, "delete_security_group_rule")
    cloud.objects.delete("security_group_rule", rule_id)
