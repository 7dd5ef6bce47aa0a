"""The invariant checkers fail when their invariant is broken (a checker that cannot fail
proves nothing)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from stowage.simulation import checks
from stowage.simulation.loop import VirtualClock
from stowage.simulation.world import QUOTA_INSTANCES, _config, _open, _sqlite_state
from stowage.virt.sim import SimConfig, SimDriver


@pytest.fixture
def subject(tmp_path: Path) -> Iterator[checks.Subject]:
    state, fixture = _sqlite_state(3)
    cloud = _open(f"sqlite:///{state / 'ledger.db'}", _config(state, 3), VirtualClock())
    drivers = {
        h: SimDriver(SimConfig(disk_bytes=16), disk_dir=tmp_path / h)
        for h in ("host1", "host2", "host3")
    }
    yield checks.Subject(cloud, drivers, quotas={fixture.demo: {"instances": QUOTA_INSTANCES}})
    cloud.ledger.engine.dispose()
    shutil.rmtree(state.parent, ignore_errors=True)


def _instance(s: checks.Subject, iid: str, **body: object) -> None:
    project = next(iter(s.quotas))
    doc = {"id": iid, "name": iid, "project_id": project, "flavor": {"vcpus": 1, "ram": 512}}
    s.cloud.objects.create("instance", iid, {**doc, **body}, project_id=project)


def test_a_fresh_cloud_passes_every_check(subject: checks.Subject) -> None:
    assert checks.check_all(subject) == []


def test_stray_and_double_pinned_guests_are_found(subject: checks.Subject) -> None:
    subject.drivers["host1"].adopt("stray-a", {0: 2})
    subject.drivers["host1"].adopt("stray-b", {0: 2})
    found = {v.check for v in checks.check_all(subject)}
    assert {"hypervisor.pcpu_shared", "hypervisor.unplaced_guest"} <= found


def test_quota_stuck_instances_and_missing_claims_are_found(subject: checks.Subject) -> None:
    for n in range(QUOTA_INSTANCES + 1):
        _instance(subject, f"i{n}", status="ACTIVE", task_state=None, host=None)
    _instance(subject, "moving", status="MIGRATING", task_state="migrating", host="host2")
    subject.cloud.operations.enqueue("build", "i0", "host1", step="spawn")
    found = {v.check for v in checks.check_all(subject)}
    assert {
        "quota.exceeded",
        "instance.stuck",
        "instance.unclaimed",
        "hypervisor.missing_guest",
        "operation.open",
    } <= found


def test_an_unfinished_migration_is_found(subject: checks.Subject) -> None:
    subject.cloud.objects.create(
        "migration", "m1", {"instance_uuid": "i0", "status": "pre-migrating"}
    )
    subject.errors.append("request #1: error KeyError")
    found = {v.check for v in checks.check_all(subject)}
    assert {"migration.open", "api.unexpected_error"} <= found


def test_an_image_nothing_fills_and_a_server_without_its_guest_are_found(
    subject: checks.Subject,
) -> None:
    subject.cloud.objects.create("image", "snap", {"name": "snap", "status": "saving"})
    _instance(subject, "gone", status="ACTIVE", task_state=None, host="host1", power_state=1)
    found = {v.check for v in checks.check_all(subject)}
    assert {"image.stuck", "server.running_without_guest", "hypervisor.missing_guest"} <= found


def test_a_guest_the_reconciler_recorded_as_vanished_is_no_violation(
    subject: checks.Subject,
) -> None:
    fault = {"error_code": "reconcile.missing_instance", "code": 500, "message": "gone"}
    _instance(subject, "gone", status="SHUTOFF", host="host1", power_state=0, fault=fault)
    found = {v.check for v in checks.check_all(subject)}
    assert not found & {"server.running_without_guest", "hypervisor.missing_guest"}
