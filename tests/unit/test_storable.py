"""What both databases store alike: the remote ids a create's answer may carry, and text a target
wrote that must be kept rather than refused."""

from __future__ import annotations

from typing import Any

import pytest

from delivery.storable import remote_id_problem, storable_text


@pytest.mark.parametrize("value", ["r-1", "42", 42, 0, "x" * 500, "kunden/bücher"])
def test_usable_remote_ids(value: Any) -> None:
    assert remote_id_problem(value) is None


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (True, "is not a string or an integer"),
        (1.5, "is not a string or an integer"),
        (float("nan"), "is not a string or an integer"),
        (float("inf"), "is not a string or an integer"),
        (["r-1"], "is not a string or an integer"),
        ("", "is blank"),
        ("  ", "is blank"),
        ("a\x00b", "holds a NUL character"),
        ("a\ud800", "holds a lone surrogate (\\ud800)"),
        ("x" * 501, "is longer than 500 characters"),
        (10**501, "is longer than 500 characters"),
    ],
)
def test_unusable_remote_ids(value: Any, problem: str) -> None:
    assert (remote_id_problem(value) or "").startswith(problem)


def test_storable_text_keeps_everything_but_nul_and_lone_surrogates() -> None:
    assert storable_text("ok é 🙂") == "ok é 🙂"
    assert storable_text("a\x00b\ud800c\udfffd") == "a\ufffdb\ufffdc\ufffdd"
