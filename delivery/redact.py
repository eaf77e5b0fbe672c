"""Keep secrets out of everything we write: ledger errors, logs, artifacts, exceptions.

A target that echoes a token back rarely echoes it as sent: its JSON encoder escapes `"` and `\\`
(PHP's json_encode writes `/` as `\\/` too, and non-ASCII as `\\uXXXX`), and a URL or form carries
it percent-encoded. Every one of those spellings is masked, not only the raw token.
"""

from __future__ import annotations

import functools
import json
import re
from urllib.parse import quote, quote_plus

MASK = "***"


def spellings(secret: str) -> frozenset[str]:
    """`secret` as sent, and as a JSON string body or a URL may carry it back."""
    escaped = {json.dumps(secret)[1:-1], json.dumps(secret, ensure_ascii=False)[1:-1]}
    return frozenset(
        {
            secret,
            *escaped,
            *(form.replace("/", "\\/") for form in escaped),
            quote(secret, safe=""),
            quote(secret),
            quote_plus(secret),
        }
    )


@functools.lru_cache(maxsize=32)
def _pattern(secrets: tuple[str, ...]) -> re.Pattern[str]:
    # Built once per set of secrets: redaction runs on every error path of a chain.
    forms = {form for secret in secrets for form in spellings(secret)}
    # Longest first, in one pass: where one spelling begins another (`a\` and `a\\`), the whole
    # longer one is masked instead of leaving its tail behind.
    return re.compile("|".join(re.escape(form) for form in sorted(forms, key=lambda f: (-len(f), f))))


@functools.lru_cache(maxsize=32)
def _longest(secrets: tuple[str, ...]) -> int:
    return max(len(form) for secret in secrets for form in spellings(secret))


@functools.lru_cache(maxsize=32)
def _present(secrets: tuple[str | None, ...]) -> tuple[str, ...]:
    # Cached: the same few secrets are looked up for every request a record's history keeps.
    return tuple(sorted({secret for secret in secrets if secret}))


def margin(*secrets: str | None) -> int:
    """How far past a cut a text must be read to mask it before cutting: the longest spelling of
    the secrets, so that one beginning before the cut ends within what was read (tokens of several
    kilobytes exist: JWTs with many claims)."""
    present = _present(secrets)
    return _longest(present) if present else 0


def redact_start(text: str, chars: int, *secrets: str | None) -> str:
    """The first `chars` characters of `text`, masked before the cut: a secret straddling it would
    otherwise leave its start showing."""
    return redact(text[: chars + margin(*secrets)], *secrets)[:chars]


def redact(text: str, *secrets: str | None) -> str:
    present = _present(secrets)
    if not present or not text:
        return text
    return _pattern(present).sub(MASK, text)
