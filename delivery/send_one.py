"""The sender that takes one record at a time (`OneAtATime`), for a connection settled `per_record`
whose writer's calls are made from threads.

Each worker takes the next record: checks and plans it, commits its write's intent (fenced), sends,
and settles the outcome in a transaction of its own (fenced again), so the job's records are written
in the batch's order when one worker writes, in the calling thread. A `delivery.job.Sender`; its
job's windows and group commits go unused (its window is the record it holds).
"""

from __future__ import annotations

from delivery.breaker import TargetBreaker
from delivery.domain import Candidate, ChainEnd, LedgerRow, LedgerStatus
from delivery.errors import RuleFault
from delivery.job import Job, ToSettle
from delivery.settle import Outcomes
from delivery.step import Send
from delivery.store import ledger
from delivery.workers import Cut, Signals, work_through


class OneAtATime:
    """Each record checked, planned, its intent committed, sent and settled in turn."""

    window_size = 1

    def send(self, job: Job, signals: Signals, outcomes: Outcomes[ToSettle]) -> list[ChainEnd]:
        """Deliver and settle the candidates, `context.workers` at a time (1: strictly in order, in
        this thread). The first exception stops every worker and is raised."""
        assert outcomes.each  # settled by this sender, record by record (`delivery.senders.choose`)
        context = job.context

        def deliver_one(index: int, breaker: TargetBreaker, signals: Signals) -> LedgerStatus | Cut | None:
            return _one(job, job.candidates[index], breaker, signals)

        size = len(job.candidates)
        results, cuts = work_through(size, context.workers, context.new_worker_breaker, deliver_one, signals)
        job.statuses.update((i, status) for i, status in enumerate(results) if status is not None)
        return cuts


def _one(job: Job, candidate: Candidate, breaker: TargetBreaker, signals: Signals) -> LedgerStatus | Cut | None:
    """One record: check, decide, (record a write's intent,) send, settle. Returns the status it
    settled, None when it was left alone (the job ended first, or a requeue owns the row now), or a
    cut saying how the batch must end (breaker open, superseded)."""
    context = job.context
    step, engine = context.step, context.engine
    step.check(candidate, job.phase)
    plan = step.plan(candidate)
    intent: LedgerRow | None = None
    if isinstance(plan, Send):
        with engine.begin() as conn:
            if not context.fence.held(conn, breaker):
                return Cut(ChainEnd.SUPERSEDED)
            if signals.stop.is_set():
                return None
            intent = context.write_intent(conn, candidate, plan)
        if intent is None:
            context.left_to_requeue(candidate, "meanwhile")
            return None
    try:
        done = step.carry_out(candidate, plan, intent, breaker, context.bounds(signals.stop))
    except RuleFault:
        # Raised before anything was applied (a refused token, a verb the writer lacks): the
        # intent goes back, so the fault writes nothing.
        _withdraw(job, candidate, intent)
        raise
    if done is None or isinstance(done, ChainEnd):
        _withdraw(job, candidate, intent)  # nothing went out
        return None if done is None else Cut(done)
    candidate, outcome = done
    if signals.over.is_set():
        # The job has ended (timeout, cancellation): nothing settles after it. The intent
        # stays: the next chain repeats a create under the same key, and sends an update whatever
        # its body, the row being in doubt. (A batch
        # merely cut short, by the breaker or another worker's fault, still settles the
        # answers of the calls in flight.)
        return None
    # A checkout per record, not a connection held for the batch: no connection waits
    # through HTTP calls, and the pool's pre-ping guards every settle.
    with engine.begin() as conn:
        if not context.fence.held(conn, breaker):
            return Cut(ChainEnd.SUPERSEDED)
        if not ledger.settle(conn, context.rule, candidate, outcome, context.clock()):
            context.left_to_requeue(candidate, "while it was being sent")
            return None
        context.heartbeat(conn)
    return outcome.status


def _withdraw(job: Job, candidate: Candidate, intent: LedgerRow | None) -> None:
    if intent is not None and intent != candidate.ledger:
        with job.context.engine.begin() as conn:
            ledger.withdraw_intent(conn, candidate.ledger, intent)
