"""The networks a fresh cloud starts with."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from stowage.services.networks.common import _As, _bodies
from stowage.services.networks.network import create_network
from stowage.services.networks.subnet import create_subnet

if TYPE_CHECKING:
    from stowage.services.cloud import Cloud

# -- bootstrap --------------------------------------------------------------------------------


def bootstrap_networks(cloud: Cloud, projects: Mapping[str, str]) -> None:
    """devstack's networks: a shared "private" 10.0.0.0/24 of project demo and an external
    "public" 172.24.4.0/24 of admin; nothing is created twice."""
    existing = {n.get("name") for n in _bodies(cloud, "network")}
    if "private" not in existing:
        demo = _As(projects["demo"], True)
        net = create_network(cloud, demo, {"name": "private", "shared": True})
        create_subnet(
            cloud,
            demo,
            {
                "name": "private-subnet",
                "network_id": net["id"],
                "ip_version": 4,
                "cidr": "10.0.0.0/24",
                "dns_nameservers": [],
            },
        )
    if "public" not in existing:
        admin = _As(projects["admin"], True)
        net = create_network(
            cloud,
            admin,
            {
                "name": "public",
                "router:external": True,
                "provider:network_type": "flat",
                "provider:physical_network": "public",
            },
        )
        create_subnet(
            cloud,
            admin,
            {
                "name": "public-subnet",
                "network_id": net["id"],
                "ip_version": 4,
                "cidr": "172.24.4.0/24",
                "enable_dhcp": False,
            },
        )
