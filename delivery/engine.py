"""One chain of one rule: health gate, breaker check, drain, scan, and where every fault goes.

The routing is ADR-0029's: a fault that would fall the same way for every record of the rule ends
the chain and writes nothing for itself (a returned `ChainEnd`, or a raised `RuleFault`); a fault
of one record lands in that record's ledger row and the batch carries on. Nothing is rolled back:
each record's outcome is committed on its own, and the cursor moves only when a batch concludes.
The orchestration (one Prefect task per batch) lives in `flows/`; this module knows nothing of it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import pybreaker
import sqlalchemy as sa

from delivery import policy
from delivery.clock import utcnow
from delivery.domain import (
    BatchReport,
    Candidate,
    ChainEnd,
    ChainReport,
    ConnectionStatus,
    Cursor,
    LedgerStatus,
    Outcome,
    Phase,
    Rule,
    Verb,
)
from delivery.errors import (
    MissingCredential,
    MissingWriter,
    RecordRejected,
    RemoteGone,
    RuleFault,
    TargetUnavailable,
    Unaddressable,
    UnexpectedCandidate,
    UnsupportedDeliveryVerb,
)
from delivery.redact import redact
from delivery.store import catalog, chains, ledger
from delivery.store.breaker import DatabaseBreakerStorage
from delivery.writers.base import Creates, Updates, Writer, token_for
from delivery.writers.registry import find_writer

log = logging.getLogger(__name__)

#: At most this often a settle also writes the chain's heartbeat (every job writes it as it starts).
HEARTBEAT_SECONDS = 1.0

#: Faults about one record that must not count against the target's breaker.
_NOT_THE_TARGETS_FAULT = (RecordRejected, RemoteGone, Unaddressable)


def make_breaker(engine: sa.Engine, rule: Rule) -> pybreaker.CircuitBreaker:
    settings = rule.target.breaker
    return pybreaker.CircuitBreaker(
        fail_max=settings.fail_max,
        reset_timeout=settings.reset_seconds,
        exclude=list(_NOT_THE_TARGETS_FAULT),
        state_storage=DatabaseBreakerStorage(engine, rule.target.id),
        name=rule.target.name,
        # The failure that trips the breaker is still that record's failure: it must be parked
        # as failed like the ones before it, so we want the original error, not a new one.
        throw_new_error_on_trip=False,
    )


def breaker_open_until(breaker: pybreaker.CircuitBreaker, now: datetime) -> datetime | None:
    """When an open breaker lets a trial call through; None when it is not open now."""
    if breaker.current_state != pybreaker.STATE_OPEN:
        return None
    opened_at = breaker._state_storage.opened_at
    if opened_at is None:
        return None
    until = opened_at + timedelta(seconds=breaker.reset_timeout)
    return until if until > now else None


class Chain:
    """A chain in progress. `open()` once, then `run_batch()` per job, then `finish()`."""

    def __init__(
        self,
        engine: sa.Engine,
        rule_name: str,
        *,
        flow_run_id: str | None = None,
        token: str | None = None,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        """Record a new chain, or adopt `token`, the chain row the tick recorded when it launched
        this run (so that a launched run waiting for a worker already counts as alive)."""
        self.engine = engine
        self.clock = clock
        with engine.connect().execution_options(readonly=True) as conn:
            self.rule: Rule = catalog.get_rule(conn, rule_name)
        with engine.begin() as conn:
            if token is None:
                self.started_at = clock()
                self.token = chains.start_chain(conn, self.rule.id, flow_run_id, self.started_at)
            else:
                self.started_at = chains.adopt_chain(conn, token, self.rule.id, flow_run_id)
                self.token = token
        self._claimed = False
        self.report = ChainReport(
            rule=self.rule.name, token=self.token, cursor_before=self.rule.cursor, cursor_after=self.rule.cursor
        )
        self._scan_from: Cursor | None = ledger.scan_start(self.rule)
        self._writer: Writer | None = None
        self._breaker: pybreaker.CircuitBreaker | None = None
        self._secret: str | None = None
        self._beat_at = time.monotonic()

    # -- opening -------------------------------------------------------------------------------

    def open(self) -> ChainEnd | None:
        """Health gate, breaker check, writer. Returns how the chain ends when it cannot start
        (a result, not a fault); raises a `RuleFault` for a rule that is misconfigured."""
        rule = self.rule
        if not rule.enabled:
            return self._end(ChainEnd.DISABLED, f"rule {rule.name!r} is disabled")
        for role, connection in (("source", rule.source), ("target", rule.target)):
            if connection.status is not ConnectionStatus.ACTIVE:
                return self._end(
                    ChainEnd.ROUTE_CLOSED,
                    f"route closed: {role} connection {connection.name!r} is {connection.status.value}",
                )
        self._breaker = make_breaker(self.engine, rule)
        until = breaker_open_until(self._breaker, self.clock())
        if until is not None:
            return self._end(ChainEnd.BREAKER_OPEN, self._breaker_message(until))
        writer_type = find_writer(rule.target.driver)
        if writer_type is None:
            raise MissingWriter(rule.name, rule.target.driver)
        if rule.target.token_env and token_for(rule.target) is None:
            raise MissingCredential(rule.name, rule.target.name, rule.target.token_env)
        self._secret = token_for(rule.target)
        self._writer = writer_type(rule.target, rule.collection)
        return None

    def _breaker_message(self, until: datetime | None) -> str:
        when = f" until {until.isoformat(timespec='seconds')}" if until else ""
        return f"breaker open for target {self.rule.target.name!r}{when}; the connection status is unchanged"

    def _end(self, how: ChainEnd, message: str) -> ChainEnd:
        self.report.ended_by = how
        self.report.message = message
        return how

    # -- one job -------------------------------------------------------------------------------

    def run_batch(self, phase: Phase) -> BatchReport:
        """One job: a page of candidates, each delivered and settled on its own. An exception
        leaves the batch (and the chain) at once, and the cursor where it was."""
        if self._writer is None or self._breaker is None:
            raise RuntimeError("run_batch() before a successful open()")
        report = BatchReport(phase)
        rule = self.rule
        with self.engine.begin() as conn:
            if not self._claimed:
                # The first job claims the rule; the cursor is read only now, under the lock,
                # since a chain before this one may have moved it since we started.
                if not chains.claim(conn, rule.id, self.token, self.started_at):
                    return self._superseded(report)
                self._claimed = True
                cursor = catalog.get_rule(conn, rule.name).cursor
                self.report.cursor_before = self.report.cursor_after = cursor
                self._scan_from = ledger.scan_start(dataclasses.replace(rule, cursor=cursor))
            elif not chains.holds_fence(conn, rule.id, self.token):
                return self._superseded(report)
            self._heartbeat(conn, every=0)
            if phase is Phase.DRAIN:
                candidates = ledger.drain_page(conn, rule, self.started_at, rule.batch_size)
            else:
                candidates = ledger.scan_page(conn, rule, self._scan_from, rule.batch_size)
        attempted, ended = self._work(candidates, phase)
        for status in attempted:
            if status is not None:
                report.attempted += 1
                report.counts[status.value] += 1
        if ended is ChainEnd.SUPERSEDED:
            return self._superseded(report)
        if ended is ChainEnd.BREAKER_OPEN:
            report.ended_by = ended
            report.message = self._breaker_message(breaker_open_until(self._breaker, self.clock()))
        # The cursor moves past the records attempted, and only those: with writes in parallel a
        # breaker can cut a batch with holes, so it stops before the first record not attempted.
        highest: Cursor | None = None
        for candidate, status in zip(candidates, attempted, strict=True):
            if status is None:
                break
            highest = Cursor(candidate.record.changed_at, candidate.record.id)
        if phase is Phase.SCAN and candidates:
            self._scan_from = Cursor(candidates[-1].record.changed_at, candidates[-1].record.id)
        if phase is Phase.SCAN and highest is not None:
            with self.engine.begin() as conn:
                if not chains.holds_fence(conn, rule.id, self.token):
                    return self._superseded(report)
                report.cursor_after = chains.move_cursor(conn, rule.id, highest)
                self._heartbeat(conn, every=0)
        self.report.add(report)
        return report

    def _work(self, candidates: list[Candidate], phase: Phase) -> tuple[list[LedgerStatus | None], ChainEnd | None]:
        """Deliver and settle the candidates, `rule.concurrency` at a time (1: strictly in order).
        Returns each candidate's settled status (None: not attempted) and how the batch was cut
        short, if it was. The first exception stops every worker and is raised."""
        assert self._breaker is not None and self._writer is not None
        settled: list[LedgerStatus | None] = [None] * len(candidates)
        workers = min(self.rule.concurrency, len(candidates)) if self._writer.thread_safe else 1
        stop = threading.Event()
        ended: list[ChainEnd] = []
        errors: list[BaseException] = []
        pending = iter(range(len(candidates)))
        take = threading.Lock()

        def worker(breaker: pybreaker.CircuitBreaker) -> None:
            try:
                while not stop.is_set():
                    with take:
                        index = next(pending, None)
                    if index is None:
                        return
                    candidate = candidates[index]
                    self._check(candidate, phase)
                    outcome = self._deliver(candidate, breaker)
                    if outcome is None:
                        ended.append(ChainEnd.BREAKER_OPEN)
                        stop.set()
                        return
                    # A checkout per record, not a connection held for the batch: no connection
                    # waits through HTTP calls, and the pool's pre-ping guards every settle.
                    with self.engine.begin() as conn:
                        held, breaker_row = chains.holds_fence_for_settle(
                            conn, self.rule.id, self.token, self.rule.target.id
                        )
                        if isinstance(storage := breaker._state_storage, DatabaseBreakerStorage):
                            storage.observe(conn, breaker_row)
                        if not held:
                            ended.append(ChainEnd.SUPERSEDED)
                            stop.set()
                            return
                        ledger.settle(conn, self.rule, candidate, outcome, self.clock())
                        self._heartbeat(conn)
                    settled[index] = outcome.status
            except BaseException as exc:
                errors.append(exc)
                stop.set()

        if workers <= 1:
            worker(self._breaker)
        else:
            # pybreaker holds its lock across the call, so each worker gets a breaker of its own;
            # they share one state through the database, as separate processes would.
            threads = [
                threading.Thread(target=worker, args=(make_breaker(self.engine, self.rule),), daemon=True)
                for _ in range(workers)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        if errors:
            raise errors[0]
        return settled, (ChainEnd.SUPERSEDED if ChainEnd.SUPERSEDED in ended else (ended[0] if ended else None))

    def _heartbeat(self, conn: sa.Connection, *, every: float | None = None) -> None:
        """The chain's heartbeat, written with a settle at most every `HEARTBEAT_SECONDS`: the tick
        and the lock's dead-holder check judge in minutes, and a write per record would make the
        one chain row every worker's settle updates a queue of its own."""
        now = time.monotonic()
        if now - self._beat_at >= (HEARTBEAT_SECONDS if every is None else every):
            self._beat_at = now
            chains.heartbeat(conn, self.token, self.clock())

    def _superseded(self, report: BatchReport) -> BatchReport:
        report.ended_by = ChainEnd.SUPERSEDED
        report.message = f"chain superseded: another chain of rule {self.rule.name!r} took over"
        self.report.add(report)
        return report

    def _check(self, candidate: Candidate, phase: Phase) -> None:
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

    # -- one record ----------------------------------------------------------------------------

    def _deliver(self, candidate: Candidate, breaker: pybreaker.CircuitBreaker) -> Outcome | None:
        """The record's outcome, or None when the breaker refused to let the call through."""
        assert self._writer is not None
        rule, record, row = self.rule, candidate.record, candidate.ledger
        generation = row.create_generation if row else 0

        def parked(status: LedgerStatus, last_error: str, **changes: Any) -> Outcome:
            # A row that is not delivered keeps what addresses the record and what was last sent.
            return Outcome(
                status,
                remote_id=row.remote_id if row else None,
                fingerprint=row.fingerprint if row else None,
                create_generation=generation,
                last_error=last_error,
                **changes,
            )

        if record.deleted:
            # Only the drain reaches here: a failed record deleted since. There is no delete verb,
            # and sending the stale payload would be wrong, so it is considered and not written.
            return parked(LedgerStatus.SUPPRESSED, last_error="record deleted in the source; not delivered")
        verb = policy.choose_verb(row)
        if verb not in rule.policy.verbs:
            return parked(LedgerStatus.SUPPRESSED, last_error=f"policy {rule.policy.value} excludes {verb.value}")
        body = policy.map_payload(record.payload, rule.fields)
        digest = policy.fingerprint(body)
        if verb is Verb.UPDATE and row is not None and row.fingerprint == digest:
            return parked(LedgerStatus.SUPPRESSED, last_error="identical to what was last delivered")

        writer = self._writer
        try:
            if verb is Verb.CREATE:
                if not isinstance(writer, Creates):
                    raise UnsupportedDeliveryVerb(rule.name, rule.target.driver, verb.value)
                key = policy.idempotency_key(rule.name, record.external_id, generation)
                remote_id = breaker.call(writer.create, body, key)
            else:
                if not isinstance(writer, Updates):
                    raise UnsupportedDeliveryVerb(rule.name, rule.target.driver, verb.value)
                assert row is not None and row.remote_id is not None
                breaker.call(writer.update, row.remote_id, body)
                remote_id = row.remote_id
        except pybreaker.CircuitBreakerError:
            return None
        except RuleFault:
            raise
        except RemoteGone as exc:
            return parked(
                LedgerStatus.REMOTE_GONE, attempts=(row.attempts if row else 0) + 1, last_error=self._error(exc)
            )
        except Unaddressable as exc:
            # The record now exists in the target; a second attempt would make a second copy.
            return parked(
                LedgerStatus.EXHAUSTED, attempts=(row.attempts if row else 0) + 1, last_error=self._error(exc)
            )
        except (TargetUnavailable, RecordRejected) as exc:
            attempts = (row.attempts if row else 0) + 1
            if attempts >= rule.max_attempts:
                return parked(
                    LedgerStatus.EXHAUSTED,
                    attempts=attempts,
                    last_error=f"gave up after {attempts} attempts: {self._error(exc)}",
                )
            retry_after = exc.retry_after_seconds if isinstance(exc, TargetUnavailable) else None
            return parked(
                LedgerStatus.FAILED,
                attempts=attempts,
                next_attempt_at=policy.next_attempt_at(
                    self.clock(), attempts, rule.retry_schedule_seconds, retry_after
                ),
                last_error=self._error(exc),
            )
        return Outcome(
            LedgerStatus.DELIVERED,
            remote_id=remote_id,
            fingerprint=digest,
            create_generation=generation,
        )

    def _error(self, exc: Exception) -> str:
        return redact(str(exc), self._secret)[:1000]

    # -- closing -------------------------------------------------------------------------------

    def finish(self, error: BaseException | None = None) -> ChainReport:
        """Record how the chain ended. Never rolls anything back."""
        if error is not None:
            self.report.ended_by = ChainEnd.RULE_FAULT
            self.report.message = redact(f"{type(error).__name__}: {error}", self._secret)
        if self._writer is not None:
            self._writer.close()
        with self.engine.begin() as conn:
            chains.end_chain(conn, self.report, self.clock())
        return self.report

    def redact(self, text: str) -> str:
        return redact(text, self._secret)
