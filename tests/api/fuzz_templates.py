"""What the body of each route looks like when it is right: the fuzzer sends these as they are
and spoiled. A route without a template still gets junk bodies."""

from __future__ import annotations

import uuid
from collections.abc import Collection
from typing import Any

__all__ = ["image_patches", "server_actions", "templates"]


def templates(
    ids: dict[str, list[str]], routes: Collection[tuple[str, str]]
) -> dict[tuple[str, str], list[Any]]:
    """Plausible bodies per (method, path) of the live `routes`; the fuzzer sends them as they
    are and spoiled. Those above the compute block are of the routes stowage always had: a
    stale one fails test_the_fuzzer_sees_every_route; the others are kept only while live."""
    cirros = ids["cirros"][0]
    server = ids["compute:server_id"][0]
    project = ids["project"][0]
    user = ids["identity:user_id"][0]
    net = ids["networking:networks"][0]
    subnet = ids["networking:subnets"][0]
    sg = ids["networking:security-groups"][0]
    rp = ids["placement:rp_uuid"][0]
    group = ids["compute:group_id"][0]
    allocation = {
        "allocations": {rp: {"resources": {"VCPU": 1}}},
        "project_id": project,
        "user_id": user,
        "consumer_generation": None,
    }
    inventory: dict[str, Any] = {"total": 8, "reserved": 0, "min_unit": 1, "max_unit": 8}
    inventory |= {"step_size": 1, "allocation_ratio": 16.0}
    auth_password = {"user": {"name": "fuzz", "domain": {"id": "default"}, "password": "fuzz-pw"}}
    t: dict[tuple[str, str], list[Any]] = {
        # identity
        ("POST", "/identity/v3/auth/tokens"): [
            {
                "auth": {
                    "identity": {"methods": ["password"], "password": auth_password},
                    "scope": {"project": {"id": project}},
                }
            },
            {
                "auth": {
                    "identity": {"methods": ["token"], "token": {"id": "x"}},
                    "scope": {"domain": {"name": "Default"}},
                }
            },
            {
                "auth": {
                    "identity": {"methods": ["password"], "password": auth_password},
                    "scope": {"system": {"all": True}},
                }
            },
        ],
        ("POST", "/identity/v3/domains"): [{"domain": {"name": "d", "enabled": True}}],
        ("PATCH", "/identity/v3/domains/{domain_id}"): [{"domain": {"description": "x"}}],
        ("POST", "/identity/v3/projects"): [
            {
                "project": {
                    "name": "p",
                    "domain_id": "default",
                    "parent_id": project,
                    "enabled": True,
                    "tags": ["a"],
                    "is_domain": False,
                    "description": "",
                }
            }
        ],
        ("PATCH", "/identity/v3/projects/{project_id}"): [
            {"project": {"name": "fuzz", "enabled": True, "tags": ["b"]}}
        ],
        ("PUT", "/identity/v3/projects/{project_id}/tags"): [{"tags": ["a", "b"]}],
        ("POST", "/identity/v3/users"): [
            {
                "user": {
                    "name": "u",
                    "password": "p",
                    "domain_id": "default",
                    "default_project_id": project,
                    "enabled": True,
                    "email": "u@example.org",
                }
            }
        ],
        ("PATCH", "/identity/v3/users/{user_id}"): [
            {"user": {"email": "x@example.org", "enabled": True, "default_project_id": project}}
        ],
        ("POST", "/identity/v3/users/{user_id}/password"): [
            {"user": {"password": "fuzz-pw", "original_password": "fuzz-pw"}}
        ],
        ("POST", "/identity/v3/roles"): [{"role": {"name": "r", "description": "d"}}],
        ("PATCH", "/identity/v3/roles/{role_id}"): [{"role": {"description": "d"}}],
        # compute
        ("POST", "/compute/v2.1/servers"): [
            {
                "server": {
                    "name": "fz",
                    "flavorRef": "42",
                    "imageRef": cirros,
                    "networks": [{"uuid": net}],
                    "min_count": 1,
                    "max_count": 1,
                    "metadata": {"k": "v"},
                    "key_name": "fuzz-key",
                    "security_groups": [{"name": "default"}],
                    "availability_zone": "nova",
                    # No `tags` (2.52) or `description` (2.19): the base body is valid at the
                    # default microversion, so mutations of it reach the build.
                    "block_device_mapping_v2": [
                        {"boot_index": 0, "uuid": cirros, "source_type": "image"}
                    ],
                },
                "OS-SCH-HNT:scheduler_hints": {
                    "group": group,
                    "same_host": [server],
                    "different_host": server,
                },
            }
        ],
        ("PUT", "/compute/v2.1/servers/{server_id}"): [
            {"server": {"name": "fuzz-renamed", "description": "d"}}
        ],
        ("POST", "/compute/v2.1/servers/{server_id}/action"): server_actions(ids),
        ("POST", "/compute/v2.1/flavors"): [
            {
                "flavor": {
                    "name": "f",
                    "ram": 64,
                    "vcpus": 1,
                    "disk": 1,
                    "id": "fz",
                    "OS-FLV-EXT-DATA:ephemeral": 0,
                    "swap": 0,
                    "rxtx_factor": 1.0,
                    "os-flavor-access:is_public": True,
                    "description": "d",
                }
            }
        ],
        ("PUT", "/compute/v2.1/flavors/{flavor_id}"): [{"flavor": {"description": "d"}}],
        ("POST", "/compute/v2.1/flavors/{flavor_id}/action"): [
            {"addTenantAccess": {"tenant": project}},
            {"removeTenantAccess": {"tenant": project}},
        ],
        ("POST", "/compute/v2.1/flavors/{flavor_id}/os-extra_specs"): [
            {"extra_specs": {"hw:cpu_policy": "dedicated", "fuzz:k": "v"}}
        ],
        ("PUT", "/compute/v2.1/flavors/{flavor_id}/os-extra_specs/{key}"): [
            {"fuzz:k": "v"},
            {"hw:cpu_policy": "shared"},
        ],
        ("POST", "/compute/v2.1/os-keypairs"): [
            {"keypair": {"name": "k", "type": "ssh"}},
            {
                "keypair": {
                    "name": "k2",
                    "public_key": "ssh-rsa AAAAB3NzaC1yc2E fuzz",
                    "user_id": user,
                }
            },
        ],
        ("POST", "/compute/v2.1/os-server-groups"): [
            {"server_group": {"name": "g", "policies": ["affinity"]}},
            {
                "server_group": {
                    "name": "g",
                    "policy": "anti-affinity",
                    "rules": {"max_server_per_host": 2},
                }
            },
        ],
        ("PUT", "/compute/v2.1/os-services/{service_id}"): [
            {"status": "disabled", "disabled_reason": "fuzz"},
            {"status": "enabled"},
            {"forced_down": False},
        ],
        ("POST", "/compute/v2.1/os-aggregates"): [
            {"aggregate": {"name": "a", "availability_zone": "z"}}
        ],
        ("PUT", "/compute/v2.1/os-aggregates/{aggregate_id}"): [
            {"aggregate": {"name": "fuzz-agg", "availability_zone": None}}
        ],
        ("POST", "/compute/v2.1/os-aggregates/{aggregate_id}/action"): [
            {"add_host": {"host": "host1"}},
            {"remove_host": {"host": "host1"}},
            {"set_metadata": {"metadata": {"k": "v", "gone": None}}},
        ],
        ("POST", "/compute/v2.1/os-aggregates/{aggregate_id}/images"): [
            {"cache": [{"id": cirros}]}
        ],
        ("PUT", "/compute/v2.1/os-quota-sets/{project_id}"): [
            {"quota_set": {"instances": 10, "cores": 20, "ram": 51200, "force": True}}
        ],
        # image
        ("POST", "/image/v2/images"): [
            {
                "name": "i",
                "disk_format": "qcow2",
                "container_format": "bare",
                "visibility": "private",
                "min_disk": 0,
                "min_ram": 0,
                "tags": ["t"],
                "protected": False,
                "hw_rng_model": "virtio",
            }
        ],
        ("PATCH", "/image/v2/images/{image_id}"): image_patches(),
        # networking
        ("POST", "/networking/v2.0/networks"): [
            {
                "network": {
                    "name": "n",
                    "admin_state_up": True,
                    "shared": False,
                    "mtu": 1450,
                    "port_security_enabled": True,
                    "provider:network_type": "vxlan",
                }
            }
        ],
        ("PUT", "/networking/v2.0/networks/{id}"): [{"network": {"name": "fuzz-net", "mtu": 1400}}],
        ("POST", "/networking/v2.0/subnets"): [
            {
                "subnet": {
                    "network_id": net,
                    "ip_version": 4,
                    "cidr": "10.9.0.0/24",
                    "gateway_ip": "10.9.0.1",
                    "enable_dhcp": True,
                    "allocation_pools": [{"start": "10.9.0.10", "end": "10.9.0.20"}],
                    "dns_nameservers": ["8.8.8.8"],
                    "host_routes": [{"destination": "0.0.0.0/0", "nexthop": "10.9.0.1"}],
                }
            }
        ],
        ("PUT", "/networking/v2.0/subnets/{id}"): [
            {
                "subnet": {
                    "name": "s",
                    "allocation_pools": [{"start": "192.168.77.5", "end": "192.168.77.9"}],
                }
            }
        ],
        ("POST", "/networking/v2.0/ports"): [
            {
                "port": {
                    "network_id": net,
                    "name": "p",
                    "fixed_ips": [{"subnet_id": subnet, "ip_address": "192.168.77.50"}],
                    "security_groups": [sg],
                    "admin_state_up": True,
                    "mac_address": "fa:16:3e:00:00:01",
                    "binding:host_id": "host1",
                }
            }
        ],
        ("PUT", "/networking/v2.0/ports/{id}"): [
            {"port": {"name": "p", "fixed_ips": [{"subnet_id": subnet}], "device_id": server}}
        ],
        ("POST", "/networking/v2.0/security-groups"): [
            {"security_group": {"name": "s", "description": "d", "stateful": True}}
        ],
        ("PUT", "/networking/v2.0/security-groups/{id}"): [{"security_group": {"name": "s2"}}],
        ("POST", "/networking/v2.0/security-group-rules"): [
            {
                "security_group_rule": {
                    "security_group_id": sg,
                    "direction": "ingress",
                    "ethertype": "IPv4",
                    "protocol": "tcp",
                    "port_range_min": 80,
                    "port_range_max": 81,
                    "remote_ip_prefix": "0.0.0.0/0",
                }
            }
        ],
        # placement
        ("POST", "/placement/resource_providers"): [
            {"name": "r", "uuid": str(uuid.uuid4()), "parent_provider_uuid": rp}
        ],
        ("PUT", "/placement/resource_providers/{rp_uuid}"): [
            {"name": "fuzz-rp", "parent_provider_uuid": None}
        ],
        ("PUT", "/placement/resource_providers/{rp_uuid}/inventories"): [
            {"resource_provider_generation": 1, "inventories": {"VCPU": inventory}}
        ],
        ("POST", "/placement/resource_providers/{rp_uuid}/inventories"): [
            {"resource_class": "DISK_GB", **inventory}
        ],
        ("PUT", "/placement/resource_providers/{rp_uuid}/inventories/{rc}"): [
            {"resource_provider_generation": 1, **inventory}
        ],
        ("PUT", "/placement/resource_providers/{rp_uuid}/aggregates"): [
            {"aggregates": [str(uuid.uuid4())], "resource_provider_generation": 1},
            [str(uuid.uuid4())],
        ],
        ("PUT", "/placement/resource_providers/{rp_uuid}/traits"): [
            {"traits": ["CUSTOM_FUZZ"], "resource_provider_generation": 1}
        ],
        ("POST", "/placement/resource_classes"): [{"name": "CUSTOM_FZ"}],
        ("PUT", "/placement/allocations/{consumer_id}"): [
            allocation,
            {"allocations": [{"resource_provider": {"uuid": rp}, "resources": {"VCPU": 1}}]},
        ],
        ("POST", "/placement/allocations"): [{str(uuid.uuid4()): allocation}],
        ("POST", "/placement/reshaper"): [
            {
                "inventories": {
                    rp: {"resource_provider_generation": 1, "inventories": {"VCPU": inventory}}
                },
                "allocations": {str(uuid.uuid4()): allocation},
            }
        ],
    }
    compute = "/compute/v2.1"
    meta = [{"metadata": {"k": "v"}}]
    newer: dict[tuple[str, str], list[Any]] = {
        ("POST", f"{compute}/servers/{{server_id}}/metadata"): meta,
        ("PUT", f"{compute}/servers/{{server_id}}/metadata"): meta,
        ("PUT", f"{compute}/servers/{{server_id}}/metadata/{{key}}"): [{"meta": {"k": "v"}}],
        ("PUT", f"{compute}/servers/{{server_id}}/tags"): [{"tags": ["a", "b"]}],
        ("POST", f"{compute}/images/{{image_id}}/metadata"): meta,
        ("PUT", f"{compute}/images/{{image_id}}/metadata"): meta,
        ("PUT", f"{compute}/images/{{image_id}}/metadata/{{key}}"): [{"meta": {"k": "v"}}],
        ("PUT", f"{compute}/os-quota-class-sets/{{class_name}}"): [
            {"quota_class_set": {"instances": 10, "cores": 20, "ram": 51200}}
        ],
        ("POST", f"{compute}/os-security-groups"): [
            {"security_group": {"name": "s", "description": "d"}}
        ],
        ("PUT", f"{compute}/os-security-groups/{{group_id}}"): [
            {"security_group": {"name": "s", "description": "d"}}
        ],
        ("POST", f"{compute}/os-security-group-rules"): [
            {
                "security_group_rule": {
                    "parent_group_id": sg,
                    "ip_protocol": "tcp",
                    "from_port": 22,
                    "to_port": 22,
                    "cidr": "0.0.0.0/0",
                }
            }
        ],
        ("PUT", f"{compute}/os-hosts/{{host_name}}"): [
            {"status": "disable", "maintenance_mode": "enable"}
        ],
    }
    t |= {key: value for key, value in newer.items() if key in routes}
    for tagged in ("networks", "subnets", "ports", "security-groups"):
        t[("PUT", f"/networking/v2.0/{tagged}/{{id}}/tags")] = [{"tags": ["a", "b"]}]
    return t


def server_actions(ids: dict[str, list[str]]) -> list[Any]:
    """A plausible body for each server action nova has (and stowage may not)."""
    cirros = ids["cirros"][0]
    return [
        {"os-stop": None},
        {"os-start": None},
        {"reboot": {"type": "SOFT"}},
        {"reboot": {"type": "HARD"}},
        {"pause": None},
        {"unpause": None},
        {"suspend": None},
        {"resume": None},
        {"lock": {"locked_reason": "fuzz"}},
        {"unlock": None},
        {"os-resetState": {"state": "active"}},
        {"migrate": {"host": "host2"}},
        {"os-migrateLive": {"host": None, "block_migration": "auto"}},
        {"evacuate": {"host": "host2", "onSharedStorage": False}},
        {"resize": {"flavorRef": "fuzz-flavor", "OS-DCF:diskConfig": "AUTO"}},
        {"confirmResize": None},
        {"revertResize": None},
        {"createImage": {"name": "snap", "metadata": {"k": "v"}}},
        {"rebuild": {"imageRef": cirros, "name": "rebuilt", "metadata": {"k": "v"}}},
        {"addSecurityGroup": {"name": "default"}},
        {"removeSecurityGroup": {"name": "default"}},
        {"os-getConsoleOutput": {"length": 10}},
        {"shelve": None},
        {"unshelve": None},
        {"changePassword": {"adminPass": "x"}},
        {"trigger_crash_dump": None},
    ]


def image_patches() -> list[Any]:
    return [
        [{"op": "replace", "path": "/name", "value": "renamed"}],
        [{"op": "add", "path": "/hw_fuzz", "value": "x"}, {"op": "remove", "path": "/hw_fuzz"}],
        [{"op": "replace", "path": "/tags", "value": ["a"]}],
        [{"op": "add", "path": "/min_ram", "value": 64}],
        [{"op": "replace", "path": "/visibility", "value": "shared"}],
        [{"replace": "/name", "value": "old-style"}],
    ]
