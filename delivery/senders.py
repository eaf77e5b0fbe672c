"""The one place a job's ways are chosen (`choose`): its sender from the writer's capabilities and
the connection, its settle from the connection's `settle`, two separate axes of one
`delivery.job.Job`.

The senders, each a `delivery.job.Sender`: one record at a time (`delivery.send_one`), a thread per
call in flight (`delivery.send_threads`), tasks on one event loop (`delivery.send_loop`), batch calls
(`delivery.send_batches`). The settles (`delivery.settle`): `grouped` or `per_record`. Given the
writer and the connection, never the chain.
"""

from __future__ import annotations

from delivery.domain import Candidate, Connection, Phase, SettleMode
from delivery.job import Job, JobContext, Sender
from delivery.send_batches import BatchCalls
from delivery.send_loop import EventLoop
from delivery.send_one import OneAtATime
from delivery.send_threads import Threads
from delivery.settle import Settle, settle_for
from delivery.writers.base import CreatesMany, DeletesMany, UpdatesMany, Writer, offers_async, single_verbs_of


def offers_batches(writer: Writer) -> bool:
    """Whether the writer offers at least one batch verb."""
    return isinstance(writer, (CreatesMany, UpdatesMany, DeletesMany))


def choose(writer: Writer, target: Connection) -> tuple[Sender, Settle]:
    """The sender and the settle of a job writing with `writer` to `target`.

    A writer with batch verbs on a `grouped` connection sends in batch calls. A writer with async
    verbs sends from one event loop where settles are grouped and the target has no rate budget. It
    keeps the thread path while it has sync verbs on a `per_record` connection (one transaction per
    outcome is what bounds that path) and on a target with a budget (which bounds the rate anyway; a
    request leaving its slot late by a loop's turn on a loaded machine was seen to crowd the next
    one's second). Only a writer offering nothing but async verbs is always sent from the loop, on a
    `per_record` connection each outcome committed before its task takes the next record. Otherwise
    threads send a `grouped` connection's records, and one record at a time (intent, send, settle,
    on as many threads as the connection's concurrency) a `per_record` connection's."""
    settle = settle_for(target.settle)
    grouped = target.settle is SettleMode.GROUPED
    if grouped and offers_batches(writer):
        return BatchCalls(writer), settle
    if offers_async(writer) and (not single_verbs_of(type(writer)) or (grouped and target.rate_limit is None)):
        return EventLoop(), settle
    if grouped:
        return Threads(), settle
    return OneAtATime(), settle


def job_for(context: JobContext, candidates: list[Candidate], phase: Phase) -> Job:
    """The job for a page of candidates, its sender and settle chosen by `choose`."""
    sender, settle = choose(context.writer, context.rule.target)
    return Job(context, candidates, phase, sender, settle)
