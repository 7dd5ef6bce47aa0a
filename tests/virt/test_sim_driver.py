"""The simulated driver implements the whole port: guests, console, pause/suspend, migration."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from stowage.virt.driver import (
    Driver,
    DriverError,
    Guest,
    InstanceNotFound,
    InstanceState,
    MigrationProgress,
    MigrationTarget,
)
from stowage.virt.sim import FaultKind, SimConfig, SimDriver


@pytest.fixture
def sims() -> Iterator[tuple[SimDriver, SimDriver]]:
    a, b = SimDriver(SimConfig(disk_bytes=4096)), SimDriver(SimConfig(disk_bytes=4096))
    yield a, b
    a.close()
    b.close()


def test_is_a_driver(sims: tuple[SimDriver, SimDriver]) -> None:
    assert isinstance(sims[0], Driver)


def test_shared_cpu_guest_console_and_pause(sims: tuple[SimDriver, SimDriver]) -> None:
    sim, _ = sims
    sim.spawn("vm", {}, [], 256, Guest(vcpus=2, memory_mb=256))
    assert sim.running()["vm"] == {"pins": {}, "state": InstanceState.RUNNING}
    assert sim.console_output("vm") == "sim: vm booted with 2 vCPUs\n"
    sim.pause("vm")
    assert sim.running()["vm"]["state"] is InstanceState.PAUSED
    with pytest.raises(DriverError) as caught:
        sim.suspend("vm")
    assert caught.value.code == "virt.suspend.bad_state"
    sim.unpause("vm")
    sim.suspend("vm")
    assert sim.running()["vm"]["state"] is InstanceState.SUSPENDED
    sim.resume("vm")
    assert sim.running()["vm"]["state"] is InstanceState.RUNNING
    sim.reboot("vm")
    assert sim.console_output("vm", 1) == "sim: vm booted with 2 vCPUs\n"
    assert sim.console_output("vm").count("booted") == 2
    with pytest.raises(InstanceNotFound):
        sim.console_output("nope")


def test_guest_needs_vcpus(sims: tuple[SimDriver, SimDriver]) -> None:
    with pytest.raises(DriverError) as caught:
        sims[0].spawn("vm", {}, [], 256)
    assert caught.value.code == "virt.guest.no_vcpus"
    with pytest.raises(DriverError) as caught:
        sims[0].spawn("vm", {3: 1}, [0], 256, Guest(vcpus=2, memory_mb=256))
    assert caught.value.code == "virt.guest.bad_vcpus"


def test_live_migration_phases(sims: tuple[SimDriver, SimDriver]) -> None:
    src, dst = sims
    src.spawn("vm", {0: 1}, [0], 128)
    dest_guest = Guest(vcpus=1, memory_mb=128, pins={0: 5}, cells=(1,))
    handle = dst.prepare_migration("vm", dest_guest)
    assert dst.running()["vm"] == {"pins": {0: 5}, "state": InstanceState.PAUSED}
    seen: list[MigrationProgress] = []
    src.migrate("vm", MigrationTarget("dst", dest_guest, handle), seen.append)
    assert seen == [MigrationProgress(128 << 20, 128 << 20, 0)]
    assert "vm" not in src.running()
    dst.finish_migration("vm")
    assert dst.running()["vm"] == {"pins": {0: 5}, "state": InstanceState.RUNNING}
    with pytest.raises(DriverError) as caught:
        dst.rollback_migration("vm")  # it runs there now: not an incoming guest
    assert caught.value.code == "virt.migrate.not_incoming"


def test_failed_migration_rolls_back_and_the_source_keeps_running(
    sims: tuple[SimDriver, SimDriver],
) -> None:
    src, dst = sims
    src.spawn("vm", {0: 1}, [0], 128)
    guest = Guest(vcpus=1, memory_mb=128, pins={0: 2}, cells=(0,))
    handle = dst.prepare_migration("vm", guest)
    src.inject("migrate", "transfer", FaultKind.FAIL)
    with pytest.raises(DriverError):
        src.migrate("vm", MigrationTarget("dst", guest, handle))
    assert src.running()["vm"] == {"pins": {0: 1}, "state": InstanceState.RUNNING}
    assert src.migration_progress("vm") is None
    dst.rollback_migration("vm")
    assert "vm" not in dst.running()
    dst.rollback_migration("vm")  # idempotent
    with pytest.raises(DriverError) as caught:
        src.abort_migration("vm")
    assert caught.value.code == "virt.migrate.no_job"


def test_the_serial_console_shows_the_log_echoes_and_hangs_up(tmp_path: Path) -> None:
    """A session gets the console so far, the echo of what is typed (each typed line joins
    the log), the guest's new lines; a newer session or a stopped guest hangs it up."""
    driver = SimDriver(disk_dir=tmp_path)
    driver.spawn("vm-s", {0: 1}, [0], 128)
    said: list[bytes] = []
    session = driver.open_serial_console("vm-s", said.append)
    assert said == [b"sim: vm-s booted with 1 vCPUs\n"]
    session.write(b"ls\x7fs -l\r")
    assert b"".join(said[1:]) == b"ls\b \bs -l\r\n"
    assert driver.console_output("vm-s").splitlines()[-1] == "ls -l"
    later: list[bytes] = []
    driver.open_serial_console("vm-s", later.append)
    assert said[-1] == b""  # the older session was hung up
    session.write(b"ignored\r")
    assert "ignored" not in driver.console_output("vm-s")
    driver.power_off("vm-s")
    assert later[-1] == b""
    with pytest.raises(DriverError) as caught:
        driver.open_serial_console("vm-s", later.append)
    assert caught.value.code == "virt.console.not_running"
