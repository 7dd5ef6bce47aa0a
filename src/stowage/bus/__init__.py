"""Transports between services and agents: in-process and RabbitMQ (imported on demand)."""

from stowage.bus.base import (
    BusClosed,
    BusError,
    BusTimeout,
    Handler,
    RemoteError,
    ReplyCache,
    Transport,
)
from stowage.bus.inproc import InProcTransport

__all__ = [
    "BusClosed",
    "BusError",
    "BusTimeout",
    "Handler",
    "InProcTransport",
    "RemoteError",
    "ReplyCache",
    "Transport",
]
