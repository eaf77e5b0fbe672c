"""Pure decisions: whether a rule may deliver now, where its scan starts, which verb a ledger row
calls for, where a record's outcome goes (ADR-0029's record-fault table), and when a failed record
is tried next."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from delivery.digest import canonical_digest
from delivery.domain import (
    ChainEnd,
    Connection,
    ConnectionStatus,
    Cursor,
    DeletePolicy,
    LedgerRow,
    LedgerStatus,
    Outcome,
    Rule,
    Verb,
)
from delivery.errors import (
    RecordFault,
    RecordRejected,
    RemoteGone,
    TargetUnavailable,
    Unaddressable,
    UnsendablePayload,
)

#: Retry-After values beyond this are treated as this: one day, so no answer can hold a record back
#: longer (a mistaken date would otherwise keep it unsent for years, unseen).
RETRY_AFTER_CAP_SECONDS = 86_400


def gate(rule: Rule) -> tuple[ChainEnd, str] | None:
    """The health gate: why the rule may not deliver now (disabled, or its route closed: the source
    or the target connection is not active), or None when it may."""
    if not rule.enabled:
        return ChainEnd.DISABLED, f"rule {rule.name!r} is disabled"
    closed = closed_connection(rule)
    if closed is not None:
        role, connection = closed
        return (
            ChainEnd.ROUTE_CLOSED,
            f"route closed: {role} connection {connection.name!r} is {connection.status.value}",
        )
    return None


def closed_connection(rule: Rule) -> tuple[str, Connection] | None:
    """What closes the rule's route, as (role, connection): its source or target when that is not
    active, the source first. None: the route is open (whether the rule is enabled or not)."""
    for role, connection in (("source", rule.source), ("target", rule.target)):
        if connection.status is not ConnectionStatus.ACTIVE:
            return role, connection
    return None


def rule_changed(running: Rule, saved: Rule) -> bool:
    """Whether `saved` (the rule as the database holds it now) differs from the rule a chain runs
    by in anything a job reads: policy, fields, collection, limits, retry schedule, batch size,
    concurrency, or its target's settings (timeout, token source, settle mode, breaker...). The
    cursor is the chain's own business, and the connections' statuses the gate's."""

    def settings_of(rule: Rule) -> Rule:
        return dataclasses.replace(
            rule,
            cursor=None,
            source=dataclasses.replace(rule.source, status=ConnectionStatus.ACTIVE),
            target=dataclasses.replace(rule.target, status=ConnectionStatus.ACTIVE),
        )

    return settings_of(running) != settings_of(saved)


def scan_start(rule: Rule) -> Cursor | None:
    """Where a chain's scan begins: the cursor less the overlap window, which catches changes that
    committed late with a change signal just behind the cursor."""
    if rule.cursor is None:
        return None
    return Cursor(rule.cursor.changed_at - timedelta(seconds=rule.overlap_seconds), -1)


def choose_verb(ledger: LedgerRow | None) -> Verb:
    """ADR-0015: a row holding a remote id means update by it; anything else means create.
    Nothing asks the target."""
    return Verb.UPDATE if ledger is not None and ledger.remote_id else Verb.CREATE


def create_may_be_a_replay(row: LedgerRow | None, digest: str) -> bool:
    """Whether a create about to carry the body `digest` may be answered with an older body.

    The row's `create_digest` is the digest of the first body sent under its current
    Idempotency-Key, written before that body went out; a target honouring the key keeps the first
    body it applied. Another digest there means the answer may hold that older body. A row in
    doubt cannot tell: a later body sent under the key, its answer unseen, may be the one the
    target applied first (the first send refused or lost on the way). A row from before those
    digests were kept that has been attempted already cannot tell either, so both count too."""
    if row is None or row.remote_id:
        return False
    if row.in_doubt:
        # A follow-up update, or a create with another body under the same key, went out and
        # its answer was never seen: the target may hold that body, whatever the key's first was.
        return True
    if row.create_digest is None:
        return row.attempts > 0
    return row.create_digest != digest


def identical_to_delivered(row: LedgerRow | None, digest: str) -> bool:
    """Whether an update carrying the body `digest` would change nothing in the target, so it is
    suppressed: only when the target's last answer for the record confirmed that very body. A row
    in doubt (a write went out whose answer was never recorded: a timeout, a connection lost after
    sending, a cut or a crash between send and settle) proves nothing about what the target holds,
    and its next offer is sent whatever its body."""
    return row is not None and not row.in_doubt and row.delivered_digest == digest


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


def map_payload(
    payload: Mapping[str, Any], fields: Mapping[str, str] | None, *, skip_nulls: bool = False
) -> dict[str, Any]:
    """The body a target receives: `fields` maps target field <- payload field; none = whole payload.
    A payload field that is absent is sent as null so the target field is cleared, not left stale,
    unless the rule says `nulls: skip`: then a field whose value is null is left out, and the
    target keeps its value."""
    body = dict(payload) if fields is None else {target: payload.get(source) for target, source in fields.items()}
    return {k: v for k, v in body.items() if v is not None} if skip_nulls else body


def body_digest(body: Mapping[str, Any]) -> str:
    """A stable digest of a mapped payload, to suppress writes that would change nothing."""
    return canonical_digest(body)


def idempotency_key(rule: str, external_id: str, generation: int, epoch: int = 0) -> str:
    """The same for every retry of one create (even after a crash between the target's answer and
    our ledger write); new when an operator requeues a `remote_gone` row, which bumps the
    generation, and new for every record once the rule's source or domain changes, which moves
    the epoch (a record `c-1` of the new source is not the old source's `c-1`). Built from names,
    not database ids, so a rebuilt database cannot hand one record's key to another. Epoch 0 keeps
    the form keys had before epochs existed, so creates in flight across an upgrade keep theirs."""
    parts: list[object] = ["delivery", rule, external_id, generation]
    if epoch:
        parts.append(epoch)
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:32]


# -- where a record's outcome goes ------------------------------------------------------------------


def parked(row: LedgerRow | None, status: LedgerStatus, **changes: Any) -> Outcome:
    """An outcome that is not a delivery: the row keeps what addresses the record and what was
    last delivered, unless `changes` say otherwise."""
    kept: dict[str, Any] = {
        "remote_id": row.remote_id if row else None,
        "delivered_digest": row.delivered_digest if row else None,
        "create_generation": row.create_generation if row else 0,
        "in_doubt": row.in_doubt if row else False,
        "deleting": row.deleting if row else False,
    }
    return Outcome(status, **{**kept, **changes})


def delivered(row: LedgerRow | None, remote_id: str | None, digest: str, note: str | None = None) -> Outcome:
    """The target took the write and said so: attempts reset, the error cleared (or a `note` kept),
    and what it holds known again."""
    return Outcome(
        LedgerStatus.DELIVERED,
        remote_id=remote_id,
        delivered_digest=digest,
        create_generation=row.create_generation if row else 0,
        last_error=note,
    )


def deleted(row: LedgerRow | None, remote_id: str | None) -> Outcome:
    """The target no longer holds the copy `remote_id` (it answered the delete 2xx, or 404/410:
    gone already is the same end). The row forgets the id and moves its Idempotency-Key on, so a
    record restored in the source is created again under a new key, never answered with the
    deleted copy."""
    return Outcome(
        LedgerStatus.DELETED,
        remote_id=None,
        last_error=f"deleted in the target (its id there was {remote_id})" if remote_id else None,
        create_generation=(row.create_generation if row else 0) + 1,
        key_renewed=True,
    )


def create_may_have_landed(row: LedgerRow | None) -> bool:
    """Whether a create may have made the record in the target although the row holds no remote
    id: a create went out under the row's current key (its first body's digest is kept from before
    the send until an answer gives the id), and its outcome was never learnt. A row from before
    those digests were kept counts once it has been attempted."""
    if row is None or row.remote_id:
        return False
    return row.create_digest is not None or row.in_doubt or row.attempts > 0


def plans_delete(rule: Rule, row: LedgerRow | None, record_deleted: bool) -> bool:
    """Whether a record's step sends a delete (`delivery.step.RecordStep.plan`): the record is
    deleted in the source, the rule propagates deletes, and its row holds the remote id of the
    copy this rule made; or a delete of that copy went out unanswered (it is finished first,
    whatever the source says now)."""
    if row is None or not row.remote_id:
        return False
    return row.deleting or (record_deleted and rule.deletes is DeletePolicy.PROPAGATE)


def after_delete(rule: Rule, row: LedgerRow, record_deleted: bool, now: datetime) -> Outcome:
    """Where a delete answered 2xx or 404/410 puts the row: `deleted`; or, for a record live in
    the source again (a delete in doubt finished before its restore), failed and due at once under
    a new key, so the next chain's drain creates it again as a record never delivered."""
    gone = deleted(row, row.remote_id)
    if record_deleted or Verb.CREATE not in rule.policy.verbs:
        return gone
    return dataclasses.replace(
        gone,
        status=LedgerStatus.FAILED,
        next_attempt_at=now,
        last_error=f"{gone.last_error} to finish a delete whose answer was never seen; "
        "the record is live in the source again: the next chain creates it",
    )


def created_to_delete(row: LedgerRow | None, remote_id: str | None, now: datetime) -> Outcome:
    """A create sent again for a record deleted in the source since (`create_may_have_landed`)
    was answered with `remote_id`: the row keeps it, failed and due at once, so the next chain's
    drain deletes that copy (or, the record restored meanwhile, updates it)."""
    return Outcome(
        LedgerStatus.FAILED,
        remote_id=remote_id,
        next_attempt_at=now,
        last_error=f"its create was answered with id {remote_id} after the record was deleted in the source; "
        "the next chain deletes it",
        create_generation=row.create_generation if row else 0,
    )


def after_fault(
    row: LedgerRow | None,
    fault: RecordFault,
    *,
    message: str,
    max_attempts: int,
    schedule: Sequence[int],
    now: datetime,
    remote_id: str | None = None,
    unknown: bool = False,
    outage_until: datetime | None = None,
    paused_until: datetime | None = None,
    target_healthy: bool = False,
) -> Outcome:
    """Where a record fault puts the record's ledger row (ADR-0029). `message` is the fault as the
    row will show it (already cut and cleaned of secrets); `remote_id` is an id the write got
    before failing (a create whose follow-up update failed), kept so the next attempt updates it.
    `unknown`: the write may have been applied (its answer was not seen), so the row is in doubt.

    `outage_until`: the fault is the target's and its breaker is open after it (it tripped on this
    very failure, or this was the trial call after a cooldown), until then at the earliest. An
    outage never spends a record's last attempt: the record stays failed, due once the cooldown has
    passed, so a target coming back finds it still in play rather than parked for a person.

    `paused_until`: the target answered with a pause (a 429 or 503 with Retry-After) that outlasts
    the job. That spends no attempt: the record stays failed, due the moment the pause ends.

    `target_healthy`: the breaker, read just after this failure, holds no failure but this one
    since the target's last success (someone was answered after this record's previous failure,
    and nobody else failed since). A failure that may be the target's (`TargetUnavailable`) parks
    a record only with that proof, and only once its last attempt was spent already: the failure
    that spends the last attempt leaves it failed (`awaiting_proof`), and it is sent once more, so
    a record is parked for the target's failures only when they came again after the target was
    seen answering others. An outage (the target down for everyone) therefore parks nothing,
    whether the breaker tripped yet or not, save the one case ADR-0039 names (a proof attempt that
    is the very first request of a new outage)."""
    attempts = (row.attempts if row else 0) + 1
    kept: dict[str, Any] = {}
    if unknown:
        kept["in_doubt"] = True
    if remote_id is not None:
        kept["remote_id"] = remote_id
        if row is None or row.remote_id != remote_id:
            kept["delivered_digest"] = None  # what the target holds is not known to be ours yet
    if paused_until is not None and isinstance(fault, TargetUnavailable):
        next_at = max(paused_until, now)
        return parked(
            row, LedgerStatus.FAILED, attempts=attempts - 1, next_attempt_at=next_at, last_error=message, **kept
        )
    if isinstance(fault, RemoteGone):
        return parked(row, LedgerStatus.REMOTE_GONE, attempts=attempts, last_error=message, **kept)
    if isinstance(fault, (Unaddressable, UnsendablePayload)):
        # Unaddressable: the record now exists in the target, and a second attempt would make a
        # second copy. Unsendable: a retry would meet the very same body.
        return parked(row, LedgerStatus.EXHAUSTED, attempts=attempts, last_error=message, **kept)
    if not isinstance(fault, (TargetUnavailable, RecordRejected)):
        raise TypeError(f"no outcome is defined for {type(fault).__name__}")
    retry_after = fault.retry_after_seconds if isinstance(fault, TargetUnavailable) else None
    not_before = now
    if outage_until is not None and isinstance(fault, TargetUnavailable):
        attempts = min(attempts, max(max_attempts - 1, 0))
        not_before = outage_until
    elif (
        attempts >= max_attempts
        and isinstance(fault, TargetUnavailable)
        and not (awaiting_proof(row, max_attempts) and target_healthy)
    ):
        # It may be an outage the breaker has not tripped on yet: the attempt counts, the record
        # stays in play, and it is parked only if it fails again with the target seen healthy.
        attempts = max(max_attempts, 1)
    elif attempts >= max_attempts:
        return parked(
            row,
            LedgerStatus.EXHAUSTED,
            attempts=attempts,
            last_error=f"gave up after {attempts} attempt{'' if attempts == 1 else 's'}: {message}",
            **kept,
        )
    return parked(
        row,
        LedgerStatus.FAILED,
        attempts=attempts,
        next_attempt_at=max(next_attempt_at(now, attempts, schedule, retry_after), not_before),
        last_error=message,
        **kept,
    )


def awaiting_proof(row: LedgerRow | None, max_attempts: int) -> bool:
    """A failed row whose last attempt was spent by a failure that may have been the target's: it
    is sent again, and parked only if it fails again while the target is seen healthy."""
    return row is not None and row.status is LedgerStatus.FAILED and row.attempts >= max(max_attempts, 1)
