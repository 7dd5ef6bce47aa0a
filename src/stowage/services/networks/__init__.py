"""Networks, subnets, ports and security groups as documents, with IP and MAC claims.

Each resource is a document of its own kind ("network", "subnet", "port", "security_group",
"security_group_rule") whose body is what neutron returns, less the fields computed when it
is read (a network's `subnets`, a group's `security_group_rules`) and less the admin-only
fields a member does not see. The document's project_id column is the owning project.

Addresses are claimed with documents whose id is derived from what they claim, so the store's
primary key refuses a second claim on the same address:
  "ip_allocation"  id "<subnet id>/<address>",  name = the subnet id
  "mac_allocation" id uuid5(network id, MAC),    name = the network id
A port is written after its claims and its claims are released after it is deleted.
"""

from __future__ import annotations

from stowage.services.caller import Caller
from stowage.services.networks.addresses import ports_in_one_commit
from stowage.services.networks.bootstrap import bootstrap_networks
from stowage.services.networks.common import (
    AVAILABILITY_ZONE,
    MTU,
    NetworkError,
    NeutronBadRequest,
    NeutronConflict,
    NeutronForbidden,
    NeutronNotFound,
    stamped,
)
from stowage.services.networks.devices import (
    addresses_of,
    allocate_port,
    attach_port,
    made_by,
    ports_of,
    refresh_server_addresses,
    release_port,
    release_ports,
)
from stowage.services.networks.network import (
    create_network,
    delete_network,
    get_network,
    list_networks,
    update_network,
)
from stowage.services.networks.port import (
    create_port,
    delete_port,
    get_port,
    list_ports,
    update_port,
)
from stowage.services.networks.security_groups import (
    create_security_group,
    create_security_group_rule,
    delete_security_group,
    delete_security_group_rule,
    ensure_default_security_group,
    get_security_group,
    get_security_group_rule,
    list_security_group_rules,
    list_security_groups,
    update_security_group,
)
from stowage.services.networks.subnet import (
    create_subnet,
    delete_subnet,
    get_subnet,
    list_subnets,
    update_subnet,
)
from stowage.services.networks.tags import set_tags, tags_of

__all__ = [
    "AVAILABILITY_ZONE",
    "MTU",
    "Caller",
    "NetworkError",
    "NeutronBadRequest",
    "NeutronConflict",
    "NeutronForbidden",
    "NeutronNotFound",
    "addresses_of",
    "allocate_port",
    "attach_port",
    "bootstrap_networks",
    "create_network",
    "create_port",
    "create_security_group",
    "create_security_group_rule",
    "create_subnet",
    "delete_network",
    "delete_port",
    "delete_security_group",
    "delete_security_group_rule",
    "delete_subnet",
    "ensure_default_security_group",
    "get_network",
    "get_port",
    "get_security_group",
    "get_security_group_rule",
    "get_subnet",
    "list_networks",
    "list_ports",
    "list_security_group_rules",
    "list_security_groups",
    "list_subnets",
    "made_by",
    "ports_in_one_commit",
    "ports_of",
    "refresh_server_addresses",
    "release_port",
    "release_ports",
    "set_tags",
    "stamped",
    "tags_of",
    "update_network",
    "update_port",
    "update_security_group",
    "update_subnet",
]
