"""One job of a target settled in groups (`settle: grouped`, see `delivery.settle`).

The workers send; a thread of the job's own commits their outcomes in groups. The batch is taken in
windows of `GROUP_RECORDS` candidates: a window is checked, planned and its creates' intents
committed (one transaction) by the first worker to reach it, before any of its records is sent, so a
conflicting ledger row is still found before any request. A peer of
`delivery.per_record.PerRecordJob` behind the `delivery.job.Job` protocol (`delivery.bulk.BulkJob`
builds on it), given a `JobContext`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Iterator
from typing import Any

from delivery.breaker import TargetBreaker
from delivery.domain import Candidate, ChainEnd, LedgerRow, LedgerStatus, Outcome, Phase
from delivery.errors import LedgerRowConflict, RuleFault
from delivery.job import JobContext, Settled
from delivery.settle import GROUP_RECORDS, SettleGroups
from delivery.step import Send
from delivery.store import ledger
from delivery.workers import Cut, Signals, work_through

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Settle:
    """One record's outcome, waiting for its group's commit."""

    index: int
    candidate: Candidate
    outcome: Outcome


class GroupedJob:
    """What the workers of one grouped job share, and how they deliver the batch."""

    def __init__(self, context: JobContext, candidates: list[Candidate], phase: Phase) -> None:
        self.context = context
        self.candidates = candidates
        self.phase = phase
        self.plans: dict[int, Outcome | Send] = {}
        #: A write's intent row (`JobContext.write_intent`), by index; None where a requeue took the row first.
        self.intents: dict[int, LedgerRow | None] = {}
        #: Indices whose request may have gone out: their intents stay whatever happens next.
        self.sent: set[int] = set()
        self.windows: set[int] = set()
        self.window_lock = threading.Lock()
        self.statuses: dict[int, LedgerStatus | None] = {}
        self.superseded = False
        #: Candidates per window (see the module's docstring).
        self.window_size = GROUP_RECORDS

    def run(self) -> Settled:
        """Deliver the batch with `context.workers` workers. Returns each candidate's settled status (None:
        not attempted) and the cuts that ended it early. A fault raised by one record (a rule
        fault, a writer's bug) still commits the outcomes gathered before it (nothing is rolled
        back); a job interrupted (a timeout, a cancellation) commits no outcome more, and its
        records are sent again by the next chain. Either way the intents of writes never sent are
        taken back."""
        signals = Signals()

        def commit(group: list[_Settle]) -> None:
            if signals.over.is_set():
                return
            if not self._commit_group(group):
                self.superseded = True
                signals.stop.set()

        groups: SettleGroups[_Settle] = SettleGroups(commit, signals.stop.set)
        fault: BaseException | None = None
        cuts: list[Any] = []
        try:
            try:
                cuts = self._deliver(signals, groups)
            except BaseException as exc:
                if signals.over.is_set():
                    raise  # a timeout or cancellation: the job has ended
                fault = exc  # a rule fault, a writer's bug, the database: nothing is rolled back
            groups.close(commit=True)
        except BaseException:
            signals.over.set()
            groups.close(commit=False)
            self._withdraw_quietly()  # still part of ending the job
            raise
        error = fault or groups.error
        if fault is not None and groups.error is not None:
            log.error("rule %s: outcomes could not be committed: %r", self.context.rule.name, groups.error)
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

    def _deliver(self, signals: Signals, groups: SettleGroups[_Settle]) -> list[Any]:
        """Send the batch, handing outcomes to `groups`; the cuts that ended it early. An exception
        raised into this thread (a timeout, a cancellation) sets `signals.over` before it leaves;
        any other is a fault of the job. Nothing of the job's sending runs once it returns."""

        def step(unit: int, breaker: TargetBreaker, signals: Signals) -> Cut | None:
            return self._unit(unit, breaker, signals, groups)

        # Pooled even for one worker: an exception from a step is then a fault of the job (its
        # gathered outcomes are committed), one raised into this thread an interruption.
        _, cuts = work_through(
            self._units(), self.context.workers, self.context.new_worker_breaker, step, signals, pooled=True
        )
        return cuts

    def _units(self) -> int:
        """How many units of work the workers share: a record each."""
        return len(self.candidates)

    def _unit(self, unit: int, breaker: TargetBreaker, signals: Signals, groups: SettleGroups[_Settle]) -> Cut | None:
        return self._one(unit, breaker, signals, groups)

    def _ready_to_send(
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

    def _one(self, index: int, breaker: TargetBreaker, signals: Signals, groups: SettleGroups[_Settle]) -> Cut | None:
        """One record: its window prepared first, then send, then hand the outcome to the group
        being gathered."""
        window = index // self.window_size
        if window not in self.windows:
            with self.window_lock:
                if window not in self.windows and not self.superseded and not signals.stop.is_set():
                    self._prepare_window(window)
        ready = self._ready_to_send(index, window, signals)
        if not isinstance(ready, tuple):
            return ready
        candidate, plan, intent = ready
        with self._unsent_on_rule_fault(index):
            done = self.context.step.carry_out(candidate, plan, intent, breaker, self.context.bounds(signals.stop))
        item = self._to_settle(index, done, signals)
        if not isinstance(item, _Settle):
            return item
        groups.add(item)
        return None

    @contextlib.contextmanager
    def _unsent_on_rule_fault(self, index: int) -> Iterator[None]:
        """A rule fault in the send of record `index` is raised before anything was applied (a
        refused token, a verb the writer lacks): its intent goes back, so the fault writes nothing."""
        try:
            yield
        except RuleFault:
            self.sent.discard(index)
            raise

    def _to_settle(
        self, index: int, done: tuple[Candidate, Outcome] | ChainEnd | None, signals: Signals
    ) -> _Settle | Cut | None:
        """What a send of record `index` left (see `Step.carry_out`): its outcome to settle, or how
        the batch ends, or None (nothing to settle: nothing went out, or the job is over)."""
        if done is None or isinstance(done, ChainEnd):
            self.sent.discard(index)  # nothing went out: its intent goes back
            return None if done is None else Cut(done)
        candidate, outcome = done
        if signals.over.is_set():
            return None
        return _Settle(index, candidate, outcome)

    def _prepare_window(self, window: int) -> None:
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

    def _commit_group(self, group: list[_Settle]) -> bool:
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

    def _settle_together(self, group: list[_Settle]) -> bool:
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
