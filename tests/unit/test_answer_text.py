"""`rest.answer_text`, the writers' reading of an answer's body as text (for a record's history and
for errors): what httpx's `Response.text` gives, for every charset a target may name, or none, or
one Python does not know, and bytes that do not decode; only the first characters asked for."""

from __future__ import annotations

import httpx
from hypothesis import given
from hypothesis import strategies as st

from delivery.writers.rest import answer_text

CHARSETS = ["utf-8", "UTF-8", "latin-1", "iso-8859-1", "windows-1252", "utf-16", "ascii", "shift_jis"]


def response(content: bytes, content_type: str | None) -> httpx.Response:
    headers = {"content-type": content_type} if content_type is not None else {}
    return httpx.Response(200, content=content, headers=headers)


@given(text=st.text(max_size=300), charset=st.sampled_from(CHARSETS), quoted=st.booleans())
def test_it_reads_what_httpx_reads(text: str, charset: str, quoted: bool) -> None:
    content = text.encode(charset, errors="replace")
    named = f'"{charset}"' if quoted else charset
    answer = response(content, f"application/json; charset={named}")
    assert answer_text(answer, 10_000) == answer.text


@given(content=st.binary(max_size=300))
def test_bytes_that_do_not_decode_are_replaced_as_httpx_replaces_them(content: bytes) -> None:
    for content_type in (None, "application/json", "text/plain; charset=utf-8"):
        answer = response(content, content_type)
        assert answer_text(answer, 10_000) == answer.text


def test_a_charset_python_does_not_know_reads_as_utf_8() -> None:
    answer = response("Łódź".encode(), "text/plain; charset=x-no-such-charset")
    assert answer_text(answer, 100) == "Łódź"


def test_only_the_start_is_decoded_and_it_holds_the_characters_asked_for() -> None:
    body = "ü" * 5_000  # two bytes each
    answer = response(body.encode(), "text/plain; charset=utf-8")
    read = answer_text(answer, 100)
    assert read.startswith("ü" * 100) and len(read) < len(body)


def test_a_codec_that_is_no_text_encoding_reads_as_utf_8() -> None:
    for charset in ("idna", "punycode", "undefined"):
        answer = response("Łódź".encode(), f"text/plain; charset={charset}")
        assert answer_text(answer, 100) == "Łódź", charset


def test_only_a_charset_parameter_names_the_charset() -> None:
    answer = response("Łódź".encode(), "text/plain; x-charset=latin-1")
    assert answer_text(answer, 100) == "Łódź"
