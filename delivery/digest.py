"""Canonical JSON and its digest: the one recipe behind every stored hash (a ledger
row's `delivered_digest` and `create_digest` from `body_digest`, a mirror row's `record_digest`;
the columns keep their older names `fingerprint`, `create_fingerprint` and `content_hash`).
A leaf: it imports nothing of the project.

Changing the recipe changes every stored digest: every mirror row would look changed on the next
load and every unchanged payload would be sent again. tests/unit/test_digest.py pins it."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def canonical_json(value: Any) -> str:
    """Keys sorted, no whitespace; a value JSON has no form for (a datetime) written as its str()."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def canonical_digest(value: Any) -> str:
    """The SHA-256 of `value`'s canonical JSON, as 64 hex digits."""
    return hashlib.sha256(canonical_json(value).encode()).hexdigest()
