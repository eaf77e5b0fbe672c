"""`redact` masks a secret in every spelling a target or a library may echo it back in: as is,
escaped inside a JSON string (with `/` as `\\/` too, as PHP's json_encode writes it), and
percent-encoded as a URL path, query or form would carry it."""

from __future__ import annotations

import json
from urllib.parse import quote, quote_plus

import pytest

from delivery.redact import MASK, redact, redact_start

SLASHED = "Sekr3t/Tok+en=="
QUOTED = 'Qu0te"Back\\slash/Pl+us'
UNICODE = "T\u00f6k\u00ebn/\u2603+x"

TOKENS = pytest.mark.parametrize("token", [SLASHED, QUOTED, UNICODE], ids=["slashed", "quoted", "unicode"])


def spellings(token: str) -> dict[str, str]:
    """Written out here rather than taken from the module, so that a spelling the module forgets
    shows up as a failure."""
    json_ascii = json.dumps(token)[1:-1]
    json_utf8 = json.dumps(token, ensure_ascii=False)[1:-1]
    return {
        "raw": token,
        "json": json_ascii,
        "json-utf8": json_utf8,
        "php": json_ascii.replace("/", "\\/"),
        "php-utf8": json_utf8.replace("/", "\\/"),
        "url-segment": quote(token, safe=""),
        "url-path": quote(token),
        "form": quote_plus(token),
    }


@TOKENS
@pytest.mark.parametrize("spelling", ["raw", "json", "json-utf8", "php", "php-utf8", "url-segment", "url-path", "form"])
def test_every_spelling_is_masked_whole(token: str, spelling: str) -> None:
    echoed = spellings(token)[spelling]
    assert redact(f'{{"auth": "Bearer {echoed}"}}', token) == '{"auth": "Bearer ***"}'


def test_the_reported_php_echo_is_masked() -> None:
    body = '{"error":"invalid token","auth":"Bearer Sekr3t\\/Tok+en=="}'
    assert redact(body, SLASHED) == '{"error":"invalid token","auth":"Bearer ***"}'


@TOKENS
def test_every_spelling_in_one_text_is_masked(token: str) -> None:
    text = " | ".join(spellings(token).values())
    masked = redact(text, token)
    assert set(masked.split(" | ")) == {MASK}


def test_a_spelling_that_begins_like_another_is_masked_whole() -> None:
    # The raw token is the start of its JSON spelling: masking the raw one first would leave `\\`.
    token = "abc\\"
    assert redact(f"x {json.dumps(token)} y", token) == f'x "{MASK}" y'


def test_several_secrets_and_none_or_empty_ones() -> None:
    text = f"a={SLASHED} b={quote_plus(QUOTED)} c=plain"
    assert redact(text, SLASHED, None, "", QUOTED) == "a=*** b=*** c=plain"
    assert redact(text) == text
    assert redact(text, None, "") == text


def test_text_without_the_secret_is_unchanged() -> None:
    assert redact('HTTP 422: {"error": "nope\\/no"}', SLASHED) == 'HTTP 422: {"error": "nope\\/no"}'
    assert redact("", SLASHED) == ""


def test_regex_characters_in_a_secret_are_literal() -> None:
    token = "a.b*c(d)[e]$"
    assert redact("aXb*c(d)[e]$ and a.b*c(d)[e]$", token) == "aXb*c(d)[e]$ and ***"


def test_a_long_secret_straddling_the_cut_leaves_nothing_of_itself() -> None:
    """A token of several kilobytes (a JWT with many claims) that begins before the cut."""
    token = "eyJ" + "x" * 6_000
    text = "a" * 400 + json.dumps({"authorization": f"Bearer {token}"})
    start = redact_start(text, 500, token)
    assert start == text[:400] + '{"authorization": "Bearer ***"}'
    assert redact_start(text, 500) == text[:500]  # no secret: the plain start
