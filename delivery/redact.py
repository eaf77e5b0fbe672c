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

#: How far past a cut a text is masked first: a secret (in any of its spellings) up to this long
#: that begins before the cut is masked whole, not cut in two with its start left showing. Tokens
#: of several kilobytes exist (JWTs with many claims); none of sixteen.
SECRET_MARGIN = 16_384


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


def redact_start(text: str, chars: int, *secrets: str | None) -> str:
    """The first `chars` characters of `text`, its secrets masked (see `SECRET_MARGIN`)."""
    return redact(text[: chars + SECRET_MARGIN], *secrets)[:chars]


def redact(text: str, *secrets: str | None) -> str:
    present = tuple(sorted({secret for secret in secrets if secret}))
    if not present or not text:
        return text
    return _pattern(present).sub(MASK, text)
