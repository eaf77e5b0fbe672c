"""One job of a chain, and the narrow context every job is given.

A job is a page of candidates delivered and settled. Its ways are peers behind one small protocol
(`Job`): settled record by record (`delivery.per_record.PerRecordJob`), in groups
(`delivery.grouped.GroupedJob`), or sent in batch calls and settled in groups
(`delivery.bulk.BulkJob`). The chain (`delivery.chain`) opens and closes, claims the rule, reads the
page, builds the job's `JobContext` and chooses the job, in one place; a job sees only its context
(the fence, the clock, the heartbeat, the rule, the step and its writer, the workers' breakers, the
job's deadline) and never the chain: no job module imports `delivery.chain`, and an import-linter
contract in `pyproject.toml` keeps it so.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, Protocol

import sqlalchemy as sa

from delivery.breaker import TargetBreaker
from delivery.clock import Clock
from delivery.domain import Candidate, LedgerRow, LedgerStatus, Phase, Rule, Verb
from delivery.step import RecordStep, Send
from delivery.store import chains, ledger
from delivery.traffic import JobBounds
from delivery.writers.base import Writer

log = logging.getLogger(__name__)

#: What a job returns: each candidate's settled status (None: not attempted), and the reasons
#: (`ChainEnd`s) of the cuts that ended it early.
Settled = tuple[list[LedgerStatus | None], list[Any]]


class Job(Protocol):
    """One job: its candidates delivered and settled, `context.workers` at a time. An exception
    leaves the job at once (nothing is rolled back); however it ends, no worker of the job still
    runs when `run` returns or raises."""

    def run(self) -> Settled: ...


#: How a job is made: the chain chooses one (a class implementing `Job`) per job.
JobType = Callable[["JobContext", list[Candidate], Phase], Job]


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
