"""The catalog as data: regions, services and endpoints, and the catalogs tokens carry."""

from __future__ import annotations

import httpx
from tests.api.cloudproc import RunningCloud
from tests.api.personas import personas
from tests.api.sdk import SDK_WARNINGS, connect
from tests.api.test_identity import Admin, unique


def _catalog(cloud: RunningCloud, token: str) -> list[dict[str, object]]:
    response = httpx.get(
        f"{cloud.base_url}/identity/v3/auth/catalog", headers={"X-Auth-Token": token}
    )
    assert response.status_code == 200, response.text
    catalog: list[dict[str, object]] = response.json()["catalog"]
    return catalog


@SDK_WARNINGS
def test_an_operators_endpoint_reaches_every_tokens_catalog(cloud: RunningCloud) -> None:
    team = personas(cloud, "cat")
    kind = unique("stowage-test")
    service = cloud.osc_json("service", "create", "--name", "extra", kind)
    url = "http://extra.example:8776/v3/$(project_id)s"
    endpoint = cloud.osc_json(
        "endpoint", "create", "--region", "RegionOne", service["id"], "public", url
    )
    try:
        # The member's CLI sees it in its own catalog, its project put in the URL.
        shown = team.osc("member", "catalog", "show", kind, "-f", "json")
        assert shown.returncode == 0, shown.stderr
        assert f"http://extra.example:8776/v3/{team.project['id']}" in shown.stdout
        # The built-in services are data too: listed, and in the catalog of every token.
        listed = {s["Type"] for s in cloud.osc_json("service", "list")}
        assert {"identity", "compute", "image", "network", "placement", kind} <= listed
        reader = team.token("reader")
        assert {"identity", "compute", kind} <= {str(s["type"]) for s in _catalog(cloud, reader)}
        # A disabled endpoint leaves the catalogs; readers and members may not list endpoints.
        admin = Admin(cloud)
        patch = {"endpoint": {"enabled": False}}
        assert admin("PATCH", f"/endpoints/{endpoint['id']}", patch).status_code == 200
        extra = next(s for s in _catalog(cloud, reader) if s["type"] == kind)
        assert extra["endpoints"] == []
        for role in ("member", "reader"):
            denied = Admin(cloud, team.token(role))("GET", "/endpoints")
            assert denied.status_code == 403
            assert "identity:list_endpoints" in denied.text
        # openstacksdk's identity layer reads the same data.
        conn = connect(cloud)
        ours = list(conn.identity.endpoints(service_id=service["id"]))
        assert [(e.interface, e.url, e.is_enabled) for e in ours] == [("public", url, False)]
    finally:
        # Deleting the service takes its endpoints with it.
        cloud.osc("service", "delete", service["id"])
    admin = Admin(cloud)
    assert admin("GET", f"/endpoints/{endpoint['id']}").status_code == 404


def test_regions_nest_refuse_cycles_and_deletes_in_use(cloud: RunningCloud) -> None:
    admin = Admin(cloud)
    parent = unique("region")
    created = admin("PUT", f"/regions/{parent}", {"region": {"description": "top"}})
    assert created.status_code == 201, created.text
    child = admin("POST", "/regions", {"region": {"parent_region_id": parent}}).json()["region"]
    assert child["parent_region_id"] == parent
    cycle = admin("PATCH", f"/regions/{parent}", {"region": {"parent_region_id": child["id"]}})
    assert cycle.status_code == 400
    assert admin("DELETE", f"/regions/{parent}").status_code == 403
    missing = admin("POST", "/regions", {"region": {"parent_region_id": "nowhere"}})
    assert missing.status_code == 400
    assert admin("DELETE", f"/regions/{child['id']}").status_code == 204
    assert admin("DELETE", f"/regions/{parent}").status_code == 204
    assert admin("GET", f"/regions/{parent}").status_code == 404
    bad = admin(
        "POST",
        "/endpoints",
        {"endpoint": {"service_id": "none", "interface": "public", "url": "http://x"}},
    )
    assert bad.status_code == 400


def test_an_endpoint_moved_with_the_legacy_region_field_creates_the_region(
    cloud: RunningCloud,
) -> None:
    """`region` (v2's name) on update, as on create: the region is made if missing, and the
    endpoint moves to it (Keystone's _validate_endpoint_region; Tempest's
    test_update_endpoint)."""
    admin = Admin(cloud)
    service = cloud.osc_json("service", "create", "--name", "moved", unique("stowage-test"))
    first, second = unique("region"), unique("region")
    try:
        body = {"service_id": service["id"], "interface": "public", "url": "http://a.example/"}
        made = admin("POST", "/endpoints", {"endpoint": {**body, "region": first}})
        assert made.status_code == 201, made.text
        endpoint = made.json()["endpoint"]
        assert admin("GET", f"/regions/{first}").status_code == 200
        moved = admin("PATCH", f"/endpoints/{endpoint['id']}", {"endpoint": {"region": second}})
        assert moved.status_code == 200, moved.text
        assert (moved.json()["endpoint"]["region"], moved.json()["endpoint"]["region_id"]) == (
            second,
            second,
        )
        assert admin("GET", f"/regions/{second}").status_code == 200
        # The first region holds no endpoint any more: it may go.
        assert admin("DELETE", f"/regions/{first}").status_code == 204
        # Named as region_id, a region must exist.
        absent = admin("PATCH", f"/endpoints/{endpoint['id']}", {"endpoint": {"region_id": "x"}})
        assert absent.status_code == 400, absent.text
    finally:
        cloud.osc("service", "delete", service["id"])
    assert admin("DELETE", f"/regions/{second}").status_code == 204
