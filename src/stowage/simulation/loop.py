"""Virtual time for one simulated run: an asyncio loop whose clock jumps when every task waits.

`VirtualLoop` is a selector event loop whose `time()` is a `VirtualClock` and whose selector,
instead of blocking for the next timer, moves the clock to it: an idle minute costs nothing.
Work handed to an executor (`asyncio.to_thread`, `run_in_executor`) runs inline on the loop's
own thread, so a run has no thread but the caller's. A blocking call that "sleeps" through
`VirtualClock.sleep` (the simulated driver's latencies and slow disk) does not block: the
sleep is added up, and the executor's future resolves that much virtual time later, as a
pool thread's would.

`deterministic(rng)` makes `uuid.uuid4()` and Stowage's own ids draw from the run's generator,
so ids, and with them every order by id, are the same on every replay.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import selectors
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from stowage.domain.ids import drawn_from

__all__ = ["Deadlock", "VirtualClock", "VirtualLoop", "deterministic"]

EPOCH = 1_800_000_000.0
"""Where virtual time starts: a plausible Unix time, the same for every run."""


class Deadlock(RuntimeError):
    """Every task waits and no timer is due: nothing can ever happen again."""


class VirtualClock:
    """Seconds since the Unix epoch, moved only by the loop (and by nothing else)."""

    def __init__(self, start: float = EPOCH) -> None:
        self.now = start
        self._owed = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds > 0:
            self.now += seconds

    def sleep(self, seconds: float) -> None:
        """A blocking sleep inside executor work: owed, and paid by that work's future."""
        if seconds > 0:
            self._owed += seconds

    def take_owed(self) -> float:
        owed, self._owed = self._owed, 0.0
        return owed


class _VirtualSelector(selectors.DefaultSelector):
    def __init__(self, clock: VirtualClock) -> None:
        super().__init__()
        self._clock = clock

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        events = super().select(0)
        if events or timeout == 0:
            return events
        if timeout is None:
            raise Deadlock("every task waits and no timer is due")
        self._clock.advance(timeout)
        return []


class VirtualLoop(asyncio.SelectorEventLoop):
    """A loop on virtual time whose executor work runs inline (see the module's doc)."""

    def __init__(self, clock: VirtualClock) -> None:
        super().__init__(_VirtualSelector(clock))
        self.clock = clock
        # A timer is due when it is before now + resolution: the resolution must be more than
        # a float's step at the epoch (2.4e-7 s), or a timer due exactly now never fires.
        self._clock_resolution = 1e-6

    def time(self) -> float:
        return self.clock.now

    def run_in_executor(  # type: ignore[override]
        self, executor: Any, func: Callable[..., Any], *args: Any
    ) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = self.create_future()
        self.clock.take_owed()
        try:
            result = func(*args)
        except BaseException as exc:  # a Crash too: it reaches the awaiting task
            owed = self.clock.take_owed()
            if owed > 0:
                self.call_later(owed, _settle, future, None, exc)
            else:
                future.set_exception(exc)
            return future
        owed = self.clock.take_owed()
        if owed > 0:
            self.call_later(owed, _settle, future, result, None)
        else:
            future.set_result(result)
        return future


def _settle(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


@contextlib.contextmanager
def deterministic(rng: random.Random) -> Iterator[None]:
    """`uuid.uuid4()` from `rng` for the duration, and Stowage's own ids
    (`stowage.domain.ids`) from `rng` and a count of milliseconds from EPOCH."""
    original = uuid.uuid4
    made = itertools.count(int(EPOCH * 1000))

    def uuid4() -> uuid.UUID:
        return uuid.UUID(int=rng.getrandbits(128), version=4)

    def source() -> tuple[int, int]:
        return next(made), rng.getrandbits(80)

    uuid.uuid4 = uuid4
    try:
        with drawn_from(source):
            yield
    finally:
        uuid.uuid4 = original
