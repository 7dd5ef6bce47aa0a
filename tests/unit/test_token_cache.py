"""The cache of validated tokens (services/tokens.py ValidationCache): brief, bounded, and
never keeps what a validation learned before a change to revocations, users or projects."""

from __future__ import annotations

from stowage.services.tokens import ValidationCache


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_entry_lives_its_ttl_and_no_longer() -> None:
    clock = Clock()
    cache = ValidationCache(ttl_s=2.0, clock=clock)
    cache.put("t", "ctx", cache.generation)
    clock.now += 1.9
    assert cache.get("t") == "ctx"
    clock.now += 0.2
    assert cache.get("t") is None


def test_a_change_drops_every_entry() -> None:
    cache = ValidationCache(clock=Clock())
    cache.put("t", "ctx", cache.generation)
    cache.changed()
    assert cache.get("t") is None


def test_a_validation_that_began_before_a_change_is_not_kept() -> None:
    cache = ValidationCache(clock=Clock())
    began = cache.generation  # a request starts validating...
    cache.changed()  # ...while the token is revoked...
    cache.put("t", "stale", began)  # ...and what it learned is not kept
    assert cache.get("t") is None


def test_the_cache_is_bounded() -> None:
    cache = ValidationCache(size_max=3, clock=Clock())
    for i in range(10):
        cache.put(f"t{i}", i, cache.generation)
    assert len(cache._entries) <= 3
    assert cache.get("t9") == 9


def test_a_ttl_of_zero_caches_nothing() -> None:
    cache = ValidationCache(ttl_s=0.0, clock=Clock())
    cache.put("t", "ctx", cache.generation)
    assert cache.get("t") is None
