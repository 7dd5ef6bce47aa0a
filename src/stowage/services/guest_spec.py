"""The whole guest for the hypervisor: flavor sizes, image, NICs, volumes and config drive.

The conductor sends this with a claim (`claim_of`), so that a driver can build the guest:
the claim alone says nothing of a shared-CPU flavor's vCPUs or of the image to boot. The
dict is the bus form of `stowage.virt.driver.Guest` (its `from_payload` reads it); the host's
shared CPU set is the driver's own (the `cpu_shared_set` the host registered with).

The volumes (`volumes`, with the backend's connection info; boot index 0 is the root disk)
and the config drive's files (`config_drive`, base64) are there only for a server that has
them, so that every other guest's description is what it was.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

from stowage.services.cloud import Cloud

__all__ = ["guest_payload", "image_spec"]


def image_spec(
    cloud: Cloud, image_id: str, known: Mapping[str, Mapping[str, Any] | None] | None = None
) -> dict[str, Any] | None:
    """The driver's `ImageSpec` (as a payload) of an active image, None for any other.
    `known`: images the caller read already, by id (None: read, and there is none)."""
    from stowage.services import images

    if known is not None and image_id in known:
        image = known[image_id]
    else:
        image = images.find_image(cloud, image_id) if image_id else None
    if image is None or image.get("status") != "active":
        return None
    return {
        "id": image["id"],
        "disk_format": image.get("disk_format") or "raw",
        "size": int(image.get("size") or 0),
        "checksum": image.get("checksum"),
        "hash_algo": image.get("os_hash_algo"),
        "hash_value": image.get("os_hash_value"),
    }


def guest_payload(
    cloud: Cloud,
    instance_id: str,
    *,
    flavor: dict[str, Any] | None = None,
    body: Mapping[str, Any] | None = None,
    images: Mapping[str, Mapping[str, Any] | None] | None = None,
) -> dict[str, Any]:
    """What the driver needs besides the claim, for `instance_id`.

    `flavor` overrides the instance's (a resize's new flavor); `body` is the instance as the
    caller read it (read here otherwise); `images`, the images it read with it (`image_spec`).
    """
    from stowage.services import networks

    if body is None:
        doc = cloud.objects.find("instance", instance_id)
        body = {} if doc is None else doc.body
    flavor = flavor or body.get("flavor") or {}
    out: dict[str, Any] = {
        "vcpus": int(flavor.get("vcpus") or 0),
        "root_gb": int(flavor.get("disk") or 0),
        "name": str(body.get("name") or ""),
        "image": None,
        "nics": [],
        "user_data": body.get("user_data"),  # base64, as the API stored it
    }
    # An unshelve boots from the image its shelve made of the disk, which is then rebased
    # onto the server's own image (flattened when that image is gone).
    image_id = (body.get("shelved_image_id") or body.get("image_id")) if body else None
    out["image"] = image_spec(cloud, str(image_id or ""), images) if body else None
    if body.get("shelved_image_id") and out["image"] is not None:
        own = image_spec(cloud, str(body.get("image_id") or ""), images)
        out["rebase_image"] = own
        out["flatten_disk"] = own is None
    nics: dict[str, dict[str, Any]] = {}
    for entries in networks.addresses_of(cloud, instance_id).values():
        for entry in entries:
            mac = str(entry.get("OS-EXT-IPS-MAC:mac_addr") or "")
            if mac:
                nic = nics.setdefault(mac, {"mac": mac, "ips": []})
                nic["ips"].append(str(entry.get("addr")))
    out["nics"] = list(nics.values())
    # Volumes being attached are not yet the guest's: their attach follows (or is undone).
    devices = [d for d in body.get("block_devices") or [] if not d.get("attaching")]
    if devices:
        from stowage.services.volumes.model import backend_of

        backend = backend_of(cloud)
        out["volumes"] = [
            {
                "device": d["device"],
                "connection": backend.connection_info(str(d["volume_id"])),
                "boot_index": d.get("boot_index"),
                "volume_id": d["volume_id"],
            }
            for d in devices
        ]
    if body.get("config_drive"):
        from stowage.services.guest_metadata import config_drive_files

        files = config_drive_files(cloud, instance_id)
        out["config_drive"] = {k: base64.b64encode(v).decode() for k, v in files.items()}
    return out
