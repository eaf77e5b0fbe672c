"""Reading mirror JSONL files: each line checked on its own, the first bad one refused by number,
and the file streamed rather than read whole."""

from __future__ import annotations

import json
import sys
from collections.abc import Generator
from pathlib import Path

import pytest

from delivery.domain import MirrorInput
from delivery.errors import InputError, MirrorLoadError
from delivery.mirror_file import parse_line, read_mirror_file


def refusal(number: int, line: str) -> MirrorLoadError:
    with pytest.raises(MirrorLoadError) as caught:
        parse_line(number, line)
    error = caught.value
    assert error.line == number
    assert str(error).startswith(f"line {number}: ")
    return error


def write(tmp_path: Path, *lines: str, newline: str = "\n") -> Path:
    path = tmp_path / "mirror.jsonl"
    path.write_text("".join(line + newline for line in lines), encoding="utf-8")
    return path


GOOD = '{"id": "%s", "payload": {"n": %d}}'


# --- parse_line: good lines ----------------------------------------------------------------------


def test_string_id() -> None:
    item = parse_line(1, '{"id": "c-1", "payload": {"email": "a@x.io"}}')
    assert item == MirrorInput("c-1", {"email": "a@x.io"}, False)


def test_int_id_becomes_str() -> None:
    item = parse_line(1, '{"id": 42, "payload": {}}')
    assert item.external_id == "42"
    assert isinstance(item.external_id, str)


@pytest.mark.parametrize(
    ("raw", "expected"), [("0", "0"), ("-7", "-7"), ("12345678901234567890", "12345678901234567890")]
)
def test_other_int_ids(raw: str, expected: str) -> None:
    assert parse_line(1, f'{{"id": {raw}, "payload": {{}}}}').external_id == expected


def test_deleted_defaults_to_false() -> None:
    assert parse_line(1, '{"id": "c-1", "payload": {}}').deleted is False


@pytest.mark.parametrize("deleted", [True, False])
def test_deleted_explicit(deleted: bool) -> None:
    line = json.dumps({"id": "c-1", "payload": {}, "deleted": deleted})
    assert parse_line(1, line).deleted is deleted


def test_payload_is_kept_as_given() -> None:
    payload = {"email": "a@x.io", "tags": ["a", "b"], "address": {"city": "Oslo"}, "age": None, "vip": True}
    assert parse_line(1, json.dumps({"id": "c", "payload": payload})).payload == payload


def test_empty_payload_is_fine() -> None:
    assert parse_line(1, '{"id": "c", "payload": {}}').payload == {}


def test_line_with_trailing_newline_and_spaces() -> None:
    assert parse_line(1, '  {"payload": {}, "id": "c"}  \r\n').external_id == "c"


def test_id_of_exactly_500_chars() -> None:
    assert parse_line(1, json.dumps({"id": "x" * 500, "payload": {}})).external_id == "x" * 500


def test_unicode_id() -> None:
    assert parse_line(1, json.dumps({"id": "caf\u00e9/1", "payload": {}})).external_id == "caf\u00e9/1"


# --- parse_line: refusals ------------------------------------------------------------------------


@pytest.mark.parametrize("line", ["{", "not json", '{"id": "a",}', "", "   ", "{\"id\": 'a'}"])
def test_invalid_json(line: str) -> None:
    error = refusal(7, line)
    assert "not valid JSON" in str(error)
    assert "at column" in str(error)


@pytest.mark.parametrize("line", ["[]", '["id", "payload"]', '"text"', "42", "null", "true"])
def test_not_an_object(line: str) -> None:
    error = refusal(3, line)
    assert str(error) == "line 3: must be a JSON object with 'id' and 'payload'"


def test_unknown_key() -> None:
    error = refusal(2, '{"id": "a", "payload": {}, "extra": 1}')
    assert str(error) == "line 2: unknown key(s) extra; allowed: deleted, id, payload"


def test_several_unknown_keys_are_listed_sorted() -> None:
    error = refusal(2, '{"id": "a", "payload": {}, "zeta": 1, "alpha": 2}')
    assert "unknown key(s) alpha, zeta;" in str(error)


def test_an_unknown_key_that_is_no_plain_name_is_quoted_on_the_one_line() -> None:
    """Before: printed as it was, so `{"\\n": 1}` split the error over two lines, and an empty
    or blank key showed as nothing."""
    error = refusal(1, '{"id": "a", "payload": {}, "a\\nb": 1, "": 2, " ": 3, "\u00e9t\u00e9": 4}')
    assert str(error) == 'line 1: unknown key(s) "", " ", "a\\nb", été; allowed: deleted, id, payload'


def test_misspelt_key_is_unknown_before_anything_else() -> None:
    assert "unknown key(s) paylod" in str(refusal(1, '{"id": "a", "paylod": {}}'))


@pytest.mark.parametrize(
    "line",
    [
        '{"payload": {}}',
        '{"id": null, "payload": {}}',
        '{"id": "", "payload": {}}',
        '{"id": "   ", "payload": {}}',
        '{"id": 1.5, "payload": {}}',
        '{"id": ["a"], "payload": {}}',
        '{"id": {"v": 1}, "payload": {}}',
    ],
    ids=["missing", "null", "empty", "blank", "float", "list", "object"],
)
def test_missing_or_empty_id(line: str) -> None:
    # An integer id is taken (as its digits): the message says so, not only "string".
    assert str(refusal(4, line)) == "line 4: 'id' must be a non-empty string or an integer"


@pytest.mark.parametrize("value", ["true", "false"])
def test_bool_id(value: str) -> None:
    error = refusal(5, f'{{"id": {value}, "payload": {{}}}}')
    assert str(error) == "line 5: 'id' must be a non-empty string or an integer"


def test_id_longer_than_500_chars() -> None:
    error = refusal(6, json.dumps({"id": "x" * 501, "payload": {}}))
    assert str(error) == "line 6: 'id' is longer than 500 characters"


def test_int_id_longer_than_500_digits() -> None:
    error = refusal(6, '{"id": ' + "9" * 501 + ', "payload": {}}')
    assert str(error) == "line 6: 'id' is longer than 500 characters"


@pytest.mark.parametrize("payload", ["null", "[]", '"x"', "1", "true"])
def test_payload_not_an_object(payload: str) -> None:
    assert str(refusal(8, f'{{"id": "a", "payload": {payload}}}')) == "line 8: 'payload' must be a JSON object"


def test_missing_payload() -> None:
    assert str(refusal(8, '{"id": "a"}')) == "line 8: 'payload' must be a JSON object"


@pytest.mark.parametrize("deleted", ["null", "0", "1", '"true"', '"false"', "[]"])
def test_deleted_not_bool(deleted: str) -> None:
    error = refusal(9, f'{{"id": "a", "payload": {{}}, "deleted": {deleted}}}')
    assert str(error) == "line 9: 'deleted' must be true or false"


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ('{"score": NaN}', "payload.score is NaN"),
        ('{"score": Infinity}', "payload.score is Infinity"),
        ('{"score": -Infinity}', "payload.score is -Infinity"),
        ('{"score": 1e400}', "payload.score is Infinity"),
        ('{"score": -1e400}', "payload.score is -Infinity"),
        ('{"address": {"geo": {"lat": NaN}}}', "payload.address.geo.lat is NaN"),
        ('{"scores": [1, 2.5, Infinity]}', "payload.scores[2] is Infinity"),
        ('{"rows": [{"v": 1}, {"v": NaN}]}', "payload.rows[1].v is NaN"),
        ('{"first name": NaN}', 'payload["first name"] is NaN'),
    ],
    ids=["nan", "infinity", "minus-infinity", "overflow", "minus-overflow", "nested", "in-a-list", "deep", "odd-key"],
)
def test_non_finite_numbers_in_the_payload_are_refused(payload: str, message: str) -> None:
    error = refusal(12, f'{{"id": "a", "payload": {payload}}}')
    assert str(error) == f"line 12: {message}, which JSON cannot carry (a number beyond ±1.8e308 reads as Infinity)"


NUL = "holds a NUL character (\\u0000), which PostgreSQL cannot store"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"id": "a\\u0000b", "payload": {"v": 1}}', f"'id' {NUL}"),
        ('{"id": "a", "payload": {"v": "x\\u0000"}}', f"payload.v {NUL}"),
        ('{"id": "a", "payload": {"k\\u0000": 1}}', f'the key payload["k\\u0000"] {NUL}'),
        ('{"id": "a", "payload": {"rows": [{"v": "ok"}, {"v": ["\\u0000"]}]}}', f"payload.rows[1].v[0] {NUL}"),
        ('{"id": "\\ud800", "payload": {}}', "'id' holds a lone surrogate (\\ud800), which is not valid Unicode"),
        (
            '{"id": "a", "payload": {"v": "x\\udfff"}}',
            "payload.v holds a lone surrogate (\\udfff), which is not valid Unicode",
        ),
        (
            '{"id": "a", "payload": {"\\udc80": 1}}',
            'the key payload["\\udc80"] holds a lone surrogate (\\udc80), which is not valid Unicode',
        ),
    ],
    ids=["nul-in-id", "nul-in-value", "nul-in-key", "nul-deep", "surrogate-id", "surrogate-value", "surrogate-key"],
)
def test_text_no_database_stores_alike_is_refused(line: str, message: str) -> None:
    """PostgreSQL cannot store a NUL (SQLite would); a lone surrogate is not Unicode, so the record
    would load and then be parked by every chain as a body that cannot be encoded."""
    assert str(refusal(3, line)) == f"line 3: {message}"


def test_a_surrogate_pair_is_one_character_and_loads() -> None:
    item = parse_line(1, '{"id": "\\ud83d\\ude00", "payload": {"v": "\\ud83d\\ude00", "nul": "\\\\u0000"}}')
    assert item.external_id == "\U0001f600"
    assert item.payload == {"v": "\U0001f600", "nul": "\\u0000"}  # an escaped backslash is no NUL


def test_a_number_too_long_to_read_is_refused_not_a_traceback() -> None:
    error = refusal(2, '{"id": ' + "9" * 5000 + ', "payload": {}}')
    assert str(error) == f"line 2: a number has more than {sys.get_int_max_str_digits()} digits"


def test_nesting_too_deep_to_read_is_refused_not_a_traceback() -> None:
    error = refusal(2, '{"id": "a", "payload": {"x": ' + "[" * 5000 + "]" * 5000 + "}}")
    assert str(error) == "line 2: arrays or objects are nested too deeply to read"


def test_the_first_non_finite_number_in_document_order_is_named() -> None:
    error = refusal(1, '{"id": "a", "payload": {"b": [NaN], "a": Infinity}}')
    assert str(error).startswith("line 1: payload.b[0] is NaN,")


def test_finite_numbers_at_the_edge_are_fine() -> None:
    line = '{"id": "a", "payload": {"max": 1.7976931348623157e308, "min": -1.7976931348623157e308, "n": "NaN"}}'
    assert parse_line(1, line).payload["n"] == "NaN"  # a string spelling NaN is just a string


def test_a_non_finite_line_in_a_file_is_refused_by_its_number(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD % ("a", 1), "", '{"id": "b", "payload": {"n": NaN}}', GOOD % ("c", 3))
    seen: list[str] = []
    with pytest.raises(MirrorLoadError) as caught:
        for item in read_mirror_file(path):
            seen.append(item.external_id)
    assert seen == ["a"]
    assert caught.value.line == 3
    assert str(caught.value).startswith("line 3: payload.n is NaN")


def test_large_line_numbers() -> None:
    assert refusal(100_000, "{").line == 100_000


def test_mirror_load_error_is_an_input_error() -> None:
    assert issubclass(MirrorLoadError, InputError)


# --- read_mirror_file ----------------------------------------------------------------------------


def test_reads_every_line_in_order(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD % ("a", 1), '{"id": 2, "payload": {}, "deleted": true}', GOOD % ("c", 3))
    assert list(read_mirror_file(path)) == [
        MirrorInput("a", {"n": 1}, False),
        MirrorInput("2", {}, True),
        MirrorInput("c", {"n": 3}, False),
    ]


def test_empty_file(tmp_path: Path) -> None:
    assert list(read_mirror_file(write(tmp_path))) == []


def test_last_line_without_newline(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text(GOOD % ("a", 1) + "\n" + GOOD % ("b", 2), encoding="utf-8")
    assert [item.external_id for item in read_mirror_file(path)] == ["a", "b"]


def test_crlf_line_endings(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD % ("a", 1), GOOD % ("b", 2), newline="\r\n")
    assert [item.external_id for item in read_mirror_file(path)] == ["a", "b"]


def test_blank_lines_are_ignored(tmp_path: Path) -> None:
    path = write(tmp_path, "", GOOD % ("a", 1), "   ", "\t", GOOD % ("b", 2), "")
    assert [item.external_id for item in read_mirror_file(path)] == ["a", "b"]


def test_blank_lines_still_count_for_line_numbers(tmp_path: Path) -> None:
    path = write(tmp_path, "", GOOD % ("a", 1), "", "{broken")
    with pytest.raises(MirrorLoadError) as caught:
        list(read_mirror_file(path))
    assert caught.value.line == 4
    assert str(caught.value).startswith("line 4: not valid JSON")


def test_it_is_a_generator_that_streams(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD % ("a", 1), GOOD % ("b", 2), "{broken", GOOD % ("d", 4))
    items = read_mirror_file(path)
    assert next(items) == MirrorInput("a", {"n": 1}, False)
    assert next(items).external_id == "b"
    with pytest.raises(MirrorLoadError) as caught:
        next(items)
    assert caught.value.line == 3
    assert str(caught.value).startswith("line 3: ")


def test_consuming_the_first_item_does_not_raise_for_a_bad_line_3(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD % ("a", 1), GOOD % ("b", 2), '{"id": "c", "payload": []}')
    items = read_mirror_file(path)
    assert isinstance(items, Generator)
    assert next(items).external_id == "a"
    items.close()


def test_fully_consuming_raises_at_line_3(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD % ("a", 1), GOOD % ("b", 2), '{"id": "c", "payload": []}', GOOD % ("d", 4))
    seen: list[str] = []
    with pytest.raises(MirrorLoadError) as caught:
        for item in read_mirror_file(path):
            seen.append(item.external_id)
    assert seen == ["a", "b"]
    assert caught.value.line == 3
    assert str(caught.value) == "line 3: 'payload' must be a JSON object"


def test_the_first_bad_line_wins(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD % ("a", 1), "[]", "{broken")
    with pytest.raises(MirrorLoadError) as caught:
        list(read_mirror_file(path))
    assert caught.value.line == 2


def test_missing_file_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "nope.jsonl"
    items = read_mirror_file(path)  # a generator: nothing happens until it is consumed
    with pytest.raises(InputError) as caught:
        next(items)
    assert str(path) in str(caught.value)
    assert "cannot be read" in str(caught.value) and "line" not in str(caught.value)


def test_directory_is_reported(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="cannot be read"):
        list(read_mirror_file(tmp_path))


def test_invalid_utf8_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_bytes(b'{"id": "a", "payload": {"x": "\xff"}}\n')
    with pytest.raises(MirrorLoadError, match="not valid UTF-8"):
        list(read_mirror_file(path))


def test_invalid_utf8_names_its_own_line(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_bytes(
        (GOOD % ("a", 1) + "\n" + GOOD % ("b", 2) + "\n").encode() + b'{"id": "c", "payload": {"x": "\xff"}}\n'
    )
    seen: list[str] = []
    with pytest.raises(MirrorLoadError) as caught:
        for item in read_mirror_file(path):
            seen.append(item.external_id)
    assert seen == ["a", "b"]
    assert caught.value.line == 3
