"""An in-process cloud and the hypothesis strategies that throw wrong requests at every route."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import string
import threading
import uuid
import warnings
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote, urlencode

import httpx
from hypothesis import strategies as st
from tests.api.fuzz_templates import templates

from stowage.services.cloud import Cloud, CloudConfig
from stowage.services.runtime import open_cloud
from stowage.wiring import all_in_one

__all__ = [
    "MAX_BODY",
    "Endpoint",
    "Harness",
    "Sent",
    "check_response",
    "endpoints",
    "examples",
    "junk",
    "mutated",
    "requests_for",
    "start_harness",
]

BASE_URL = "http://127.0.0.1:8880"
T = TypeVar("T")


def examples(default: int) -> int:
    """Examples per hypothesis test; STOWAGE_FUZZ_EXAMPLES=500 runs a longer hunt."""
    raw = os.environ.get("STOWAGE_FUZZ_EXAMPLES")
    return int(raw) if raw else default


# -- the routes -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One method on one route, e.g. PUT /compute/v2.1/os-services/{service_id}."""

    service: str  # the mount: identity, compute, image, networking, placement
    method: str
    route: str  # inside the service, e.g. /v2.1/os-services/{service_id}

    @property
    def path(self) -> str:
        return f"/{self.service}{self.route}"

    @property
    def params(self) -> tuple[str, ...]:
        parts = self.route.split("/")
        return tuple(p[1:-1] for p in parts if p.startswith("{") and p.endswith("}"))

    @property
    def group(self) -> str:
        """The service and its resource: compute/os-services, placement/resource_providers."""
        skip = {"v2", "v2.0", "v2.1", "v3"}
        parts = [p for p in self.route.split("/") if p and p not in skip]
        head = parts[0] if parts else "(root)"
        return f"{self.service}/{'(grants)' if head.startswith('{') else head}"

    def __str__(self) -> str:
        return f"{self.method} {self.path}"


def endpoints(app: Any) -> list[Endpoint]:
    """Every method of every route of every service, read from the apps' own route tables."""
    found: list[Endpoint] = []
    for mount in app.app.routes:
        if not hasattr(getattr(mount, "app", None), "openapi"):
            continue  # not a JSON API (e.g. /metrics)
        service = mount.path.strip("/")
        with warnings.catch_warnings():
            # openapi() warns about repeated operation ids (GET and HEAD on one function).
            warnings.simplefilter("ignore", UserWarning)
            paths = mount.app.openapi()["paths"]
        for route, operations in paths.items():
            found.extend(Endpoint(service, method.upper(), route) for method in operations)
    return sorted(found, key=lambda e: (e.service, e.route, e.method))


# -- the cloud under test ---------------------------------------------------------------------


@dataclass(slots=True)
class Sent:
    """One fuzzed request, kept to be printed when its answer is wrong."""

    endpoint: Endpoint
    method: str
    url: str
    headers: dict[str, str]
    content: bytes | None

    def __str__(self) -> str:
        shown = {k: v for k, v in self.headers.items() if k != "X-Auth-Token"}
        token = "yes" if "X-Auth-Token" in self.headers else "no"
        body = (self.content or b"")[:600]
        return f"{self.method} {self.url}\n  token={token} headers={shown}\n  body={body!r}"


class _Loop:
    """An event loop on its own thread, running the app's lifespan as `stowage up` does, so the
    agents and conductor it starts make progress between requests."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-loop", daemon=True)
        self.thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=300)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=60)
        self.loop.close()


class _Lifespan:
    """The ASGI lifespan protocol, spoken to the app: startup now, shutdown at close."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.messages: asyncio.Queue[dict[str, str]] = asyncio.Queue()
        self.started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.messages.put({"type": "lifespan.startup"})
        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
        self.task = asyncio.create_task(self.app(scope, self.messages.get, self._send))
        await self.started

    async def stop(self) -> None:
        await self.messages.put({"type": "lifespan.shutdown"})
        if self.task is not None:
            await self.task

    async def _send(self, message: dict[str, Any]) -> None:
        if message["type"] == "lifespan.startup.complete":
            self.started.set_result(None)
        elif message["type"] == "lifespan.startup.failed":
            self.started.set_exception(RuntimeError(message.get("message", "startup failed")))


@dataclass(slots=True)
class Harness:
    """A cloud on a temporary state directory, with a client straight into its ASGI app."""

    cloud: Cloud
    app: Any
    loop: _Loop
    client: httpx.AsyncClient
    tokens: dict[str, str] = field(default_factory=dict)
    ids: dict[str, list[str]] = field(default_factory=dict)
    templates: dict[tuple[str, str], list[Any]] = field(default_factory=dict)
    strategies: dict[Any, st.SearchStrategy[Sent]] = field(default_factory=dict)

    def send(self, sent: Sent) -> httpx.Response:
        return self.loop.run(
            self.client.request(sent.method, sent.url, headers=sent.headers, content=sent.content)
        )

    def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        token: str = "admin",
        headers: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """A well-formed request that must succeed: the setup the fuzzer then aims at."""
        sent = {"X-Auth-Token": self.tokens[token], **(headers or {})}
        response = self.loop.run(self.client.request(method, path, headers=sent, json=body))
        assert response.status_code < 300, f"{method} {path}: {response.text}"
        answer: dict[str, Any] = response.json() if response.content else {}
        return answer

    def token(self, user: str, password: str, project: str) -> str:
        scope = {"project": {"name": project, "domain": {"id": "default"}}}
        user_ref = {"name": user, "domain": {"id": "default"}, "password": password}
        body = {
            "auth": {
                "identity": {"methods": ["password"], "password": {"user": user_ref}},
                "scope": scope,
            }
        }
        response = self.loop.run(self.client.post("/identity/v3/auth/tokens", json=body))
        assert response.status_code == 201, response.text
        return response.headers["x-subject-token"]


@contextlib.contextmanager
def start_harness(state_dir: Path) -> Iterator[Harness]:
    """The cloud `stowage up` would run on `state_dir`, seeded with one of each resource."""
    # Hosts must not be seen down midway through a long run on a busy machine.
    cloud = open_cloud(CloudConfig(state_dir=state_dir, hosts=2, service_down_time_s=86400.0))
    app = all_in_one(cloud)
    loop = _Loop()

    async def started() -> tuple[_Lifespan, httpx.AsyncClient]:
        lifespan = _Lifespan(app)
        await lifespan.start()
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=True)
        return lifespan, httpx.AsyncClient(transport=transport, base_url=BASE_URL)

    async def stopped(lifespan: _Lifespan, client: httpx.AsyncClient) -> None:
        await client.aclose()
        await lifespan.stop()

    try:
        lifespan, client = loop.run(started())
        try:
            cloud.ledger.heartbeat()
            harness = Harness(cloud, app, loop, client)
            harness.tokens["admin"] = harness.token("admin", cloud.config.admin_password, "admin")
            harness.tokens["member"] = harness.token("demo", cloud.config.member_password, "demo")
            # The only token a fuzzed DELETE /v3/auth/tokens may revoke.
            harness.tokens["spare"] = harness.token("demo", cloud.config.member_password, "demo")
            _seed(harness)
            harness.templates = templates(harness.ids, {(e.method, e.path) for e in endpoints(app)})
            yield harness
        finally:
            loop.run(stopped(lifespan, client))
    finally:
        loop.close()
        cloud.ledger.close()


def _seed(h: Harness) -> None:
    """One resource of each kind, owned by the fuzzer, so fuzzed requests reach past lookups."""
    ids = h.ids
    _seed_identity(h, ids)
    _seed_image(h, ids)
    _seed_network(h, ids)
    _seed_compute(h, ids)
    _seed_placement(h, ids)


def _seed_identity(h: Harness, ids: dict[str, list[str]]) -> None:
    domain = h.call("POST", "/identity/v3/domains", {"domain": {"name": "fuzz-domain"}})
    project = h.call(
        "POST", "/identity/v3/projects", {"project": {"name": "fuzz", "domain_id": "default"}}
    )
    project_id = project["project"]["id"]
    user = h.call(
        "POST",
        "/identity/v3/users",
        {"user": {"name": "fuzz", "password": "fuzz-pw", "default_project_id": project_id}},
    )
    role = h.call("POST", "/identity/v3/roles", {"role": {"name": "fuzz-role"}})
    h.call("PUT", f"/identity/v3/projects/{project_id}/tags/fuzz")
    named = {p["name"]: p["id"] for p in h.call("GET", "/identity/v3/projects")["projects"]}
    ids.update(
        {
            "identity:domain_id": [domain["domain"]["id"]],
            "identity:project_id": [project_id],
            "identity:user_id": [user["user"]["id"]],
            "identity:role_id": [role["role"]["id"]],
            "identity:tag": ["fuzz"],
            "identity:kind": ["projects", "domains"],
            "identity:target": [project_id, domain["domain"]["id"]],
            "project": [project_id, named["demo"], named["admin"]],
        }
    )


def _seed_image(h: Harness, ids: dict[str, list[str]]) -> None:
    images = h.call("GET", "/image/v2/images?name=cirros-0.6.3-x86_64-disk")["images"]
    cirros = images[0]["id"] if images else h.call("GET", "/image/v2/images")["images"][0]["id"]
    mine = h.call(
        "POST",
        "/image/v2/images",
        {"name": "fuzz-image", "disk_format": "raw", "container_format": "bare"},
        token="member",
    )
    h.call("PUT", f"/image/v2/images/{mine['id']}/tags/fuzz", token="member")
    headers = {"X-Auth-Token": h.tokens["member"], "Content-Type": "application/octet-stream"}
    data = f"/image/v2/images/{mine['id']}/file"
    upload = h.client.put(data, headers=headers, content=b"x" * 512)
    assert h.loop.run(upload).status_code == 204
    # Cirros is what the servers boot from: the fuzzer aims at its own image, not at it.
    ids.update({"image:image_id": [mine["id"]], "image:tag": ["fuzz"], "cirros": [cirros]})


def _seed_network(h: Harness, ids: dict[str, list[str]]) -> None:
    base = "/networking/v2.0"
    net = h.call("POST", f"{base}/networks", {"network": {"name": "fuzz-net"}}, token="member")
    net_id = net["network"]["id"]
    subnet = h.call(
        "POST",
        f"{base}/subnets",
        {"subnet": {"network_id": net_id, "ip_version": 4, "cidr": "192.168.77.0/24"}},
        token="member",
    )
    port = h.call("POST", f"{base}/ports", {"port": {"network_id": net_id}}, token="member")
    group = h.call(
        "POST", f"{base}/security-groups", {"security_group": {"name": "fuzz-sg"}}, token="member"
    )
    group_id = group["security_group"]["id"]
    rule = h.call(
        "POST",
        f"{base}/security-group-rules",
        {
            "security_group_rule": {
                "security_group_id": group_id,
                "direction": "ingress",
                "ethertype": "IPv4",
                "protocol": "tcp",
                "port_range_min": 22,
                "port_range_max": 22,
            }
        },
        token="member",
    )
    h.call("PUT", f"{base}/networks/{net_id}/tags/fuzz", token="member")
    ids.update(
        {
            "networking:networks": [net_id],
            "networking:subnets": [subnet["subnet"]["id"]],
            "networking:ports": [port["port"]["id"]],
            "networking:security-groups": [group_id],
            "networking:security-group-rules": [rule["security_group_rule"]["id"]],
            "networking:tag": ["fuzz"],
            "networking:alias": ["security-group", "tag", "standard-attr-tag", "nope"],
            "compute:network_id": [net_id],
        }
    )


def _seed_compute(h: Harness, ids: dict[str, list[str]]) -> None:
    base = "/compute/v2.1"
    flavor = {"name": "fuzz.flavor", "ram": 128, "vcpus": 1, "disk": 1, "id": "fuzz-flavor"}
    h.call("POST", f"{base}/flavors", {"flavor": flavor})
    h.call("POST", f"{base}/flavors/fuzz-flavor/os-extra_specs", {"extra_specs": {"fuzz:k": "v"}})
    h.call("POST", f"{base}/os-keypairs", {"keypair": {"name": "fuzz-key"}}, token="member")
    group = h.call(
        "POST",
        f"{base}/os-server-groups",
        {"server_group": {"name": "fuzz-group", "policies": ["anti-affinity"]}},
        token="member",
    )
    aggregate = h.call("POST", f"{base}/os-aggregates", {"aggregate": {"name": "fuzz-agg"}})
    servers = []
    for token in ("member", "member", "admin"):
        server = {
            "name": f"fuzz-{token}",
            "flavorRef": "42",
            "imageRef": ids["cirros"][0],
            "networks": "none",
        }
        at_237 = {"OpenStack-API-Version": "compute 2.37"}  # "none" is 2.37's
        servers.append(
            h.call("POST", f"{base}/servers", {"server": server}, token=token, headers=at_237)
        )
    server_ids = [s["server"]["id"] for s in servers]
    new = {"OpenStack-API-Version": "compute 2.53"}
    services = h.call("GET", f"{base}/os-services")["services"]
    services_new = h.call("GET", f"{base}/os-services", headers=new)["services"]
    hypervisors = h.call("GET", f"{base}/os-hypervisors")["hypervisors"]
    hypervisors_new = h.call("GET", f"{base}/os-hypervisors", headers=new)["hypervisors"]
    actions = h.call("GET", f"{base}/servers/{server_ids[0]}/os-instance-actions")
    ids.update(
        {
            "compute:server_id": server_ids,
            "compute:flavor_id": ["fuzz-flavor", "42", "c1"],
            "compute:key": ["fuzz:k", "hw:cpu_policy", "k"],
            "compute:name": ["fuzz-key"],
            "compute:group_id": [group["server_group"]["id"]],
            "compute:aggregate_id": [str(aggregate["aggregate"]["id"])],
            "compute:service_id": [str(s["id"]) for s in services + services_new],
            "compute:hypervisor_id": [str(x["id"]) for x in hypervisors + hypervisors_new],
            "compute:pattern": ["host1", "host", "nohost"],
            "compute:project_id": ids["project"],
            "compute:request_id": [a["request_id"] for a in actions["instanceActions"]],
            "compute:host": ["host1", "nohost"],
            "compute:host_name": ["host1", "nohost"],
            "compute:class_name": ["default"],
        }
    )


def _seed_placement(h: Harness, ids: dict[str, list[str]]) -> None:
    # Hosts are the only providers (the ledger registers them); placement cannot create one.
    latest = {"OpenStack-API-Version": "placement latest"}
    h.call("PUT", "/placement/traits/CUSTOM_FUZZ", headers=latest)
    h.call("PUT", "/placement/resource_classes/CUSTOM_FUZZ", headers=latest)
    providers = h.call("GET", "/placement/resource_providers", headers=latest)
    ids.update(
        {
            "placement:rp_uuid": [p["uuid"] for p in providers["resource_providers"]],
            "placement:rc": ["VCPU", "MEMORY_MB", "DISK_GB", "CUSTOM_FUZZ"],
            "placement:name": ["CUSTOM_FUZZ", "HW_CPU_X86_AVX", "VCPU", "CUSTOM_NOPE"],
            "placement:consumer_id": [*ids["compute:server_id"], str(uuid.uuid4())],
        }
    )


# -- values -----------------------------------------------------------------------------------

_NASTY_TEXT = (
    "",
    " ",
    "null",
    "true",
    "0",
    "-1",
    "1e309",
    "NaN",
    "../../etc/passwd",
    "%00",
    "\x00",
    "a" * 300,
    "\ud800",
    "\U0001f600",
    "Ω≈ç√",
    "'; DROP TABLE objects; --",
    "{}",
    "[]",
    "2.1",
    "CUSTOM_",
    "in:",
    "!",
    ":",
    ",",
)
_NASTY_NUMBERS = (0, -1, 1, 2**31, 2**31 - 1, 2**63, -(2**63), 2**64 + 1, 10**30)


def junk_scalars() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.none(),
        st.booleans(),
        st.sampled_from(_NASTY_NUMBERS),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from(_NASTY_TEXT),
        st.text(max_size=20),
    )


@functools.cache
def junk() -> st.SearchStrategy[Any]:
    """Any JSON value, with the numbers and strings that break parsers."""
    return st.recursive(
        junk_scalars(),
        lambda inner: (
            st.lists(inner, max_size=4)
            | st.dictionaries(st.text(max_size=8) | st.sampled_from(_NASTY_TEXT), inner, max_size=4)
        ),
        max_leaves=8,
    )


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place inside a JSON value, the value itself first."""
    out = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            out.extend(_paths(item, (*prefix, key)))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            out.extend(_paths(item, (*prefix, index)))
    return out


def _replace(value: Any, where: tuple[Any, ...], make: Callable[[Any], Any]) -> Any:
    """A copy of `value` with the node at `where` turned into make(node); _DROP removes it."""
    if not where:
        return make(value)
    head, rest = where[0], where[1:]
    if isinstance(value, dict):
        copy = dict(value)
        new = _replace(value[head], rest, make)
        if new is _DROP:
            del copy[head]
        else:
            copy[head] = new
        return copy
    copy_list = list(value)
    new = _replace(value[head], rest, make)
    if new is _DROP:
        del copy_list[head]
    else:
        copy_list[head] = new
    return copy_list


_DROP = object()


@st.composite
def mutated(draw: st.DrawFn, template: Any) -> Any:
    """A template with a few nodes wrong: gone, of another type, out of range, or padded."""
    value = template
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        where = draw(st.sampled_from(_paths(value)))
        how = draw(st.sampled_from(["drop", "junk", "retype", "extra"] if where else ["junk"]))
        if how == "drop":
            value = _replace(value, where, functools.partial(_const, _DROP))
        elif how == "junk":
            replacement = draw(junk())
            value = _replace(value, where, functools.partial(_const, replacement))
        elif how == "retype":
            value = _replace(value, where, _retype(draw(st.integers(0, 5))))
        else:
            key = draw(st.sampled_from(["extra", "", "name", "id", "\u2603"]))
            extra = draw(junk())
            value = _replace(value, where, functools.partial(_pad, key=key, extra=extra))
    return value


def _retype(which: int) -> Callable[[Any], Any]:
    """A node of another type, or a number past what a field can hold."""

    def swap(node: Any) -> Any:
        number = isinstance(node, int | float) and not isinstance(node, bool)
        choices = [
            str(node),
            [node],
            {"value": node},
            None,
            2**63 if number and node < 0 else -1,
            2**64 if number else "",
        ]
        return choices[which]

    return swap


def _const(value: Any, _node: Any) -> Any:
    return value


def _pad(node: Any, *, key: str, extra: Any) -> Any:
    if isinstance(node, dict):
        return {**node, key: extra}
    if isinstance(node, list):
        return [*node, extra]
    return node


# -- whole requests ---------------------------------------------------------------------------

_PLAIN = string.ascii_letters + string.digits + "-_.:~!$&'()*+,;=@ %/"
_QUERY_KEYS = (
    "limit",
    "marker",
    "sort",
    "sort_key",
    "sort_dir",
    "name",
    "status",
    "all_tenants",
    "project_id",
    "tenant_id",
    "fields",
    "page_reverse",
    "changes-since",
    "host",
    "flavor",
    "image",
    "visibility",
    "tag",
    "tags",
    "tags-any",
    "not-tags",
    "member_of",
    "resources",
    "required",
    "in_tree",
    "uuid",
    "user_id",
    "minDisk",
    "minRam",
    "is_public",
    "hypervisor_hostname_pattern",
    "with_servers",
    "binary",
    "domain_id",
    "parent_id",
    "enabled",
    "network_id",
    "device_id",
    "shared",
    "router:external",
    "include_subtree",
    "scope.project.id",
    "effective",
    "include_names",
    "group_policy",
    "root_required",
    "same_subtree",
    "resources1",
    "required1",
    "member_of1",
    "in_tree1",
    "consumer_type",
    "type",
    "detailed",
    "migration_type",
    "instance_uuid",
)


def _weighted(*choices: tuple[int, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """one_of with weights: most requests are right but for one thing, so handlers run."""
    picks = [index for index, (weight, _) in enumerate(choices) for _ in range(weight)]
    return st.sampled_from(picks).flatmap(lambda index: choices[index][1])


@functools.cache
def _segment(known: tuple[str, ...]) -> st.SearchStrategy[str]:
    """A path segment: mostly an id the cloud has, else something that is not one."""
    made_up = st.one_of(
        st.uuids().map(str),
        st.uuids().map(lambda u: u.hex),
        st.integers(min_value=-(2**65), max_value=2**65).map(str),
        st.sampled_from([t for t in _NASTY_TEXT if t and t.strip(".") and "/" not in t]),
        st.text(st.characters(codec="utf-8", exclude_characters="/"), min_size=1, max_size=30),
    ).filter(lambda s: s.strip(".") != "" and "\ud800" not in s)
    quoted = made_up.map(lambda s: quote(s, safe=""))
    if not known:
        return quoted
    return _weighted((3, st.sampled_from(known)), (1, quoted))


@functools.cache
def _query() -> st.SearchStrategy[list[tuple[str, str]]]:
    plausible = st.sampled_from(["1", "0", "2", "true", "False", "asc", "desc", "name:asc"])
    value = st.one_of(
        plausible,
        st.sampled_from(["-1", "2.5", "", "x:y:z", "in:", "!", ",", "CUSTOM_X", "VCPU:1"]),
        st.integers(min_value=-(2**65), max_value=2**65).map(str),
        st.sampled_from([t for t in _NASTY_TEXT if "\ud800" not in t]),
        st.uuids().map(str),
        st.text(st.characters(codec="utf-8"), max_size=20),
    )
    key = st.sampled_from(_QUERY_KEYS) | st.text(st.sampled_from(_PLAIN), max_size=10)
    return _weighted(
        (2, st.just([])),
        (1, st.lists(st.tuples(st.sampled_from(_QUERY_KEYS), plausible), max_size=2)),
        (1, st.lists(st.tuples(key, value), min_size=1, max_size=4)),
    )


def _version_headers(
    service: str, valid: st.SearchStrategy[str], wrong: list[str]
) -> st.SearchStrategy[dict[str, str]]:
    huge = ["99999999999999999999.1", "1.99999999999999999999", "0.0", "-1.-1"]
    bad = st.sampled_from([*wrong, *huge]) | st.text(st.sampled_from(_PLAIN), max_size=8)
    other = "compute 2.1" if service == "placement" else "placement 1.2"
    forms: list[Callable[[str], dict[str, str]]] = [
        lambda v: {"OpenStack-API-Version": f"{service} {v}"},
        lambda v: {"OpenStack-API-Version": f"{other}, {service} {v}"},
    ]
    if service == "compute":
        forms.append(lambda v: {"X-OpenStack-Nova-API-Version": v})
    form = st.sampled_from(forms)
    return _weighted(
        (2, st.just({})),
        (2, st.tuples(form, valid | st.just("latest")).map(lambda f: f[0](f[1]))),
        (1, st.tuples(form, bad).map(lambda f: f[0](f[1]))),
    )


@functools.cache
def _versions(service: str) -> st.SearchStrategy[dict[str, str]]:
    """Microversion headers: none, valid ones, and ones out of range or not versions at all."""
    if service == "compute":
        return _version_headers(
            "compute",
            st.integers(min_value=1, max_value=96).map(lambda n: f"2.{n}"),
            ["2.0", "2.97", "3.0", "1.1", "2.-1", "2", "2.1.1", " 2.5 ", "", "2.1 extra", "2.x"],
        )
    if service == "placement":
        return _version_headers(
            "placement",
            st.integers(min_value=0, max_value=39).map(lambda n: f"1.{n}"),
            ["1.40", "2.0", "0.9", "1.-1", "1", "1.1.1", " 1.5 ", "", "1.01", "1.x", "placement"],
        )
    header = st.text(st.sampled_from(_PLAIN), max_size=12)
    return _weighted((4, st.just({})), (1, header.map(lambda v: {"OpenStack-API-Version": v})))


_JSON = "application/json"
_PATCH_TYPES = (
    "application/openstack-images-v2.1-json-patch",
    "application/openstack-images-v2.0-json-patch",
)


@functools.cache
def _content_types(endpoint: Endpoint) -> st.SearchStrategy[str | None]:
    usual: list[str | None] = [_JSON, _JSON, _JSON]
    if endpoint.method == "PATCH" and endpoint.service == "image":
        usual = [*_PATCH_TYPES, *_PATCH_TYPES, _JSON]
    if endpoint.route.endswith("/file"):
        usual = ["application/octet-stream", "application/octet-stream", _JSON]
    odd = [
        None,
        "text/plain",
        "application/x-www-form-urlencoded",
        "application/json; charset=latin-1",
        "application/xml",
        "multipart/form-data; boundary=x",
    ]
    return _weighted((6, st.sampled_from(usual)), (1, st.sampled_from(odd)))


MAX_BODY = 114688  # what start_harness's cloud allows (CloudConfig's default)
_NOT_JSON = ("application/x-www-form-urlencoded", "application/xml", "multipart/form-data")


def _sized(size: int) -> bytes:
    """A JSON object of exactly `size` bytes."""
    head = b'{"pad": "'
    return head + b"a" * (size - len(head) - 2) + b'"}'


def _exempt_from_body_rules(sent: Sent) -> bool:
    """Image data streams to disk as octet-stream: no size limit, no JSON."""
    return sent.endpoint.service == "image" and sent.endpoint.route.endswith(("/file", "/stage"))


def _encode(value: Any) -> bytes:
    # allow_nan: NaN and Infinity are what a sloppy client sends and what Python's parser takes.
    return json.dumps(value, allow_nan=True).encode()


def _bodies(templates: list[Any]) -> st.SearchStrategy[bytes | None]:
    raw = st.one_of(
        st.sampled_from([b"", b"{", b"[1,", b"nul", b"\xff\xfe{}", b'{"a":1}{"b":2}', b"\x00"]),
        st.binary(max_size=40),
        st.sampled_from([b'{"a": NaN}', b"Infinity", b"-Infinity", b'{"a":1e999}']),
        st.just(b"[" * 2000 + b"]" * 2000),
        # Just over and just under the body limit (Nova's and Keystone's 114688 bytes).
        st.sampled_from([MAX_BODY + 1, MAX_BODY, 4 * MAX_BODY]).map(_sized),
    )
    anything = st.one_of(
        st.none(),
        raw,
        junk().map(_encode),
        st.dictionaries(st.sampled_from(_NASTY_TEXT), junk(), max_size=3).map(_encode),
    )
    if not templates:
        return anything
    spoiled = st.one_of([mutated(t) for t in templates]).map(_encode)
    return _weighted((1, st.sampled_from(templates).map(_encode)), (4, spoiled), (2, anything))


def _token_choice(h: Harness) -> st.SearchStrategy[str | None]:
    """Mostly a valid admin or member token, so most requests reach the handlers."""
    admin, member = h.tokens["admin"], h.tokens["member"]
    bad = [None, "garbage", "gAAAAA" + "A" * 100, member[:-3] + "abc"]
    return _weighted((6, st.sampled_from([admin, member])), (1, st.sampled_from(bad)))


def _known(h: Harness, endpoint: Endpoint, param: str, last: bool) -> tuple[str, ...]:
    """Ids the cloud has for a path parameter; DELETE never aims at the fuzzer's own seeds."""
    if endpoint.service == "networking" and param == "id":
        key = f"networking:{endpoint.route.split('/')[2]}"
    else:
        key = f"{endpoint.service}:{param}"
    harmless_to_delete = {"tag", "key", "name", "kind", "target", "rc"}
    if endpoint.method == "DELETE" and last and param not in harmless_to_delete:
        return ()
    known = h.ids.get(key)
    if known is None:  # e.g. compute's image proxy: the image service's ids
        known = next((v for k, v in h.ids.items() if k.endswith(f":{param}")), [])
    return tuple(known)


def requests_for(
    h: Harness, endpoint: Endpoint, templates: list[Any] | None = None
) -> st.SearchStrategy[Sent]:
    """Wrong (and some right) requests to `endpoint`; built once per endpoint and templates."""
    key = (endpoint, None if templates is None else json.dumps(templates))
    if key not in h.strategies:
        chosen = h.templates.get((endpoint.method, endpoint.path), [])
        h.strategies[key] = _requests(h, endpoint, chosen if templates is None else templates)
    return h.strategies[key]


def _requests(h: Harness, endpoint: Endpoint, templates: list[Any]) -> st.SearchStrategy[Sent]:
    params = endpoint.params
    segments = [
        _segment(_known(h, endpoint, p, last=i == len(params) - 1)) for i, p in enumerate(params)
    ]
    tokens = _token_choice(h)
    bodies = _bodies(templates)
    subjects = [h.tokens["spare"], "garbage"]
    if endpoint.method != "DELETE":
        subjects += [h.tokens["admin"], h.tokens["member"]]
    wants_subject = endpoint.path == "/identity/v3/auth/tokens" and endpoint.method != "POST"
    has_body = endpoint.method in ("POST", "PUT", "PATCH")

    @st.composite
    def one(draw: st.DrawFn) -> Sent:
        path = endpoint.route
        for param, segment in zip(params, segments, strict=True):
            path = path.replace(f"{{{param}}}", draw(segment), 1)
        query = draw(_query())
        url = f"/{endpoint.service}{path}" + (f"?{urlencode(query)}" if query else "")
        headers: dict[str, str] = {}
        token = draw(tokens)
        if token is not None:
            headers["X-Auth-Token"] = token
        headers.update(draw(_versions(endpoint.service)))
        if wants_subject:
            headers["X-Subject-Token"] = draw(st.sampled_from(subjects))
        content: bytes | None = None
        if has_body or draw(st.integers(0, 9)) == 0:
            content = draw(bodies)
            kind = draw(_content_types(endpoint))
            if kind is not None and content is not None:
                headers["Content-Type"] = kind
        return Sent(endpoint, endpoint.method, url, headers, content)

    return one()


# -- what an answer must be -------------------------------------------------------------------


def _compute_shape(body: Any, status: int) -> bool:
    if not isinstance(body, dict) or len(body) != 1:
        return False
    fault = next(iter(body.values()))
    return isinstance(fault, dict) and fault.get("code") == status and "message" in fault


def _identity_shape(body: Any, status: int) -> bool:
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and error.get("code") == status and "message" in error


def _image_shape(body: Any, status: int) -> bool:
    return (
        isinstance(body, dict)
        and str(body.get("code", "")).startswith(str(status))
        and "message" in body
    )


def _network_shape(body: Any, status: int) -> bool:
    error = body.get("NeutronError") if isinstance(body, dict) else None
    return isinstance(error, dict) and {"type", "message", "detail"} <= set(error)


def _placement_shape(body: Any, status: int) -> bool:
    errors = body.get("errors") if isinstance(body, dict) else None
    return (
        isinstance(errors, list)
        and len(errors) == 1
        and isinstance(errors[0], dict)
        and errors[0].get("status") == status
        and "detail" in errors[0]
    )


_SHAPES: dict[str, Callable[[Any, int], bool]] = {
    "compute": _compute_shape,
    "identity": _identity_shape,
    "image": _image_shape,
    "networking": _network_shape,
    "placement": _placement_shape,
    # Cinder's faults and the metadata service's errors share Nova's shape.
    "volume": _compute_shape,
    "openstack": _compute_shape,
    "latest": _compute_shape,
}


def check_response(sent: Sent, response: httpx.Response) -> None:
    """No 5xx but 501; a request id on every answer; errors in the shape of their service."""
    status = response.status_code
    where = f"\n{sent}\n  -> {status} {response.text[:600]}"
    # 501 is an answer, not a crash: Nova says it for what a driver does not do (os-hosts).
    assert status < 500 or status == 501, f"server error{where}"
    if sent.content and not _exempt_from_body_rules(sent):
        media = sent.headers.get("Content-Type", "")
        if len(sent.content) > MAX_BODY:
            assert status == 413, f"a body over the limit not refused with 413{where}"
        elif media.startswith(_NOT_JSON):
            wanted = 400 if sent.endpoint.service == "identity" else 415
            assert status == wanted, f"a {media} body not refused with {wanted}{where}"
    assert response.headers.get("x-openstack-request-id"), f"no request id{where}"
    if 400 <= status <= 501 and sent.method != "HEAD":
        try:
            body = response.json()
        except ValueError:
            raise AssertionError(f"a {status} that is not JSON{where}") from None
        shape = _SHAPES[sent.endpoint.service]
        assert shape(body, status), f"a {status} not in the {sent.endpoint.service} shape{where}"
    elif (
        response.headers.get("content-type", "").startswith("application/json") and response.content
    ):
        try:
            response.json()
        except ValueError:
            raise AssertionError(f"a JSON answer that does not parse{where}") from None
