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
import threading
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


class _Urandom:
    """The system's random bytes, read a page at a time and handed out in order, each byte
    once. A read is a system call, and CPython lets go of the GIL around it: a create made
    four ids inside the ledger's write transaction, and each call handed the interpreter to
    another thread and waited to get it back while the write lock was held (py-spy,
    2026-12-06: 8% of the API's group writer's time in the lock). A forked child starts
    with none, so parent and child never hand out the same bytes."""

    page = 4096

    def __init__(self) -> None:
        self._forget()
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._bytes = b""
        self._at = 0

    def take(self, n: int) -> bytes:
        with self._lock:
            if self._at + n > len(self._bytes):
                self._bytes = os.urandom(max(self.page, n))
                self._at = 0
            start = self._at
            self._at = start + n
            return self._bytes[start : start + n]


_urandom = _Urandom()


def random_bits(bits: int) -> int:
    """`bits` bits from the system's random source (see `_Urandom`)."""
    return int.from_bytes(_urandom.take((bits + 7) // 8)) >> (-bits % 8)


def _system() -> tuple[int, int]:
    return time.time_ns() // 1_000_000, random_bits(80)


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
