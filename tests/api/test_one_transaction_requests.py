"""Requests whose write transaction reads the ledger, in a cloud served from this process
(with the suite's nesting guard on): before, each read took a second connection while the
write's was open, which the guard refuses (a 500) and which can wait on it for good."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.api.inprocess import InProcessCloud, in_process_cloud


@pytest.fixture(scope="module")
def cloud(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessCloud]:
    with in_process_cloud(Path(tmp_path_factory.mktemp("one-transaction"))) as running:
        yield running


def test_an_aggregates_host_changes_and_their_refusals(cloud: InProcessCloud) -> None:
    made = cloud.request(
        "POST",
        "/compute/v2.1/os-aggregates",
        json={"aggregate": {"name": "agg-one", "availability_zone": "zone-one"}},
    )
    assert made.status_code == 200, made.text
    action = f"/compute/v2.1/os-aggregates/{made.json()['aggregate']['id']}/action"
    # The zone check lists the other aggregates inside the add's transaction.
    added = cloud.request("POST", action, json={"add_host": {"host": "host1"}})
    assert added.status_code == 200, added.text
    assert added.json()["aggregate"]["hosts"] == ["host1"]
    # A host it does not hold: whether the host exists is read once the change has ended.
    absent = cloud.request("POST", action, json={"remove_host": {"host": "host2"}})
    assert absent.status_code == 404, absent.text
    assert "Cannot remove host host2 in aggregate" in absent.text
    unknown = cloud.request("POST", action, json={"remove_host": {"host": "no-such-host"}})
    assert unknown.status_code == 404, unknown.text
    assert "Compute host no-such-host could not be found." in unknown.text
    removed = cloud.request("POST", action, json={"remove_host": {"host": "host1"}})
    assert removed.status_code == 200, removed.text
    assert removed.json()["aggregate"]["hosts"] == []


def test_a_servers_metadata_change_checks_the_quota_in_its_transaction(
    cloud: InProcessCloud,
) -> None:
    body = cloud.tiny_server("with-metadata")
    created = cloud.request("POST", "/compute/v2.1/servers", json=body)
    assert created.status_code == 202, created.text
    path = f"/compute/v2.1/servers/{created.json()['server']['id']}/metadata"
    merged = cloud.request("POST", path, json={"metadata": {"a": "1"}})
    assert merged.status_code == 200, merged.text
    assert merged.json() == {"metadata": {"a": "1"}}
    assert cloud.request("GET", path).json() == {"metadata": {"a": "1"}}
