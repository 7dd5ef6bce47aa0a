"""The whole guest for the hypervisor: flavor sizes, image and NICs.

The conductor sends this with a claim (`claim_of`), so that a driver can build the guest:
the claim alone says nothing of a shared-CPU flavor's vCPUs or of the image to boot. The
dict is the bus form of `stowage.virt.driver.Guest` (its `from_payload` reads it); the host's
shared CPU set is the driver's own (the `cpu_shared_set` the host registered with).
"""

from __future__ import annotations

from typing import Any

from stowage.services.cloud import Cloud

__all__ = ["guest_payload"]


def guest_payload(
    cloud: Cloud, instance_id: str, *, flavor: dict[str, Any] | None = None
) -> dict[str, Any]:
    """What the driver needs besides the claim, for `instance_id`.

    `flavor` overrides the instance's (a resize's new flavor).
    """
    from stowage.services import images, networks

    doc = cloud.objects.find("instance", instance_id)
    body = {} if doc is None else dict(doc.body)
    flavor = flavor or body.get("flavor") or {}
    out: dict[str, Any] = {
        "vcpus": int(flavor.get("vcpus") or 0),
        "root_gb": int(flavor.get("disk") or 0),
        "name": str(body.get("name") or ""),
        "image": None,
        "nics": [],
        "user_data": body.get("user_data"),  # base64, as the API stored it
    }
    # An unshelve boots from the image its shelve made of the disk.
    image_id = (body.get("shelved_image_id") or body.get("image_id")) if body else None
    image = images.find_image(cloud, str(image_id or "")) if body else None
    if image is not None and image.get("status") == "active":
        out["image"] = {
            "id": image["id"],
            "disk_format": image.get("disk_format") or "raw",
            "size": int(image.get("size") or 0),
            "checksum": image.get("checksum"),
            "hash_algo": image.get("os_hash_algo"),
            "hash_value": image.get("os_hash_value"),
        }
    nics: dict[str, dict[str, Any]] = {}
    for entries in networks.addresses_of(cloud, instance_id).values():
        for entry in entries:
            mac = str(entry.get("OS-EXT-IPS-MAC:mac_addr") or "")
            if mac:
                nic = nics.setdefault(mac, {"mac": mac, "ips": []})
                nic["ips"].append(str(entry.get("addr")))
    out["nics"] = list(nics.values())
    return out
