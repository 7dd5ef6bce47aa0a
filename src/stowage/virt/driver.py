"""The hypervisor driver port: blocking calls that the agent runs in its executors."""

from __future__ import annotations

from collections.abc import Iterator
from enum import StrEnum
from typing import Protocol, TypedDict, runtime_checkable

from stowage.domain.errors import StowageError

__all__ = [
    "Driver",
    "DriverCrashed",
    "DriverError",
    "InstanceNotFound",
    "InstanceState",
    "RunningInstance",
]


class InstanceState(StrEnum):
    """What the hypervisor says an instance is doing."""

    RUNNING = "running"
    SHUTOFF = "shutoff"


class RunningInstance(TypedDict):
    """One row of `Driver.running()`: guest vCPU -> host CPU pins, and the state."""

    pins: dict[int, int]
    state: InstanceState


class DriverError(StowageError):
    """An operation failed in an orderly way; the agent reports it as an error result."""

    code = "virt.driver.failed"


class InstanceNotFound(DriverError):
    """The hypervisor does not know the instance."""

    code = "virt.instance.not_found"


class DriverCrashed(Exception):
    """The hypervisor connection died mid-operation; the outcome of the step is unknown.

    Deliberately not a `DriverError`: an error result says "this did not happen", a crash
    says "we do not know", and the caller must reconcile rather than retry blindly.
    """


@runtime_checkable
class Driver(Protocol):
    """A hypervisor on one host.

    Every method may block (file IO, libvirt, subprocess): the agent calls them from a
    bounded executor, never on its event loop. Methods are called from several threads at
    once, so implementations guard their own state.
    """

    def spawn(
        self, instance_id: str, pins: dict[int, int], cells: list[int], memory_mb: int
    ) -> None:
        """Create the instance's disk, define it with these pins and NUMA cells, start it."""
        ...

    def destroy(self, instance_id: str) -> None:
        """Stop the instance, undefine it and delete its disk."""
        ...

    def reboot(self, instance_id: str) -> None:
        """Stop and start the instance."""
        ...

    def power_off(self, instance_id: str) -> None:
        """Stop the instance, keeping its definition and disk."""
        ...

    def power_on(self, instance_id: str) -> None:
        """Start a stopped instance."""
        ...

    def running(self) -> dict[str, RunningInstance]:
        """Every instance the hypervisor knows, by instance id."""
        ...

    def read_disk(self, instance_id: str, chunk_bytes: int) -> Iterator[bytes]:
        """The instance's disk data in chunks of at most `chunk_bytes`, for snapshots.

        Each `next()` may block on the disk; the caller closes the iterator when done.
        """
        ...
