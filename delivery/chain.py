"""One chain of one rule: health gate, breaker check, drain, scan, and where every fault goes.

The routing is ADR-0029's: a fault that would fall the same way for every record of the rule ends
the chain and writes nothing for itself (a returned `ChainEnd`, or a raised `RuleFault`); a fault
of one record lands in that record's ledger row and the batch carries on. Nothing is rolled back:
each record's outcome is its own ledger write, committed on its own or with others in a bounded group
(the target connection's `settle`, see `delivery.settle`), and the cursor moves only when a batch
concludes, after every outcome of the batch is committed.
This module holds the chain's life: it opens and closes the chain, claims the rule and reads each
job's page (`_start_job`), builds the job's narrow context (`delivery.job.JobContext`) and has the
one job (`delivery.job.Job`) made for it, its sender and its settle chosen in one place
(`delivery.senders.choose`) from the writer and the connection; then it moves the cursor past what
the job attempted (`cursor_after`, pure). No job, sender or settle module imports this one. One
record's check, plan and send are `delivery.step`'s.
The orchestration (one Prefect task per batch) lives in `flows/`; this module knows nothing of it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa

from delivery import decisions, liveness
from delivery.breaker import BreakerListener, TargetBreaker, open_message
from delivery.clock import SYSTEM, Clock
from delivery.domain import (
    BatchReport,
    Candidate,
    ChainEnd,
    ChainReport,
    Cursor,
    LedgerStatus,
    LeftBehind,
    Phase,
    Rule,
)
from delivery.errors import (
    MissingCredential,
    MissingWriter,
    TooManyDeletes,
    UnusableCredential,
)
from delivery.job import Fence, Heartbeat, JobContext, Sender
from delivery.redact import redact
from delivery.senders import choose, job_for
from delivery.settings import settings
from delivery.settle import Settle
from delivery.step import RecordStep
from delivery.storable import storable_text
from delivery.store import catalog, chains, ledger
from delivery.store.oauth import RefreshTokens
from delivery.traffic import TargetTraffic, TrafficListener
from delivery.writers.base import (
    SecretReader,
    Writer,
    accepts_concurrency,
    accepts_credentials,
    credentials_for,
    secret_sources,
    token_for,
    token_problem,
    token_source,
)
from delivery.writers.registry import writer_for

log = logging.getLogger(__name__)

#: Seconds a job keeps in hand before its timeout, beyond one request's own timeout: a wait for
#: the target's traffic never runs the job into its timeout (which would fail the chain).
JOB_DEADLINE_MARGIN_SECONDS = 5.0


def cursor_after(
    candidates: Sequence[Candidate], attempted: Sequence[LedgerStatus | None], since: Cursor | None
) -> Cursor | None:
    """Where a scan job moves the cursor, pure: past the page's records attempted (`attempted[i]`
    not None), and only those. With writes in parallel a breaker can cut a batch with holes, so it
    stops before the first record not attempted. `since` is where the page was read from: a cursor
    not past it is no move (None), so the cursor never goes backwards."""
    highest: Cursor | None = None
    for candidate, status in zip(candidates, attempted, strict=True):
        if status is None:
            break
        highest = Cursor(candidate.record.changed_at, candidate.record.id)
    if highest is None or (since is not None and highest <= since):
        return None
    return highest


class Chain:
    """A chain in progress. `open()` once, then `run_batch()` per job, then `finish()`."""

    def __init__(
        self,
        engine: sa.Engine,
        rule_name: str,
        *,
        flow_run_id: str | None = None,
        token: str | None = None,
        clock: Clock = SYSTEM,
        breaker_listeners: Sequence[BreakerListener] = (),
        traffic_listeners: Sequence[TrafficListener] = (),
    ) -> None:
        """Record a new chain, or adopt `token`, the chain row the tick recorded when it launched
        this run (so that a launched run waiting for a worker already counts as alive).
        `breaker_listeners` are attached to every breaker of the chain (the flows layer's way to
        hear of a trip, which this module reports only as how a batch ended); `traffic_listeners`
        to the target's traffic control (a pause and its end)."""
        self.engine = engine
        self.clock = clock
        self.flow_run_id = flow_run_id
        self._breaker_listeners = tuple(breaker_listeners)
        self._traffic_listeners = tuple(traffic_listeners)
        with engine.connect().execution_options(readonly=True) as conn:
            self.rule: Rule = catalog.get_rule(conn, rule_name)
        with engine.begin() as conn:
            if token is None:
                self.started_at = clock()
                self.token = chains.start_chain(conn, self.rule.id, flow_run_id, self.started_at)
            else:
                self.started_at = chains.adopt_chain(conn, token, self.rule.id, flow_run_id, clock())
                self.token = token
        self._claimed = False
        self._cursor_read = False
        self.report = ChainReport(
            rule=self.rule.name, token=self.token, cursor_before=self.rule.cursor, cursor_after=self.rule.cursor
        )
        self._scan_from: Cursor | None = decisions.scan_start(self.rule)
        self._writer: Writer | None = None
        self._step: RecordStep | None = None
        self._breaker: TargetBreaker | None = None
        self._traffic: TargetTraffic | None = None
        #: The latest the job in progress may still make a request (see `_job_deadline`).
        self._deadline: datetime | None = None
        #: The workers' breakers, the chain's own first (see `_work`).
        self._worker_breakers: list[TargetBreaker] = []
        self._secret: str | None = None
        self._secrets: SecretReader | None = None
        self._heartbeat = Heartbeat(self.token, clock, liveness.HEARTBEAT_SECONDS)
        #: Seconds waited for traffic by the chain's earlier `TargetTraffic`s (a rule saved mid-chain).
        self._waited_before = 0.0
        #: Deletes this chain's jobs sent (see `_guard_deletes`).
        self._deletes = 0

    # -- opening -------------------------------------------------------------------------------

    def open(self, secrets: SecretReader | None = None) -> ChainEnd | None:
        """Health gate, breaker check, writer. Returns how the chain ends when it cannot start
        (a result, not a fault); raises a `RuleFault` for a rule that is misconfigured.
        `secrets` reads the Prefect Secret block a target's `token_secret` names (the flows layer
        gives it); the token is read here, once per chain, so a changed one counts from the next."""
        rule = self.rule
        closed = decisions.gate(rule)
        if closed is not None:
            return self._end(*closed)
        self._breaker = TargetBreaker(self.engine, rule, self._breaker_listeners, self.clock)
        self._worker_breakers = [self._breaker]
        until = self._breaker.open_until(self.clock())
        if until is not None:
            return self._end(ChainEnd.BREAKER_OPEN, self._breaker_message(until))
        self._traffic = TargetTraffic(self.engine, rule.target, self.clock, self._traffic_listeners)
        paused = self._traffic.pause_seen()
        if paused is not None and paused > self._job_deadline(rule):
            return self._end(ChainEnd.RATE_LIMITED, self._paused_message(paused))
        self._secrets = secrets
        self._equip(rule)
        return None

    def _equip(self, rule: Rule) -> None:
        """The writer and the step for `rule`. The token is read when the chain opens, so a token
        changed at its source counts from the next chain; read again only when a rule saved
        mid-chain takes it from another variable or block."""
        # The type that writes to this connection: with its batch verbs where it names batch paths.
        writer_type = writer_for(rule.target)
        if writer_type is None:
            raise MissingWriter(rule.name, rule.target.driver)
        token = self._secret
        if self._step is None or token_source(rule.target) != token_source(self.rule.target):
            token = self._read_token(rule)
        options: dict[str, Any] = {"token": token}
        if accepts_concurrency(writer_type):
            options["concurrency"] = rule.concurrency if writer_type.thread_safe else 1
        if rule.target.auth is not None and accepts_credentials(writer_type):
            options["credentials"] = self._read_credentials(rule)
            options["refresh_store"] = RefreshTokens(self.engine, rule.target.id, self.clock)
        writer = writer_type(rule.target, rule.collection, **options)
        if self._writer is not None:
            self._writer.close()
        self.rule, self._secret, self._writer = rule, token, writer
        assert self._traffic is not None
        if self._traffic.target != rule.target:
            # Same target row, new budget or pause cap: the shared state stays in the database.
            waited, self._traffic = (
                self._traffic.waited_seconds,
                TargetTraffic(self.engine, rule.target, self.clock, self._traffic_listeners),
            )
            self._waited_before += waited
        self._step = RecordStep(rule, writer, token, self.clock, self._traffic, chain_run_id=self.flow_run_id)

    def _read_credentials(self, rule: Rule) -> dict[str, str]:
        """The secrets of the target's `auth`, each read now; one missing, or that no header can
        carry, is a fault of the rule naming where it should come from."""
        values = credentials_for(rule.target, self._secrets)
        for name, env, block in secret_sources(rule.target):
            value = values.get(name)
            if value is None:
                if block is not None and self._secrets is None:
                    why = "which cannot be read here: no Prefect Secret reader was given"
                    raise MissingCredential(rule.name, rule.target.name, block=block, why=why)
                raise MissingCredential(rule.name, rule.target.name, env, block=block)
            problem = token_problem(value) if name != "password" else None
            if problem is not None:
                where = f"the Prefect Secret block {block!r}" if block else f"${env}"
                raise UnusableCredential(rule.name, rule.target.name, where, problem)
        return {name: value for name, value in values.items() if value is not None}

    def _read_token(self, rule: Rule) -> str | None:
        secrets = self._secrets
        token = token_for(rule.target, secrets)
        if token is None and rule.target.token_secret:
            block = rule.target.token_secret
            if secrets is None:  # a chain run outside the flows layer
                why = "which cannot be read here: no Prefect Secret reader was given"
                raise MissingCredential(rule.name, rule.target.name, block=block, why=why)
            raise MissingCredential(rule.name, rule.target.name, block=block)
        if token is None and rule.target.token_env:
            raise MissingCredential(rule.name, rule.target.name, rule.target.token_env)
        problem = None if token is None else token_problem(token)
        if problem is not None:
            raise UnusableCredential(rule.name, rule.target.name, token_source(rule.target) or "-", problem)
        return token

    def _adopt(self, saved: Rule) -> None:
        """Take over a rule saved while this chain runs, from the job about to start (the job in
        flight, if any, has ended: jobs of a chain run one after another). Everything a job reads
        of the rule or its target comes from `self.rule` and the writer and step built for it, so
        swapping them between jobs is safe. A change of route never reaches here: `delivery
        apply` retires the rule's ledger and supersedes its chains, and the fence ends this one."""
        log.info("rule %s: saved while its chain runs; its next job uses the saved rule", saved.name)
        if saved.target.breaker != self.rule.target.breaker:
            # Same target row, new thresholds: new breakers over the same shared state.
            self._breaker = TargetBreaker(self.engine, saved, self._breaker_listeners, self.clock)
            self._worker_breakers = [self._breaker]
        self._equip(saved)

    @property
    def step(self) -> RecordStep:
        """Check, plan and send one record; there once `open()` has succeeded."""
        if self._step is None:
            raise RuntimeError("the chain has not opened")
        return self._step

    @property
    def waited_seconds(self) -> float:
        """Seconds this chain's workers spent waiting for the target's traffic (budget, pauses)."""
        return self._waited_before + (self._traffic.waited_seconds if self._traffic is not None else 0.0)

    def _job_deadline(self, rule: Rule) -> datetime:
        """The latest a job starting now may still make a request: a wait for the target's traffic
        must end the job well before its timeout (`DELIVERY_BATCH_TIMEOUT_SECONDS`) would fail it,
        leaving time for the request itself."""
        budget = settings().batch_timeout_seconds - rule.target.timeout_seconds - JOB_DEADLINE_MARGIN_SECONDS
        return self.clock() + timedelta(seconds=max(budget, 0.0))

    def _held_message(self) -> str:
        assert self._traffic is not None
        paused = self._traffic.paused_until()
        if paused is not None:
            return self._paused_message(paused)
        return (
            f"target {self.rule.target.name!r}: its rate budget allows no more requests before this "
            "job's deadline; the next tick resumes"
        )

    def _paused_message(self, until: datetime) -> str:
        return (
            f"target {self.rule.target.name!r} is paused until {until.isoformat(timespec='seconds')} "
            "(it asked for a pause with Retry-After); the next tick resumes"
        )

    def _breaker_message(self, until: datetime | None) -> str:
        return open_message(self.rule.target.name, until)

    def _end(self, how: ChainEnd, message: str) -> ChainEnd:
        self.report.ended_by = how
        self.report.message = message
        return how

    # -- one job -------------------------------------------------------------------------------

    def run_batch(self, phase: Phase) -> BatchReport:
        """One job: a page of candidates, read under the lock (`_start_job`), then delivered and
        settled by the job made for the target (`_run_job`), then the cursor moved past what it
        attempted (`_conclude`). An exception leaves the batch (and the chain) at once, and the
        cursor where it was."""
        if self._writer is None or self._breaker is None:
            raise RuntimeError("run_batch() before a successful open()")
        report = BatchReport(phase)
        page = self._start_job(phase, report)
        if isinstance(page, BatchReport):
            return page
        attempted, ended = self._run_job(page, phase, report)
        return self._conclude(phase, report, page, attempted, ended)

    def _start_job(self, phase: Phase, report: BatchReport) -> list[Candidate] | BatchReport:
        """The start of a job, in one transaction under the lock: the claim or the fence, the
        handover to a newer chain, the gate, the cursor, the page. Returns the page, or the batch's
        report when the chain cannot go on (superseded, handed over, gated)."""
        rule = self.rule
        with self.engine.begin() as conn:
            ended = self._hold(conn, report)
            if ended is not None:
                return ended
            # The gate again at every job, under the lock: a connection set to error or disabled
            # mid-chain stops the chain at its next job, not at the next tick.
            fresh = catalog.get_rule(conn, rule.name)
            closed = decisions.gate(fresh)
            if closed is not None:
                report.ended_by, report.message = closed
                self.report.add(report)
                return report
            if not self._cursor_read:
                self._cursor_read = True
                self.report.cursor_before = self.report.cursor_after = fresh.cursor
                self._scan_from = decisions.scan_start(dataclasses.replace(rule, cursor=fresh.cursor))
            # A rule saved since the last job (`delivery apply`) counts from this job on: its page
            # is read with the saved batch size, and its records planned and sent by the saved
            # rule (taken over below, once this transaction has ended).
            saved = fresh if decisions.rule_changed(rule, fresh) else None
            rule = saved or rule
            self._heartbeat(conn, every=0)
            if phase is Phase.DRAIN:
                candidates = ledger.drain_page(conn, rule, self.started_at, rule.batch_size)
            else:
                candidates = ledger.scan_page(conn, rule, self._scan_from, rule.batch_size)
        if saved is not None:
            self._adopt(saved)
        return candidates

    def _hold(self, conn: sa.Connection, report: BatchReport) -> BatchReport | None:
        """Claim the rule (the first job) or check the fence (the next ones), and hand over to a
        newer chain waiting for the rule. Returns the batch's report when this chain ends here."""
        rule = self.rule
        if not self._claimed:
            # The first job claims the rule; the cursor is read only now, under the lock,
            # since a chain before this one may have moved it since we started.
            if not chains.claim(conn, rule.id, self.token, self.started_at):
                return self._superseded(report, conn)
            self._claimed = True
        elif not chains.holds_fence(conn, rule.id, self.token):
            return self._superseded(report, conn)
        # A chain holding the lock job after job retakes it the moment it lets go, while a
        # newer one waits in steps: without a handover a manual run would wait out the
        # whole older chain. The most recently started chain goes on, as in `claim`.
        newer = liveness.newer_waiting(conn, rule.id, self.token, self.started_at, self.clock())
        if newer is None:
            return None
        report.ended_by = ChainEnd.SUPERSEDED
        report.message = (
            f"chain superseded: a newer chain of rule {rule.name!r} (flow run "
            f"{newer.flow_run_id or '-'}) is waiting for the rule and takes over"
        )
        self.report.add(report)
        return report

    def _run_job(
        self, candidates: list[Candidate], phase: Phase, report: BatchReport
    ) -> tuple[list[LedgerStatus | None], ChainEnd | None]:
        """Deliver and settle the page by the job made for the target, counting what it attempted
        into `report`. Returns each candidate's settled status (None: not attempted) and how the
        batch was cut short, if it was."""
        deleting = self._guard_deletes(candidates)
        self._deadline = self._job_deadline(self.rule)
        waited = self.waited_seconds
        attempted, ended = self._work(candidates, phase)
        self._deletes += sum(1 for i in deleting if attempted[i] is not None)
        report.waited_seconds = self.waited_seconds - waited
        if ended is None and self._traffic is not None and self._traffic.paused_past(self._deadline):
            # The target asked for a pause this job cannot wait out: no later job could send either.
            ended = ChainEnd.RATE_LIMITED
        for status in attempted:
            if status is not None:
                report.attempted += 1
                report.counts[status.value] += 1
        return attempted, ended

    def _conclude(
        self,
        phase: Phase,
        report: BatchReport,
        candidates: list[Candidate],
        attempted: list[LedgerStatus | None],
        ended: ChainEnd | None,
    ) -> BatchReport:
        """How the batch ended, and the cursor moved past what it attempted (a scan's)."""
        assert self._breaker is not None
        report.left_behind = self._left_behind(candidates, attempted)
        if ended is ChainEnd.SUPERSEDED:
            return self._superseded(report)
        if ended is ChainEnd.BREAKER_OPEN:
            report.ended_by = ended
            report.message = self._breaker_message(self._breaker.open_until(self.clock()))
        if ended is ChainEnd.RATE_LIMITED:
            report.ended_by = ended
            report.message = self._held_message()
        if phase is not Phase.SCAN:
            self.report.add(report)
            return report
        to = cursor_after(candidates, attempted, self._scan_from)
        if candidates:
            self._scan_from = Cursor(candidates[-1].record.changed_at, candidates[-1].record.id)
        if to is not None:
            with self.engine.begin() as conn:
                if not chains.holds_fence(conn, self.rule.id, self.token):
                    return self._superseded(report, conn)
                report.cursor_after = chains.move_cursor(conn, self.rule.id, to)
                self._heartbeat(conn, every=0)
        self.report.add(report)
        return report

    def _guard_deletes(self, candidates: list[Candidate]) -> list[int]:
        """The page's records whose step will send a delete, by index. Raises `TooManyDeletes`,
        before anything of the page is sent, when they would bring the chain's deletes past the
        rule's `max_deletes_per_chain`: a source emptied by mistake must not empty the target."""
        rule = self.rule
        deleting = [
            i
            for i, candidate in enumerate(candidates)
            if decisions.plans_delete(rule, candidate.ledger, candidate.record.deleted)
        ]
        if deleting and self._deletes + len(deleting) > rule.max_deletes_per_chain:
            raise TooManyDeletes(rule.name, self._deletes + len(deleting), rule.max_deletes_per_chain)
        return deleting

    def _left_behind(self, candidates: list[Candidate], statuses: list[LedgerStatus | None]) -> list[LeftBehind]:
        """The job's records that were parked or left failed, with their errors as settled (read
        back only when there are any: a clean job costs no query)."""
        left = [(c, s) for c, s in zip(candidates, statuses, strict=True) if s in ledger.LEFT_BEHIND]
        if not left:
            return []
        with self.engine.connect().execution_options(readonly=True) as conn:
            rows = ledger.left_behind_of(conn, self.rule.id, [c.record.id for c, _ in left])
        return [
            LeftBehind(
                c.record.external_id,
                status,
                getattr(rows.get(c.record.id), "last_error", None),
                getattr(rows.get(c.record.id), "next_attempt_at", None),
                held=status is LedgerStatus.FAILED
                and getattr(rows.get(c.record.id), "attempts", None) == (c.ledger.attempts if c.ledger else 0),
            )
            for c, status in left
            if status is not None
        ]

    def has_work(self, phase: Phase) -> bool:
        """Whether the phase's next page would offer anything, read without the lock: a hint that
        spares a job (and its Prefect task) that would find nothing. A record that turns up just
        after it is read waits for the next chain, as one after an empty page does."""
        with self.engine.connect().execution_options(readonly=True) as conn:
            if phase is Phase.DRAIN:
                return bool(ledger.drain_page(conn, self.rule, self.started_at, 1))
            return bool(ledger.scan_page(conn, self.rule, self._scan_from, 1))

    def _work(self, candidates: list[Candidate], phase: Phase) -> tuple[list[LedgerStatus | None], ChainEnd | None]:
        """Deliver and settle the candidates, `rule.concurrency` at a time (1: strictly in order), by
        the job made for this chain's writer and target (`delivery.senders.job_for`). Returns each
        candidate's settled status (None: not attempted) and how the batch was cut short, if it
        was. The first exception stops every worker and is raised."""
        settled, cuts = job_for(self._job_context(), candidates, phase).run()
        return settled, (ChainEnd.SUPERSEDED if ChainEnd.SUPERSEDED in cuts else (cuts[0] if cuts else None))

    def _ways(self) -> tuple[Sender, Settle]:
        """The sender and the settle the next job gets (`delivery.senders.choose`, the one place
        they are chosen)."""
        assert self._writer is not None
        return choose(self._writer, self.rule.target)

    def _job_context(self) -> JobContext:
        """What the job in progress may use: its rule, step, writer, fence, clock, heartbeat,
        deadline and workers' breakers."""
        assert self._breaker is not None and self._writer is not None and self._deadline is not None
        rule = self.rule
        taken: list[TargetBreaker] = []

        def new_worker_breaker() -> TargetBreaker:
            # pybreaker holds its lock across the call, so each worker gets a breaker of its own;
            # they share one state through the database, as separate processes would. Made once
            # per chain (each costs round trips) and handed to the next batch's workers: a batch's
            # workers have all stopped before the next batch starts.
            if len(taken) == len(self._worker_breakers):
                self._worker_breakers.append(TargetBreaker(self.engine, self.rule, self._breaker_listeners, self.clock))
            breaker = self._worker_breakers[len(taken)]
            taken.append(breaker)
            return breaker

        return JobContext(
            engine=self.engine,
            rule=rule,
            step=self.step,
            writer=self._writer,
            clock=self.clock,
            fence=Fence(rule.id, self.token, rule.target.id),
            heartbeat=self._heartbeat,
            deadline=self._deadline,
            workers=rule.concurrency if self._writer.thread_safe else 1,
            new_worker_breaker=new_worker_breaker,
            worker_breakers=taken,
        )

    def _superseded(self, report: BatchReport, conn: sa.Connection | None = None) -> BatchReport:
        """End the batch superseded; `conn`: the transaction the fence was found closed in, if open
        (on SQLite a second connection would wait for its write lock)."""
        report.ended_by = ChainEnd.SUPERSEDED
        # Whoever ended this chain's row said why (the tick: no heartbeat; apply: the rule moved);
        # with no such word, a newer chain claimed the rule.
        if conn is not None:
            why = chains.ended_message(conn, self.token)
        else:
            # Read-only: on SQLite a write transaction would queue behind the newer chain's writes.
            with self.engine.connect().execution_options(readonly=True) as own:
                why = chains.ended_message(own, self.token)
        report.message = (
            f"chain superseded: {why.removeprefix('superseded: ')}"
            if why
            else (f"chain superseded: another chain of rule {self.rule.name!r} took over")
        )
        self.report.add(report)
        return report

    # -- closing -------------------------------------------------------------------------------

    def finish(self, error: BaseException | None = None, *, cancelled: bool = False) -> ChainReport:
        """Record how the chain ended. Never rolls anything back. A chain stopped by a person or
        by Prefect (`cancelled`) ends `cancelled`: that is no fault of the rule."""
        if cancelled:
            self.report.ended_by = ChainEnd.CANCELLED
            self.report.message = "chain cancelled" + (f" ({type(error).__name__})" if error is not None else "")
        elif error is not None:
            self.report.ended_by = ChainEnd.RULE_FAULT
            self.report.message = storable_text(redact(f"{type(error).__name__}: {error}", self._secret))
        elif self.report.ended_by is ChainEnd.CAUGHT_UP and not self.report.message:
            # Recorded with the chain too, so `delivery status` and the status artifact show it.
            counts = ", ".join(f"{n} {status}" for status, n in sorted(self.report.counts.items()) if n)
            self.report.message = f"caught up: {counts or 'nothing to deliver'}"
        if self._writer is not None:
            self._writer.close()
        with self.engine.begin() as conn:
            chains.end_chain(conn, self.report, self.clock())
        return self.report

    def redact(self, text: str) -> str:
        return redact(text, self._secret)
