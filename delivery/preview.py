"""What the next chain of a rule would do now, before it runs: whether it would start at all, then
the due retries (the drain's set) and the scan's first changes, each record with what the chain
would do with it (create, update, delete, suppress, or skip) and why.

The decisions are the engine's own: the health gate (`decisions.gate`), the breaker's stored state,
the writer's registry and verbs, the drain's page (`ledger.drain_page`), where the scan starts
(`decisions.scan_start`), and for each record `RecordStep.check` (which records a page may offer) and
`RecordStep.plan` (the verb, the policy, the mapped body and `identical_to_delivered`, a row in
doubt, a create that may be a replay). A preview reads everything in one read-only transaction and
writes nothing: no chain is recorded, no intent or breaker row written, no writer built, no token
read, and nothing sent.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from delivery import breaker, decisions
from delivery.clock import utcnow
from delivery.domain import Candidate, ChainEnd, Cursor, DeletePolicy, LedgerStatus, Phase, Rule, Verb
from delivery.errors import MissingWriter, UnexpectedCandidate, UnsupportedDeliveryVerb
from delivery.step import RecordStep, Send
from delivery.store import catalog, ledger, traffic
from delivery.store.preview import read_only_snapshot, scan_changes
from delivery.writers.base import Writer, verbs_of
from delivery.writers.registry import find_writer

#: How many rows of each phase a preview shows unless told otherwise, and at most.
DEFAULT_LIMIT = 50
MAX_LIMIT = 10_000

#: The reasons a preview gives that are its own words (a suppression's reason is the engine's
#: `last_error`: "identical to what was last delivered", "policy create_only excludes update",
#: "record deleted in the source; not delivered").
NEW_RECORD = "new record: no ledger row yet"
NO_REMOTE_ID = "no remote id in its ledger row"
REPLAY = "the key may have carried an older body, so an update with this body follows"
REPLAY_NOT_UPDATED = "the key may have carried an older body, which the target may keep (its writer cannot update)"
IN_DOUBT = "in doubt (an earlier write's answer was never seen): sent whatever its body"
CHANGED = "its mapped body differs from what was last delivered"
NOTHING_DELIVERED = "no body delivered under its remote id is known"
DELETED = "deleted in the source: the scan does not offer it (the rule's deletes: ignore)"
NEVER_DELIVERED = "deleted in the source: this rule never delivered it, so nothing is deleted"
DELETE = "deleted in the source: the copy this rule made is deleted in the target"
DELETE_REPLAY = (
    "deleted in the source while its create's outcome is unknown: the create is sent again under its key "
    "to learn the id, which the next chain deletes"
)
DELETE_FINISH = (
    "a delete of its copy may have been applied unanswered: the delete is sent again, and the next chain "
    "creates the record anew"
)


class Action(enum.StrEnum):
    """What the chain would do with a record."""

    CREATE = "create"
    UPDATE = "update"
    #: Deleted in the target (the record was deleted in the source, and the rule made the copy).
    DELETE = "delete"
    #: Considered and not written: the row would become `suppressed`.
    SUPPRESS = "suppress"
    #: Not offered at all (parked, deleted, or a failed row the drain retries later): the row stays.
    SKIP = "skip"


def limit_problem(limit: object) -> str | None:
    """Why `limit` is no row limit for a preview, or None."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        return f"must be a whole number from 1 to {MAX_LIMIT}, not {limit!r}"
    return None


@dataclass(frozen=True)
class Hold:
    """Why the chain would not run through now. `kind`: `disabled`, `route_closed` or
    `breaker_open` (the chain would end Completed at once, sending nothing), `rate_limited` (the
    target asked for a pause that has not ended: nothing would be sent before then), `missing_writer` (it
    would fail at once), or `missing_verb` (it would start, and fail at its first record that needs
    the verb the writer lacks)."""

    kind: str
    message: str

    @property
    def line(self) -> str:
        """The line a preview opens with."""
        if self.kind == "missing_verb":
            return f"the chain would fail (UnsupportedDeliveryVerb) at its first such record: {self.message}"
        if self.kind == "missing_writer":
            return f"the chain would fail at once (MissingWriter): {self.message}"
        return f"the chain would not start now ({self.kind}): {self.message}"

    def as_json(self) -> dict[str, str]:
        return {"kind": self.kind, "message": self.message, "line": self.line}


@dataclass(frozen=True)
class PreviewRow:
    phase: Phase
    external_id: str
    action: Action
    reason: str
    #: The record's ledger row as it stands (None: it has none yet).
    status: LedgerStatus | None
    attempts: int
    changed_at: datetime
    remote_id: str | None = None
    in_doubt: bool = False
    next_attempt_at: datetime | None = None
    last_error: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "phase": self.phase.value,
            "external_id": self.external_id,
            "action": self.action.value,
            "reason": self.reason,
            "status": self.status.value if self.status else None,
            "attempts": self.attempts,
            "changed_at": self.changed_at.isoformat(),
            "remote_id": self.remote_id,
            "in_doubt": self.in_doubt,
            "next_attempt_at": self.next_attempt_at.isoformat() if self.next_attempt_at else None,
            "last_error": self.last_error,
        }


def _zero() -> dict[str, int]:
    return {action.value: 0 for action in Action}


@dataclass(frozen=True)
class Preview:
    rule: str
    target: str
    at: datetime
    limit: int
    #: Why the chain would not run through now; None: it would start.
    hold: Hold | None
    #: The rule's cursor, and where the scan would start (the cursor less the overlap window).
    cursor: Cursor | None
    scan_from: Cursor | None
    #: The first `limit` due retries, oldest due first (as the drain takes them).
    drain: list[PreviewRow] = field(default_factory=list)
    #: The scan's first `limit` changes, in its (changed_at, id) order.
    scan: list[PreviewRow] = field(default_factory=list)
    #: More due retries, or more changes, follow those shown (the counts cover only those shown).
    drain_cut: bool = False
    scan_cut: bool = False

    @property
    def rows(self) -> list[PreviewRow]:
        """The drain's rows first, then the scan's: the order the chain meets them."""
        return [*self.drain, *self.scan]

    @property
    def counts(self) -> dict[str, int]:
        """Rows shown per action (every action named, 0 when none)."""
        return {**_zero(), **Counter(row.action.value for row in self.rows)}

    def counts_of(self, phase: Phase) -> dict[str, int]:
        return {**_zero(), **Counter(row.action.value for row in self.rows if row.phase is phase)}

    @property
    def cut(self) -> bool:
        return self.drain_cut or self.scan_cut

    @property
    def tally(self) -> str:
        """The counts in a line: `3 create, 1 update, 0 suppress, 2 skip` (deletes named only when
        there are some: most rules never delete)."""
        return ", ".join(f"{n} {action}" for action, n in self.counts.items() if n or action != Action.DELETE)

    @property
    def shown(self) -> str:
        """What the rows cover: `1 due retry, the first 50 changes` (`the first`: cut off there)."""
        drain = f"{len(self.drain)} due retr{'y' if len(self.drain) == 1 else 'ies'}"
        scan = f"{len(self.scan)} change{'' if len(self.scan) == 1 else 's'}"
        return f"{'the first ' if self.drain_cut else ''}{drain}, {'the first ' if self.scan_cut else ''}{scan}"

    @property
    def cut_note(self) -> str | None:
        """Where the rows were cut off at the limit, and what that leaves out; None: nothing was."""
        if not self.cut:
            return None
        more = " and ".join(
            what for what, cut in (("more due retries", self.drain_cut), ("more changes", self.scan_cut)) if cut
        )
        return f"cut off at limit {self.limit}: {more} follow, not counted"

    @property
    def summary(self) -> str:
        """One line: the counts, what they cover, and where they were cut off."""
        return f"{self.tally} (of {self.shown})" + (f"; {self.cut_note}" if self.cut_note else "")

    def as_json(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "target": self.target,
            "at": self.at.isoformat(),
            "limit": self.limit,
            "starts": self.hold is None or self.hold.kind == "missing_verb",
            "hold": self.hold.as_json() if self.hold else None,
            "cursor": self.cursor.as_json() if self.cursor else None,
            "scan_from": self.scan_from.as_json() if self.scan_from else None,
            "counts": self.counts,
            "drain": {"shown": len(self.drain), "cut": self.drain_cut, "counts": self.counts_of(Phase.DRAIN)},
            "scan": {"shown": len(self.scan), "cut": self.scan_cut, "counts": self.counts_of(Phase.SCAN)},
            "cut": self.cut,
            "cut_note": self.cut_note,
            "rows": [row.as_json() for row in self.rows],
        }


def preview(
    source: sa.Engine | sa.Connection, rule_name: str, limit: int = DEFAULT_LIMIT, *, now: datetime | None = None
) -> Preview:
    """What the next chain of `rule_name` would do if it started `now`: at most `limit` due retries,
    then at most `limit` of the scan's first changes. `source`: an engine (read in one read-only
    transaction of its own) or a connection whose transaction the caller holds. Raises `UnknownName`
    for a rule that does not exist and `ValueError` for a limit that is not 1 to `MAX_LIMIT`."""
    problem = limit_problem(limit)
    if problem is not None:
        raise ValueError(f"limit {problem}")
    now = now or utcnow()
    if isinstance(source, sa.Connection):
        return _preview(source, rule_name, limit, now)
    with read_only_snapshot(source) as conn:
        return _preview(conn, rule_name, limit, now)


def _preview(conn: sa.Connection, rule_name: str, limit: int, now: datetime) -> Preview:
    rule = catalog.get_rule(conn, rule_name)
    writer_type = find_writer(rule.target.driver)
    # The engine's own check and plan, over a writer of no verb that holds nothing: neither reads
    # the writer, and the verb each record needs is checked against the real writer's type below.
    step = RecordStep(rule, Writer(rule.target, rule.collection), None, lambda: now)
    verbs = verbs_of(writer_type) if writer_type is not None else None
    scan_from = decisions.scan_start(rule)
    due = ledger.drain_page(conn, rule, now, limit + 1)
    changes = scan_changes(conn, rule, scan_from, now, limit + 1)
    return Preview(
        rule=rule.name,
        target=rule.target.name,
        at=now,
        limit=limit,
        hold=_hold(conn, rule, writer_type, now),
        cursor=rule.cursor,
        scan_from=scan_from,
        drain=[_row(step, verbs, c, Phase.DRAIN) for c in due[:limit]],
        scan=[_row(step, verbs, c, Phase.SCAN) for c in changes[:limit]],
        drain_cut=len(due) > limit,
        scan_cut=len(changes) > limit,
    )


def _hold(conn: sa.Connection, rule: Rule, writer_type: type[Writer] | None, now: datetime) -> Hold | None:
    """The first thing that would stop the chain, in the order `Chain.open` meets them (the
    credential excepted: a preview reads no token), then a verb the policy uses that the writer lacks."""
    closed = decisions.gate(rule)
    if closed is not None:
        end, message = closed
        return Hold(end.value, message)
    until = breaker.stored_open_until(conn, rule.target, now)
    if until is not None:
        return Hold(ChainEnd.BREAKER_OPEN.value, breaker.open_message(rule.target.name, until))
    paused = traffic.paused_until(conn, rule.target.id, now)
    if paused is not None and paused.paused_until is not None:
        return Hold(
            ChainEnd.RATE_LIMITED.value,
            f"target {rule.target.name!r} is paused until {paused.paused_until.isoformat(timespec='seconds')} "
            f"({paused.pause_reason or 'Retry-After'}): nothing is sent before then",
        )
    if writer_type is None:
        return Hold("missing_writer", str(MissingWriter(rule.name, rule.target.driver)))
    lacking = sorted(rule.verbs - verbs_of(writer_type))
    if lacking:
        return Hold(
            "missing_verb",
            "; ".join(str(UnsupportedDeliveryVerb(rule.name, rule.target.driver, verb.value)) for verb in lacking),
        )
    return None


def _row(step: RecordStep, verbs: frozenset[Verb] | None, candidate: Candidate, phase: Phase) -> PreviewRow:
    record, row = candidate.record, candidate.ledger
    action, reason = _decide(step, verbs, candidate, phase)
    return PreviewRow(
        phase=phase,
        external_id=record.external_id,
        action=action,
        reason=reason,
        status=row.status if row else None,
        attempts=row.attempts if row else 0,
        changed_at=record.changed_at,
        remote_id=row.remote_id if row else None,
        in_doubt=row.in_doubt if row else False,
        next_attempt_at=row.next_attempt_at if row else None,
        last_error=row.last_error if row else None,
    )


def _decide(step: RecordStep, verbs: frozenset[Verb] | None, candidate: Candidate, phase: Phase) -> tuple[Action, str]:
    row = candidate.ledger
    try:
        step.check(candidate, phase)
    except UnexpectedCandidate as refused:
        # A record the phase's page does not offer: the chain passes it over and its row stays.
        if row is not None and row.status.is_terminal:
            return Action.SKIP, f"parked: {row.status.value}; only a requeue puts it back"
        if candidate.record.deleted:
            return Action.SKIP, NEVER_DELIVERED if step.rule.deletes is DeletePolicy.PROPAGATE else DELETED
        if row is not None and row.status is LedgerStatus.FAILED:
            when = row.next_attempt_at.isoformat(timespec="seconds") if row.next_attempt_at else "-"
            return Action.SKIP, f"failed, not due yet: the drain retries it from {when}"
        return Action.SKIP, str(refused)
    plan = step.plan(candidate)
    if not isinstance(plan, Send):
        return Action.SUPPRESS, plan.last_error or "suppressed"
    if plan.verb is Verb.DELETE:
        reason = DELETE if candidate.record.deleted else DELETE_FINISH
    elif plan.to_delete:
        reason = DELETE_REPLAY
    elif plan.verb is Verb.CREATE:
        reason = NEW_RECORD if row is None else NO_REMOTE_ID
        if plan.follow_up:
            updates = verbs is None or Verb.UPDATE in verbs
            reason += f"; {REPLAY}" if updates else f"; {REPLAY_NOT_UPDATED}"
    else:
        assert row is not None  # an update has a row holding the remote id
        reason = IN_DOUBT if row.in_doubt else (CHANGED if row.delivered_digest else NOTHING_DELIVERED)
    if phase is Phase.DRAIN:
        attempt, limit = (row.attempts if row else 0) + 1, step.rule.max_attempts
        proof = "; parked if it fails again with the target seen healthy" if attempt > limit else ""
        reason = f"due retry, attempt {attempt} of {limit}{proof}: {reason}"
    if verbs is not None and plan.verb not in verbs:
        reason += f"; the writer cannot {plan.verb.value}: the chain fails here (UnsupportedDeliveryVerb)"
    return Action(plan.verb.value), reason
