"""Reading a mirror JSONL file line by line, refusing the first bad line by its number."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from delivery.errors import InputError, MirrorLoadError
from delivery.store.mirror import MirrorInput

_KEYS = {"id", "payload", "deleted"}


def parse_line(number: int, line: str) -> MirrorInput:
    try:
        data: Any = json.loads(line)
    except json.JSONDecodeError as exc:
        raise MirrorLoadError(number, f"not valid JSON ({exc.msg} at column {exc.colno})") from exc
    if not isinstance(data, dict):
        raise MirrorLoadError(number, "must be a JSON object with 'id' and 'payload'")
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        raise MirrorLoadError(number, f"unknown key(s) {', '.join(unknown)}; allowed: deleted, id, payload")
    external_id = data.get("id")
    if isinstance(external_id, bool) or not isinstance(external_id, (str, int)) or str(external_id).strip() == "":
        raise MirrorLoadError(number, "'id' must be a non-empty string")
    if len(str(external_id)) > 500:
        raise MirrorLoadError(number, "'id' is longer than 500 characters")
    payload = data.get("payload")
    if not isinstance(payload, dict):
        raise MirrorLoadError(number, "'payload' must be a JSON object")
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
