"""Stored digests must never change: a mirror row's `content_hash` column (`record_digest`) that
moved would make every row look changed on the next load (and re-offer every record), a ledger
row's `fingerprint` column (`delivered_digest`, from `body_digest`) that moved would
defeat the suppression of unchanged payloads (and re-send every record). The literals below were
computed with the code as it stood before both went through `delivery.digest`."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from delivery.decisions import body_digest
from delivery.digest import canonical_digest
from delivery.store.mirror import record_digest

BODY: dict[str, Any] = {
    "name": "Zoë Ådler",
    "email": "zoe@example.com",
    "n": 1,
    "x": 1.5,
    "ok": True,
    "none": None,
    "tags": ["b", "a"],
    "nested": {"z": 1, "a": [1, {"y": 2, "b": 3}]},
}


def test_body_digest_of_a_fixed_body_is_pinned() -> None:
    assert body_digest(BODY) == "4f4687e497cf693428a2b5a5b66858343f4f4ae715fd7981c2a86e0bcfb94774"


def test_body_digest_of_a_non_json_value_is_pinned() -> None:
    # `default=str` is part of the recipe: a datetime digests as its str().
    when = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert body_digest({"at": when}) == "4f978a17fc7e9dfbb2d887080273cb24371f04f29619a654d85851b927f1c95c"


def test_record_digest_of_a_fixed_payload_is_pinned() -> None:
    assert record_digest(BODY, False) == "69124101f37c3d70dd1aca7277bf86e4adf95a4d0db568bc90f6b0c31ad4f96c"
    assert record_digest(BODY, True) == "78c78030e7c46f10329e9086bfe6458406ced5389a1aff66b3514c02c106263e"
    assert record_digest({}, False) == "304d6856242819edc60f8fc5d896d345d4ca05e24379ea945b53d9a542e3a8c2"


def test_both_are_the_one_canonical_digest() -> None:
    assert body_digest(BODY) == canonical_digest(BODY)
    assert record_digest(BODY, True) == canonical_digest([BODY, True])


def test_canonical_digest_ignores_key_order_only() -> None:
    assert canonical_digest({"a": 1, "b": {"c": 2, "d": 3}}) == canonical_digest({"b": {"d": 3, "c": 2}, "a": 1})
    assert canonical_digest([1, 2]) != canonical_digest([2, 1])
