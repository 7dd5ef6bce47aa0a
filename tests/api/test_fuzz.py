"""Every JSON API under hypothesis: wrong bodies, ids, queries and microversions never get a 5xx.

The cloud runs in this process (the app `stowage up` serves, on a temporary state directory),
driven through httpx's ASGI transport, so a few thousand requests take seconds. Each resource
group gets `STOWAGE_FUZZ_EXAMPLES` examples (a modest default for CI; set it to 500 for a
hunt). Runs are derandomized; STOWAGE_FUZZ_SEED=N runs with that seed instead.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from tests.api.fuzz_templates import image_patches, server_actions
from tests.api.fuzzing import (
    MAX_BODY,
    Endpoint,
    Harness,
    Sent,
    check_response,
    endpoints,
    examples,
    requests_for,
    start_harness,
)

from stowage.api.app import create_app
from stowage.services.cloud import Cloud

# The route table, read at collection so each resource group is its own test. Building the apps
# touches no cloud; test_the_fuzzer_sees_every_route checks this table against the live one.
ROUTES = endpoints(create_app(cast(Cloud, None)))
GROUPS = sorted({e.group for e in ROUTES})
SERVICES = (
    "identity",
    "compute",
    "image",
    "networking",
    "placement",
    "volume",
    "openstack",
    "latest",
)
_SEED = os.environ.get("STOWAGE_FUZZ_SEED")


def _fuzz(max_examples: int) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Hypothesis settings for one fuzz run: bounded, no deadline, reproducible."""

    def wrap(test: Callable[..., None]) -> Callable[..., None]:
        configured = settings(
            max_examples=examples(max_examples),
            deadline=None,
            derandomize=_SEED is None,
            database=None,
            print_blob=True,
            suppress_health_check=[
                HealthCheck.too_slow,
                HealthCheck.data_too_large,
                HealthCheck.filter_too_much,
                HealthCheck.large_base_example,
            ],
        )(test)
        return seed(int(_SEED))(configured) if _SEED is not None else configured

    return wrap


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    with start_harness(tmp_path_factory.mktemp("fuzz") / "state") as running:
        yield running


def _run(
    harness: Harness,
    members: list[Endpoint],
    max_examples: int,
    templates: list[Any] | None = None,
) -> Counter[int]:
    """Fuzz `members` and return how often each status came back."""
    statuses: Counter[int] = Counter()

    @_fuzz(max_examples)
    @given(data=st.data())
    def one(data: st.DataObject) -> None:
        endpoint = data.draw(st.sampled_from(members), label="endpoint")
        sent = data.draw(requests_for(harness, endpoint, templates), label="request")
        response = harness.send(sent)
        statuses[response.status_code] += 1
        check_response(sent, response)

    one()
    return statuses


def test_the_fuzzer_sees_every_route(harness: Harness) -> None:
    live = endpoints(harness.app)
    assert live == ROUTES
    assert {e.service for e in live} == set(SERVICES)
    stale = set(harness.templates) - {(e.method, e.path) for e in live}
    assert not stale, f"body templates for routes that no longer exist: {sorted(stale)}"


@pytest.mark.parametrize("group", GROUPS)
def test_resource_group_never_answers_5xx(harness: Harness, group: str) -> None:
    members = [e for e in ROUTES if e.group == group]
    statuses = _run(harness, members, max_examples=min(60, 15 + 5 * len(members)))
    # The fuzzer got past authentication and lookups at least once, so the handlers ran.
    assert set(statuses) - {401, 404, 405}, f"{group}: only {dict(statuses)}"


def test_server_create_never_answers_5xx(harness: Harness) -> None:
    create = Endpoint("compute", "POST", "/v2.1/servers")
    for project in harness.ids["project"]:  # quotas the fuzzer may have set to 0 earlier
        harness.call("DELETE", f"/compute/v2.1/os-quota-sets/{project}")
    statuses = _run(harness, [create], max_examples=60)
    assert statuses[202] > 0 and statuses[400] > 0, repr(sorted(statuses.items()))


def test_server_actions_never_answer_5xx(harness: Harness) -> None:
    action = Endpoint("compute", "POST", "/v2.1/servers/{server_id}/action")
    statuses = _run(harness, [action], max_examples=80, templates=server_actions(harness.ids))
    assert statuses[202] + statuses[200] + statuses[204] > 0, dict(statuses)
    assert statuses[400] + statuses[409] > 0, dict(statuses)


def test_image_patch_never_answers_5xx(harness: Harness) -> None:
    patch = Endpoint("image", "PATCH", "/v2/images/{image_id}")
    statuses = _run(harness, [patch], max_examples=40, templates=image_patches())
    assert statuses[200] > 0 and statuses[400] > 0, dict(statuses)


def test_placement_under_every_microversion_never_answers_5xx(harness: Harness) -> None:
    members = [e for e in ROUTES if e.service == "placement"]
    statuses = _run(harness, members, max_examples=60)
    assert statuses[200] > 0 and statuses[406] + statuses[400] > 0, dict(statuses)


def _password_auth(domain: Any) -> dict[str, Any]:
    user = {"name": "fuzz", "domain": domain, "password": "fuzz-pw"}
    return {"auth": {"identity": {"methods": ["password"], "password": {"user": user}}}}


_DEEP = b"[" * 5000 + b"]" * 5000

# Requests that once got a 500, each kept as an example the fuzzer must never lose.
CRASHERS = [
    pytest.param("GET", "/identity/v3/projects/%0A/users/x/roles", None, id="newline-in-id"),
    pytest.param("GET", "/nowhere", None, id="no-such-service"),
    pytest.param("POST", "/networking/v2.0/networks", _DEEP, id="deep-json-network"),
    pytest.param("POST", "/placement/resource_classes", _DEEP, id="deep-json-placement"),
    pytest.param(
        "POST", "/networking/v2.0/networks", b'{"network": {"name": "\\ud800"}}', id="surrogate"
    ),
    pytest.param(
        "POST", "/identity/v3/auth/tokens", _password_auth(True), id="token-domain-not-object"
    ),
    pytest.param(
        "POST",
        "/compute/v2.1/servers",
        {"server": {"name": "x", "flavorRef": "42", "security_groups": ["default"]}},
        id="server-security-group-not-object",
    ),
    pytest.param(
        "POST",
        "/compute/v2.1/servers",
        {"server": {"name": "x", "flavorRef": "42", "block_device_mapping_v2": ["x"]}},
        id="server-bdm-not-object",
    ),
]


@pytest.mark.parametrize(("method", "path", "body"), CRASHERS)
def test_requests_that_once_crashed_get_a_4xx(
    harness: Harness, method: str, path: str, body: Any
) -> None:
    content = body if isinstance(body, bytes | None) else json.dumps(body).encode()
    headers = {
        "X-Auth-Token": harness.tokens["admin"],
        "Content-Type": "application/json",
        "OpenStack-API-Version": "placement latest",
    }
    service = path.split("/")[1]
    endpoint = Endpoint(service if service in SERVICES else "identity", method, path)
    sent = Sent(endpoint, method, path, headers, content)
    response = harness.send(sent)
    assert 400 <= response.status_code < 500, response.text
    check_response(sent, response)


def _walked(endpoint: Endpoint) -> str:
    path = endpoint.path
    for param in endpoint.params:
        path = path.replace(f"{{{param}}}", "x", 1)
    return path


_EVERY_BODY_ROUTE = [
    e
    for e in ROUTES
    if e.method in ("POST", "PUT", "PATCH")
    and not (e.service == "image" and e.route.endswith(("/file", "/stage")))
]


@pytest.mark.parametrize(
    ("size", "media"),
    [
        pytest.param(MAX_BODY + 1, "application/json", id="one-byte-over"),
        pytest.param(50 * MAX_BODY, "application/json", id="far-over"),
        pytest.param(100, "application/xml", id="xml"),
        pytest.param(100, "application/x-www-form-urlencoded", id="form"),
    ],
)
def test_every_route_refuses_large_and_non_json_bodies(
    harness: Harness, size: int, media: str
) -> None:
    """Every route that takes a body, with and without a token: too large is 413, not JSON is
    415 (Keystone: 400), before the handler runs."""
    head = b'{"pad": "'
    content = head + b"a" * (size - len(head) - 2) + b'"}'
    wrong = []
    for endpoint in _EVERY_BODY_ROUTE:
        for token in (harness.tokens["admin"], None):
            headers = {"Content-Type": media, "OpenStack-API-Version": "placement latest"}
            if token is not None:
                headers["X-Auth-Token"] = token
            path = _walked(endpoint)
            sent = Sent(endpoint, endpoint.method, path, headers, content)
            response = harness.send(sent)
            check_response(sent, response)
            wanted = 413 if size > MAX_BODY else 400 if endpoint.service == "identity" else 415
            if response.status_code != wanted:
                wrong.append(f"{endpoint} token={token is not None}: {response.status_code}")
    assert not wrong, wrong
