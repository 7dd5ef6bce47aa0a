"""openstacksdk pointed at a test cloud, as automation (Terraform, CI) would use it alone."""

from __future__ import annotations

from typing import Any

import openstack
import pytest
from openstack.connection import Connection
from tests.api.cloudproc import RunningCloud

__all__ = ["SDK_WARNINGS", "connect"]

# openstacksdk 4.22 warns about its own deprecations from inside itself (InfluxDB support
# whenever it builds a cloud region, configured or not; a `service_type` its own proxies
# pass): not ours to fix, and not about what the cloud answers.
SDK_WARNINGS = pytest.mark.filterwarnings(
    "ignore::openstack.warnings.RemovedInSDK60Warning",
    "ignore::openstack.warnings.RemovedInSDK50Warning",
)


def connect(cloud: RunningCloud, **auth: Any) -> Connection:
    """A connection with `auth` (password by default: the admin) and nothing from clouds.yaml."""
    auth_type = auth.pop("auth_type", "password")
    if auth_type == "password":
        auth = {
            "username": "admin",
            "password": "stowage-admin",
            "project_name": "admin",
            "user_domain_name": "Default",
            "project_domain_name": "Default",
            **auth,
        }
    return openstack.connect(
        auth_type=auth_type,
        auth={"auth_url": f"{cloud.base_url}/identity/v3", **auth},
        region_name="RegionOne",
        load_yaml_config=False,
        load_envvars=False,
    )
