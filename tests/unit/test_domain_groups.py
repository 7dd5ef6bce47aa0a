"""Server groups: parsing policies and rules, failure domains, and the placement gate."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from stowage.domain.errors import InvalidSpec
from stowage.domain.groups import (
    HOST_DOMAIN,
    GroupPolicy,
    ServerGroup,
    domain_of,
    group_allows,
    parse_group,
)

PROPERTY = settings(max_examples=200, deadline=None)


# --- parse_group ------------------------------------------------------------------------


@pytest.mark.parametrize("policy", list(GroupPolicy))
def test_every_nova_policy_parses_with_defaults(policy: GroupPolicy) -> None:
    group = parse_group("g1", "web", policy.value, project_id="p", user_id="u")
    assert group == ServerGroup(
        id="g1",
        name="web",
        policy=policy,
        max_per_domain=1,
        failure_domain=HOST_DOMAIN,
        project_id="p",
        user_id="u",
        rules={},
    )


def test_strictness_and_slots() -> None:
    assert GroupPolicy.AFFINITY.strict
    assert GroupPolicy.ANTI_AFFINITY.strict
    assert not GroupPolicy.SOFT_AFFINITY.strict
    assert not GroupPolicy.SOFT_ANTI_AFFINITY.strict
    assert parse_group("g", "n", "anti-affinity").slotted
    for policy in ("affinity", "soft-affinity", "soft-anti-affinity"):
        assert not parse_group("g", "n", policy).slotted


def test_anti_affinity_rules() -> None:
    group = parse_group(
        "g", "n", "anti-affinity", {"max_server_per_host": 3, "failure_domain": "rack"}
    )
    assert group.max_per_domain == 3
    assert group.failure_domain == "rack"


def test_max_server_per_host_may_be_a_digit_string() -> None:
    assert parse_group("g", "n", "anti-affinity", {"max_server_per_host": "2"}).max_per_domain == 2


def test_rules_are_copied_not_shared() -> None:
    rules: dict[str, object] = {"max_server_per_host": 2}
    group = parse_group("g", "n", "anti-affinity", rules)
    rules["max_server_per_host"] = 5
    assert group.rules == {"max_server_per_host": 2}


@pytest.mark.parametrize(
    ("policy", "rules", "words"),
    [
        ("anti_affinity", None, ["policy", "'anti_affinity'", "soft-anti-affinity"]),
        ("", None, ["policy"]),
        ("Affinity", None, ["policy", "'Affinity'"]),
        ("anti-affinity", {"max_servers": 2}, ["rules", "'max_servers'"]),
        ("affinity", {"max_server_per_host": 2}, ["rules", "affinity"]),
        ("soft-anti-affinity", {"max_server_per_host": 2}, ["rules", "soft-anti-affinity"]),
        ("anti-affinity", {"max_server_per_host": 0}, ["max_server_per_host", "0"]),
        ("anti-affinity", {"max_server_per_host": -1}, ["max_server_per_host", "-1"]),
        ("anti-affinity", {"max_server_per_host": "-1"}, ["max_server_per_host", "'-1'"]),
        ("anti-affinity", {"max_server_per_host": "two"}, ["max_server_per_host", "'two'"]),
        ("anti-affinity", {"max_server_per_host": 1.5}, ["max_server_per_host", "1.5"]),
        ("anti-affinity", {"max_server_per_host": True}, ["max_server_per_host", "True"]),
        ("anti-affinity", {"max_server_per_host": None}, ["max_server_per_host", "None"]),
        ("anti-affinity", {"failure_domain": ""}, ["failure_domain", "''"]),
        ("anti-affinity", {"failure_domain": 3}, ["failure_domain", "3"]),
    ],
)
def test_invalid_groups_say_what_is_wrong(
    policy: str, rules: dict[str, object] | None, words: list[str]
) -> None:
    with pytest.raises(InvalidSpec) as err:
        parse_group("g", "n", policy, rules)
    for word in words:
        assert word in str(err.value)
    assert err.value.code == "spec.invalid"


# --- domain_of --------------------------------------------------------------------------


def test_host_domain_is_the_host_itself() -> None:
    group = parse_group("g", "n", "anti-affinity")
    assert domain_of(group, "h1", {}) == "host=h1"
    assert domain_of(group, "h1", {"rack": "r1", "host": "other"}) == "host=h1"


def test_label_domain_is_the_label_value() -> None:
    group = parse_group("g", "n", "anti-affinity", {"failure_domain": "rack"})
    assert domain_of(group, "h1", {"rack": "r1"}) == "rack=r1"
    assert domain_of(group, "h2", {"rack": "r1"}) == "rack=r1"
    assert domain_of(group, "h3", {"rack": ""}) == "rack="
    assert domain_of(group, "h4", {"zone": "z"}) is None


# --- group_allows by example ------------------------------------------------------------


def test_affinity_allows_the_first_member_anywhere_then_only_that_host() -> None:
    group = parse_group("g", "n", "affinity")
    assert group_allows(group, "h1", "host=h1", {}, {}) is None
    assert group_allows(group, "h1", "host=h1", {"h1": 2}, {"host=h1": 2}) is None
    assert group_allows(group, "h1", "host=h1", {"h2": 0}, {}) is None  # left, not running
    reason = group_allows(group, "h1", "host=h1", {"h2": 1, "h3": 1}, {})
    assert reason == "affinity: members already run on h2"


def test_anti_affinity_refuses_a_host_that_holds_a_member() -> None:
    group = parse_group("g", "n", "anti-affinity")
    assert group_allows(group, "h1", "host=h1", {"h2": 1}, {"host=h2": 1}) is None
    reason = group_allows(group, "h2", "host=h2", {"h2": 1}, {"host=h2": 1})
    assert reason == "anti-affinity: host=h2 already holds 1 of at most 1 members"


def test_anti_affinity_max_per_host() -> None:
    group = parse_group("g", "n", "anti-affinity", {"max_server_per_host": 2})
    assert group_allows(group, "h1", "host=h1", {"h1": 1}, {"host=h1": 1}) is None
    reason = group_allows(group, "h1", "host=h1", {"h1": 2}, {"host=h1": 2})
    assert reason == "anti-affinity: host=h1 already holds 2 of at most 2 members"


def test_anti_affinity_by_rack_counts_the_rack_not_the_host() -> None:
    group = parse_group("g", "n", "anti-affinity", {"failure_domain": "rack"})
    # h2 holds nothing, but its rack does.
    reason = group_allows(group, "h2", "rack=r1", {"h1": 1}, {"rack=r1": 1})
    assert reason == "anti-affinity: rack=r1 already holds 1 of at most 1 members"
    assert group_allows(group, "h3", "rack=r2", {"h1": 1}, {"rack=r1": 1}) is None


def test_anti_affinity_refuses_a_host_without_the_label() -> None:
    group = parse_group("g", "n", "anti-affinity", {"failure_domain": "rack"})
    reason = group_allows(group, "h9", domain_of(group, "h9", {}), {}, {})
    assert reason == "anti-affinity: host has no 'rack' label"


@pytest.mark.parametrize("policy", ["soft-affinity", "soft-anti-affinity"])
def test_soft_policies_never_refuse(policy: str) -> None:
    group = parse_group("g", "n", policy)
    assert group_allows(group, "h1", "host=h1", {"h1": 5, "h2": 5}, {"host=h1": 5}) is None
    assert group_allows(group, "h1", None, {"h2": 1}, {}) is None


# --- placing members one by one with group_allows as the gate ---------------------------

RACKS = ["r0", "r1", "r2"]


@st.composite
def fleets(draw: st.DrawFn) -> dict[str, dict[str, str]]:
    """Hosts and their labels; some hosts have no rack label."""
    count = draw(st.integers(1, 8))
    hosts: dict[str, dict[str, str]] = {}
    for i in range(count):
        rack = draw(st.sampled_from([*RACKS, None]))
        hosts[f"h{i}"] = {} if rack is None else {"rack": rack}
    return hosts


@st.composite
def groups(draw: st.DrawFn) -> ServerGroup:
    policy = draw(st.sampled_from([GroupPolicy.ANTI_AFFINITY, *GroupPolicy]))
    rules: dict[str, object] = {}
    if policy is GroupPolicy.ANTI_AFFINITY:
        if draw(st.booleans()):
            rules["max_server_per_host"] = draw(st.integers(1, 3))
        domain = draw(st.sampled_from([None, "rack", "rack", HOST_DOMAIN]))
        if domain is not None:
            rules["failure_domain"] = domain
    return parse_group("g", "n", policy.value, rules)


@PROPERTY
@given(
    hosts=fleets(),
    group=groups(),
    orders=st.lists(st.permutations(range(8)), min_size=1, max_size=12),
)
def test_members_placed_through_the_gate_respect_the_policy(
    hosts: dict[str, dict[str, str]], group: ServerGroup, orders: list[list[int]]
) -> None:
    names = sorted(hosts)
    member_hosts: Counter[str] = Counter()
    domain_counts: Counter[str] = Counter()
    placed: list[str] = []
    for order in orders:
        # Each member tries the hosts in its own order and lands on the first one allowed.
        candidates = [names[i] for i in order if i < len(names)]
        refusals: dict[str, str] = {}
        for host in candidates:
            domain = domain_of(group, host, hosts[host])
            reason = group_allows(group, host, domain, member_hosts, domain_counts)
            if reason is None:
                assert domain is not None or group.policy is not GroupPolicy.ANTI_AFFINITY
                member_hosts[host] += 1
                if domain is not None:
                    domain_counts[domain] += 1
                placed.append(host)
                break
            refusals[host] = reason
        else:
            _check_refusal_is_justified(group, hosts, member_hosts, domain_counts, refusals)
            event("a member found no host")
    _check_final_placement(group, hosts, placed, len(orders))
    event(f"{group.policy.value} via {group.failure_domain}")


def _check_refusal_is_justified(
    group: ServerGroup,
    hosts: dict[str, dict[str, str]],
    member_hosts: Counter[str],
    domain_counts: Counter[str],
    refusals: dict[str, str],
) -> None:
    """Nobody is refused without cause: each refusal names a real obstacle."""
    assert group.policy.strict
    assert set(refusals) == set(hosts)
    for host, reason in refusals.items():
        assert reason.startswith(f"{group.policy.value}: ")
        if group.policy is GroupPolicy.AFFINITY:
            assert any(n > 0 for h, n in member_hosts.items() if h != host)
            continue
        domain = domain_of(group, host, hosts[host])
        if domain is None:
            assert group.failure_domain != HOST_DOMAIN
            assert f"no {group.failure_domain!r} label" in reason
        else:
            assert domain_counts[domain] >= group.max_per_domain
            assert domain in reason


def _check_final_placement(
    group: ServerGroup, hosts: dict[str, dict[str, str]], placed: list[str], attempts: int
) -> None:
    """The policy holds over all members, and the gate refused no member it could have taken."""
    if group.policy is GroupPolicy.ANTI_AFFINITY:
        per_domain: Counter[str] = Counter()
        for host in placed:
            if group.failure_domain == HOST_DOMAIN:
                per_domain[host] += 1
            else:
                # A host without the label never takes a member.
                assert group.failure_domain in hosts[host]
                per_domain[hosts[host][group.failure_domain]] += 1
        assert all(n <= group.max_per_domain for n in per_domain.values())
        if group.failure_domain == HOST_DOMAIN:
            domains = set(hosts)
        else:
            domains = {
                labels[group.failure_domain]
                for labels in hosts.values()
                if group.failure_domain in labels
            }
        # Every member tries every host, so placement stops only when all domains are full.
        assert len(placed) == min(attempts, len(domains) * group.max_per_domain)
        return
    if group.policy is GroupPolicy.AFFINITY:
        assert len(set(placed)) <= 1
    # Affinity takes every member on the first member's host; soft policies never refuse.
    assert len(placed) == attempts


@PROPERTY
@given(hosts=fleets(), members=st.integers(1, 12), max_per=st.integers(1, 3))
def test_rack_spread_counts_per_label_value(
    hosts: dict[str, dict[str, str]], members: int, max_per: int
) -> None:
    group = parse_group(
        "g", "n", "anti-affinity", {"failure_domain": "rack", "max_server_per_host": max_per}
    )
    member_hosts: Counter[str] = Counter()
    domain_counts: Counter[str] = Counter()
    placed = 0
    for _ in range(members):
        for host in sorted(hosts):
            domain = domain_of(group, host, hosts[host])
            if group_allows(group, host, domain, member_hosts, domain_counts) is None:
                assert domain is not None
                member_hosts[host] += 1
                domain_counts[domain] += 1
                placed += 1
                break
    racks = {labels["rack"] for labels in hosts.values() if "rack" in labels}
    # Exactly as many as the racks can take: no more (the rule), no fewer (the gate is fair).
    assert placed == min(members, len(racks) * max_per)
    assert set(domain_counts) <= {f"rack={r}" for r in racks}
    assert all(n <= max_per for n in domain_counts.values())
    for host, labels in hosts.items():
        if "rack" not in labels:
            assert member_hosts[host] == 0
            reason = group_allows(group, host, domain_of(group, host, labels), {}, {})
            assert reason == "anti-affinity: host has no 'rack' label"
