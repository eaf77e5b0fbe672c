"""Reading a mirror JSONL file line by line, refusing the first bad line by its number."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from delivery.domain import MirrorInput
from delivery.errors import InputError, MirrorLoadError
from delivery.storable import EXTERNAL_ID_MAX, payload_problem, text_problem

_KEYS = {"id", "payload", "deleted"}


def parse_line(number: int, line: str) -> MirrorInput:
    try:
        data: Any = json.loads(line)
    except json.JSONDecodeError as exc:
        raise MirrorLoadError(number, f"not valid JSON ({exc.msg} at column {exc.colno})") from exc
    except ValueError as exc:
        # Python refuses to read an integer of more than 4300 digits (a guard against slow parsing).
        raise MirrorLoadError(number, f"a number has more than {sys.get_int_max_str_digits()} digits") from exc
    except RecursionError:
        raise MirrorLoadError(number, "arrays or objects are nested too deeply to read") from None
    if not isinstance(data, dict):
        raise MirrorLoadError(number, "must be a JSON object with 'id' and 'payload'")
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        # Quoted unless a plain name: a key may be empty, blank, or hold a line break.
        names = ", ".join(key if key.isidentifier() else json.dumps(key, ensure_ascii=False) for key in unknown)
        raise MirrorLoadError(number, f"unknown key(s) {names}; allowed: deleted, id, payload")
    external_id = data.get("id")
    if isinstance(external_id, bool) or not isinstance(external_id, (str, int)) or str(external_id).strip() == "":
        raise MirrorLoadError(number, "'id' must be a non-empty string or an integer")
    problem = text_problem(str(external_id), EXTERNAL_ID_MAX)
    if problem is not None:
        raise MirrorLoadError(number, f"'id' {problem}")
    payload = data.get("payload")
    if not isinstance(payload, dict):
        raise MirrorLoadError(number, "'payload' must be a JSON object")
    # json.loads takes NaN, Infinity and 1e400 (which overflows to inf), and "\u0000" and a lone
    # "\ud800": no target can be sent the first ones, PostgreSQL cannot store the others.
    problem = payload_problem(payload)
    if problem is not None:
        raise MirrorLoadError(number, problem)
    deleted = data.get("deleted", False)
    if not isinstance(deleted, bool):
        raise MirrorLoadError(number, "'deleted' must be true or false")
    return MirrorInput(str(external_id), payload, deleted)


def read_mirror_file(path: Path) -> Iterator[MirrorInput]:
    """Stream the file: 100k lines never sit in memory at once. Blank lines are ignored. Lines are
    decoded one by one so that bad UTF-8 is reported on its own line."""
    try:
        handle = path.open("rb")
    except OSError as exc:
        raise InputError(f"{path} cannot be read: {exc.strerror}") from exc
    with handle:
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise MirrorLoadError(number, f"not valid UTF-8 (byte {exc.start + 1} of the line)") from exc
            if line.strip():
                yield parse_line(number, line)
