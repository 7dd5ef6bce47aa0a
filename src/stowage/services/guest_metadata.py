"""What a guest learns about itself: the OpenStack metadata (meta_data.json, user_data,
network_data.json, vendor_data), the EC2-style tree, and the config drive built from them.

One content builder serves both the metadata service on the API port and the config drive
image (ISO 9660, label `config-2`, as Nova writes it: `stowage.virt.config_drive`) that the
libvirt driver attaches as a cdrom.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
from typing import Any

from stowage.domain.errors import NotFound
from stowage.services.cloud import Cloud
from stowage.virt.config_drive import build_config_drive

__all__ = [
    "OPENSTACK_VERSIONS",
    "build_config_drive",
    "config_drive_files",
    "ec2_metadata",
    "metadata_secret",
    "openstack_metadata",
    "signature_of",
]

# The metadata versions Nova serves, oldest first; `latest` is the newest's content.
OPENSTACK_VERSIONS = (
    "2012-08-10",
    "2013-04-04",
    "2013-10-17",
    "2015-10-15",
    "2016-06-30",
    "2016-10-06",
    "2017-02-22",
    "2018-08-27",
    "2020-10-14",
)


def metadata_secret(cloud: Cloud) -> bytes:
    """Nova's `metadata_proxy_shared_secret`: the key a metadata proxy signs instance ids
    with (X-Instance-ID-Signature), kept 0600 in the state directory."""
    path = cloud.config.state_dir / "metadata_secret"
    if not path.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(secrets.token_hex(32).encode())
        tmp.chmod(0o600)
        tmp.replace(path)
    return path.read_bytes().strip()


def signature_of(secret: bytes, instance_id: str) -> str:
    return hmac.new(secret, instance_id.encode(), hashlib.sha256).hexdigest()


def _instance(cloud: Cloud, instance_id: str) -> dict[str, Any]:
    doc = cloud.objects.find("instance", instance_id)
    if doc is None:
        raise NotFound(f"Instance {instance_id} could not be found.")
    return {**doc.body, "id": doc.id}


def _keys(cloud: Cloud, body: dict[str, Any]) -> list[dict[str, str]]:
    name = body.get("key_name")
    if not name:
        return []
    for doc in cloud.objects.list("keypair"):
        if doc.body.get("user_id") == body.get("user_id") and doc.body.get("name") == name:
            kind = str(doc.body.get("type", "ssh"))
            return [{"name": name, "type": kind, "data": str(doc.body["public_key"])}]
    return []


def _hostname(body: dict[str, Any]) -> str:
    return str(body.get("hostname") or body.get("name") or body["id"]).lower().replace(" ", "-")


def user_data(cloud: Cloud, instance_id: str) -> bytes | None:
    raw = _instance(cloud, instance_id).get("user_data")
    return None if raw is None else base64.b64decode(raw)


def openstack_metadata(cloud: Cloud, instance_id: str) -> dict[str, Any]:
    """meta_data.json, network_data.json and the vendor data of the instance."""
    body = _instance(cloud, instance_id)
    keys = _keys(cloud, body)
    meta = {
        "uuid": body["id"],
        "name": body.get("name"),
        "hostname": _hostname(body),
        "launch_index": body.get("launch_index", 0),
        "availability_zone": body.get("availability_zone") or "nova",
        "project_id": body.get("project_id"),
        "meta": dict(body.get("metadata") or {}),
        "public_keys": {k["name"]: k["data"] for k in keys},
        "keys": keys,
        "devices": [],
        "random_seed": base64.b64encode(secrets.token_bytes(512)).decode(),
    }
    return {
        "meta_data.json": meta,
        "network_data.json": _network_data(cloud, instance_id),
        "vendor_data.json": {},
        "vendor_data2.json": {},
    }


def _network_data(cloud: Cloud, instance_id: str) -> dict[str, Any]:
    from stowage.services import networks

    links: list[dict[str, Any]] = []
    nets: list[dict[str, Any]] = []
    for network_name, entries in networks.addresses_of(cloud, instance_id).items():
        for entry in entries:
            mac = str(entry.get("OS-EXT-IPS-MAC:mac_addr") or "")
            link_id = f"tap{mac.replace(':', '')[-10:]}"
            if not any(link["id"] == link_id for link in links):
                links.append(
                    {"id": link_id, "type": "phy", "ethernet_mac_address": mac, "mtu": 1500}
                )
            version = int(entry.get("version") or 4)
            nets.append(
                {
                    "id": f"network{len(nets)}",
                    "type": "ipv4" if version == 4 else "ipv6",
                    "link": link_id,
                    "ip_address": entry.get("addr"),
                    "routes": [],
                    "network_id": network_name,
                }
            )
    return {"links": links, "networks": nets, "services": []}


def ec2_metadata(cloud: Cloud, instance_id: str) -> dict[str, Any]:
    """The EC2-style tree (`/latest/meta-data/`): leaves are strings, branches dicts."""
    body = _instance(cloud, instance_id)
    from stowage.services import networks

    ips = [
        str(e.get("addr"))
        for entries in networks.addresses_of(cloud, instance_id).values()
        for e in entries
        if int(e.get("version") or 4) == 4
    ]
    keys = _keys(cloud, body)
    return {
        "ami-id": body.get("image_id") or "",
        "ami-launch-index": str(body.get("launch_index", 0)),
        "hostname": _hostname(body),
        "instance-id": body["id"],
        "instance-type": (body.get("flavor") or {}).get("name", ""),
        "local-hostname": _hostname(body),
        "local-ipv4": ips[0] if ips else "",
        "placement": {"availability-zone": body.get("availability_zone") or "nova"},
        "public-keys": {f"0={k['name']}": {"openssh-key": k["data"]} for k in keys[:1]},
        "reservation-id": body.get("reservation_id") or "",
        "security-groups": "\n".join(body.get("security_groups") or []),
    }


def config_drive_files(cloud: Cloud, instance_id: str) -> dict[str, bytes]:
    """Every file of the instance's config drive, by path (as Nova lays it out)."""
    content = openstack_metadata(cloud, instance_id)
    data = user_data(cloud, instance_id)
    files: dict[str, bytes] = {}
    for version in (*OPENSTACK_VERSIONS[-1:], "latest"):
        for name, value in content.items():
            files[f"openstack/{version}/{name}"] = json.dumps(value).encode()
        if data is not None:
            files[f"openstack/{version}/user_data"] = data
    files["ec2/latest/meta-data.json"] = json.dumps(ec2_metadata(cloud, instance_id)).encode()
    if data is not None:
        files["ec2/latest/user-data"] = data
    return files
