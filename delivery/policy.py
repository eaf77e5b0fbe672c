"""Pure decisions: which verb a ledger row calls for, and when a failed record is tried next."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from delivery.domain import LedgerRow, Verb

#: Retry-After values beyond this are treated as this: one day (the issue's cap).
RETRY_AFTER_CAP_SECONDS = 86_400


def choose_verb(ledger: LedgerRow | None) -> Verb:
    """ADR-0015: a row holding a remote id means update by it; anything else means create.
    Nothing asks the target."""
    return Verb.UPDATE if ledger is not None and ledger.remote_id else Verb.CREATE


def next_attempt_at(
    now: datetime,
    attempts: int,
    schedule: Sequence[int],
    retry_after_seconds: float | None = None,
) -> datetime:
    """When the `attempts`-th failure is tried again: the schedule's step for it (the last step
    repeats), but never before the target's Retry-After (capped at one day)."""
    step = schedule[min(max(attempts, 1), len(schedule)) - 1] if schedule else 60
    delay = float(step)
    if retry_after_seconds is not None:
        delay = max(delay, min(max(retry_after_seconds, 0.0), RETRY_AFTER_CAP_SECONDS))
    return now + timedelta(seconds=delay)


def map_payload(payload: Mapping[str, Any], fields: Mapping[str, str] | None) -> dict[str, Any]:
    """The body a target receives: `fields` maps target field <- payload field; none = whole payload.
    A payload field that is absent is sent as null so the target field is cleared, not left stale."""
    if fields is None:
        return dict(payload)
    return {target: payload.get(source) for target, source in fields.items()}


def fingerprint(body: Mapping[str, Any]) -> str:
    """A stable digest of a mapped payload, to suppress writes that would change nothing."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def idempotency_key(rule: str, external_id: str, generation: int) -> str:
    """The same for every retry of one create (even after a crash between the target's answer and
    our ledger write, since nothing needs storing first); new when an operator requeues a
    `remote_gone` row, which bumps the generation. Built from names, not database ids, so a
    rebuilt database cannot hand one record's key to another."""
    raw = json.dumps(["delivery", rule, external_id, generation])
    return hashlib.sha256(raw.encode()).hexdigest()[:32]
