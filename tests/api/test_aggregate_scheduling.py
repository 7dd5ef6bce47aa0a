"""Host aggregate metadata reaches the scheduler: `aggregate_instance_extra_specs:` is honoured.

Through the real `openstack` CLI: `aggregate set --property` and `aggregate add/remove host`
change what the scheduler's (incrementally refreshed) view holds about the hosts at once.
"""

from __future__ import annotations

import uuid
from typing import Any

from tests.api.cloudproc import RunningCloud, boot_args


def try_boot(cloud: RunningCloud, name: str, flavor: str) -> dict[str, Any]:
    """Boot and wait; a build that ends in ERROR is returned, not failed on."""
    cloud.osc(*boot_args(name, flavor=flavor), check=False)
    shown: dict[str, Any] = cloud.osc_json("server", "show", name)
    return shown


def test_aggregate_metadata_steers_flavors_that_ask_for_it(cloud: RunningCloud) -> None:
    tag = uuid.uuid4().hex[:6]
    aggregate, flavor = f"agg-ssd-{tag}", f"fl-ssd-{tag}"
    cloud.osc("aggregate", "create", "--property", "ssd=true", aggregate)
    cloud.osc("aggregate", "add", "host", aggregate, "host2")
    shown = cloud.osc_json("aggregate", "show", aggregate)
    assert shown["hosts"] == ["host2"]
    cloud.osc(
        "flavor", "create", "--vcpus", "1", "--ram", "128", "--disk", "1",
        "--property", "aggregate_instance_extra_specs:ssd=true", flavor,
    )  # fmt: skip
    names = []
    try:
        for i in range(4):
            names.append(f"ssd-{tag}-{i}")
            server = try_boot(cloud, names[-1], flavor)
            assert server["status"] == "ACTIVE", server.get("fault")
            assert server["OS-EXT-SRV-ATTR:host"] == "host2"

        # The metadata changes: the next build finds no host, and says which filter refused.
        cloud.osc("aggregate", "set", "--property", "ssd=false", aggregate)
        names.append(f"ssd-{tag}-refused")
        refused = try_boot(cloud, names[-1], flavor)
        assert refused["status"] == "ERROR"
        fault = str(refused["fault"])
        assert "No valid host was found" in fault and "aggregate_extra_specs" in fault
        assert "ssd=true" in fault

        # Back to true: host2 takes it again; host2 leaves the aggregate: nowhere again.
        cloud.osc("aggregate", "set", "--property", "ssd=true", aggregate)
        names.append(f"ssd-{tag}-back")
        assert try_boot(cloud, names[-1], flavor)["OS-EXT-SRV-ATTR:host"] == "host2"
        cloud.osc("aggregate", "remove", "host", aggregate, "host2")
        names.append(f"ssd-{tag}-removed")
        removed = try_boot(cloud, names[-1], flavor)
        assert removed["status"] == "ERROR"
        assert "aggregate_extra_specs" in str(removed["fault"])

        # A flavor without the spec still lands anywhere.
        names.append(f"plain-{tag}")
        assert try_boot(cloud, names[-1], "m1.nano")["status"] == "ACTIVE"
    finally:
        if names:
            cloud.osc("server", "delete", *names, check=False)
        cloud.osc("aggregate", "remove", "host", aggregate, "host2", check=False)
        cloud.osc("aggregate", "delete", aggregate, check=False)
        cloud.osc("flavor", "delete", flavor, check=False)
