"""Block storage use cases on a real ledger (SQLite and PostgreSQL): the intent in the
document survives a crash and is driven to its end; claims and quotas commit with it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.agent.test_use_cases import Crash, crash_at_commit, open_cloud

from stowage.domain.errors import NotFound
from stowage.ledger import audit
from stowage.ledger.db import READONLY
from stowage.ledger.storage import pool_usage
from stowage.services.caller import SystemCaller
from stowage.services.cloud import Cloud
from stowage.services.volumes import (
    InvalidVolume,
    VolumeQuotaExceeded,
    attach,
    register_pool,
    volumes,
)


class Caller(SystemCaller):
    @property
    def user_id(self) -> str:
        return "u"


ME = Caller("p", False)


@pytest.fixture(name="cloud")
def volume_cloud(db_url: str, tmp_path: Path) -> Iterator[Cloud]:
    """A cloud with a 10 GB volume pool (tests/agent/test_one_transaction_paths.py too)."""
    made = open_cloud(db_url, tmp_path / "state", volume_pool_gb=10)
    register_pool(made)
    yield made
    made.ledger.close()


def used_gb(cloud: Cloud) -> int:
    with cloud.ledger.engine.connect().execution_options(**READONLY) as conn:
        return sum(p.used_gb for p in pool_usage(conn))


def test_a_create_left_creating_by_a_crash_is_driven_on_resume(cloud: Cloud) -> None:
    doc = volumes.create_volume(cloud, ME, {"size": 2, "name": "v"})
    assert doc.body["status"] == "creating" and used_gb(cloud) == 2
    # The process died before its volume worker ran: a new one resumes the intent.
    assert volumes.resume(cloud) == 1
    assert cloud.objects.get("volume", doc.id).body["status"] == "available"
    assert volumes.backend_of(cloud).exists(doc.id)
    assert volumes.resume(cloud) == 0


def test_a_delete_cut_at_its_last_commit_finishes_on_resume(cloud: Cloud) -> None:
    doc = volumes.create_volume(cloud, ME, {"size": 3})
    volumes.drive(cloud, "volume", doc.id)
    volumes.delete_volume(cloud, ME, doc.id)
    with pytest.raises(Crash), crash_at_commit(cloud.ledger.engine, 1):
        volumes.drive(cloud, "volume", doc.id)  # the file goes; the commit never lands
    assert cloud.objects.get("volume", doc.id).body["status"] == "deleting"
    assert used_gb(cloud) == 3
    volumes.resume(cloud)
    with pytest.raises(NotFound):
        volumes.get_volume(cloud, ME, doc.id)
    assert used_gb(cloud) == 0
    assert audit(cloud.ledger) == []


def test_the_pool_and_the_quota_refuse_in_the_creating_commit(cloud: Cloud) -> None:
    big = volumes.create_volume(cloud, ME, {"size": 11})
    assert big.body["status"] == "error" and used_gb(cloud) == 0  # no valid backend
    cloud.objects.create("volume_quota", "p", {"gigabytes": 12})
    volumes.create_volume(cloud, ME, {"size": 1})
    with pytest.raises(VolumeQuotaExceeded):
        volumes.create_volume(cloud, ME, {"size": 1})  # 11 + 1 + 1 > 12 gigabytes
    assert used_gb(cloud) == 1


def test_one_of_two_reserves_of_a_volume_wins(cloud: Cloud) -> None:
    doc = volumes.create_volume(cloud, ME, {"size": 1})
    volumes.drive(cloud, "volume", doc.id)
    attach.reserve(cloud, ME, doc.id)
    with pytest.raises(InvalidVolume):
        attach.reserve(cloud, ME, doc.id)
    with pytest.raises(InvalidVolume):
        volumes.delete_volume(cloud, ME, doc.id)
