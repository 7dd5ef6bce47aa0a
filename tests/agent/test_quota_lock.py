"""The project's quota lock on PostgreSQL (issue 12): creates with nothing to count hold it
shared and run side by side; whoever counts (a limited create, a quota update) holds it
exclusively, waits for them, and counts what they made."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.agent.test_use_cases import instance_count, open_cloud, request

from stowage.domain.errors import InvalidSpec
from stowage.services import quotas
from stowage.services.cloud import Cloud
from stowage.services.compute import build_servers

pytestmark = pytest.mark.postgres

UNLIMITED = {"instances": -1, "cores": -1, "ram": -1}


@pytest.fixture
def cloud(tmp_path: Path) -> Iterator[Cloud]:
    from tests.conftest import pg_schema_url

    for url in pg_schema_url():
        made = open_cloud(url, tmp_path / "state")
        try:
            yield made
        finally:
            made.ledger.close()


def _project(cloud: Cloud, limits: dict[str, int]) -> str:
    # Advisory locks are the database's, not the schema's: a project of this test alone.
    project = "p-" + uuid.uuid4().hex[:10]
    cloud.objects.create("quota", project, limits)
    return project


class _OpenCreate:
    """A create of one server in `project` whose transaction stays open (holding the
    project's quota lock as the create took it) until `commit()`."""

    def __init__(self, cloud: Cloud, project: str) -> None:
        self._holding = threading.Event()
        self._commit = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(cloud, project), daemon=True)
        self._thread.start()
        assert self._holding.wait(20), "the first create did not get as far as its commit"

    def _run(self, cloud: Cloud, project: str) -> None:
        with cloud.objects.writing():
            build_servers(cloud, request(1, project=project), "req-open")
            self._holding.set()
            self._commit.wait(60)

    def commit(self) -> None:
        self._commit.set()
        self._thread.join(30)
        assert not self._thread.is_alive()


def _started(work: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(work())
        except Exception as exc:  # the outcome the test reads
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def test_creates_of_a_project_without_limits_do_not_wait_for_each_other(cloud: Cloud) -> None:
    """Before the fix every create took the lock exclusively: `bench/api.py --production`
    found PostgreSQL sessions waiting on it in 666 of 1,170 samples, and the second create
    here waited for the first's commit."""
    project = _project(cloud, UNLIMITED)
    first = _OpenCreate(cloud, project)
    try:
        second, outcome = _started(
            lambda: build_servers(cloud, request(2, project=project), "req-second")
        )
        second.join(15)
        assert not second.is_alive(), "the second create waited for the first one's commit"
        assert [len(docs) for docs in outcome] == [2]
    finally:
        first.commit()
    assert instance_count(cloud, project) == 3


def _behind_an_open_create(
    cloud: Cloud, project: str, work: Callable[[], Any], limit: dict[str, int] | None = None
) -> list[Any]:
    """`work`'s outcome, started while a create of `project` holds its transaction open (and
    after `limit` is set): it must still wait after a second, and end once the create commits."""
    first = _OpenCreate(cloud, project)
    try:
        if limit is not None:
            cloud.objects.update("quota", project, limit)
        waiter, outcome = _started(work)
        waiter.join(1.0)
        assert waiter.is_alive(), "it went ahead of an open create"
    finally:
        first.commit()
    waiter.join(15)
    assert not waiter.is_alive()
    return outcome


def test_a_limited_create_waits_for_the_creates_holding_the_lock_and_counts_them(
    cloud: Cloud,
) -> None:
    project = _project(cloud, UNLIMITED)
    # The limit applies once the first create is open: the next create counts, so it waits.
    outcome = _behind_an_open_create(
        cloud,
        project,
        lambda: build_servers(cloud, request(5, project=project), "req-second"),
        limit={"instances": 3},
    )
    assert [len(docs) for docs in outcome] == [2]  # 3 allowed, 1 made by the first
    assert instance_count(cloud, project) == 3


def test_a_quota_update_waits_for_the_creates_holding_the_lock_and_counts_them(
    cloud: Cloud,
) -> None:
    project = _project(cloud, UNLIMITED)
    outcome = _behind_an_open_create(
        cloud,
        project,
        lambda: quotas.set_quota(cloud, project, None, {"instances": 0}, force=False),
    )
    assert len(outcome) == 1 and isinstance(outcome[0], InvalidSpec)
    assert "already used and reserved 1" in str(outcome[0])


def test_a_limit_set_between_a_creates_first_read_and_its_lock_is_counted(
    cloud: Cloud, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The create read no limit, then one was set before it took the lock shared: it starts
    again, counting, under the lock held exclusively."""
    project = _project(cloud, UNLIMITED)
    build_servers(cloud, request(1, project=project), "req-one")
    taken: list[bool] = []
    lock = quotas.lock_project

    def set_first(conn: Any, project_id: str, *, shared: bool = False) -> None:
        if threading.current_thread() is threading.main_thread():  # the create's
            taken.append(shared)
            if len(taken) == 1:  # another client sets the limit now, in its own transaction
                setter, outcome = _started(
                    lambda: quotas.set_quota(cloud, project, None, {"instances": 2}, force=False)
                )
                setter.join(15)
                assert outcome == [None]
        lock(conn, project_id, shared=shared)

    monkeypatch.setattr(quotas, "lock_project", set_first)
    docs = build_servers(cloud, request(5, project=project), "req-five")
    assert taken == [True, False]  # shared, then (counting) exclusively
    assert len(docs) == 1
    assert instance_count(cloud, project) == 2
