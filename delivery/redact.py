"""Keep secrets out of everything we write: ledger errors, logs, artifacts, exceptions."""

from __future__ import annotations

MASK = "***"


def redact(text: str, *secrets: str | None) -> str:
    for secret in secrets:
        if secret:
            text = text.replace(secret, MASK)
    return text
