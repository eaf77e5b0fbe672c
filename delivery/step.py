"""One record's step, decided and sent: is it a candidate at all, what to do with it (an outcome
reached without writing, or the write to make), and the write itself with where its fault goes.

No database here: the chain records intents and settles outcomes around these calls, on its own
(`delivery.chain`) or in groups (`delivery.grouped`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import datetime
from typing import Any

import pybreaker

from delivery import policy
from delivery.breaker import TargetBreaker
from delivery.domain import Candidate, LedgerRow, LedgerStatus, Outcome, Phase, Rule, Verb
from delivery.errors import (
    RecordFault,
    RuleFault,
    TargetUnavailable,
    Unauthorized,
    UnexpectedCandidate,
    UnsupportedDeliveryVerb,
)
from delivery.redact import redact
from delivery.storable import storable_text
from delivery.writers.base import Creates, Updates, Writer

#: Written on a delivered row when a create may have been answered with an older body and the
#: target's writer cannot update: an operator should know the target may hold a stale copy.
REPLAY_NOT_UPDATABLE = (
    "created under a key that may have carried an older body; the target's writer cannot update, "
    "so the target may hold that older body"
)


@dataclasses.dataclass(frozen=True)
class Send:
    """A write to make: the verb, the mapped body and its digest. `follow_up`: a create that may
    be answered with an older body under its key (`policy.create_may_be_a_replay`), to be followed
    by an update with this body."""

    verb: Verb
    body: dict[str, Any]
    digest: str
    follow_up: bool = False


class RecordStep:
    """Check, plan and send one record of `rule` through `writer`. Thread-safe as far as the
    writer is: it holds no state of its own between calls."""

    def __init__(self, rule: Rule, writer: Writer, secret: str | None, clock: Callable[[], datetime]) -> None:
        self.rule = rule
        self.writer = writer
        self.secret = secret
        self.clock = clock

    def check(self, candidate: Candidate, phase: Phase) -> None:
        """A candidate the query should never have returned is a broken invariant, raised and never
        skipped: a skipped change would leave no trace of never having been delivered."""
        record, row, rule = candidate.record, candidate.ledger, self.rule
        why = None
        if record.source_id != rule.source.id or record.domain != rule.domain:
            why = "it belongs to another source or domain"
        elif row is not None and row.rule_id != rule.id:
            why = "its ledger row belongs to another rule"
        elif row is not None and row.status.is_terminal:
            why = f"its ledger row is terminal ({row.status.value})"
        elif phase is Phase.DRAIN and (row is None or row.status is not LedgerStatus.FAILED):
            why = "the drain offered a row that is not failed"
        elif phase is Phase.SCAN and record.deleted:
            why = "it is deleted"
        elif phase is Phase.SCAN and row is not None and row.status is LedgerStatus.FAILED:
            why = "it is failed, and failed rows belong to the drain"
        elif phase is Phase.SCAN and row is not None and row.settled_changed_at == record.changed_at:
            why = "its ledger row already settled this change"
        if why is not None:
            raise UnexpectedCandidate(rule.name, record.external_id, why)

    def plan(self, candidate: Candidate) -> Outcome | Send:
        """What to do with a record, decided from its ledger row alone: an outcome reached without
        writing (suppressed), or the write to make."""
        rule, record, row = self.rule, candidate.record, candidate.ledger
        if record.deleted:
            # Only the drain reaches here: a failed record deleted since. There is no delete verb,
            # and sending the stale payload would be wrong, so it is considered and not written.
            return policy.parked(row, LedgerStatus.SUPPRESSED, last_error="record deleted in the source; not delivered")
        verb = policy.choose_verb(row)
        if verb not in rule.policy.verbs:
            excluded = f"policy {rule.policy.value} excludes {verb.value}"
            return policy.parked(row, LedgerStatus.SUPPRESSED, last_error=excluded)
        body = policy.map_payload(record.payload, rule.fields)
        digest = policy.fingerprint(body)
        if verb is Verb.UPDATE and policy.identical_to_delivered(row, digest):
            return policy.parked(row, LedgerStatus.SUPPRESSED, last_error="identical to what was last delivered")
        return Send(verb, body, digest, follow_up=verb is Verb.CREATE and policy.create_may_be_a_replay(row, digest))

    def carry_out(
        self, candidate: Candidate, plan: Outcome | Send, intent: LedgerRow | None, breaker: TargetBreaker
    ) -> tuple[Candidate, Outcome] | None:
        """The plan carried out: an outcome reached without writing, or the write sent (the
        candidate then carries its create's intent row, which the settle checks). None when the
        breaker refused the call: nothing went out."""
        if not isinstance(plan, Send):
            return candidate, plan
        outcome = self.send(candidate, plan, intent, breaker)
        if outcome is None:
            return None
        return (candidate if intent is None else Candidate(candidate.record, intent)), outcome

    def send(
        self, candidate: Candidate, plan: Send, intent: LedgerRow | None, breaker: TargetBreaker
    ) -> Outcome | None:
        """Make the write; the outcome it leads to, or None when the breaker refused the call.
        The outcome is reckoned from the row as the page read it: the intent written before the
        send (the candidate then carries it, for the settle's version check) is no outcome."""
        rule, record, row = self.rule, candidate.record, candidate.ledger
        writer = self.writer
        remote_id = row.remote_id if row else None
        #: Whether the call that failed, if one did, may have changed the record's body in the
        #: target (an update, or a replayed create's follow-up): a create alone leaves the key's
        #: first body, which the row's create_fingerprint knows already.
        updating = plan.verb is Verb.UPDATE
        try:
            if plan.verb is Verb.CREATE:
                if not isinstance(writer, Creates):
                    raise UnsupportedDeliveryVerb(rule.name, rule.target.driver, plan.verb.value)
                generation = row.create_generation if row else 0
                key = policy.idempotency_key(rule.name, record.external_id, generation, rule.key_epoch)
                remote_id = breaker.call(writer.create, plan.body, key)
                if plan.follow_up:
                    # The same key may have carried an older body before (a crash before the
                    # settle, a timeout after the target took it): a target that honours the key
                    # answers with the record it made then and keeps that body. Make it ours.
                    if not isinstance(writer, Updates):
                        return policy.delivered(row, remote_id, plan.digest, note=REPLAY_NOT_UPDATABLE)
                    updating = True
                    breaker.call(writer.update, remote_id, plan.body)
            else:
                if not isinstance(writer, Updates):
                    raise UnsupportedDeliveryVerb(rule.name, rule.target.driver, plan.verb.value)
                assert remote_id is not None
                breaker.call(writer.update, remote_id, plan.body)
        except pybreaker.CircuitBreakerError:
            if plan.verb is Verb.CREATE and remote_id is not None:
                # The create went through and the follow-up update was refused: keep the id, and
                # no fingerprint, so the next attempt updates.
                refused = TargetUnavailable("breaker open before the follow-up update", outcome_unknown=False)
                return self._after(row, refused, remote_id, breaker)
            return None
        except Unauthorized as fault:
            raise fault.for_rule(rule.name) from fault
        except RuleFault:
            raise
        except RecordFault as fault:
            unknown = updating and isinstance(fault, TargetUnavailable) and fault.outcome_unknown
            return self._after(row, fault, remote_id, breaker, unknown=unknown)
        return policy.delivered(row, remote_id, plan.digest)

    def _after(
        self,
        row: LedgerRow | None,
        fault: RecordFault,
        remote_id: str | None,
        breaker: TargetBreaker,
        *,
        unknown: bool = False,
    ) -> Outcome:
        now = self.clock()
        # Read only after the target's own failures: whether it is down now, the cooldown's end.
        outage_until = breaker.outage_until(now) if isinstance(fault, TargetUnavailable) else None
        return policy.after_fault(
            row,
            fault,
            message=storable_text(redact(str(fault), self.secret))[:1000],
            max_attempts=self.rule.max_attempts,
            schedule=self.rule.retry_schedule_seconds,
            now=now,
            remote_id=remote_id,
            unknown=unknown,
            outage_until=outage_until,
        )
