"""Security: who may do what, authentication's guards and input limits (issue 10)."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
from tests.api.cloudproc import RunningCloud


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _call(cloud: RunningCloud, token: str, method: str, path: str, **kwargs: Any) -> httpx.Response:
    headers = {"X-Auth-Token": token, **kwargs.pop("headers", {})}
    return httpx.request(method, f"{cloud.base_url}{path}", headers=headers, timeout=30, **kwargs)


def _reader_of_demo(cloud: RunningCloud) -> str:
    """A new user with only the reader role on project demo, and its token."""
    name = unique("reader")
    cloud.osc("user", "create", "--password", "read-only", "--project", "demo", name)
    cloud.osc("role", "add", "--project", "demo", "--user", name, "reader")
    return cloud.token(name, "read-only", "demo")


# -- a reader writes nothing through the compute proxies ---------------------------------------


def test_a_reader_cannot_write_through_the_compute_proxies(cloud: RunningCloud) -> None:
    member = cloud.token("demo", "stowage-demo", "demo")
    reader = _reader_of_demo(cloud)
    image = _call(
        cloud,
        member,
        "POST",
        "/image/v2/images",
        json={"name": unique("img"), "disk_format": "raw", "container_format": "bare"},
    )
    assert image.status_code == 201, image.text
    image_id = image.json()["id"]
    group = _call(
        cloud,
        member,
        "POST",
        "/networking/v2.0/security-groups",
        json={"security_group": {"name": unique("sg")}},
    )
    assert group.status_code == 201, group.text
    group_id = group.json()["security_group"]["id"]
    # Glance and Neutron themselves refuse the reader.
    assert _call(cloud, reader, "DELETE", f"/image/v2/images/{image_id}").status_code == 403
    rule = {"security_group_rule": {"security_group_id": group_id, "direction": "ingress"}}
    refused = _call(cloud, reader, "POST", "/networking/v2.0/security-group-rules", json=rule)
    assert refused.status_code == 403

    def proxy(method: str, path: str, **kwargs: Any) -> httpx.Response:
        return cloud.compute(method, path, version="2.35", token=reader, **kwargs)

    meta = {"metadata": {"k": "v"}}
    assert proxy("POST", f"/images/{image_id}/metadata", json=meta).status_code == 403
    assert proxy("PUT", f"/images/{image_id}/metadata", json=meta).status_code == 403
    item = {"meta": {"k": "v"}}
    assert proxy("PUT", f"/images/{image_id}/metadata/k", json=item).status_code == 403
    assert proxy("DELETE", f"/images/{image_id}/metadata/k").status_code == 403
    assert proxy("DELETE", f"/images/{image_id}").status_code == 403
    assert _call(cloud, member, "GET", f"/image/v2/images/{image_id}").status_code == 200
    assert "k" not in _call(cloud, member, "GET", f"/image/v2/images/{image_id}").json()

    opened = {
        "security_group_rule": {
            "parent_group_id": group_id,
            "ip_protocol": "tcp",
            "from_port": 22,
            "to_port": 22,
            "cidr": "0.0.0.0/0",
        }
    }
    assert proxy("POST", "/os-security-group-rules", json=opened).status_code == 403
    created = {"security_group": {"name": unique("sg"), "description": ""}}
    assert proxy("POST", "/os-security-groups", json=created).status_code == 403
    renamed = {"security_group": {"name": unique("sg"), "description": "x"}}
    assert proxy("PUT", f"/os-security-groups/{group_id}", json=renamed).status_code == 403
    assert proxy("DELETE", f"/os-security-groups/{group_id}").status_code == 403
    rules = _call(cloud, member, "GET", f"/networking/v2.0/security-groups/{group_id}").json()
    ingress = [
        r for r in rules["security_group"]["security_group_rules"] if r["direction"] == "ingress"
    ]
    assert ingress == []
    # The owner's member still may.
    assert cloud.compute(
        "POST", "/os-security-group-rules", version="2.35", token=member, json=opened
    ).is_success
    assert cloud.compute("DELETE", f"/images/{image_id}", version="2.35", token=member).is_success


def test_a_reader_cannot_clear_a_servers_password(cloud: RunningCloud) -> None:
    reader = _reader_of_demo(cloud)
    server = cloud.boot(unique("pw"), cloud="stowage")
    path = f"/servers/{server['id']}/os-server-password"
    assert cloud.compute("GET", path, token=reader).status_code == 200
    assert cloud.compute("DELETE", path, token=reader).status_code == 403
    member = cloud.token("demo", "stowage-demo", "demo")
    assert cloud.compute("DELETE", path, token=member).status_code == 204
    cloud.osc("server", "delete", "--wait", server["id"], cloud="stowage")
