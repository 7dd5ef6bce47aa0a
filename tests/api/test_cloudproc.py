"""The tests' own `stowage up` starter: a port taken between its choice and the bind (by
another test's process, as seen in CI) starts the cloud again on another port."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from tests.api import cloudproc


def test_a_cloud_whose_port_was_taken_starts_on_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = int(taken.getsockname()[1])
        chosen = [busy]
        real = cloudproc.free_port
        monkeypatch.setattr(cloudproc, "free_port", lambda: chosen.pop() if chosen else real())
        cloud = cloudproc.start_cloud(tmp_path / "state")
        try:
            assert not chosen  # the taken port was tried first
            assert cloud.base_url != f"http://127.0.0.1:{busy}"
        finally:
            cloudproc.stop_cloud(cloud)
