"""One job of a chain: a page of candidates delivered and settled, and the narrow context it is given.

There is one job (`Job`), whatever the target: it holds the page's shared state (each record's plan,
its write's intent, which requests may have gone out, what settled), prepares the windows of intents
and settles outcomes, and is given two strategies chosen for it in one place
(`delivery.senders.choose`):

- a `Sender`, how its records go out: one record at a time, each intent, send and settle in turn
  (`delivery.send_one`); a thread per call in flight (`delivery.send_threads`); tasks on one event
  loop (`delivery.send_loop`); batch calls, one per verb and window (`delivery.send_batches`);
- a `delivery.settle.Settle`, how its outcomes are committed: in bounded groups (`grouped`) or
  each on its own before its worker takes the next record (`per_record`).

The chain (`delivery.chain`) opens and closes, claims the rule, reads the page and builds the job's
`JobContext`; a job and its strategies see only that context (the fence, the clock, the heartbeat,
the rule, the step and its writer, the workers' breakers, the job's deadline) and never the chain:
no job or sender module imports `delivery.chain`, and an import-linter contract in `pyproject.toml`
keeps it so. One record's check, plan and send are `delivery.step`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from typing import Any, Protocol

import sqlalchemy as sa

from delivery.breaker import TargetBreaker
from delivery.clock import Clock
from delivery.domain import Candidate, ChainEnd, LedgerRow, LedgerStatus, Outcome, Phase, Rule, Verb
from delivery.errors import LedgerRowConflict, RuleFault
from delivery.settle import Outcomes, Settle
from delivery.step import RecordStep, Send
from delivery.store import chains, ledger
from delivery.traffic import JobBounds
from delivery.workers import Cut, Signals
from delivery.writers.base import Writer

log = logging.getLogger(__name__)

#: What a job returns: each candidate's settled status (None: not attempted), and the reasons
#: (`ChainEnd`s) of the cuts that ended it early.
Settled = tuple[list[LedgerStatus | None], list[Any]]


@dataclasses.dataclass(frozen=True)
class ToSettle:
    """One record's outcome, to be committed (see `Job.hand_over`)."""

    index: int
    candidate: Candidate
    outcome: Outcome


class Sender(Protocol):
    """How a job's records go out, `job.context.workers` calls at a time at most. It hands each
    outcome to `job.hand_over` (or, sending one record at a time, settles it itself), cuts the job
    short by `signals.stop`, and returns the cuts' reasons; an exception raised into the calling
    thread (a timeout, a cancellation) sets `signals.over` before it leaves. However it ends,
    nothing of its sending runs once `send` returns or raises."""

    #: Candidates per window, whose intents are committed together before any of them is sent.
    window_size: int

    def send(self, job: Job, signals: Signals, outcomes: Outcomes[ToSettle]) -> list[ChainEnd]: ...


@dataclasses.dataclass(frozen=True)
class Fence:
    """The chain's hold on its rule (its token), checked in the transaction of every write, with
    the target's breaker row read in the same statement."""

    rule_id: int
    token: str
    target_id: int

    def held(self, conn: sa.Connection, breaker: TargetBreaker) -> bool:
        """The fence check before a worker's own write, its breaker taking the row read with it."""
        held, breaker_row = chains.holds_fence_for_settle(conn, self.rule_id, self.token, self.target_id)
        breaker.observe(conn, breaker_row)
        return held

    def held_for(self, conn: sa.Connection, worker_breakers: Sequence[TargetBreaker]) -> bool:
        """The fence check, the breaker row read with it handed to every worker's breaker (from
        this thread, while the workers call: each takes it only if it wrote nothing since)."""
        breakers = list(worker_breakers)
        marks = [breaker.storage.write_mark for breaker in breakers]
        held, breaker_row = chains.holds_fence_for_settle(conn, self.rule_id, self.token, self.target_id)
        for breaker, mark in zip(breakers, marks, strict=True):
            breaker_row = breaker.observe(conn, breaker_row, mark)
        return held


class Heartbeat:
    """The chain's heartbeat, written with a settle at most every `every` seconds: the tick and the
    lock's dead-holder check judge in minutes, and a write per record would make the one chain row
    every worker's settle updates a queue of its own."""

    def __init__(self, token: str, clock: Clock, every: float) -> None:
        self._token = token
        self._clock = clock
        self._every = every
        self._beat_at = clock.monotonic()

    def __call__(self, conn: sa.Connection, *, every: float | None = None) -> None:
        """Beat in `conn` if the last beat is `every` seconds old (by default the heartbeat's own)."""
        now = self._clock.monotonic()
        if now - self._beat_at >= (self._every if every is None else every):
            self._beat_at = now
            chains.heartbeat(conn, self._token, self._clock())


@dataclasses.dataclass(frozen=True)
class JobContext:
    """What a job may use, and nothing that is the chain itself."""

    #: The delivery database: a checkout per write, none held through an HTTP call.
    engine: sa.Engine
    #: The rule as this job delivers it (a rule saved mid-chain counts from the job after).
    rule: Rule
    #: Check, plan and send one record (it holds the writer and the target's traffic control).
    step: RecordStep
    #: The step's writer, for a job that calls its batch verbs.
    writer: Writer
    #: The chain's clock (`delivery.clock`): every moment the job stamps or waits for.
    clock: Clock
    fence: Fence
    heartbeat: Heartbeat
    #: The latest the job may still make a request (see `bounds`).
    deadline: datetime
    #: How many workers write at once (1: strictly in order).
    workers: int
    #: A breaker for one more worker (each worker has its own; they share one state through the
    #: database), and the ones this job's workers took so far, in the order taken.
    new_worker_breaker: Callable[[], TargetBreaker]
    worker_breakers: list[TargetBreaker]

    def bounds(self, stop: threading.Event) -> JobBounds:
        """The job's bounds for a worker whose stop signal is `stop`."""
        return JobBounds(self.deadline, stop)

    def fence_held_for_workers(self, conn: sa.Connection) -> bool:
        """The fence check for a write made for all the job's workers (see `Fence.held_for`)."""
        return self.fence.held_for(conn, self.worker_breakers)

    def write_intent(self, conn: sa.Connection, candidate: Candidate, plan: Send) -> LedgerRow | None:
        """What the ledger must say before `plan` goes out: the row as it now stands, or None when
        a requeue took it (see `write_intents`)."""
        return self.write_intents(conn, [(candidate, plan)])[0]

    def write_intents(self, conn: sa.Connection, sends: Sequence[tuple[Candidate, Send]]) -> list[LedgerRow | None]:
        """What the ledger must say before each write goes out, for a window's writes at once: a
        create's key and first body (`ledger.record_create_intents`: new rows in one executemany),
        an update's doubt (`ledger.record_update_intents`), a delete's `deleting`
        (`ledger.record_delete_intents`), one statement for each kind. Returns each row as it now
        stands, or None where a requeue took it since the page was read."""
        intents: list[LedgerRow | None] = [candidate.ledger for candidate, _ in sends]
        creates = [i for i, (_, plan) in enumerate(sends) if plan.verb is Verb.CREATE]
        if creates:
            items = [(sends[i][0], sends[i][1].digest, sends[i][1].follow_up) for i in creates]
            made = ledger.record_create_intents(conn, self.rule, items, self.clock())
            for i, row in zip(creates, made, strict=True):
                intents[i] = row
        for verb, record_intents in (
            (Verb.UPDATE, ledger.record_update_intents),
            (Verb.DELETE, ledger.record_delete_intents),
        ):
            chosen = [i for i, (_, plan) in enumerate(sends) if plan.verb is verb]
            rows = [sends[i][0].ledger for i in chosen]
            assert all(row is not None for row in rows)  # an update or a delete has a row holding the remote id
            if chosen:
                for i, row in zip(chosen, record_intents(conn, [r for r in rows if r is not None]), strict=True):
                    intents[i] = row
        return intents

    def left_to_requeue(self, candidate: Candidate, when: str) -> None:
        """A row whose version moved since the page was read: a requeue wrote it, and it stands."""
        log.warning(
            "rule %s: record %s was requeued %s; the requeue stands",
            self.rule.name,
            candidate.record.external_id,
            when,
        )


class Job:
    """One job: its candidates delivered by its `sender` and settled by its `settle`, the state
    its workers share (plans, intents, what may have gone out, what settled) kept here."""

    def __init__(
        self, context: JobContext, candidates: list[Candidate], phase: Phase, sender: Sender, settle: Settle
    ) -> None:
        self.context = context
        self.candidates = candidates
        self.phase = phase
        self.sender = sender
        self.settle = settle
        self.plans: dict[int, Outcome | Send] = {}
        #: A write's intent row (`JobContext.write_intent`), by index; None where a requeue took the row first.
        self.intents: dict[int, LedgerRow | None] = {}
        #: Indices whose request may have gone out: their intents stay whatever happens next.
        self.sent: set[int] = set()
        self.windows: set[int] = set()
        self.window_lock = threading.Lock()
        self.statuses: dict[int, LedgerStatus | None] = {}
        self.superseded = False
        #: Candidates per window (see `Sender.window_size`).
        self.window_size = sender.window_size

    def run(self) -> Settled:
        """Deliver the batch. Returns each candidate's settled status (None: not attempted) and the
        cuts that ended it early. A fault raised by one record (a rule fault, a writer's bug) still
        commits the outcomes gathered before it (nothing is rolled back); a job interrupted (a
        timeout, a cancellation) commits no outcome more, and its records are sent again by the
        next chain. Either way the intents of writes never sent are taken back."""
        signals = Signals()

        def commit(group: list[ToSettle]) -> None:
            if signals.over.is_set():
                return
            if not self.commit_group(group):
                self.superseded = True
                signals.stop.set()

        outcomes = self.settle.open(commit, signals.stop.set)
        fault: BaseException | None = None
        cuts: list[Any] = []
        try:
            try:
                cuts = self.sender.send(self, signals, outcomes)
            except BaseException as exc:
                if signals.over.is_set():
                    raise  # a timeout or cancellation: the job has ended
                fault = exc  # a rule fault, a writer's bug, the database: nothing is rolled back
            outcomes.close(commit=True)
        except BaseException:
            signals.over.set()
            outcomes.close(commit=False)
            self._withdraw_quietly()  # still part of ending the job
            raise
        error = fault or outcomes.error
        if fault is not None and outcomes.error is not None:
            log.error("rule %s: outcomes could not be committed: %r", self.context.rule.name, outcomes.error)
        if not self.superseded:
            # A create never sent must not read as sent.
            if error is None:
                self._withdraw_unsent()
            else:
                self._withdraw_quietly()
        if error is not None:
            raise error
        if self.superseded:
            cuts.append(ChainEnd.SUPERSEDED)
        return [self.statuses.get(i) for i in range(len(self.candidates))], cuts

    # -- windows of intents ----------------------------------------------------------------------

    def prepare(self, window: int, signals: Signals) -> None:
        """Window `window` prepared by the first worker to reach it (see `prepare_window`), unless
        the batch was cut or superseded first."""
        if window not in self.windows:
            with self.window_lock:
                if window not in self.windows and not self.superseded and not signals.stop.is_set():
                    self.prepare_window(window)

    def prepare_window_once(self, window: int) -> None:
        """`prepare_window` unless done already (a window prefetched: see `delivery.send_loop`)."""
        with self.window_lock:
            if window not in self.windows and not self.superseded:
                self.prepare_window(window)

    def prepare_window(self, window: int) -> None:
        """Check and plan a window's candidates, and commit their intents (creates' keys and
        bodies, updates' doubt) in one transaction: a conflicting ledger row is found here, before
        any of them is sent."""
        context, step = self.context, self.context.step
        indices = self.window(window)
        sends: list[tuple[int, Send]] = []
        for i in indices:
            step.check(self.candidates[i], self.phase)
            plan = self.plans[i] = step.plan(self.candidates[i])
            if isinstance(plan, Send):
                sends.append((i, plan))
        if sends:
            with context.engine.begin() as conn:
                if not context.fence_held_for_workers(conn):
                    self.superseded = True
                    return
                # One statement for each kind of write: a window may hold fifty of any.
                made = context.write_intents(conn, [(self.candidates[i], plan) for i, plan in sends])
            # Only once committed: a rolled-back intent is no row to take back.
            self.intents.update(zip((i for i, _ in sends), made, strict=True))
        self.windows.add(window)

    def window(self, window: int) -> range:
        """The candidates' indices in `window`."""
        return range(window * self.window_size, min((window + 1) * self.window_size, len(self.candidates)))

    def ready_to_send(
        self, index: int, window: int, signals: Signals
    ) -> tuple[Candidate, Outcome | Send, LedgerRow | None] | Cut | None:
        """Whether record `index` may go out now, once its window was prepared: the candidate, its
        plan and its intent, or how the job ends (a Cut), or None (the record is left: the batch
        was cut, or a requeue took its row meanwhile). A send is marked sent from here: the request
        may go out, so a cut keeps its intent (its outcome unknown)."""
        if self.superseded:
            return Cut(ChainEnd.SUPERSEDED)
        if window not in self.windows:
            return None  # the batch was cut before this window was prepared
        candidate, plan = self.candidates[index], self.plans[index]
        intent: LedgerRow | None = None
        if isinstance(plan, Send):
            if signals.stop.is_set():
                return None  # the batch is cut short: no call starts after that
            intent = self.intents[index]
            if intent is None:
                self.context.left_to_requeue(candidate, "meanwhile")
                return None
            self.sent.add(index)
        return candidate, plan, intent

    @contextlib.contextmanager
    def unsent_on_rule_fault(self, index: int) -> Iterator[None]:
        """A rule fault in the send of record `index` is raised before anything was applied (a
        refused token, a verb the writer lacks): its intent goes back, so the fault writes nothing."""
        try:
            yield
        except RuleFault:
            self.sent.discard(index)
            raise

    def to_settle(
        self, index: int, done: tuple[Candidate, Outcome] | ChainEnd | None, signals: Signals
    ) -> ToSettle | Cut | None:
        """What a send of record `index` left (see `RecordStep.carry_out`): its outcome to settle,
        or how the batch ends, or None (nothing to settle: nothing went out, or the job is over)."""
        if done is None or isinstance(done, ChainEnd):
            self.sent.discard(index)  # nothing went out: its intent goes back
            return None if done is None else Cut(done)
        candidate, outcome = done
        if signals.over.is_set():
            return None
        return ToSettle(index, candidate, outcome)

    # -- settles ---------------------------------------------------------------------------------

    def hand_over(self, item: ToSettle, outcomes: Outcomes[ToSettle]) -> Cut | None:
        """An outcome handed to the settle: gathered for its group, or (settled `per_record`)
        committed now, in this worker, before it takes the next record."""
        if not outcomes.each:
            outcomes.add(item)
            return None
        if not self.commit_group([item]):
            self.superseded = True
            return Cut(ChainEnd.SUPERSEDED)
        return None

    def commit_group(self, group: list[ToSettle]) -> bool:
        """Settle a group's outcomes in one transaction; False when the fence is closed (nothing
        written). A conflicting ledger row takes the whole transaction with it: the others are then
        settled one by one, and the conflict is raised after them."""
        try:
            return self._settle_together(group)
        except LedgerRowConflict as conflict:
            if len(group) == 1:
                raise
            first = conflict
        for item in group:
            try:
                if not self._settle_together([item]):
                    return False
            except LedgerRowConflict:
                pass
        raise first

    def _settle_together(self, group: list[ToSettle]) -> bool:
        context = self.context
        with context.engine.begin() as conn:
            if not context.fence_held_for_workers(conn):
                return False
            now = context.clock()
            settled: dict[int, LedgerStatus | None] = {}
            written = ledger.settle_many(conn, context.rule, [(item.candidate, item.outcome) for item in group], now)
            for item, done in zip(group, written, strict=True):
                if done:
                    settled[item.index] = item.outcome.status
                else:
                    settled[item.index] = None
                    context.left_to_requeue(item.candidate, "while it was being sent")
            context.heartbeat(conn)
        self.statuses.update(settled)
        return True

    def _withdraw_quietly(self) -> None:
        """`_withdraw_unsent` on a job ending with an error: that error is the one to raise."""
        try:
            self._withdraw_unsent()
        except Exception:
            log.exception("rule %s: could not take back the intents of writes never sent", self.context.rule.name)

    def _withdraw_unsent(self) -> None:
        """Take back the intents of writes the batch never sent (it was cut short)."""
        unsent = [
            (i, row)
            for i, row in self.intents.items()
            if row is not None and i not in self.sent and row != self.candidates[i].ledger
        ]
        if not unsent:
            return
        context = self.context
        with context.engine.begin() as conn:
            if not context.fence_held_for_workers(conn):
                return
            for i, row in unsent:
                ledger.withdraw_intent(conn, self.candidates[i].ledger, row)
