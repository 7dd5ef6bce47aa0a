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


def test_ids_read_the_random_source_a_page_at_a_time(monkeypatch: object) -> None:
    """Each read of os.urandom lets go of the GIL inside the ledger's write transaction:
    a create's ids take their bits from one page read (one read per ~400 ids, not one each)."""
    import os

    import pytest

    from stowage.domain import ids

    assert isinstance(monkeypatch, pytest.MonkeyPatch)
    reads: list[int] = []
    real = os.urandom

    def counted(n: int) -> bytes:
        reads.append(n)
        return real(n)

    monkeypatch.setattr(ids, "_urandom", ids._Urandom())
    monkeypatch.setattr(os, "urandom", counted)
    made = {new_uuid() for _ in range(400)}
    assert len(made) == 400
    assert len(reads) == 1, reads
    assert {m.version for m in made} == {7}


def test_random_bits_stay_in_range_and_vary() -> None:
    from stowage.domain.ids import random_bits

    drawn = [random_bits(12) for _ in range(2000)]
    assert all(0 <= d < 1 << 12 for d in drawn)
    assert max(drawn) >= 1 << 11  # the top bit is drawn, not shifted away
    assert len(set(drawn)) > 1000
    assert all(0 <= random_bits(80) < 1 << 80 for _ in range(100))


def test_a_forked_child_draws_other_bits_than_its_parent() -> None:
    """A child forked with part of a page in hand must not hand out the parent's next bytes:
    the two would make the same ids in the same millisecond."""
    import os

    from stowage.domain.ids import random_bits

    random_bits(8)  # a page is held
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next 64 bits, to the parent
        os.close(read_end)
        os.write(write_end, random_bits(64).to_bytes(8, "big"))
        os._exit(0)
    os.close(write_end)
    child = int.from_bytes(os.read(read_end, 8), "big")
    os.close(read_end)
    os.waitpid(pid, 0)
    assert random_bits(64) != child
