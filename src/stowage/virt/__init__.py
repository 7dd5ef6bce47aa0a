"""Hypervisor drivers: the port the agent calls, a simulated hypervisor, later libvirt."""

from __future__ import annotations

from stowage.virt.driver import (
    Driver,
    DriverCrashed,
    DriverError,
    InstanceNotFound,
    InstanceState,
    RunningInstance,
)

__all__ = [
    "Driver",
    "DriverCrashed",
    "DriverError",
    "InstanceNotFound",
    "InstanceState",
    "RunningInstance",
]
