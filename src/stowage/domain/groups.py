"""Server groups: Nova's four policies, max_server_per_host, and failure-domain spread."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from stowage.domain.errors import InvalidSpec

__all__ = [
    "HOST_DOMAIN",
    "GroupPolicy",
    "ServerGroup",
    "domain_of",
    "group_allows",
    "parse_group",
]

HOST_DOMAIN = "host"


class GroupPolicy(StrEnum):
    AFFINITY = "affinity"
    ANTI_AFFINITY = "anti-affinity"
    SOFT_AFFINITY = "soft-affinity"
    SOFT_ANTI_AFFINITY = "soft-anti-affinity"

    @property
    def strict(self) -> bool:
        return self in (GroupPolicy.AFFINITY, GroupPolicy.ANTI_AFFINITY)


@dataclass(frozen=True, slots=True)
class ServerGroup:
    """A server group. For anti-affinity, `failure_domain` names what members spread over:
    "host" (Nova's meaning) or a host label such as "rack"; `max_per_domain` is Nova's
    max_server_per_host rule applied to that domain."""

    id: str
    name: str
    policy: GroupPolicy
    max_per_domain: int = 1
    failure_domain: str = HOST_DOMAIN
    project_id: str = ""
    user_id: str = ""
    rules: Mapping[str, object] = field(default_factory=dict)

    @property
    def slotted(self) -> bool:
        """True when membership takes a slot the ledger keys uniquely (strict anti-affinity)."""
        return self.policy is GroupPolicy.ANTI_AFFINITY


def parse_group(
    group_id: str,
    name: str,
    policy: str,
    rules: Mapping[str, object] | None = None,
    *,
    project_id: str = "",
    user_id: str = "",
) -> ServerGroup:
    """Validate a policy and its rules as the compute API (2.64) does, plus `failure_domain`."""
    try:
        parsed = GroupPolicy(policy)
    except ValueError:
        allowed = ", ".join(p.value for p in GroupPolicy)
        raise InvalidSpec(f"policy: {policy!r} is not one of {allowed}") from None
    rules = dict(rules or {})
    unknown = set(rules) - {"max_server_per_host", "failure_domain"}
    if unknown:
        raise InvalidSpec(f"rules: unknown rule {sorted(unknown)[0]!r}")
    if rules and parsed is not GroupPolicy.ANTI_AFFINITY:
        raise InvalidSpec(f"rules: only the anti-affinity policy takes rules, not {parsed.value}")
    max_per = rules.get("max_server_per_host", 1)
    if isinstance(max_per, str) and max_per.isdigit():
        max_per = int(max_per)
    if not isinstance(max_per, int) or isinstance(max_per, bool) or max_per < 1:
        raise InvalidSpec(f"rules: max_server_per_host must be a positive integer, got {max_per!r}")
    domain = rules.get("failure_domain", HOST_DOMAIN)
    if not isinstance(domain, str) or not domain:
        raise InvalidSpec(f"rules: failure_domain must be a host label name, got {domain!r}")
    return ServerGroup(
        id=group_id,
        name=name,
        policy=parsed,
        max_per_domain=max_per,
        failure_domain=domain,
        project_id=project_id,
        user_id=user_id,
        rules=rules,
    )


def domain_of(group: ServerGroup, host: str, labels: Mapping[str, str]) -> str | None:
    """The failure domain a host belongs to for this group; None if the host lacks the label."""
    if group.failure_domain == HOST_DOMAIN:
        return f"host={host}"
    value = labels.get(group.failure_domain)
    return None if value is None else f"{group.failure_domain}={value}"


def group_allows(
    group: ServerGroup,
    host: Hashable,
    domain: str | None,
    member_hosts: Mapping[Any, int],
    domain_counts: Mapping[str, int],
) -> str | None:
    """None if one more member may go to `host`; otherwise why not.

    `member_hosts` counts the group's placed members per host and `domain_counts` per
    domain, both ends of in-flight migrations included.
    """
    if group.policy is GroupPolicy.AFFINITY:
        others = [h for h, n in member_hosts.items() if n > 0 and h != host]
        if others:
            return f"affinity: members already run on {sorted(map(str, others))[0]}"
        return None
    if group.policy is GroupPolicy.ANTI_AFFINITY:
        if domain is None:
            return f"anti-affinity: host has no {group.failure_domain!r} label"
        held = domain_counts.get(domain, 0)
        if held >= group.max_per_domain:
            return (
                f"anti-affinity: {domain} already holds {held} of at most "
                f"{group.max_per_domain} members"
            )
    return None
