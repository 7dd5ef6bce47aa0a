"""The tests here share the one RabbitMQ broker, and one of them restarts it: across xdist
workers they take turns, through a lock file in the run's common temporary directory."""

from __future__ import annotations

import fcntl
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def one_broker_user_at_a_time(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    # Under xdist each worker's base temp is <run>/popen-gwN: the parent is the whole run's.
    lock_path = tmp_path_factory.getbasetemp().parent / "stowage-rabbitmq.lock"
    with lock_path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
