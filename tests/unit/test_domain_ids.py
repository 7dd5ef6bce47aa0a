"""The identifiers Stowage makes: version 7 UUIDs, in the order they were made."""

from __future__ import annotations

import time
import uuid

from stowage.domain.ids import new_id, new_request_id, new_uuid, time_ordered


def test_the_layout_is_rfc_9562_version_7() -> None:
    ms = 1_767_225_600_123
    rand = (1 << 80) - 1  # more bits than fit: only the low 74 are used
    made = time_ordered(ms, rand)
    assert made.version == 7
    assert made.variant == uuid.RFC_4122
    assert made.int >> 80 == ms
    assert made.int & ((1 << 62) - 1) == (1 << 62) - 1
    assert made.int >> 64 & 0xFFF == 0xFFF
    assert time_ordered(ms, 0).int == ms << 80 | 0x7 << 76 | 0b10 << 62


def test_ids_sort_by_the_time_they_were_made_as_text_and_as_numbers() -> None:
    made = []
    for _ in range(3):
        made.append(new_id())
        time.sleep(0.002)
    assert made == sorted(made)
    assert [uuid.UUID(m) for m in made] == sorted(uuid.UUID(m) for m in made)
    assert all(str(uuid.UUID(m)) == m for m in made)


def test_ids_made_in_one_millisecond_differ() -> None:
    made = {new_uuid() for _ in range(10_000)}
    assert len(made) == 10_000
    assert {m.version for m in made} == {7}


def test_a_request_id_has_novas_form() -> None:
    rid = new_request_id()
    assert rid.startswith("req-")
    assert uuid.UUID(rid[4:]).version == 7
    assert len(rid) == 40


def test_ids_drawn_from_a_source_replay_the_same() -> None:
    """A simulated run draws its ids from its own generator and count, to replay the same."""
    import random

    from stowage.domain.ids import drawn_from

    def run() -> list[str]:
        rng = random.Random(7)
        ms = iter(range(1_800_000_000_000, 1_800_000_000_010))
        with drawn_from(lambda: (next(ms), rng.getrandbits(80))):
            return [new_id() for _ in range(5)]

    first = run()
    assert first == run() == sorted(first)
    assert new_id() not in first  # the system's source again after the block
