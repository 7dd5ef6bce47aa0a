"""Network v2.0: networks, subnets, ports, security groups and their rules, routers, floating
IPs, tags, extensions.

Every collection shares neutron's list semantics: filters on any attribute (repeat a
parameter to accept several values), `fields` to trim the answer, `sort_key`/`sort_dir`, and
`limit`/`marker`/`page_reverse` paging with `<collection>_links`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute

from stowage.api.auth import cloud_of, require_context, require_writer
from stowage.api.common import ApiError, Context, json_body
from stowage.api.responses import JSONResponse
from stowage.services import networks as svc
from stowage.services.cloud import Cloud
from stowage.services.networks import auto_allocate, availability, l3, subnetpools

__all__ = ["NeutronRoute", "router"]


class _NeutronRoute(APIRoute):
    """Render the network service's refusals with neutron's status and error type."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def translated(request: Request) -> Response:
            try:
                return await handler(request)
            except svc.NetworkError as exc:
                raise ApiError(exc.status, exc.message, code=exc.code) from None

        return translated


NeutronRoute = _NeutronRoute
router = APIRouter(route_class=_NeutronRoute)
Reader = Annotated[Context, Depends(require_context)]
Writer = Annotated[Context, Depends(require_writer)]

Lister = Callable[[Cloud, Context], list[dict[str, Any]]]
Getter = Callable[[Cloud, Context, str], dict[str, Any]]
Creator = Callable[[Cloud, Context, Mapping[str, Any]], dict[str, Any]]
Updater = Callable[[Cloud, Context, str, Mapping[str, Any]], dict[str, Any]]
Deleter = Callable[[Cloud, Context, str], None]


@dataclass(frozen=True, slots=True)
class _Resource:
    collection: str  # in the URL
    singular: str  # JSON key of one
    plural: str  # JSON key of many
    kind: str  # document kind
    fields: tuple[str, ...]  # what may be filtered and sorted on
    list: Lister
    get: Getter
    create: Creator
    update: Updater | None
    delete: Deleter
    not_found: str


_STANDARD = (
    "id",
    "name",
    "description",
    "project_id",
    "tenant_id",
    "created_at",
    "updated_at",
    "revision_number",
)
RESOURCES = (
    _Resource(
        "networks",
        "network",
        "networks",
        "network",
        (
            *_STANDARD,
            "status",
            "admin_state_up",
            "shared",
            "router:external",
            "mtu",
            "port_security_enabled",
            "availability_zones",
            "availability_zone_hints",
            "subnets",
            "provider:network_type",
            "provider:physical_network",
            "provider:segmentation_id",
            "ipv4_address_scope",
            "ipv6_address_scope",
            "is_default",
            "qos_policy_id",
            "dns_domain",
            "l2_adjacency",
        ),
        svc.list_networks,
        svc.get_network,
        svc.create_network,
        svc.update_network,
        svc.delete_network,
        "Network {} could not be found.",
    ),
    _Resource(
        "subnets",
        "subnet",
        "subnets",
        "subnet",
        (
            *_STANDARD,
            "network_id",
            "ip_version",
            "cidr",
            "gateway_ip",
            "allocation_pools",
            "enable_dhcp",
            "dns_nameservers",
            "host_routes",
            "ipv6_ra_mode",
            "ipv6_address_mode",
            "subnetpool_id",
            "segment_id",
            "service_types",
        ),
        svc.list_subnets,
        svc.get_subnet,
        svc.create_subnet,
        svc.update_subnet,
        svc.delete_subnet,
        "Subnet {} could not be found.",
    ),
    _Resource(
        "ports",
        "port",
        "ports",
        "port",
        (
            *_STANDARD,
            "network_id",
            "admin_state_up",
            "status",
            "mac_address",
            "fixed_ips",
            "device_id",
            "device_owner",
            "security_groups",
            "port_security_enabled",
            "binding:host_id",
            "binding:vnic_type",
            "binding:vif_type",
            "ip_allocation",
            "dns_name",
            "qos_policy_id",
        ),
        svc.list_ports,
        svc.get_port,
        svc.create_port,
        svc.update_port,
        svc.delete_port,
        "Port {} could not be found.",
    ),
    _Resource(
        "security-groups",
        "security_group",
        "security_groups",
        "security_group",
        (*_STANDARD, "stateful", "shared", "security_group_rules"),
        svc.list_security_groups,
        svc.get_security_group,
        svc.create_security_group,
        svc.update_security_group,
        svc.delete_security_group,
        "Security group {} does not exist",
    ),
    _Resource(
        "security-group-rules",
        "security_group_rule",
        "security_group_rules",
        "security_group_rule",
        (
            *_STANDARD,
            "security_group_id",
            "direction",
            "ethertype",
            "protocol",
            "port_range_min",
            "port_range_max",
            "remote_ip_prefix",
            "normalized_cidr",
            "remote_group_id",
            "remote_address_group_id",
            "belongs_to_default_sg",
        ),
        svc.list_security_group_rules,
        svc.get_security_group_rule,
        svc.create_security_group_rule,
        None,
        svc.delete_security_group_rule,
        "Security group rule {} does not exist",
    ),
    _Resource(
        "routers",
        "router",
        "routers",
        "router",
        (
            *_STANDARD,
            "status",
            "admin_state_up",
            "external_gateway_info",
            "availability_zones",
            "availability_zone_hints",
            "flavor_id",
        ),
        l3.list_routers,
        l3.get_router,
        l3.create_router,
        l3.update_router,
        l3.delete_router,
        "Router {} could not be found",
    ),
    _Resource(
        "floatingips",
        "floatingip",
        "floatingips",
        "floatingip",
        (
            *_STANDARD,
            "status",
            "floating_network_id",
            "floating_ip_address",
            "router_id",
            "port_id",
            "fixed_ip_address",
            "qos_policy_id",
        ),
        l3.list_floatingips,
        l3.get_floatingip,
        l3.create_floatingip,
        l3.update_floatingip,
        l3.delete_floatingip,
        "Floating IP {} could not be found",
    ),
    _Resource(
        "subnetpools",
        "subnetpool",
        "subnetpools",
        "subnetpool",
        (
            *_STANDARD,
            "prefixes",
            "default_prefixlen",
            "min_prefixlen",
            "max_prefixlen",
            "ip_version",
            "shared",
            "is_default",
            "default_quota",
            "address_scope_id",
        ),
        subnetpools.list_subnetpools,
        subnetpools.get_subnetpool,
        subnetpools.create_subnetpool,
        subnetpools.update_subnetpool,
        subnetpools.delete_subnetpool,
        "Subnet pool {} could not be found.",
    ),
)


def _bad(message: str) -> ApiError:
    return ApiError(400, message, code="HTTPBadRequest")


# -- list semantics ---------------------------------------------------------------------------

_PAGING = {"limit", "marker", "page_reverse", "sort_key", "sort_dir", "fields"}
_TAG_FILTERS = {"tags", "tags-any", "not-tags", "not-tags-any"}


def _as_bool(text: str) -> bool | None:
    lowered = text.lower()
    if lowered in ("true", "1"):
        return True
    if lowered in ("false", "0"):
        return False
    return None


def _matches_value(actual: Any, wanted: list[str]) -> bool:
    if isinstance(actual, bool):
        return any(_as_bool(w) is actual for w in wanted)
    if isinstance(actual, list):
        return any(str(item) in wanted for item in actual if not isinstance(item, dict))
    if actual is None:
        return any(w.lower() in ("", "none", "null") for w in wanted)
    return str(actual) in wanted


def _matches_fixed_ips(row: Mapping[str, Any], wanted: list[str]) -> bool:
    constraints: dict[str, set[str]] = {}
    for item in wanted:
        key, _sep, value = item.partition("=")
        constraints.setdefault(key.strip(), set()).add(value.strip())
    for ip in row.get("fixed_ips") or []:
        if all(
            (key == "ip_address_substr" and any(v in ip["ip_address"] for v in values))
            or ip.get(key) in values
            for key, values in constraints.items()
        ):
            return True
    return False


def _matches_tags(row: Mapping[str, Any], key: str, raw: list[str]) -> bool:
    wanted = {t for value in raw for t in value.split(",") if t}
    tags = set(row.get("tags") or [])
    if key == "tags":
        return wanted <= tags
    if key == "tags-any":
        return bool(wanted & tags)
    if key == "not-tags":
        return not wanted <= tags
    return not wanted & tags


def _filtered(
    rows: list[dict[str, Any]], resource: _Resource, items: list[tuple[str, str]]
) -> list[dict[str, Any]]:
    wanted: dict[str, list[str]] = {}
    for key, value in items:
        if key not in _PAGING:
            wanted.setdefault(key, []).append(value)
    for key in wanted:
        if key not in resource.fields and key not in _TAG_FILTERS:
            raise _bad(f"[{key}] is invalid attribute for filtering")
    out = []
    for row in rows:
        ok = True
        for key, values in wanted.items():
            if key in _TAG_FILTERS:
                ok = _matches_tags(row, key, values)
            elif key == "fixed_ips":
                ok = _matches_fixed_ips(row, values)
            else:
                ok = _matches_value(row.get(key), values)
            if not ok:
                break
        if ok:
            out.append(row)
    return out


def _sort_value(row: Mapping[str, Any], key: str) -> tuple[int, str]:
    value = row.get(key)
    if value is None:
        return (0, "")
    if isinstance(value, bool | int):
        return (1, f"{int(value):020d}")
    return (1, str(value))


def _sorted(
    rows: list[dict[str, Any]], resource: _Resource, items: list[tuple[str, str]]
) -> list[dict[str, Any]]:
    keys = [v for k, v in items if k == "sort_key"]
    dirs = [v for k, v in items if k == "sort_dir"]
    if not keys:
        if dirs:
            raise _bad("sort_dir requires sort_key")
        return rows
    if dirs and len(dirs) != len(keys):
        raise _bad("The number of sort_keys and sort_dirs must be same")
    for key in keys:
        if key not in resource.fields:
            raise _bad(f"{key} is an invalid attribute for sort_keys")
    for direction in dirs:
        if direction not in ("asc", "desc"):
            raise _bad(f"{direction} is an invalid value for sort_dirs, valid values are asc, desc")
    pairs = list(zip(keys, dirs or ["asc"] * len(keys), strict=True))
    out = list(rows)
    for key, direction in reversed(pairs):
        out.sort(key=functools.partial(_sort_value, key=key), reverse=direction == "desc")
    return out


def _page(
    request: Request, rows: list[dict[str, Any]], resource: _Resource, items: list[tuple[str, str]]
) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    params = dict(items)
    reverse = _as_bool(params.get("page_reverse", "false")) is True
    limit_text = params.get("limit")
    limit = 0
    if limit_text is not None:
        try:
            limit = int(limit_text)
        except ValueError:
            raise _bad(f"'{limit_text}' is not an integer") from None
        if limit < 0:
            raise _bad(f"Limit must be an integer 0 or greater and not '{limit}'")
    ordered = list(reversed(rows)) if reverse else rows
    marker = params.get("marker")
    if marker is not None:
        index = next((i for i, row in enumerate(ordered) if row["id"] == marker), None)
        if index is None:
            raise ApiError(404, resource.not_found.format(marker), code="NotFound")
        ordered = ordered[index + 1 :]
    page = ordered[:limit] if limit else ordered
    links = []
    base = f"{cloud_of(request).config.base_url}/networking/v2.0/{resource.collection}"
    rest = [(k, v) for k, v in items if k not in ("marker", "page_reverse")]
    if limit and len(page) == limit:
        links.append(
            {"rel": "next", "href": f"{base}?{urlencode([*rest, ('marker', page[-1]['id'])])}"}
        )
    if marker is not None and page:
        back = [*rest, ("marker", page[0]["id"]), ("page_reverse", "True")]
        links.append({"rel": "previous", "href": f"{base}?{urlencode(back)}"})
    if reverse:
        page.reverse()
    return page, links


def _trimmed(row: Mapping[str, Any], fields: list[str]) -> dict[str, Any]:
    if not fields:
        return dict(row)
    return {key: row[key] for key in fields if key in row}


# -- handlers ---------------------------------------------------------------------------------


def _lister(resource: _Resource) -> Callable[..., Coroutine[Any, Any, JSONResponse]]:
    async def handler(request: Request, ctx: Reader) -> JSONResponse:
        items = list(request.query_params.multi_items())
        rows = resource.list(cloud_of(request), ctx)
        rows = _sorted(_filtered(rows, resource, items), resource, items)
        page, links = _page(request, rows, resource, items)
        fields = [v for k, v in items if k == "fields"]
        body: dict[str, Any] = {resource.plural: [_trimmed(row, fields) for row in page]}
        if links:
            body[f"{resource.plural}_links"] = links
        return JSONResponse(body)

    return handler


def _shower(resource: _Resource) -> Callable[..., Coroutine[Any, Any, JSONResponse]]:
    async def handler(request: Request, ctx: Reader) -> JSONResponse:
        row = resource.get(cloud_of(request), ctx, request.path_params["id"])
        fields = [v for k, v in request.query_params.multi_items() if k == "fields"]
        return JSONResponse({resource.singular: _trimmed(row, fields)})

    return handler


async def _attrs(request: Request, resource: _Resource) -> dict[str, Any]:
    return _attrs_of(await json_body(request), resource)


def _attrs_of(body: Any, resource: _Resource) -> dict[str, Any]:
    if not isinstance(body, dict) or not isinstance(body.get(resource.singular), dict):
        raise _bad(f"Unable to find '{resource.singular}' in request body")
    if len(body) != 1:
        raise _bad(
            f"Unrecognized attribute(s) '{', '.join(k for k in body if k != resource.singular)}'"
        )
    attrs: dict[str, Any] = body[resource.singular]
    return attrs


def _creator(resource: _Resource) -> Callable[..., Coroutine[Any, Any, JSONResponse]]:
    async def handler(request: Request, ctx: Writer) -> JSONResponse:
        body = await json_body(request)
        if isinstance(body, dict) and list(body) == [resource.plural]:
            rows = _create_bulk(cloud_of(request), ctx, resource, body[resource.plural])
            return JSONResponse({resource.plural: rows}, status_code=201)
        attrs = _attrs_of(body, resource)
        row = resource.create(cloud_of(request), ctx, attrs)
        return JSONResponse({resource.singular: row}, status_code=201)

    return handler


def _create_bulk(
    cloud: Cloud, ctx: Context, resource: _Resource, items: Any
) -> list[dict[str, Any]]:
    """Neutron's bulk create: all of them, or (the ones made are deleted again) none."""
    if not isinstance(items, list) or not items or not all(isinstance(i, dict) for i in items):
        raise _bad(f"Invalid input: '{resource.plural}' is a list of {resource.singular} objects")
    made: list[dict[str, Any]] = []
    try:
        for item in items:
            made.append(resource.create(cloud, ctx, item))
    except BaseException:
        for row in reversed(made):
            resource.delete(cloud, ctx, row["id"])
        raise
    return made


def _updater(
    resource: _Resource, update: Updater
) -> Callable[..., Coroutine[Any, Any, JSONResponse]]:
    async def handler(request: Request, ctx: Writer) -> JSONResponse:
        attrs = await _attrs(request, resource)
        row = update(cloud_of(request), ctx, request.path_params["id"], attrs)
        return JSONResponse({resource.singular: row})

    return handler


def _deleter(resource: _Resource) -> Callable[..., Coroutine[Any, Any, Response]]:
    async def handler(request: Request, ctx: Writer) -> Response:
        resource.delete(cloud_of(request), ctx, request.path_params["id"])
        return Response(status_code=204)

    return handler


for _r in RESOURCES:
    path = f"/{_r.collection}"
    router.add_api_route(path, _lister(_r), methods=["GET"])
    router.add_api_route(path, _creator(_r), methods=["POST"])
    router.add_api_route(f"{path}/{{id}}", _shower(_r), methods=["GET"])
    if _r.update is not None:
        router.add_api_route(f"{path}/{{id}}", _updater(_r, _r.update), methods=["PUT"])
    router.add_api_route(f"{path}/{{id}}", _deleter(_r), methods=["DELETE"])


# -- router interfaces ----------------------------------------------------------------------


async def _interface_body(request: Request) -> Any:
    body = await json_body(request)
    if not isinstance(body, dict):
        raise _bad("Bad router request: the body must be an object.")
    return body


@router.put("/routers/{id}/add_router_interface")
async def add_router_interface(id: str, request: Request, ctx: Writer) -> JSONResponse:
    body = await _interface_body(request)
    return JSONResponse(l3.add_router_interface(cloud_of(request), ctx, id, body))


@router.put("/routers/{id}/remove_router_interface")
async def remove_router_interface(id: str, request: Request, ctx: Writer) -> JSONResponse:
    body = await _interface_body(request)
    return JSONResponse(l3.remove_router_interface(cloud_of(request), ctx, id, body))


# -- IP availability ------------------------------------------------------------------------


@router.get("/network-ip-availabilities")
async def list_ip_availabilities(request: Request, ctx: Reader) -> JSONResponse:
    items = list(request.query_params.multi_items())
    filters: dict[str, list[str]] = {}
    for key, value in items:
        if key in _PAGING:
            continue
        if key not in availability.FILTERS:
            raise _bad(f"[{key}] is invalid attribute for filtering")
        filters.setdefault(key, []).append(value)
    rows = availability.list_ip_availabilities(cloud_of(request), ctx, filters)
    fields = [v for k, v in items if k == "fields"]
    return JSONResponse({"network_ip_availabilities": [_trimmed(r, fields) for r in rows]})


@router.get("/network-ip-availabilities/{id}")
async def show_ip_availability(id: str, request: Request, ctx: Reader) -> JSONResponse:
    row = availability.get_ip_availability(cloud_of(request), ctx, id)
    fields = [v for k, v in request.query_params.multi_items() if k == "fields"]
    return JSONResponse({"network_ip_availability": _trimmed(row, fields)})


# -- auto-allocated topology ---------------------------------------------------------------


@router.get("/auto-allocated-topology/{project_id}")
async def get_auto_allocated_topology(
    project_id: str, request: Request, ctx: Reader
) -> JSONResponse:
    fields = [v for k, v in request.query_params.multi_items() if k == "fields"]
    row = auto_allocate.get_auto_allocated_topology(
        cloud_of(request),
        ctx,
        project_id,
        dry_run="dry-run" in fields,
        writer=ctx.can_write,
    )
    shown = [f for f in fields if f != "dry-run"]
    return JSONResponse({"auto_allocated_topology": _trimmed(row, shown)})


@router.delete("/auto-allocated-topology/{project_id}")
async def delete_auto_allocated_topology(
    project_id: str, request: Request, ctx: Writer
) -> Response:
    auto_allocate.delete_auto_allocated_topology(cloud_of(request), ctx, project_id)
    return Response(status_code=204)


# -- tags -------------------------------------------------------------------------------------

_TAGGED = {
    "networks": "network",
    "subnets": "subnet",
    "ports": "port",
    "security-groups": "security_group",
    "subnetpools": "subnetpool",
}


def _kind(request: Request) -> str:
    return _TAGGED[request.url.path.split("/v2.0/")[1].split("/")[0]]


def _tagged(request: Request) -> tuple[Cloud, str, str]:
    """The cloud, and the kind and id of the resource whose tags the request is about."""
    return cloud_of(request), _kind(request), request.path_params["id"]


def _no_tag(tag: str) -> ApiError:
    return ApiError(404, f"Tag {tag} could not be found.", code="TagNotFound")


def _tag_routes(collection: str) -> None:
    base = f"/{collection}/{{id}}/tags"

    async def get_tags(request: Request, ctx: Reader) -> JSONResponse:
        cloud, kind, rid = _tagged(request)
        return JSONResponse({"tags": svc.tags_of(cloud, ctx, kind, rid)})

    async def put_tags(request: Request, ctx: Writer) -> JSONResponse:
        body = await json_body(request)
        if not isinstance(body, dict) or "tags" not in body:
            raise _bad("Invalid input for tags. Reason: the body needs a 'tags' list.")
        cloud, kind, rid = _tagged(request)
        return JSONResponse({"tags": svc.set_tags(cloud, ctx, kind, rid, body["tags"])})

    async def clear_tags(request: Request, ctx: Writer) -> Response:
        cloud, kind, rid = _tagged(request)
        svc.set_tags(cloud, ctx, kind, rid, [])
        return Response(status_code=204)

    async def check_tag(request: Request, ctx: Reader) -> Response:
        cloud, kind, rid = _tagged(request)
        tag = request.path_params["tag"]
        if tag not in svc.tags_of(cloud, ctx, kind, rid):
            raise _no_tag(tag)
        return Response(status_code=204)

    async def add_tag(request: Request, ctx: Writer) -> Response:
        cloud, kind, rid = _tagged(request)
        tags = svc.tags_of(cloud, ctx, kind, rid)
        svc.set_tags(cloud, ctx, kind, rid, [*tags, request.path_params["tag"]])
        return Response(status_code=201)

    async def remove_tag(request: Request, ctx: Writer) -> Response:
        cloud, kind, rid = _tagged(request)
        tag = request.path_params["tag"]
        tags = svc.tags_of(cloud, ctx, kind, rid)
        if tag not in tags:
            raise _no_tag(tag)
        svc.set_tags(cloud, ctx, kind, rid, [t for t in tags if t != tag])
        return Response(status_code=204)

    router.add_api_route(base, get_tags, methods=["GET"])
    router.add_api_route(base, put_tags, methods=["PUT"])
    router.add_api_route(base, clear_tags, methods=["DELETE"])
    router.add_api_route(f"{base}/{{tag}}", check_tag, methods=["GET"])
    router.add_api_route(f"{base}/{{tag}}", add_tag, methods=["PUT"])
    router.add_api_route(f"{base}/{{tag}}", remove_tag, methods=["DELETE"])


for _collection in _TAGGED:
    _tag_routes(_collection)


# -- extensions -------------------------------------------------------------------------------

# alias: (name, description), as Neutron spells them (neutron_lib/api/definitions/).
EXTENSIONS: dict[str, tuple[str, str]] = {
    "allowed-address-pairs": ("Allowed Address Pairs", "Provides allowed address pairs"),
    "auto-allocated-topology": (
        "Auto Allocated Topology Services",
        "Auto Allocated Topology Services.",
    ),
    "availability_zone": ("Availability Zone", "The availability zone extension."),
    "binding": ("Port Binding", "Expose port bindings of a virtual port to external application"),
    "default-subnetpools": (
        "Default Subnetpools",
        "Provides ability to mark and use a subnetpool as the default.",
    ),
    "external-net": (
        "Neutron external network",
        "Adds external network attribute to network resource.",
    ),
    "extra_dhcp_opt": (
        "Neutron Extra DHCP options",
        "Extra options configuration for DHCP. "
        "For example PXE boot options to DHCP clients can be specified (e.g. tftp-server, "
        "server-ip-address, bootfile-name)",
    ),
    "ext-gw-mode": (
        "Neutron L3 Configurable external gateway mode",
        "Extension of the router abstraction for specifying whether SNAT should occur on the "
        "external gateway",
    ),
    "filter-validation": (
        "Filter parameters validation",
        "Provides validation on filtering parameters.",
    ),
    "network-ip-availability": (
        "Network IP Availability",
        "Provides IP availability data for each network and subnet.",
    ),
    "net-mtu": ("Network MTU", "Provides MTU attribute for a network resource."),
    "network_availability_zone": (
        "Network Availability Zone",
        "Availability zone support for network.",
    ),
    "pagination": ("Pagination support", "Extension that indicates that pagination is enabled."),
    "port-security": ("Port Security", "Provides port security"),
    "project-id": (
        "project_id field enabled",
        "Extension that indicates that project_id field is enabled.",
    ),
    "provider": ("Provider Network", "Expose mapping of virtual networks to physical networks"),
    "quota-check-limit": (
        "Quota engine limit check",
        "Support for checking the resource usage before applying a new quota limit",
    ),
    "quotas": ("Quota management support", "Expose functions for quotas management per project"),
    "quota_details": (
        "Quota details management support",
        "Expose functions for quotas usage statistics per project",
    ),
    "router": (
        "Neutron L3 Router",
        "Router abstraction for basic L3 forwarding between L2 Neutron networks and access to "
        "external networks via a NAT gateway.",
    ),
    "router_availability_zone": (
        "Router Availability Zone",
        "Availability zone support for router.",
    ),
    "security-group": ("security-group", "The security groups extension."),
    "subnet_allocation": (
        "Subnet Allocation",
        "Enables allocation of subnets from a subnet pool",
    ),
    "sorting": ("Sorting support", "Extension that indicates that sorting is enabled."),
    "standard-attr-description": (
        "standard-attr-description",
        "Extension to add descriptions to standard attributes",
    ),
    "standard-attr-revisions": (
        "Resource revision numbers",
        "This extension will display the revision number of neutron resources.",
    ),
    "standard-attr-tag": (
        "Tag support for resources with standard attribute: subnet, network, port, security_group",
        "Enables to set tag on resources with standard attribute.",
    ),
    "trunk": ("Trunk Extension", "Provides support for trunk ports"),
    "trunk-details": ("Trunk port details", "Expose trunk port details"),
    "standard-attr-timestamp": (
        "Resource timestamps",
        "Adds created_at and updated_at fields to all Neutron resources that have Neutron "
        "standard attributes.",
    ),
    "stateful-security-group": (
        "Stateful security group",
        "Indicates if the security group is stateful or not",
    ),
}


def _extension(alias: str) -> dict[str, Any]:
    name, description = EXTENSIONS[alias]
    return {
        "alias": alias,
        "name": name,
        "description": description,
        "links": [],
        "updated": "2013-01-20T00:00:00-00:00",
    }


@router.get("/extensions")
async def list_extensions(ctx: Reader) -> JSONResponse:
    return JSONResponse({"extensions": [_extension(alias) for alias in sorted(EXTENSIONS)]})


@router.get("/extensions/{alias}")
async def show_extension(alias: str, ctx: Reader) -> JSONResponse:
    if alias not in EXTENSIONS:
        raise ApiError(404, f"Extension with alias {alias} does not exist", code="NotFound")
    return JSONResponse({"extension": _extension(alias)})
