"""The sender of batch calls (`BatchCalls`), for a writer offering batch verbs (`CreatesMany`,
`UpdatesMany`, `DeletesMany`) on a connection settled in groups: its unit of work is a window of
records sent in one call per verb. A `delivery.job.Sender`, chosen where the writer offers batch
verbs (`delivery.senders.offers_batches`).

A window is `max_items` candidates (at most the batch). Its worker checks, plans and commits its
intents (as a grouped job does), then sends its creates in one `create_many` call and its updates in
one `update_many` call; a record the batch verbs cannot carry (a create that must be followed by an
update, a verb with no batch form) and an outcome reached without writing go the one-record way.
Every record still gets its own ledger outcome: an item's result is what the one-record call would
have met. A call that fails as a whole (timeout, 5xx) fails each of its items alike, each keeping
its create's intent and key for the replay; a call refused as a whole without per-item results (a
4xx) is split in halves and sent again, down to single items, so that one bad record never parks its
neighbours (the halves spend no attempt; only the record finally refused alone does).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

from delivery import decisions
from delivery.breaker import TargetBreaker
from delivery.domain import Attempt, Candidate, ChainEnd, Outcome, Verb
from delivery.errors import RuleFault, TargetUnavailable
from delivery.job import Job, ToSettle
from delivery.send_threads import send_one_in_window
from delivery.settle import Outcomes
from delivery.step import NOT_SENT, Send, not_sent_end
from delivery.workers import Cut, Signals, work_through
from delivery.writers.base import (
    BatchRefused,
    CreateItem,
    CreatesMany,
    DeleteItem,
    DeletesMany,
    UpdateItem,
    UpdatesMany,
    Writer,
)


class BatchCalls:
    """Each worker sends the next window: its creates, updates and deletes in one call per verb."""

    def __init__(self, writer: Writer) -> None:
        assert isinstance(writer, (CreatesMany, UpdatesMany, DeletesMany))  # `offers_batches`: chosen for it
        self.writer = writer
        self.window_size = max(1, writer.max_items)

    def send(self, job: Job, signals: Signals, outcomes: Outcomes[ToSettle]) -> list[ChainEnd]:
        def step(window: int, breaker: TargetBreaker, signals: Signals) -> Cut | None:
            return self._window(job, window, breaker, signals, outcomes)

        context = job.context
        windows = -(-len(job.candidates) // self.window_size)  # the last one short
        # Pooled even for one worker, as `delivery.send_threads.Threads` is (see there).
        _, cuts = work_through(windows, context.workers, context.new_worker_breaker, step, signals, pooled=True)
        return cuts

    def _window(
        self, job: Job, unit: int, breaker: TargetBreaker, signals: Signals, outcomes: Outcomes[ToSettle]
    ) -> Cut | None:
        job.prepare(unit, signals)
        if job.superseded:
            return Cut(ChainEnd.SUPERSEDED)
        if unit not in job.windows:
            return None  # the batch was cut before this window was prepared
        creates: list[int] = []
        updates: list[int] = []
        deletes: list[int] = []
        alone: list[int] = []
        for i in job.window(unit):
            plan = job.plans[i]
            if not isinstance(plan, Send) or job.intents.get(i) is None:
                alone.append(i)  # an outcome without writing, or a row a requeue took meanwhile
            elif plan.to_delete:
                alone.append(i)  # its answer's id is kept for a delete, not delivered
            elif plan.verb is Verb.CREATE and not plan.follow_up and isinstance(self.writer, CreatesMany):
                creates.append(i)
            elif plan.verb is Verb.UPDATE and isinstance(self.writer, UpdatesMany):
                updates.append(i)
            elif plan.verb is Verb.DELETE and isinstance(self.writer, DeletesMany):
                deletes.append(i)
            else:
                alone.append(i)
        for verb, indices in ((Verb.CREATE, creates), (Verb.UPDATE, updates), (Verb.DELETE, deletes)):
            if indices:
                cut = self._send_many(job, verb, indices, breaker, signals, outcomes)
                if cut is not None:
                    return cut
        for i in alone:
            cut = send_one_in_window(job, i, breaker, signals, outcomes)
            if cut is not None:
                return cut
        return None

    def _send_many(
        self,
        job: Job,
        verb: Verb,
        indices: list[int],
        breaker: TargetBreaker,
        signals: Signals,
        outcomes: Outcomes[ToSettle],
    ) -> Cut | None:
        """Send the records in one call (or in halves, see the module's docstring) and hand each
        one's outcome to the group being gathered. Records a cut left unsent keep no intent."""
        if signals.stop.is_set():
            return None  # the batch is cut short: no call starts after that
        job.sent.update(indices)
        got: dict[int, Any] = {}
        heard: dict[int, list[Attempt]] = {}
        cut: Cut | None = None
        try:
            self._call(job, verb, indices, breaker, signals, got, heard)
        except RuleFault:  # a refused token, the traffic control failing: raised before anything applied
            job.sent.difference_update(i for i in indices if i not in got)
            raise
        except NOT_SENT as held:
            end = not_sent_end(held)
            cut = None if end is None else Cut(end)
        job.sent.difference_update(i for i in indices if i not in got)  # never sent: intents go back
        step = job.context.step
        for i in indices:
            if i not in got:
                continue
            plan = job.plans[i]
            assert isinstance(plan, Send)
            candidate, intent = job.candidates[i], job.intents[i]
            outcome = step.item_outcome(candidate, plan, got[i], breaker)
            outcome = cast("Outcome", step.with_tried(outcome, heard.get(i, [])))
            if signals.over.is_set():
                return None  # the job has ended: nothing settles after it
            settled = candidate if intent is None else Candidate(candidate.record, intent)
            handed = job.hand_over(ToSettle(i, settled, outcome), outcomes)
            if handed is not None:
                return handed
        return cut

    def _call(
        self,
        job: Job,
        verb: Verb,
        indices: Sequence[int],
        breaker: TargetBreaker,
        signals: Signals,
        got: dict[int, Any],
        heard: dict[int, list[Attempt]],
    ) -> None:
        """One batch call for `indices`, its results put in `got` and its requests in `heard`; a
        call refused as a whole is split in halves, each sent again, down to one item (whose
        refusal is then its own fault)."""
        step, rule = job.context.step, job.context.rule
        items: list[Any] = []
        for i in indices:
            plan, row = job.plans[i], job.candidates[i].ledger
            assert isinstance(plan, Send)
            if verb is Verb.CREATE:
                generation = row.create_generation if row else 0
                key = decisions.idempotency_key(
                    rule.name, job.candidates[i].record.external_id, generation, rule.key_epoch
                )
                items.append(CreateItem(plan.body, key, job.candidates[i].record))
            elif verb is Verb.UPDATE:
                assert row is not None and row.remote_id is not None  # an update has a row holding the remote id
                items.append(UpdateItem(row.remote_id, plan.body, job.candidates[i].record))
            else:
                assert row is not None and row.remote_id is not None  # so has a delete (`_window`)
                items.append(DeleteItem(row.remote_id, job.candidates[i].record))
        writer = self.writer
        # Only records whose verb the writer offers in batches reach here (see `_window`).
        call: Callable[[Any], list[Any]] | None = None
        if isinstance(writer, CreatesMany) and verb is Verb.CREATE:
            call = writer.create_many
        if isinstance(writer, UpdatesMany) and verb is Verb.UPDATE:
            call = writer.update_many
        if isinstance(writer, DeletesMany) and verb is Verb.DELETE:
            call = writer.delete_many
        assert call is not None
        try:
            with step.listening(verb) as exchanges:
                try:
                    results = step.call(breaker, job.context.bounds(signals.stop), call, items)
                finally:
                    for i in indices:  # each item's history shows the call that carried it
                        heard.setdefault(i, []).extend(exchanges)
        except BatchRefused as refused:
            if len(indices) == 1:
                got[indices[0]] = refused.as_record_fault()
                return
            half = len(indices) // 2
            self._call(job, verb, indices[:half], breaker, signals, got, heard)
            self._call(job, verb, indices[half:], breaker, signals, got, heard)
            return
        except TargetUnavailable as fault:
            fault.whole_call = True
            got.update(dict.fromkeys(indices, fault))  # the call failed as a whole: each item alike
            return
        if len(results) != len(indices):
            raise TypeError(
                f"{type(writer).__name__}: a batch call of {len(indices)} items answered {len(results)} results"
            )
        got.update(zip(indices, results, strict=True))
        paused = [r for r in results if isinstance(r, TargetUnavailable) and r.pauses_target]
        if paused and step.traffic is not None:
            step.traffic.pause(paused[0])  # an item answered 429 with Retry-After pauses the target too
