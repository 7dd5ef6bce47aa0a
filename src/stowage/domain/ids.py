"""The identifiers Stowage makes for what it creates in bulk: servers, moves, operations,
requests.

Each is a UUID of version 7 (RFC 9562): the first 48 bits are the Unix time in milliseconds
of its making, then the version, 74 random bits and the variant. It reads as any other UUID
(the clients and Tempest only check the form), and it sorts by the time it was made, so the
rows keyed or indexed by it (a server's claim, its documents, its operation) go in at the end
of their B-trees instead of at a random page each: at a million servers a random key costs a
page written per claim in each index that holds it.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Callable, Iterator

_MS = (1 << 48) - 1
_RAND_A = (1 << 12) - 1
_RAND_B = (1 << 62) - 1


def time_ordered(ms: int, rand: int) -> uuid.UUID:
    """The version 7 UUID of Unix time `ms` (milliseconds) and the low 74 bits of `rand`."""
    value = (
        (ms & _MS) << 80 | 0x7 << 76 | (rand >> 62 & _RAND_A) << 64 | 0b10 << 62 | rand & _RAND_B
    )
    return uuid.UUID(int=value)


def _system() -> tuple[int, int]:
    return time.time_ns() // 1_000_000, int.from_bytes(os.urandom(10))


_sources: list[Callable[[], tuple[int, int]]] = [_system]
"""Where new ids draw from: the last one (`drawn_from` pushes and pops)."""


def new_uuid() -> uuid.UUID:
    """A new identifier: time-ordered, 74 bits of it from the system's random source."""
    return time_ordered(*_sources[-1]())


@contextlib.contextmanager
def drawn_from(source: Callable[[], tuple[int, int]]) -> Iterator[None]:
    """New ids from `source` (milliseconds, random bits) for the duration, instead of the
    clock and the system's random source: a simulated run's, to replay the same."""
    _sources.append(source)
    try:
        yield
    finally:
        _sources.remove(source)


def new_id() -> str:
    """`new_uuid` in the form the APIs show: 8-4-4-4-12 hexadecimal digits."""
    return str(new_uuid())


def new_request_id() -> str:
    """A request's id as Nova forms it (`req-` and a UUID), when the caller sent none."""
    return "req-" + new_id()
