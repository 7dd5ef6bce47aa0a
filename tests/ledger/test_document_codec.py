"""Stored documents are decoded by orjson with json as the fallback, and still compare-and-swap:
a body read back and written again is the text that was stored (the swap compares text)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from stowage.ledger import Ledger
from stowage.ledger.objects import ObjectStore, decode_body

JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()  # past 64 bits too: json's ground, orjson's refusal
    | st.floats()  # NaN and the infinities, as json.dumps writes them
    | st.text(),  # lone surrogates included
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


def _same(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(), JSON_VALUES, max_size=6))
def test_a_body_decodes_as_json_decodes_it(body: dict[str, Any]) -> None:
    stored = json.dumps(body, sort_keys=True)
    decoded = decode_body(stored)
    assert _same(decoded, json.loads(stored))
    assert json.dumps(decoded, sort_keys=True) == stored  # the swap's comparison holds


def test_what_orjson_refuses_is_still_read() -> None:
    stored = json.dumps({"big": 2**80, "nan": math.nan, "lone": "\ud800"}, sort_keys=True)
    decoded = decode_body(stored)
    assert decoded["big"] == 2**80 and math.isnan(decoded["nan"]) and decoded["lone"] == "\ud800"


def test_a_document_read_back_swaps(tmp_path: Path) -> None:
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'ledger.db'}")
    try:
        store = ObjectStore(ledger.engine)
        body = {"name": "ünï", "size": 2**70, "ratio": 0.1, "tags": ["a", None]}
        store.create("thing", "t1", body)
        read = store.get("thing", "t1").body
        assert read == body
        assert store.swap("thing", "t1", read, {**read, "name": "next"})
        assert store.get("thing", "t1").body["name"] == "next"
    finally:
        ledger.close()


def test_integers_at_the_edges_of_64_bits_keep_every_digit() -> None:
    """orjson reads an integer past its 64 bits as a float: each of these has 19 digits or
    more, so json reads it; digits in a string or in another script decode with orjson."""
    edges = [2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 10**30]
    stored = json.dumps({"edges": edges, "id": "1" * 25, "arabic": "١٢٣٤٥٦٧٨٩" * 3})
    decoded = decode_body(stored)
    assert decoded["edges"] == edges
    assert all(isinstance(n, int) for n in decoded["edges"])
    assert decoded["id"] == "1" * 25 and decoded["arabic"] == "١٢٣٤٥٦٧٨٩" * 3
