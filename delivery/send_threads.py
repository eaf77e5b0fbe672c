"""The sender whose calls in flight are threads (`Threads`), one per worker.

The batch is taken in windows of `GROUP_RECORDS` candidates: a window is checked, planned and its
writes' intents committed (one transaction) by the first worker to reach it, before any of its
records is sent, so a conflicting ledger row is still found before any request
(`delivery.job.Job.prepare`). Each worker then takes the next record, sends it, and hands its outcome
to the job's settle (`Job.hand_over`). The workers run on a pool even when there is one, so that an
exception raised into the calling thread (a timeout, a cancellation) interrupts the job while one
raised by a step is a fault of the job (its gathered outcomes are committed). A `delivery.job.Sender`;
`send_one_in_window` is also how the batch-call sender sends a record its batch verbs cannot carry.
"""

from __future__ import annotations

from delivery.breaker import TargetBreaker
from delivery.domain import ChainEnd
from delivery.job import Job, ToSettle
from delivery.settle import GROUP_RECORDS, Outcomes
from delivery.workers import Cut, Signals, work_through


class Threads:
    """Each worker thread sends the next record of the batch, its window prepared first."""

    window_size = GROUP_RECORDS

    def send(self, job: Job, signals: Signals, outcomes: Outcomes[ToSettle]) -> list[ChainEnd]:
        def step(index: int, breaker: TargetBreaker, signals: Signals) -> Cut | None:
            return send_one_in_window(job, index, breaker, signals, outcomes)

        context = job.context
        size = len(job.candidates)
        _, cuts = work_through(size, context.workers, context.new_worker_breaker, step, signals, pooled=True)
        return cuts


def send_one_in_window(
    job: Job, index: int, breaker: TargetBreaker, signals: Signals, outcomes: Outcomes[ToSettle]
) -> Cut | None:
    """One record: its window prepared first, then send, then its outcome handed to the settle."""
    window = index // job.window_size
    job.prepare(window, signals)
    ready = job.ready_to_send(index, window, signals)
    if not isinstance(ready, tuple):
        return ready
    candidate, plan, intent = ready
    with job.unsent_on_rule_fault(index):
        done = job.context.step.carry_out(candidate, plan, intent, breaker, job.context.bounds(signals.stop))
    item = job.to_settle(index, done, signals)
    if not isinstance(item, ToSettle):
        return item
    return job.hand_over(item, outcomes)
