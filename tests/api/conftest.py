"""A `stowage up` started by the tests, and the real `openstack` CLI pointed at it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tests.api.cloudproc import RunningCloud, start_cloud, stop_cloud


@pytest.fixture(scope="session")
def cloud(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCloud]:
    """One cloud for the whole API session: tests create what they need with unique names."""
    running = start_cloud(tmp_path_factory.mktemp("cloud") / "state")
    try:
        yield running
    finally:
        stop_cloud(running)
