"""A `stowage up` started by the tests, and the real `openstack` CLI pointed at it."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import openstack.config
import pytest
from openstack.connection import Connection
from tests.api.cloudproc import RunningCloud, start_cloud, stop_cloud


@pytest.fixture(scope="session")
def cloud(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCloud]:
    """One cloud for the whole API session: tests create what they need with unique names."""
    running = start_cloud(tmp_path_factory.mktemp("cloud") / "state")
    try:
        yield running
    finally:
        stop_cloud(running)


@pytest.fixture(scope="session")
def sdk(cloud: RunningCloud) -> Iterator[Any]:
    """openstacksdk as the admin, in this process (a CLI call costs a process start)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=PendingDeprecationWarning, module="openstack")
        path = str(cloud.state_dir / "clouds.yaml")
        config = openstack.config.OpenStackConfig(config_files=[path])
        conn = Connection(config=config.get_one(cloud="stowage-admin"))
    yield conn
    conn.close()
