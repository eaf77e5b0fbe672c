"""`deliver-rule`: one chain of one rule, as a Prefect flow.

drain and scan are subflows; every batch (job) is one task, never one task per record (Prefect's
per-task overhead would cap throughput). No retries anywhere: a task timeout fails the chain like
any exception, because every exception that leaves a job is a fault of the rule that a second
attempt would meet again (ADR-0029).

This module wires the chain into Prefect and decides the run's state; what the run tells the
operator besides (its name and tags, artifacts, events, the log lines of jobs and records, the
summary of `delivery run`) is `flows/chain_reporting.py`, and when a phase is done is
`delivery/phase.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import traceback
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import anyio
from prefect import flow, get_run_logger, tags, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas import State
from prefect.context import FlowRunContext, TagsContext
from prefect.exceptions import Abort, CancelledRun, TerminationSignal
from prefect.runtime import flow_run
from prefect.states import Cancelled, Completed, Failed

from delivery import liveness
from delivery.chain import Chain
from delivery.clock import SYSTEM
from delivery.db import shared_engine
from delivery.domain import BatchReport, ChainEnd, Phase
from delivery.errors import RuleFault
from delivery.phase import PhaseJobs
from delivery.settings import settings
from delivery.status import RUN_STATE_NAMES
from flows.breaker_events import RunBreakerListener
from flows.chain_reporting import ChainReporter, rule_tags, summary
from flows.lock import rule_lock
from flows.secrets import read_secret_block
from flows.traffic_events import RunTrafficListener

#: What a chain stopped from outside raises: Ctrl-C, SIGTERM (Prefect turns it into a
#: TerminationSignal; a worker cancelling the run sends it too), an asyncio/anyio cancellation, the
#: API aborting a task because its flow run was cancelled (Abort), or a subflow that ended cancelled
#: (CancelledRun). None of them is a fault of the rule.
CANCELLATIONS: tuple[type[BaseException], ...] = (
    asyncio.CancelledError,
    KeyboardInterrupt,
    SystemExit,
    TerminationSignal,
    Abort,
    CancelledRun,
)

#: The chain this flow run runs, with its reporter, for its subflows and batch tasks. They receive
#: the chain's token (a parameter Prefect records), never the Chain, which nothing should have to
#: serialise; a context variable rather than a registry by token, because a warm worker runs many
#: chains in one process, each on a thread and in a context of its own (flows/worker.py).
_running: ContextVar[ChainReporter | None] = ContextVar("delivery_running_chain", default=None)

#: The Completed state's name per chain end: the run list tells the endings apart at a glance
#: (the type stays COMPLETED: none of them is a fault, ADR-0029). A fault ends the run Failed, a
#: stop Cancelled: those two take Prefect's own states.
STATE_NAMES: dict[ChainEnd, str] = {
    end: name for end, name in RUN_STATE_NAMES.items() if end not in (ChainEnd.RULE_FAULT, ChainEnd.CANCELLED)
}


def batch_timeout_seconds() -> float:
    return settings().batch_timeout_seconds


@task(name="delivery-batch", retries=0, cache_policy=NO_CACHE, persist_result=False)
def delivery_batch(token: str, phase: Phase) -> BatchReport | State[Any]:
    """One job of the chain. A fault the engine names ends the task Failed without a traceback
    (the chain's run says it once, with what to do); anything else is raised, its traceback kept."""
    reporter = _reporter(token)
    try:
        return reporter.chain.run_batch(phase)
    except RuleFault as fault:
        reporter.fault = fault  # the subflow raises it (`_run_phase`)
        return Failed(message=f"{type(fault).__name__}: {fault}")


def _reporter(token: str) -> ChainReporter:
    reporter = _running.get()
    if reporter is None or reporter.chain.token != token:
        raise RuntimeError(f"chain {token} is not the one this flow run runs: a subflow or batch started on its own?")
    return reporter


async def _run_phase(token: str, phase: Phase) -> ChainEnd | None:
    reporter = _reporter(token)
    chain = reporter.chain
    logger = get_run_logger()
    batch = delivery_batch.with_options(timeout_seconds=batch_timeout_seconds())
    jobs = PhaseJobs(chain, phase)
    while (number := jobs.next_job()) is not None:
        async with rule_lock(chain, reporter.run_logger):  # one job of the rule at a time; waiting writes nothing
            # Untagged: Prefect takes a tag concurrency slot (an API call and a client of its own) for
            # every tagged task run. The flow runs carry the rule's tags; the batches are found in them.
            with TagsContext(current_tags=set()):
                done = batch.with_options(task_run_name=f"{phase.value}-batch-{number}")(token, phase)
        if not isinstance(done, BatchReport):
            # The batch ended Failed on a fault the engine names (`delivery_batch`): raised here,
            # where the subflow hands it to the chain's run.
            raise reporter.fault or RuntimeError(f"batch {number} ended {done.type.value}: {done.message}")
        report = done
        reporter.job_done(logger, phase, number, report)
        jobs.record(report)
    return jobs.ended_by


#: The state a drain or scan subflow ends in when a fault of the rule stopped it: of type
#: Completed, so the chain's own run is the one Failed run of the fault (Prefect's Failed filter, a
#: Failed automation and a later Retry's leftovers all see one run, not two).
STOPPED = "Stopped"


async def _run_subflow(token: str, phase: Phase) -> ChainEnd | State[Any] | None:
    try:
        return await _run_phase(token, phase)
    except CANCELLATIONS as exc:
        # Ends this subflow Cancelled rather than Crashed; the parent then sees CancelledRun.
        return Cancelled(message=f"{phase.value} cancelled ({type(exc).__name__})")
    except Exception as exc:
        # The chain's run ends Failed on it (`deliver_rule` raises it after this subflow).
        _reporter(token).fault = exc
        return Completed(message=f"stopped by {fault_state_name(exc)}: the chain's run says why", name=STOPPED)


@flow(name="drain", retries=0, validate_parameters=False)
async def drain(token: str) -> ChainEnd | State[Any] | None:
    """Due retries first, oldest due first."""
    return await _run_subflow(token, Phase.DRAIN)


@flow(name="scan", retries=0, validate_parameters=False)
async def scan(token: str) -> ChainEnd | State[Any] | None:
    """Fresh changes from the cursor less the overlap window, in change order."""
    return await _run_subflow(token, Phase.SCAN)


def fault_state_name(exc: BaseException) -> str:
    """A Failed run's state name: the fault's class (`MissingWriter`, ...); a batch that ran out of
    time is `TimedOut`, as Prefect names the task that did."""
    return "TimedOut" if isinstance(exc, TimeoutError) else type(exc).__name__


#: The flow run's context key under which the tick hands a launched run its chain token (see
#: `launch_context`). Not a parameter: the Run form has no use for it, and a Retry must not reuse it.
CHAIN_TOKEN_KEY = "delivery_chain_token"
#: The same hand-over for a chain the tick runs in its own process (no deployment to launch).
_launched_token: ContextVar[str | None] = ContextVar("delivery_launched_token", default=None)


def launch_context(token: str) -> dict[str, str]:
    """The context a launched `deliver-rule` run is created with: the chain the tick recorded."""
    return {CHAIN_TOKEN_KEY: token}


@contextlib.contextmanager
def launched(token: str) -> Iterator[None]:
    """Run `deliver_rule` in this process as the launch of the chain recorded as `token`."""
    reset = _launched_token.set(token)
    try:
        yield
    finally:
        _launched_token.reset(reset)


def _launch_token() -> str | None:
    context = FlowRunContext.get()
    run = context.flow_run if context is not None else None
    token = (run.context or {}).get(CHAIN_TOKEN_KEY) if run is not None else None
    return token if isinstance(token, str) else _launched_token.get()


def _start_chain(
    rule: str, run_id: str | None, listeners: list[RunBreakerListener], traffic: list[RunTrafficListener]
) -> Chain | State[Any]:
    """The run's chain: the one the tick recorded when it launched this run, or a fresh one for a
    run started by hand. A launch whose chain has ended (the tick judged it dead before it ran) is
    superseded; but a run that ran before (Prefect's Retry, run count 2 and up) starts a fresh chain
    of its rule, so that a retry delivers as the first run would have."""
    token = _launch_token()
    if token is not None:
        try:
            return Chain(
                shared_engine(),
                rule,
                flow_run_id=run_id,
                token=token,
                clock=SYSTEM,
                breaker_listeners=listeners,
                traffic_listeners=traffic,
            )
        except LookupError as exc:
            if flow_run.get_run_count() <= 1:
                return Completed(message=f"superseded before it started: {exc}", name=STATE_NAMES[ChainEnd.SUPERSEDED])
            get_run_logger().info("rule %s: this run is a retry; its first chain has ended, a fresh one starts", rule)
    return Chain(
        shared_engine(), rule, flow_run_id=run_id, clock=SYSTEM, breaker_listeners=listeners, traffic_listeners=traffic
    )


@flow(name="deliver-rule", retries=0, log_prints=False)
async def deliver_rule(rule: str) -> State[Any]:
    """One chain of a delivery rule: health gate, breaker check, drain (due retries), then scan
    (fresh changes). Nothing is sent that the rule's policy forbids; each record's outcome is in
    its ledger row.

    Args:
        rule: The rule's name, as delivery rules lists it (e.g. contacts-to-crm).
    """
    logger = get_run_logger()
    # A bad DELIVERY_* value fails the run here, before a chain exists: it is no fault of the rule,
    # and a chain it stopped midway would be recorded and alerted on as one.
    settings()
    run_id = flow_run.get_id()
    # The breaker's trips reach this run's log (and Prefect's events) from the chain's workers.
    breakers = RunBreakerListener(rule, run_id, logger)
    chain = _start_chain(rule, run_id, [breakers], [RunTrafficListener(rule, run_id, logger)])
    if not isinstance(chain, Chain):
        return chain
    reporter = ChainReporter(chain, logger)
    running = _running.set(reporter)
    stopped: BaseException | None = None
    try:
        await reporter.begin()
        # The token is read now, from a Secret block too: a token changed in the UI counts from this chain.
        ended: ChainEnd | State[Any] | None = chain.open(secrets=read_secret_block)
        with tags(*rule_tags(chain)):
            # A subflow's Cancelled state reaches us as CancelledRun, never as a value.
            if ended is None:
                ended = await drain.with_options(flow_run_name=f"{rule} · drain")(chain.token)
            if reporter.fault is not None:
                raise reporter.fault
            if ended is None:
                ended = await scan.with_options(flow_run_name=f"{rule} · scan")(chain.token)
            if reporter.fault is not None:
                raise reporter.fault
    except BaseException as exc:
        stopped = exc
    finally:
        _running.reset(running)
    return await _close(reporter, stopped)


#: What to do about a job that ran out of time (a timeout is no RuleFault, so it has no remedy).
TIMED_OUT_REMEDY = (
    "a job ran longer than DELIVERY_BATCH_TIMEOUT_SECONDS; raise it, or lower the rule's batch size or the "
    "target's timeout, then run the rule again"
)


async def _close(reporter: ChainReporter, stopped: BaseException | None) -> State[Any]:
    """The one way a chain that began ends, however it ended: record it, publish its end (the
    reporter), log one line and return the run's state.

    - `stopped` None: the chain ran its course (caught up, or ended by the breaker, a closed route,
      ...): Completed, named after the ending.
    - one of `CANCELLATIONS`: stopped from outside, no fault and no alert. The fence is closed
      first, so a worker of the batch still settling a record finds it closed and stops; nothing
      more is written. Returning the Cancelled state (rather than raising) is what makes Prefect end
      the run Cancelled instead of Crashed.
    - any other Exception: a fault of the rule, Failed.
    - any other BaseException (e.g. GeneratorExit): not a fault of the rule, raised again for
      Prefect to judge once the end is published."""
    chain, logger = reporter.chain, reporter.run_logger
    cancelled = isinstance(stopped, CANCELLATIONS)
    fault = fault_state_name(stopped) if isinstance(stopped, Exception) and not cancelled else None
    # Shielded: under an anyio cancel scope every await would otherwise be cancelled again.
    with anyio.CancelScope(shield=True):
        if cancelled:
            liveness.supersede(chain.engine, chain.rule.id, chain.token, "chain cancelled", chain.clock.now())
        report = chain.finish(stopped, cancelled=cancelled)
        await reporter.close(report, fault)
    if stopped is None:
        logger.info("chain of %s ended %s: %s", chain.rule.name, RUN_STATE_NAMES[report.ended_by], report.message)
        name = STATE_NAMES.get(report.ended_by, "Completed")
        return Completed(message=report.message, data=report.as_json(), name=name)
    if cancelled:
        logger.warning("chain of %s cancelled (%s): nothing more is written", chain.rule.name, type(stopped).__name__)
        return Cancelled(message=report.message, data=report.as_json())
    if fault is None:
        raise stopped
    message = report.message if report.message.startswith(f"{fault}:") else f"{fault}: {report.message}"
    remedy = getattr(stopped, "remedy", None)
    if isinstance(stopped, RuleFault | TimeoutError):
        # The fault says it all: one line, no traceback (its text is redacted already).
        logger.error("chain of %s failed: %s. What to do: %s", chain.rule.name, message, remedy or TIMED_OUT_REMEDY)
    else:
        # Not a fault the engine names: the traceback is for whoever looks into it. Redacted:
        # Prefect's own traceback of a raised exception would carry its text unmasked.
        detail = chain.redact("".join(traceback.format_exception(stopped)))
        logger.error("chain of %s failed on an unexpected error: %s\n%s", chain.rule.name, message, detail)
    # Returned, not raised, and named plainly `Failed`, so Prefect's Failed filter and automations
    # find it; the fault's class is the tag `fault:CLASS` and the message's first word. The
    # exception stays the state's data, so a caller awaiting the flow's result still gets it raised.
    return Failed(message=message, data=stopped)


def run_now(rule: str) -> dict[str, Any]:
    """Run one chain of `rule` in this process and summarise it (what `delivery run --json` prints)."""

    async def _run() -> Any:
        return await deliver_rule(rule=rule, return_state=True)

    return summary(rule, asyncio.run(_run()))
