"""Input both databases store alike, and a target can be sent: the checks that refuse a NUL, a
lone surrogate, NaN or ±Infinity, or an over-long id, naming where it sits, before anything is
written. SQLite would keep most of these and PostgreSQL refuse them; refused here, they fail the
same way on both, as input, not as a traceback from the driver.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from delivery.domain import MirrorInput


def _where(path: str, key: object) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    name = str(key)
    return f"{path}.{name}" if name.isidentifier() else f"{path}[{json.dumps(name)}]"


def _non_finite_message(path: str, value: float) -> str:
    label = "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return f"{path} is {label}, which JSON cannot carry (a number beyond ±1.8e308 reads as Infinity)"


#: The widest external id `mirror_records.external_id` holds.
EXTERNAL_ID_MAX = 500
#: The widest remote id `ledger.remote_id` holds.
REMOTE_ID_MAX = 500

#: A NUL, or half of a UTF-16 surrogate pair standing alone (what a JSON "\ud800" escape, or an
#: undecodable byte of a command-line argument, becomes in Python).
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def storable_text(value: str) -> str:
    """`value` with every NUL and lone surrogate replaced by U+FFFD: for text a target wrote (an
    error body quoted in `last_error`), which must be kept, not refused, on either database."""
    return _UNSTORABLE.sub("\ufffd", value)


def text_problem(value: str, max_length: int | None = None) -> str | None:
    """Why `value` cannot be stored the same way on SQLite and PostgreSQL, or None: it holds a NUL
    (PostgreSQL's text and JSON cannot hold one, SQLite would keep it), a lone surrogate (not
    Unicode: nothing encodes it to UTF-8, so no database or target takes it), or it is longer than
    `max_length` (PostgreSQL refuses the row, SQLite would keep it whole). The reason reads after
    the name of what holds the value, and never repeats the character itself."""
    found = _UNSTORABLE.search(value)
    if found is not None:
        char = found.group()
        if char == "\x00":
            return "holds a NUL character (\\u0000), which PostgreSQL cannot store"
        return f"holds a lone surrogate (\\u{ord(char):04x}), which is not valid Unicode"
    if max_length is not None and len(value) > max_length:
        return f"is longer than {max_length} characters"
    return None


def _first_payload_problem(value: Any, path: str) -> str | None:
    if isinstance(value, float):
        return None if math.isfinite(value) else _non_finite_message(path, value)
    if isinstance(value, str):
        problem = text_problem(value)
        return None if problem is None else f"{path} {problem}"
    if isinstance(value, dict):
        for key, item in value.items():
            where = _where(path, key)
            if isinstance(key, str):
                problem = text_problem(key)
                if problem is not None:
                    return f"the key {where} {problem}"
            found = _first_payload_problem(item, where)
            if found is not None:
                return found
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            found = _first_payload_problem(item, _where(path, index))
            if found is not None:
                return found
    return None


def payload_problem(payload: dict[str, Any]) -> str | None:
    """Why `payload` cannot be loaded, or None: the first value in document order that is NaN or
    ±Infinity (JSON has neither, so the record could never be sent; PostgreSQL's jsonb refuses
    them), or a string or key holding a NUL or a lone surrogate (`text_problem`). Any of them
    would load on one database and not the other, or park the record as a body no target can be
    sent."""
    return _first_payload_problem(payload, "payload")


def mirror_input_problem(item: MirrorInput) -> str | None:
    """Why `item` cannot be loaded into the mirror, or None: its id (a non-empty string that fits
    the column, `text_problem`) or its payload (`payload_problem`)."""
    if not isinstance(item.external_id, str) or not item.external_id.strip():
        return "'id' must be a non-empty string"
    problem = text_problem(item.external_id, EXTERNAL_ID_MAX)
    if problem is not None:
        return f"'id' {problem}"
    return payload_problem(item.payload)


def remote_id_problem(value: Any) -> str | None:
    """Why a target's answer to a create does not address the record it made, or None: the id
    must be a string with something in it, or an integer (JSON's NaN and Infinity, or a number
    too large for a double, read as floats and are not ids), and one both databases store alike
    (`text_problem`, at most `REMOTE_ID_MAX` characters). An id that fails is as good as none:
    the record exists in the target and nothing can reach it."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return "is not a string or an integer"
    text = str(value)
    if not text.strip():
        return "is blank"
    return text_problem(text, REMOTE_ID_MAX)
