"""One record's step, decided and sent: is it a candidate at all, what to do with it (an outcome
reached without writing, or the write to make), and the write itself with where its fault goes.

No database here: the job (`delivery.job`) records intents and settles outcomes around these calls,
whichever sender makes them: one record at a time (`delivery.send_one`), from threads
(`delivery.send_threads`), from one event loop (`delivery.send_loop`) or in batch calls
(`delivery.send_batches`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Awaitable, Callable, Generator, Iterator
from datetime import datetime
from typing import Any

from delivery import attempts, decisions
from delivery.breaker import Refused, TargetBreaker
from delivery.domain import (
    Attempt,
    Candidate,
    ChainEnd,
    DeletePolicy,
    LedgerRow,
    LedgerStatus,
    Nulls,
    Outcome,
    Phase,
    Rule,
    Verb,
)
from delivery.errors import (
    RecordFault,
    RemoteGone,
    RuleFault,
    TargetUnavailable,
    TrafficControlFailed,
    TrafficHeld,
    Unauthorized,
    UnexpectedCandidate,
    UnsupportedDeliveryVerb,
)
from delivery.redact import redact
from delivery.storable import storable_text
from delivery.traffic import MAX_RESENDS, JobBounds, TargetTraffic
from delivery.writers.base import Creates, CreatesAsync, Deletes, DeletesAsync, Updates, UpdatesAsync, Writer

#: Written on a delivered row when a create may have been answered with an older body and the
#: target's writer cannot update: an operator should know the target may hold a stale copy.
REPLAY_NOT_UPDATABLE = (
    "created under a key that may have carried an older body; the target's writer cannot update, "
    "so the target may hold that older body"
)


@dataclasses.dataclass(frozen=True)
class Send:
    """A write to make: the verb, the mapped body and its digest. `follow_up`: a create that may
    be answered with an older body under its key (`decisions.create_may_be_a_replay`), to be followed
    by an update with this body. `to_delete`: a create sent again under its key for a record
    deleted in the source since its create went out unanswered, only to learn the id the target
    gave it, which the next chain deletes."""

    verb: Verb
    body: dict[str, Any]
    digest: str
    follow_up: bool = False
    to_delete: bool = False


#: Runs a blocking call on a thread and awaits it (the async job's; see `RecordStep.call_async`).
OffLoop = Callable[..., Awaitable[Any]]


class Stopped(Exception):
    """The job stopped while a call waited for the target's traffic: the call was not made."""


#: What stops a call before it is made: the breaker refused it, the target's traffic holds it past
#: the job's deadline, or the job stopped while it waited.
NOT_SENT = (Refused, TrafficHeld, Stopped)


def not_sent_end(held: BaseException) -> ChainEnd | None:
    """How a batch ends when a call was not made (`NOT_SENT`): None for a job that stopped."""
    if isinstance(held, Refused):
        return ChainEnd.BREAKER_OPEN
    return ChainEnd.RATE_LIMITED if isinstance(held, TrafficHeld) else None


class RecordStep:
    """Check, plan and send one record of `rule` through `writer`, each call admitted by the
    target's `traffic` first. Thread-safe as far as the writer is: it holds no state of its own
    between calls."""

    def __init__(
        self,
        rule: Rule,
        writer: Writer,
        secret: str | None,
        clock: Callable[[], datetime],
        traffic: TargetTraffic | None = None,
        chain_run_id: str | None = None,
    ) -> None:
        self.rule = rule
        self.writer = writer
        self.secret = secret
        self.clock = clock
        self.traffic = traffic
        #: The chain's flow run, named in the record's history of each request it makes.
        self.chain_run_id = chain_run_id

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
        elif phase is Phase.SCAN and record.deleted and not (self._propagates and self._may_hold_a_copy(row)):
            why = "it is deleted" + ("" if self._propagates else " and the rule does not propagate deletes")
        elif phase is Phase.SCAN and row is not None and row.status is LedgerStatus.FAILED:
            why = "it is failed, and failed rows belong to the drain"
        elif phase is Phase.SCAN and row is not None and row.settled_changed_at == record.changed_at:
            why = "its ledger row already settled this change"
        if why is not None:
            raise UnexpectedCandidate(rule.name, record.external_id, why)

    @property
    def _propagates(self) -> bool:
        return self.rule.deletes is DeletePolicy.PROPAGATE

    @staticmethod
    def _may_hold_a_copy(row: LedgerRow | None) -> bool:
        """Whether the target holds, or may hold, a copy this rule made of the record."""
        return row is not None and (bool(row.remote_id) or decisions.create_may_have_landed(row))

    def plan(self, candidate: Candidate) -> Outcome | Send:
        """What to do with a record, decided from its ledger row alone: an outcome reached without
        writing (suppressed), or the write to make."""
        rule, record, row = self.rule, candidate.record, candidate.ledger
        body = decisions.map_payload(record.payload, rule.fields, skip_nulls=rule.nulls is Nulls.SKIP)
        digest = decisions.body_digest(body)
        if decisions.plans_delete(rule, row, record.deleted):
            # The record's copy is deleted; or a delete of it went out and its answer was never
            # seen, which is finished first whatever the source says now (a live record is then
            # created again under a new key, by the next chain's drain).
            return Send(Verb.DELETE, body, digest)
        if record.deleted:
            if rule.deletes is DeletePolicy.PROPAGATE and decisions.create_may_have_landed(row):
                # Its create went out and its answer was never seen: sent again under its key, the
                # target answers with the record it made (none is made twice), which the next
                # chain then deletes. A copy left behind unseen would never be deleted.
                return Send(Verb.CREATE, body, digest, to_delete=True)
            # Only the drain reaches here: a failed record deleted since, which this rule never
            # delivered (or does not delete). Sending the stale payload would be wrong.
            return decisions.parked(
                row, LedgerStatus.SUPPRESSED, last_error="record deleted in the source; not delivered"
            )
        verb = decisions.choose_verb(row)
        if verb not in rule.policy.verbs:
            excluded = f"policy {rule.policy.value} excludes {verb.value}"
            return decisions.parked(row, LedgerStatus.SUPPRESSED, last_error=excluded)
        if verb is Verb.UPDATE and decisions.identical_to_delivered(row, digest):
            return decisions.parked(row, LedgerStatus.SUPPRESSED, last_error="identical to what was last delivered")
        return Send(verb, body, digest, follow_up=verb is Verb.CREATE and decisions.create_may_be_a_replay(row, digest))

    def carry_out(
        self,
        candidate: Candidate,
        plan: Outcome | Send,
        intent: LedgerRow | None,
        breaker: TargetBreaker,
        bounds: JobBounds,
    ) -> tuple[Candidate, Outcome] | ChainEnd | None:
        """The plan carried out: an outcome reached without writing, or the write sent (the
        candidate then carries its create's intent row, which the settle checks). Nothing went out
        when it returns how the batch must end instead (`breaker_open`: the breaker refused the
        call; `rate_limited`: the target's traffic holds it past the job's deadline), or None (the
        job stopped while the call waited for the target's traffic)."""
        if not isinstance(plan, Send):
            return candidate, plan
        outcome = self.send(candidate, plan, intent, breaker, bounds)
        if outcome is None or isinstance(outcome, ChainEnd):
            return outcome
        return (candidate if intent is None else Candidate(candidate.record, intent)), outcome

    def send(
        self,
        candidate: Candidate,
        plan: Send,
        intent: LedgerRow | None,
        breaker: TargetBreaker,
        bounds: JobBounds,
    ) -> Outcome | ChainEnd | None:
        """Make the write; the outcome it leads to, or (nothing went out) how the batch must end,
        or None (see `carry_out`). The outcome is reckoned from the row as the page read it: the
        intent written before the send (the candidate then carries it, for the settle's version
        check) is no outcome."""
        sending = self._sending(candidate, plan, breaker, asynchronous=False)
        answer: Any = None
        error: Exception | None = None
        tried: list[Attempt] = []
        while True:
            try:
                verb, args = sending.send(answer) if error is None else sending.throw(error)
            except StopIteration as done:
                return self.with_tried(done.value, tried)
            method = getattr(self.writer, verb.value)  # create, update, delete: the type offers it (`_sending`)
            with self.listening(verb) as heard:
                try:
                    answer, error = self.call(breaker, bounds, method, *args), None
                except Exception as exc:
                    answer, error = None, exc
            tried.extend(heard)

    async def carry_out_async(
        self,
        candidate: Candidate,
        plan: Outcome | Send,
        intent: LedgerRow | None,
        breaker: TargetBreaker,
        bounds: JobBounds,
        off_loop: OffLoop,
    ) -> tuple[Candidate, Outcome] | ChainEnd | None:
        """`carry_out` on the job's event loop, through the writer's async verbs. `off_loop` runs
        what may block (a wait for the target's traffic, its database writes) on a thread."""
        if not isinstance(plan, Send):
            return candidate, plan
        outcome = await self.send_async(candidate, plan, intent, breaker, bounds, off_loop)
        if outcome is None or isinstance(outcome, ChainEnd):
            return outcome
        return (candidate if intent is None else Candidate(candidate.record, intent)), outcome

    async def send_async(
        self,
        candidate: Candidate,
        plan: Send,
        intent: LedgerRow | None,
        breaker: TargetBreaker,
        bounds: JobBounds,
        off_loop: OffLoop,
    ) -> Outcome | ChainEnd | None:
        """`send` through the writer's async verbs: the same decisions (`_sending`), the calls
        awaited. A cancellation (the job's end) leaves at the call in flight, deciding nothing."""
        sending = self._sending(candidate, plan, breaker, asynchronous=True)
        answer: Any = None
        error: Exception | None = None
        tried: list[Attempt] = []
        while True:
            try:
                verb, args = sending.send(answer) if error is None else sending.throw(error)
            except StopIteration as done:
                return self.with_tried(done.value, tried)
            method = getattr(self.writer, f"a{verb.value}")  # acreate, aupdate, adelete
            with self.listening(verb) as heard:
                try:
                    answer, error = await self.call_async(breaker, bounds, off_loop, method, *args), None
                except Exception as exc:
                    answer, error = None, exc
            tried.extend(heard)

    def listening(self, verb: Verb) -> attempts.Listening:
        """Hears the requests of one call of `verb`, as the record's history keeps them."""
        return attempts.Listening(self.rule.target.name, verb.value, self.chain_run_id)

    @staticmethod
    def with_tried(result: Outcome | ChainEnd | None, tried: list[Attempt]) -> Outcome | ChainEnd | None:
        """`result` carrying the requests that led to it (an outcome; nothing else is settled)."""
        if isinstance(result, Outcome) and tried:
            # The dataclass's own constructor, field by field: `dataclasses.replace` costs twice as
            # much, and this runs once per record.
            return Outcome(**{**vars(result), "tried": (*result.tried, *tried)})
        return result

    def _sending(
        self, candidate: Candidate, plan: Send, breaker: TargetBreaker, *, asynchronous: bool
    ) -> Generator[tuple[Verb, tuple[Any, ...]], Any, Outcome | ChainEnd | None]:
        """The write's decisions, for `send` and `send_async` alike: yields each call to make (its
        verb and arguments) and is sent its answer or thrown its exception; returns the outcome."""
        if plan.verb is Verb.DELETE:
            return (yield from self._deleting(candidate, plan, breaker, asynchronous=asynchronous))
        rule, record, row = self.rule, candidate.record, candidate.ledger
        creates, updates = (CreatesAsync, UpdatesAsync) if asynchronous else (Creates, Updates)
        writer = self.writer
        remote_id = row.remote_id if row else None
        #: The mirrored record, for a writer whose requests are described by templates.
        extra = (record,) if writer.takes_record else ()
        #: Whether the call that failed, if one did, may have changed the record's body in the
        #: target: an update, or a create carrying a body other than the first one sent under its
        #: key (`plan.follow_up`). That first send may never have been applied (refused, dropped,
        #: the target down), so a later send under the same key, its answer unseen, may be the one
        #: that made the record: the row's create_digest then no longer says what it holds.
        updating = plan.verb is Verb.UPDATE or plan.follow_up
        try:
            if plan.verb is Verb.CREATE:
                if not isinstance(writer, creates):
                    raise UnsupportedDeliveryVerb(rule.name, rule.target.driver, plan.verb.value)
                generation = row.create_generation if row else 0
                key = decisions.idempotency_key(rule.name, record.external_id, generation, rule.key_epoch)
                remote_id = yield Verb.CREATE, (plan.body, key, *extra)
                if plan.to_delete:
                    return decisions.created_to_delete(row, remote_id, self.clock())
                if plan.follow_up:
                    # The same key may have carried an older body before (a crash before the
                    # settle, a timeout after the target took it): a target that honours the key
                    # answers with the record it made then and keeps that body. Make it ours.
                    if not isinstance(writer, updates):
                        return decisions.delivered(row, remote_id, plan.digest, note=REPLAY_NOT_UPDATABLE)
                    updating = True
                    yield Verb.UPDATE, (remote_id, plan.body, *extra)
            else:
                if not isinstance(writer, updates):
                    raise UnsupportedDeliveryVerb(rule.name, rule.target.driver, plan.verb.value)
                assert remote_id is not None
                yield Verb.UPDATE, (remote_id, plan.body, *extra)
        except NOT_SENT as held:
            if plan.verb is Verb.CREATE and remote_id is not None:
                # The create went through and the follow-up update was not sent: keep the id, and
                # no delivered digest, so the next attempt updates.
                why = "breaker open" if isinstance(held, Refused) else "traffic held"
                refused = TargetUnavailable(f"{why} before the follow-up update", outcome_unknown=False)
                return self._after(row, refused, remote_id, breaker)
            return not_sent_end(held)
        except Unauthorized as fault:
            raise fault.for_rule(rule.name) from fault
        except RuleFault:
            raise
        except RecordFault as fault:
            unknown = updating and isinstance(fault, TargetUnavailable) and fault.outcome_unknown
            return self._after(row, fault, remote_id, breaker, unknown=unknown)
        return decisions.delivered(row, remote_id, plan.digest)

    def _deleting(
        self, candidate: Candidate, plan: Send, breaker: TargetBreaker, *, asynchronous: bool
    ) -> Generator[tuple[Verb, tuple[Any, ...]], Any, Outcome | ChainEnd | None]:
        """A delete's decisions (see `_sending`): the row's copy deleted. 2xx and 404/410 both end
        it (`decisions.after_delete`); a fault of the target leaves the row failed and, where the
        delete may have been applied, `deleting`."""
        rule, record, row = self.rule, candidate.record, candidate.ledger
        assert row is not None and row.remote_id is not None  # a delete has a row holding the remote id
        if not isinstance(self.writer, DeletesAsync if asynchronous else Deletes):
            raise UnsupportedDeliveryVerb(rule.name, rule.target.driver, Verb.DELETE.value)
        try:
            yield Verb.DELETE, (row.remote_id, *((record, plan.body) if self.writer.takes_record else ()))
        except NOT_SENT as held:
            return not_sent_end(held)
        except Unauthorized as fault:
            raise fault.for_rule(rule.name) from fault
        except RuleFault:
            raise
        except RemoteGone:
            pass  # gone already: the same end
        except RecordFault as fault:
            return self._after_delete_fault(row, fault, breaker)
        return decisions.after_delete(rule, row, record.deleted, self.clock())

    def _after_delete_fault(self, row: LedgerRow, fault: RecordFault, breaker: TargetBreaker) -> Outcome:
        """A delete that failed: as any write's failure, the row keeping its remote id, and
        `deleting` where the delete may have been applied (or an earlier one may have)."""
        outcome = self._after(row, fault, row.remote_id, breaker)
        unknown = isinstance(fault, TargetUnavailable) and fault.outcome_unknown
        return dataclasses.replace(outcome, deleting=row.deleting or unknown)

    def call(self, breaker: TargetBreaker, bounds: JobBounds, call: Callable[..., Any], *args: Any) -> Any:
        """One request: admitted by the target's traffic, made through its breaker. A pause the
        target asks for (a 429 or 503 with Retry-After) is waited out and the same request made
        again, since the target says it did nothing with it, unless the pause outlasts the job (or
        the request met `MAX_RESENDS` pauses already): then the fault reaches the record, which
        waits for the pause's end without spending an attempt."""
        if self.traffic is None:
            raise RuntimeError("a step that sends needs the target's traffic control")
        for resend in range(MAX_RESENDS + 1):
            with self._admission():
                if not self.traffic.admit(bounds):
                    raise Stopped
            try:
                return breaker.call(call, *args)
            except TargetUnavailable as fault:
                last = resend == MAX_RESENDS
                if not fault.pauses_target or self.traffic.pause(fault) > bounds.deadline or last:
                    raise
        raise AssertionError("unreachable: the last resend returns or raises")

    async def call_async(
        self,
        breaker: TargetBreaker,
        bounds: JobBounds,
        off_loop: OffLoop,
        call: Callable[..., Awaitable[Any]],
        *args: Any,
    ) -> Any:
        """`call` for a coroutine verb. Admission costs no thread while the target needs no wait
        and no read (`TargetTraffic.admits_at_once`); its database reads and writes (a slot, a
        pause) go `off_loop`, its waits are spent on the loop (`TargetTraffic.admit_async`).
        The breaker is entered and left on the loop (pybreaker's `calling`, which holds its lock
        only while it decides, not across the call): its database reads are served by the row the
        job's settles read (`Fence.held_for`), and only a failure writes."""
        traffic = self.traffic
        if traffic is None:
            raise RuntimeError("a step that sends needs the target's traffic control")
        for resend in range(MAX_RESENDS + 1):
            with self._admission():
                if not (traffic.admits_at_once() or await traffic.admit_async(bounds, off_loop)):
                    raise Stopped
            try:
                with breaker.calling():
                    return await call(*args)
            except TargetUnavailable as fault:
                last = resend == MAX_RESENDS
                if not fault.pauses_target or await off_loop(traffic.pause, fault) > bounds.deadline or last:
                    raise
        raise AssertionError("unreachable: the last resend returns or raises")

    @contextlib.contextmanager
    def _admission(self) -> Iterator[None]:
        """Whatever leaves the traffic control other than its own answers (held, stopped) is a
        fault of the rule raised before anything was sent: the job takes the intent back."""
        try:
            yield
        except (TrafficHeld, Stopped, TimeoutError):
            raise  # its own answers, and the job's timeout raised into the thread that waits
        except Exception as exc:
            raise TrafficControlFailed(self.rule.name, self.rule.target.name, exc) from exc

    def item_outcome(self, candidate: Candidate, plan: Send, result: Any, breaker: TargetBreaker) -> Outcome:
        """The outcome of one record sent in a batch call, from its item's result: the remote id
        (a create) or None (an update) when it was applied, or the `RecordFault` it met (the
        whole call's, when the call failed as a whole). The same outcome `send` reckons for a
        record sent on its own."""
        row = candidate.ledger
        remote_id = row.remote_id if row is not None and plan.verb is not Verb.CREATE else None
        if plan.verb is Verb.DELETE:
            assert row is not None
            if result is None or isinstance(result, RemoteGone):  # 404/410: gone already, the same end
                return decisions.after_delete(self.rule, row, candidate.record.deleted, self.clock())
            return self._after_delete_fault(row, result, breaker)
        if isinstance(result, RecordFault):
            updating = plan.verb is Verb.UPDATE or plan.follow_up  # as in `_sending`
            unknown = updating and isinstance(result, TargetUnavailable) and result.outcome_unknown
            return self._after(row, result, remote_id, breaker, unknown=unknown)
        return decisions.delivered(row, str(result) if plan.verb is Verb.CREATE else remote_id, plan.digest)

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
        paused_until = None
        if isinstance(fault, TargetUnavailable) and fault.pauses_target and self.traffic is not None:
            paused_until = self.traffic.pause_end(fault, now)
        # Read only after the target's own failures: whether it is down now, the cooldown's end.
        outage_until = None
        healthy = False
        if isinstance(fault, TargetUnavailable) and paused_until is None:
            outage_until = breaker.outage_until(now)
            if outage_until is None and decisions.awaiting_proof(row, self.rule.max_attempts):
                # A whole batch call's failure is one failure for the breaker but every item's: it
                # proves nothing about any one of them.
                healthy = not fault.whole_call and breaker.failures_since_success() <= 1
        return decisions.after_fault(
            row,
            fault,
            message=storable_text(redact(str(fault), self.secret))[:1000],
            max_attempts=self.rule.max_attempts,
            schedule=self.rule.retry_schedule_seconds,
            now=now,
            remote_id=remote_id,
            unknown=unknown,
            outage_until=outage_until,
            paused_until=paused_until,
            target_healthy=healthy,
        )
