"""The metadata service on the API port, for a server named by a signed X-Instance-ID: the
OpenStack documents and the EC2-style tree, as a guest (or cloud-init) reads them."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import uuid

import httpx
from tests.api.cloudproc import IMAGE, RunningCloud

USER_DATA = b"#cloud-config\nruncmd: [echo hello]\n"


def signed(cloud: RunningCloud, instance_id: str) -> dict[str, str]:
    secret = (cloud.state_dir / "metadata_secret").read_bytes().strip()
    signature = hmac.new(secret, instance_id.encode(), hashlib.sha256).hexdigest()
    return {"X-Instance-ID": instance_id, "X-Instance-ID-Signature": signature}


def test_a_server_reads_its_metadata_user_data_and_ec2_tree(cloud: RunningCloud) -> None:
    name = f"md-{uuid.uuid4().hex[:6]}"
    image = httpx.get(
        f"{cloud.base_url}/image/v2/images?name={IMAGE}", headers={"X-Auth-Token": cloud.token()}
    ).json()["images"][0]["id"]
    created = cloud.compute(
        "POST",
        "/servers",
        json={
            "server": {
                "name": name,
                "flavorRef": "1",
                "imageRef": image,
                "networks": "none",
                "metadata": {"role": "web"},
                "user_data": base64.b64encode(USER_DATA).decode(),
            }
        },
    )
    assert created.status_code == 202
    server_id = created.json()["server"]["id"]
    shown = cloud.compute("GET", f"/servers/{server_id}", version="2.3").json()["server"]
    assert base64.b64decode(shown["OS-EXT-SRV-ATTR:user_data"]) == USER_DATA

    base = cloud.base_url
    headers = signed(cloud, server_id)
    assert "latest" in httpx.get(f"{base}/openstack/", headers=headers).text.split("\n")
    listing = httpx.get(f"{base}/openstack/latest/", headers=headers).text.split("\n")
    assert {"meta_data.json", "user_data", "network_data.json", "vendor_data.json"} <= set(listing)
    meta = httpx.get(f"{base}/openstack/latest/meta_data.json", headers=headers).json()
    assert (meta["uuid"], meta["name"], meta["meta"]) == (server_id, name, {"role": "web"})
    data = httpx.get(f"{base}/openstack/2018-08-27/user_data", headers=headers)
    assert data.content == USER_DATA
    network = httpx.get(f"{base}/openstack/latest/network_data.json", headers=headers).json()
    assert set(network) == {"links", "networks", "services"}
    assert httpx.get(f"{base}/openstack/latest/vendor_data.json", headers=headers).json() == {}
    ec2 = httpx.get(f"{base}/latest/meta-data/", headers=headers).text.split("\n")
    assert {"instance-id", "hostname", "placement/"} <= set(ec2)
    assert httpx.get(f"{base}/latest/meta-data/instance-id", headers=headers).text == server_id
    zone = httpx.get(f"{base}/latest/meta-data/placement/availability-zone", headers=headers)
    assert zone.text == "nova"
    assert httpx.get(f"{base}/latest/user-data", headers=headers).content == USER_DATA

    forged = {**headers, "X-Instance-ID-Signature": "0" * 64}
    assert httpx.get(f"{base}/openstack/latest/meta_data.json", headers=forged).status_code == 403
    bare = httpx.get(f"{base}/openstack/latest/meta_data.json")
    assert bare.status_code == 400
    assert httpx.get(f"{base}/openstack/1999-01-01/", headers=headers).status_code == 404
    cloud.compute("DELETE", f"/servers/{server_id}")
    gone = httpx.get(f"{base}/openstack/latest/meta_data.json", headers=headers)
    assert gone.status_code == 404
    assert json.loads(gone.text)  # an error body, not an empty answer
