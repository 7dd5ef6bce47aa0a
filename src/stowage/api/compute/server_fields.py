"""The server fields Nova's schemas allow, per microversion, and the checks that make each one
either honoured or refused: nothing a create, update or rebuild names is accepted and forgotten.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import re
from typing import Any

from stowage.api.common import ApiError, Context
from stowage.domain.errors import NotFound, StowageError
from stowage.services import networks as net
from stowage.services.cloud import Cloud
from stowage.services.networks import auto_allocate

__all__ = [
    "CREATE_FIELDS",
    "REBUILD_FIELDS",
    "UPDATE_FIELDS",
    "allowed_fields",
    "apply_common_fields",
    "check_action_args",
    "check_block_devices",
    "check_group",
    "check_hostname",
    "check_lock",
    "check_nics",
    "check_refused",
    "check_unknown",
    "check_user_data",
    "create_extras",
    "disk_config",
    "hostname_of",
    "locked_by",
    "pinned_host",
    "rebuild_changes",
    "requested_host",
    "shown_host",
]

Version = tuple[int, int]

# field -> (first microversion, last microversion or None), as nova/api/openstack/compute/
# schemas/servers.py has them. What is not listed is refused ("Additional properties").
CREATE_FIELDS: dict[str, tuple[Version, Version | None]] = {
    "name": ((2, 1), None),
    "imageRef": ((2, 1), None),
    "flavorRef": ((2, 1), None),
    "adminPass": ((2, 1), None),
    "metadata": ((2, 1), None),
    "networks": ((2, 1), None),
    "OS-DCF:diskConfig": ((2, 1), None),
    "accessIPv4": ((2, 1), None),
    "accessIPv6": ((2, 1), None),
    "personality": ((2, 1), (2, 56)),
    "availability_zone": ((2, 1), None),
    "block_device_mapping": ((2, 1), None),
    "block_device_mapping_v2": ((2, 1), None),
    "config_drive": ((2, 1), None),
    "key_name": ((2, 1), None),
    "min_count": ((2, 1), None),
    "max_count": ((2, 1), None),
    "return_reservation_id": ((2, 1), None),
    "security_groups": ((2, 1), None),
    "user_data": ((2, 1), None),
    "description": ((2, 19), None),
    "tags": ((2, 52), None),
    "trusted_image_certificates": ((2, 63), None),
    "host": ((2, 74), None),
    "hypervisor_hostname": ((2, 74), None),
    "hostname": ((2, 90), None),
}

UPDATE_FIELDS: dict[str, tuple[Version, Version | None]] = {
    "name": ((2, 1), None),
    "accessIPv4": ((2, 1), None),
    "accessIPv6": ((2, 1), None),
    "OS-DCF:diskConfig": ((2, 1), None),
    "description": ((2, 19), None),
    "hostname": ((2, 90), None),
}

REBUILD_FIELDS: dict[str, tuple[Version, Version | None]] = {
    "imageRef": ((2, 1), None),
    "name": ((2, 1), None),
    "adminPass": ((2, 1), None),
    "metadata": ((2, 1), None),
    "preserve_ephemeral": ((2, 1), None),
    "OS-DCF:diskConfig": ((2, 1), None),
    "accessIPv4": ((2, 1), None),
    "accessIPv6": ((2, 1), None),
    "personality": ((2, 1), (2, 56)),
    "description": ((2, 19), None),
    "key_name": ((2, 54), None),
    "user_data": ((2, 57), None),
    "trusted_image_certificates": ((2, 63), None),
    "hostname": ((2, 90), None),
}

_USER_DATA_MAX = 65535
_HOSTNAME = re.compile(r"^[a-zA-Z0-9._-]+$")


def allowed_fields(
    fields: dict[str, tuple[Version, Version | None]], version: Version
) -> frozenset[str]:
    """The fields a schema allows at `version`."""
    return frozenset(
        name
        for name, (first, last) in fields.items()
        if version >= first and (last is None or version <= last)
    )


def check_unknown(
    body: dict[str, Any], fields: dict[str, tuple[Version, Version | None]], version: Version
) -> None:
    """Nova's `additionalProperties: false`: a field the microversion does not have is a 400."""
    unknown = sorted(set(body) - allowed_fields(fields, version))
    if unknown:
        raise ApiError(
            400,
            "Invalid input for field/attribute server. Value: "
            f"Additional properties are not allowed ({unknown[0]!r} was unexpected)",
        )


def check_user_data(value: Any) -> str | None:
    """Base64 of at most 65535 characters (Nova's `format: base64`, `maxLength: 65535`)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ApiError(400, "Invalid input for field/attribute user_data: not a string")
    if len(value) > _USER_DATA_MAX:
        raise ApiError(
            400,
            f"User data too large. User data must be no larger than {_USER_DATA_MAX} bytes "
            f"once base64 encoded. Your data is {len(value)} bytes",
        )
    try:
        base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(
            400, "Invalid input for field/attribute user_data. Value: not valid base64"
        ) from None
    return value


def check_hostname(value: Any, version: Version) -> str:
    """2.90: a hostname of at most 63 characters; 2.94: an FQDN of at most 255."""
    limit = 255 if version >= (2, 94) else 63
    if not isinstance(value, str) or not 1 <= len(value) <= limit or not _HOSTNAME.match(value):
        raise ApiError(
            400,
            f"Invalid input for field/attribute hostname. Value: {value}. A hostname of 1 to "
            f"{limit} letters, digits, '-', '.' and '_' is required",
        )
    if version < (2, 94) and "." in value:
        raise ApiError(
            400, f"Invalid input for field/attribute hostname. Value: {value}. An FQDN needs 2.94"
        )
    return value


def disk_config(value: Any) -> str:
    """OS-DCF:diskConfig: AUTO or MANUAL, kept and shown as given (MANUAL when not given)."""
    if value is None:
        return "MANUAL"
    if value not in ("AUTO", "MANUAL"):
        raise ApiError(
            400,
            f"Invalid input for field/attribute OS-DCF:diskConfig. Value: {value}. "
            "'AUTO' or 'MANUAL' is required",
        )
    return str(value)


_TRUE = frozenset({"true", "1", "on", "yes"})
_FALSE = frozenset({"false", "0", "off", "no", ""})


def check_config_drive(value: Any) -> bool:
    """Nova's `config_drive` (parameter_types.boolean): the server gets a config drive (an
    ISO 9660 cdrom labelled config-2 on libvirt; an ISO file beside the simulated disk)."""
    if value is None or value is False:
        return False
    if value is True:
        return True
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ApiError(
        400, f"Invalid input for field/attribute config_drive. Value: {value}. is not a boolean"
    )


def check_refused(server: dict[str, Any], *, rebuild: bool = False) -> None:
    """What this cloud cannot do, refused instead of accepted and dropped: injected files,
    and image certificate validation (Glance signatures are not verified)."""
    if server.get("personality"):
        raise ApiError(
            400,
            "Invalid input for field/attribute personality: file injection is not supported "
            "by this cloud",
        )
    if server.get("trusted_image_certificates"):
        raise ApiError(
            400,
            "Image certificate validation is not enabled: trusted_image_certificates cannot be "
            "honoured (Glance image signatures are not verified by this cloud)",
        )
    if server.get("preserve_ephemeral"):
        raise ApiError(400, "Invalid input for field/attribute preserve_ephemeral: not supported")


def check_block_devices(server: dict[str, Any]) -> list[dict[str, Any]]:
    """block_device_mapping_v2's volume mappings (image, volume, snapshot or blank to a
    volume); the legacy block_device_mapping (v1) is refused."""
    from stowage.services.volumes import InvalidVolume
    from stowage.services.volumes.server_volumes import parse_block_devices

    if server.get("block_device_mapping"):
        raise ApiError(
            400,
            "block_device_mapping (v1) is not supported by this cloud: use block_device_mapping_v2",
        )
    try:
        devices = parse_block_devices(server.get("block_device_mapping_v2") or [])
    except InvalidVolume as exc:
        raise ApiError(400, exc.message) from None
    if int(server.get("max_count", 1) or 1) > 1 and any(d["source"] == "volume" for d in devices):
        raise ApiError(400, "Unable to launch multiple instances with a single configured volume.")
    return [dict(d) for d in devices]


def requested_host(ctx: Context, server: dict[str, Any]) -> str | None:
    """2.74's `host` / `hypervisor_hostname`: an admin's request to build on that host (the
    scheduler's filters still run; nothing else fits, so it is that host or no valid host)."""
    host = server.get("host")
    node = server.get("hypervisor_hostname")
    if host is None and node is None:
        return None
    if not ctx.is_admin:
        field = "host" if host is not None else "hypervisor_hostname"
        raise ApiError(
            403,
            f"Policy doesn't allow compute:servers:create:requested_destination to be "
            f"performed ({field}).",
        )
    for what, value in (("host", host), ("hypervisor_hostname", node)):
        if value is not None and (not isinstance(value, str) or not 1 <= len(value) <= 255):
            raise ApiError(400, f"Invalid input for field/attribute {what}. Value: {value}.")
    if host is not None and node is not None and host != node:
        # One hypervisor per host here: a node of another host matches nothing.
        raise ApiError(400, f"Compute host {host} with hypervisor {node} could not be found.")
    return str(host if host is not None else node)


def check_group(cloud: Cloud, ctx: Context, group_id: str | None) -> None:
    """A scheduler hint's group is looked up in the caller's project (Nova's default), so
    another project's group cannot be joined, and its existence is not told."""
    if group_id is None:
        return
    try:
        group = cloud.ledger.get_group(group_id)
    except NotFound:
        group = None
    if group is None or (group.project_id != ctx.project_id and not ctx.is_admin):
        raise ApiError(400, f"Instance group {group_id} could not be found.")


def check_nics(cloud: Cloud, ctx: Context, networks: Any, version: Version) -> Any:
    """The NICs asked for, checked now as the caller may use them (Nova's validate_networks):
    a network or port the caller cannot see is "not found", whether or not it exists.
    `auto` becomes the project's one available network (get-me-a-network)."""
    if networks is None:
        if version >= (2, 37):
            # Nova's 2.37 schema: "auto" or "none" must be said (the clients send it).
            raise ApiError(
                400, "Invalid input for field/attribute server: 'networks' is a required property"
            )
        # Before 2.37 `networks` may be left out: the server gets the available network, as
        # "auto" would.
        return _auto_network(cloud, ctx)
    if isinstance(networks, str) and version < (2, 37):
        raise ApiError(400, f"Invalid input for field/attribute networks. Value: {networks}.")
    if networks == "auto":
        return _auto_network(cloud, ctx)
    if not isinstance(networks, list):
        return networks
    for nic in networks:
        port_id, net_id = nic.get("port"), nic.get("uuid")
        if port_id:
            try:
                port = net.get_port(cloud, ctx, str(port_id))
            except StowageError:
                raise ApiError(400, f"Port id {port_id} could not be found.") from None
            if port.get("project_id") != ctx.project_id and not ctx.is_admin:
                raise ApiError(400, f"Port id {port_id} could not be found.")
            if port.get("device_id"):
                raise ApiError(
                    409, f"Port {port_id} is still in use by device {port['device_id']}."
                )
        elif net_id:
            try:
                network = net.get_network(cloud, ctx, str(net_id))
            except StowageError:
                raise ApiError(400, f"Network {net_id} could not be found.") from None
            if network.get("router:external") and not network.get("shared") and not ctx.is_admin:
                raise ApiError(
                    403, f"It is not allowed to create an interface on external network {net_id}"
                )
    return networks


def _auto_network(cloud: Cloud, ctx: Context) -> Any:
    """Nova's _get_available_networks: the project's own unshared networks and the shared
    ones. One is used; more are ambiguous (409); none cannot be auto-allocated here (400)."""
    available = [
        n
        for n in net.list_networks(cloud, ctx)
        if n.get("admin_state_up", True)
        and (
            bool(n.get("shared")) or (n.get("project_id") == ctx.project_id and not n.get("shared"))
        )
    ]
    if len(available) > 1:
        raise ApiError(
            409, "Multiple possible networks found, use a Network ID to be more specific."
        )
    if not available:
        # Nova's _auto_allocate_network: Neutron's auto-allocated topology of the project.
        try:
            topology = auto_allocate.get_auto_allocated_topology(cloud, ctx, ctx.project_id)
        except StowageError as exc:
            raise ApiError(
                400,
                f"Unable to automatically allocate a network for project {ctx.project_id}: "
                f"{exc.message}",
            ) from None
        return [{"uuid": topology["id"]}]
    return [{"uuid": available[0]["id"]}]


def hostname_of(body: dict[str, Any]) -> str:
    """The guest's hostname: as set (2.90), else Nova's sanitized display name."""
    given = body.get("hostname")
    if given:
        return str(given)
    return re.sub(r"[^a-z0-9-]", "-", str(body["name"]).lower())


def shown_host(cloud: Cloud, doc: Any) -> str | None:
    """Where the server is shown to run: while a resize or cold migration waits in
    VERIFY_RESIZE the guest runs on the destination, and Nova shows that host."""
    body = doc.body
    host = body.get("host")
    if body.get("status") == "VERIFY_RESIZE":
        for migration in cloud.objects.list("migration"):
            record = migration.body
            if record.get("instance_uuid") == doc.id and record.get("status") == "finished":
                host = record.get("dest_compute") or host
    return None if host is None else str(host)


def apply_common_fields(body: dict[str, Any], server: dict[str, Any], version: Version) -> None:
    """The fields update and rebuild share, checked and written into the instance body:
    access addresses, disk config and (2.90) the hostname."""
    for field, key, ip_version in (
        ("accessIPv4", "access_ipv4", 4),
        ("accessIPv6", "access_ipv6", 6),
    ):
        if field in server:
            value = server[field]
            if value:
                try:
                    parsed = ipaddress.ip_address(value)
                except (TypeError, ValueError):
                    parsed = None
                if parsed is None or parsed.version != ip_version:
                    raise ApiError(
                        400,
                        f"Invalid input for field/attribute {field}. Value: {value}. "
                        f"Not an IPv{ip_version} address",
                    )
            body[key] = value or ""
    if "OS-DCF:diskConfig" in server:
        body["disk_config"] = disk_config(server["OS-DCF:diskConfig"])
    if "hostname" in server:
        body["hostname"] = check_hostname(server["hostname"], version)


def rebuild_changes(
    cloud: Cloud, ctx: Context, current: dict[str, Any], args: dict[str, Any], version: Version
) -> dict[str, Any]:
    """What a rebuild sets beside the image and name, each field checked as Nova checks it."""
    from stowage.api.compute.keypairs import _doc_id as keypair_doc_id
    from stowage.api.compute.server_views import check_metadata

    changes: dict[str, Any] = {}
    apply_common_fields(changes, args, version)
    if "metadata" in args:
        changes["metadata"] = check_metadata(args["metadata"])
    if "description" in args:
        description = args["description"]
        if description is not None and (not isinstance(description, str) or len(description) > 255):
            raise ApiError(400, "Invalid input for field/attribute description.")
        changes["description"] = description
    if "key_name" in args:
        key_name = args["key_name"]
        if key_name is not None and (
            not isinstance(key_name, str)
            or cloud.objects.find("keypair", keypair_doc_id(ctx.user_id, key_name)) is None
        ):
            raise ApiError(400, "Invalid key_name provided.")
        changes["key_name"] = key_name
    if "user_data" in args:
        changes["user_data"] = check_user_data(args["user_data"])
    return changes


def locked_by(ctx: Context, body: dict[str, Any]) -> str:
    """Nova's instance.locked_by: "owner" when the server's project locks it, else "admin"."""
    return "owner" if body.get("project_id") == ctx.project_id else "admin"


def check_lock(ctx: Context, body: dict[str, Any], action: str) -> None:
    """Unlocking a lock someone else set (an admin's, for the owner) needs
    os-lock-server:unlock:unlock_override, which is admin-only."""
    if action != "unlock" or not body.get("locked") or ctx.is_admin:
        return
    if (body.get("locked_by") or "owner") != locked_by(ctx, body):
        raise ApiError(
            403,
            "Policy doesn't allow os_compute_api:os-lock-server:unlock:unlock_override to be "
            "performed.",
        )


def create_extras(server: dict[str, Any], version: Version) -> dict[str, Any]:
    """The create fields beside the scheduling ones, checked (or refused), as BuildRequest
    keywords: user data, hostname, access addresses and disk config."""
    check_refused(server)
    return {
        "block_devices": check_block_devices(server),
        "user_data": check_user_data(server.get("user_data")),
        "hostname": check_hostname(server["hostname"], version) if "hostname" in server else None,
        "access_ipv4": server.get("accessIPv4") or "",
        "access_ipv6": server.get("accessIPv6") or "",
        "disk_config": disk_config(server.get("OS-DCF:diskConfig")),
        "config_drive": check_config_drive(server.get("config_drive")),
    }


def pinned_host(
    cloud: Cloud, ctx: Context, server: dict[str, Any], force_host: str | None
) -> str | None:
    """The host a build is restricted to: an admin's zone:host, or 2.74's host."""
    from stowage.services.compute import instance_hosts

    wanted = requested_host(ctx, server)
    if wanted is None:
        return force_host
    if (force_host is not None and force_host != wanted) or wanted not in set(
        instance_hosts(cloud).values()
    ):
        raise ApiError(400, f"Compute host {wanted} could not be found.")
    return wanted


# The arguments each action's schema allows (Nova's additionalProperties: false), per version.
ACTION_FIELDS: dict[str, dict[str, tuple[Version, Version | None]]] = {
    "reboot": {"type": ((2, 1), None)},
    "resize": {"flavorRef": ((2, 1), None), "OS-DCF:diskConfig": ((2, 1), None)},
    "evacuate": {
        "host": ((2, 1), None),
        "adminPass": ((2, 1), None),
        "onSharedStorage": ((2, 1), (2, 13)),
        "force": ((2, 29), (2, 67)),
    },
    "os-migrateLive": {
        "host": ((2, 1), None),
        "block_migration": ((2, 1), None),
        "disk_over_commit": ((2, 1), (2, 24)),
        "force": ((2, 30), (2, 67)),
    },
    "migrate": {"host": ((2, 56), None)},
    "createImage": {"name": ((2, 1), None), "metadata": ((2, 1), None)},
    "createBackup": {
        "name": ((2, 1), None),
        "backup_type": ((2, 1), None),
        "rotation": ((2, 1), None),
        "metadata": ((2, 1), None),
    },
    "lock": {"locked_reason": ((2, 73), None)},
    "os-resetState": {"state": ((2, 1), None)},
    "addSecurityGroup": {"name": ((2, 1), None)},
    "removeSecurityGroup": {"name": ((2, 1), None)},
}


def check_action_args(action: str, args: Any, version: Version) -> None:
    """An action's arguments that its schema does not have at `version` are a 400 (Nova's),
    never read past; a `reboot` type is SOFT or HARD."""
    fields = ACTION_FIELDS.get(action)
    if fields is None or not isinstance(args, dict):
        return
    unknown = sorted(set(args) - allowed_fields(fields, version))
    if unknown:
        raise ApiError(
            400,
            f"Invalid input for field/attribute {action}. Value: Additional properties are "
            f"not allowed ({unknown[0]!r} was unexpected)",
        )
    if action == "reboot" and args.get("type") not in ("SOFT", "HARD", "soft", "hard"):
        raise ApiError(
            400,
            f"Invalid input for field/attribute type. Value: {args.get('type')}. "
            "'SOFT' or 'HARD' is required",
        )
