"""`deliver-rule`: one chain of one rule, as a Prefect flow.

drain and scan are subflows; every batch (job) is one task, never one task per record (Prefect's
per-task overhead would cap throughput). No retries anywhere: a task timeout fails the chain like
any exception, because every exception that leaves a job is a fault of the rule that a second
attempt would meet again (ADR-0029).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import shlex
import traceback
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from typing import Any
from uuid import UUID

import anyio
from prefect import flow, get_client, get_run_logger, tags, task
from prefect.artifacts import acreate_markdown_artifact, acreate_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas import State
from prefect.context import FlowRunContext, TagsContext
from prefect.events import emit_event
from prefect.exceptions import Abort, CancelledRun, TerminationSignal
from prefect.runtime import flow_run
from prefect.states import Cancelled, Completed, Failed

from delivery import liveness
from delivery.alerts import TELLING, transition
from delivery.chain import Chain
from delivery.db import shared_engine
from delivery.domain import BatchReport, ChainEnd, ChainReport, Cursor, LedgerStatus, Phase
from delivery.errors import RuleFault, UnknownName
from delivery.phase import PhaseJobs
from delivery.settings import settings
from delivery.store import chains, ledger
from flows.breaker_events import RunBreakerListener
from flows.lock import rule_lock
from flows.parked_artifact import publish_parked_set
from flows.secrets import read_secret_block
from flows.status_artifact import publish_status
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

# Chains in progress in this process, by token: tasks and subflows receive the token, not the
# Chain object, so that nothing unserialisable travels through Prefect's parameter handling.
_chains: dict[str, Chain] = {}
#: The `deliver-rule` run's logger per chain token: what the operator must see (lock waits and
#: repairs, a breaker trip) goes to the chain's own run, not to the drain or scan subflow's.
_run_loggers: dict[str, logging.LoggerAdapter[Any]] = {}

#: The Completed state's name per chain end: the run list tells the endings apart at a glance
#: (the type stays COMPLETED: none of them is a fault, ADR-0029).
STATE_NAMES = {
    ChainEnd.CAUGHT_UP: "CaughtUp",
    ChainEnd.BREAKER_OPEN: "BreakerOpen",
    ChainEnd.ROUTE_CLOSED: "RouteClosed",
    ChainEnd.SUPERSEDED: "Superseded",
    ChainEnd.DISABLED: "Disabled",
    ChainEnd.RATE_LIMITED: "RateLimited",
}

#: How many parked or failed records a chain's records artifact lists (the total is given too).
RECORDS_LISTED = 200


def batch_timeout_seconds() -> float:
    return settings().batch_timeout_seconds


@task(name="delivery-batch", retries=0, cache_policy=NO_CACHE, persist_result=False)
def delivery_batch(token: str, phase: Phase) -> BatchReport:
    """One job of the chain."""
    return _chains[token].run_batch(phase)


def tally(counts: Mapping[str, int]) -> str:
    """`4 delivered, 1 exhausted`: counts in words, in the ledger's order of statuses."""
    return ", ".join(f"{counts[s.value]} {s.value}" for s in LedgerStatus if counts.get(s.value)) or "nothing"


def _tell_left_behind(logger: Any, rule: str, report: BatchReport) -> None:
    """One WARNING per record the job parked or left failed, with why: parking is never silent."""
    for left in report.left_behind:
        why = " ".join((left.error or "no error recorded").split())[:300]
        if left.status is LedgerStatus.FAILED:
            due = left.next_attempt_at.isoformat(timespec="seconds") if left.next_attempt_at else "not set"
            logger.warning("rule %s: record %s failed, next attempt %s: %s", rule, left.external_id, due, why)
        else:
            logger.warning("rule %s: record %s parked as %s: %s", rule, left.external_id, left.status.value, why)


async def _run_phase(token: str, phase: Phase) -> ChainEnd | None:
    chain = _chains[token]
    logger = get_run_logger()
    chain_logger = _run_loggers.get(token) or logger
    batch = delivery_batch.with_options(timeout_seconds=batch_timeout_seconds())
    jobs = PhaseJobs(chain, phase)
    while (number := jobs.next_job()) is not None:
        async with rule_lock(chain, _run_loggers.get(token)):  # one job of the rule at a time; waiting writes nothing
            # Untagged: Prefect takes a tag concurrency slot (an API call and a client of its own) for
            # every tagged task run. The flow runs carry the rule's tags; the batches are found in them.
            with TagsContext(current_tags=set()):
                report = batch.with_options(task_run_name=f"{phase.value}-batch-{number}")(token, phase)
        if report.attempted:
            logger.info("%s batch %d: %d records: %s", phase.value, number, report.attempted, tally(report.counts))
        if report.waited_seconds >= 0.05:
            chain_logger.info(
                "rule %s: %s batch %d waited %.1f s for target %s's traffic (its rate budget or a pause)",
                chain.rule.name, phase.value, number, report.waited_seconds, chain.rule.target.name,
            )  # fmt: skip
        _tell_left_behind(chain_logger, chain.rule.name, report)
        jobs.record(report)
    return jobs.ended_by


async def _run_subflow(token: str, phase: Phase) -> ChainEnd | State[Any] | None:
    try:
        return await _run_phase(token, phase)
    except CANCELLATIONS as exc:
        # Ends this subflow Cancelled rather than Crashed; the parent then sees CancelledRun.
        return Cancelled(message=f"{phase.value} cancelled ({type(exc).__name__})")


@flow(name="drain", retries=0, validate_parameters=False)
async def drain(token: str) -> ChainEnd | State[Any] | None:
    """Due retries first, oldest due first."""
    return await _run_subflow(token, Phase.DRAIN)


@flow(name="scan", retries=0, validate_parameters=False)
async def scan(token: str) -> ChainEnd | State[Any] | None:
    """Fresh changes from the cursor less the overlap window, in change order."""
    return await _run_subflow(token, Phase.SCAN)


def _artifact_key(rule: str) -> str:
    return "chain-" + (re.sub(r"[^a-z0-9-]+", "-", rule.lower()).strip("-") or "rule")


async def _publish(report: ChainReport) -> None:
    rows = [
        {
            "outcome": status.value,
            "drained": report.drained.get(status.value, 0),
            "scanned": report.scanned.get(status.value, 0),
            "total": report.counts.get(status.value, 0),
        }
        for status in LedgerStatus
    ]
    description = (
        f"**{report.rule}** ended by `{report.ended_by.value}`: {report.message or 'caught up'}\n\n"
        f"cursor before: {_cursor_words(report.cursor_before)}  \n"
        f"cursor after: {_cursor_words(report.cursor_after)}  \njobs: {report.batches}"
        + (f"  \nwaited for the target's traffic: {report.waited_seconds:.1f} s" if report.waited_seconds else "")
    )
    await acreate_table_artifact(table=rows, key=_artifact_key(report.rule), description=description)


def _cursor_words(cursor: Cursor | None) -> str:
    if cursor is None:
        return "none yet (the scan starts from the first change)"
    return f"changes up to {cursor.changed_at.isoformat(timespec='seconds')} (record {cursor.record_id})"


def records_artifact_key(rule: str) -> str:
    return _artifact_key(rule) + "-records"


def requeue_command(rule: str, statuses: list[str], since: str) -> str:
    """The `delivery requeue` command line that selects exactly the rows a chain left behind: the
    rule's rows in those statuses written since the chain started."""
    words = ["delivery", "requeue", rule, *(w for s in statuses for w in ("--status", s)), "--since", since]
    return shlex.join(words)


def _cell(value: Any, limit: int = 200) -> str:
    if value is None:
        return "-"
    text = value.isoformat(timespec="seconds") if hasattr(value, "isoformat") else str(value)
    text = " ".join(text.split())[:limit]
    return text.replace("\\", "\\\\").replace("|", "\\|") or "-"


async def _publish_records(chain: Chain) -> None:
    """The `chain-RULE-records` artifact: the records this chain parked or left failed (the first
    `RECORDS_LISTED`, and how many in all), and the `delivery requeue` command that puts them back.
    Published after every chain, so the key's latest version always speaks of the latest chain.
    last_error is redacted when it is written."""
    rule = chain.rule
    with chain.engine.connect().execution_options(readonly=True) as conn:
        rows, counts = ledger.left_behind_since(conn, rule.id, chain.started_at, RECORDS_LISTED)
    total = sum(counts.values())
    since = chain.started_at.isoformat()
    if total == 0:
        markdown = f"**{rule.name}**: this chain (started {since}) parked no record and left none failed."
    else:
        statuses = [s.value for s in ledger.LEFT_BEHIND if counts.get(s.value)]
        tally = ", ".join(f"{counts[s]} {s}" for s in statuses)
        lines = [
            f"**{rule.name}**: this chain (started {since}) parked or left failed **{total}** record(s): {tally}.",
            "",
            "Put them back (each becomes a retry due now, attempts reset; `--dry-run` lists them first; "
            "rows a later chain parks are selected too):",
            "",
            "```bash",
            requeue_command(rule.name, statuses, since),
            "```",
            "",
            "| external id | status | attempts | last error | next attempt |",
            "| --- | --- | --- | --- | --- |",
        ]
        lines += [
            f"| {_cell(r['external_id'])} | {r['status']} | {r['attempts']} | {_cell(r['last_error'])} "
            f"| {_cell(r['next_attempt_at'])} |"
            for r in rows
        ]
        if total > len(rows):
            lines += ["", f"The first {len(rows)} of {total} are listed; `delivery ledger --rule` shows them all."]
        markdown = "\n".join(lines)
    await acreate_markdown_artifact(
        markdown=markdown,
        key=records_artifact_key(rule.name),
        description=f"Records {rule.name}'s chain parked or left failed ({total})",
    )


def fault_state_name(exc: BaseException) -> str:
    """A Failed run's state name: the fault's class (`MissingWriter`, ...); a batch that ran out of
    time is `TimedOut`, as Prefect names the task that did."""
    return "TimedOut" if isinstance(exc, TimeoutError) else type(exc).__name__


def _announce(chain: Chain, report: ChainReport) -> None:
    """Emit a Prefect event when the rule's health changes; the automations in
    `automations/rule-failing.yaml` and `rule-recovered.yaml` turn these into notifications."""
    with chain.engine.connect().execution_options(readonly=True) as conn:
        previous = chains.previous_end(conn, chain.rule.id, chain.token, [end.value for end in TELLING])
    change = transition(previous, report.ended_by)
    if change is None:
        return
    emit_event(
        event=change.value,
        resource={
            "prefect.resource.id": f"delivery.rule.{chain.rule.name}",
            "prefect.resource.name": chain.rule.name,
            "delivery.target": chain.rule.target.name,
        },
        payload={"ended_by": report.ended_by.value, "message": report.message, "previous": previous},
    )


def rule_tags(chain: Chain) -> list[str]:
    return [f"rule:{chain.rule.name}", f"target:{chain.rule.target.name}"]


async def _label_run(chain: Chain) -> None:
    """Name and tag the run after the rule and target, so operators can filter on them."""
    run_id = flow_run.get_id()
    if run_id is None:
        return
    name = f"{chain.rule.name} -> {chain.rule.target.name}"
    tags = sorted({*flow_run.get_tags(), *rule_tags(chain)})
    if flow_run.get_name() == name and set(tags) <= set(flow_run.get_tags()):
        return  # created so by the tick (flow_run_name, tags): nothing to rename afterwards
    async with get_client() as client:
        await client.update_flow_run(UUID(run_id), name=name, tags=tags)


#: The tags `ending_tags` sets, replaced whole when a retried run ends again.
ENDING_TAG_PREFIXES = ("ended:", "fault:", "parked:", "failed:")


def ending_tags(report: ChainReport, fault: str | None = None) -> list[str]:
    """Tags that say how the chain ended, for the runs list and its tag filter: `ended:ENDING`
    always, `fault:CLASS` for a rule fault, `parked:N` and `failed:N` for records it parked or left
    failed. The state name alone does not serve: Prefect's state filter and its automations know
    only their own state names (a Failed run named otherwise is not found as Failed)."""
    tags = [f"ended:{report.ended_by.value}"]
    if fault is not None:
        tags.append(f"fault:{fault}")
    parked = report.counts.get(LedgerStatus.EXHAUSTED.value, 0) + report.counts.get(LedgerStatus.REMOTE_GONE.value, 0)
    if parked:
        tags.append(f"parked:{parked}")
    if failed := report.counts.get(LedgerStatus.FAILED.value, 0):
        tags.append(f"failed:{failed}")
    return tags


async def _tag_ending(chain: Chain, report: ChainReport, fault: str | None = None) -> None:
    run_id = flow_run.get_id()
    if run_id is None:
        return
    # A retried run's earlier ending goes: the tags say how this run ended last, not before.
    kept = {t for t in flow_run.get_tags() if not t.startswith(ENDING_TAG_PREFIXES)}
    tags = sorted({*kept, *rule_tags(chain), *ending_tags(report, fault)})
    async with get_client() as client:
        await client.update_flow_run(UUID(run_id), tags=tags)


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
                breaker_listeners=listeners,
                traffic_listeners=traffic,
            )
        except LookupError as exc:
            if flow_run.get_run_count() <= 1:
                return Completed(message=f"superseded before it started: {exc}", name=STATE_NAMES[ChainEnd.SUPERSEDED])
            get_run_logger().info("rule %s: this run is a retry; its first chain has ended, a fresh one starts", rule)
    return Chain(shared_engine(), rule, flow_run_id=run_id, breaker_listeners=listeners, traffic_listeners=traffic)


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
    _chains[chain.token] = chain
    _run_loggers[chain.token] = logger  # type: ignore[assignment]
    try:
        await _label_run(chain)
        # A subflow's Cancelled state reaches us as CancelledRun, never as a value.
        # The token is read now, from a Secret block too: a token changed in the UI counts from this chain.
        ended: ChainEnd | State[Any] | None = chain.open(secrets=read_secret_block)
        with tags(*rule_tags(chain)):
            if ended is None:
                ended = await drain.with_options(flow_run_name=f"{rule} · drain")(chain.token)
            if ended is None:
                ended = await scan.with_options(flow_run_name=f"{rule} · scan")(chain.token)
    except CANCELLATIONS as exc:
        return await _cancelled(chain, exc)
    except BaseException as exc:
        report = chain.finish(exc)
        if not isinstance(exc, Exception):
            await _close(chain, report)
            raise  # not a fault of the rule (e.g. GeneratorExit): Prefect judges it
        fault = fault_state_name(exc)
        await _close(chain, report, fault)
        message = report.message if report.message.startswith(f"{fault}:") else f"{fault}: {report.message}"
        remedy = getattr(exc, "remedy", None)
        if isinstance(exc, RuleFault | TimeoutError):
            # The fault says it all: one line, no traceback (its text is redacted already).
            logger.error("chain of %s failed: %s. What to do: %s", rule, message, remedy or TIMED_OUT_REMEDY)
        else:
            # Not a fault the engine names: the traceback is for whoever looks into it. Redacted:
            # Prefect's own traceback of a raised exception would carry its text unmasked.
            detail = chain.redact("".join(traceback.format_exception(exc)))
            logger.error("chain of %s failed on an unexpected error: %s\n%s", rule, message, detail)
        # Returned, not raised, and named plainly `Failed`, so Prefect's Failed filter and automations
        # find it; the fault's class is the tag `fault:CLASS` and the message's first word. The
        # exception stays the state's data, so a caller awaiting the flow's result still gets it raised.
        return Failed(message=message, data=exc)
    finally:
        _chains.pop(chain.token, None)
        _run_loggers.pop(chain.token, None)
    report = chain.finish()
    await _close(chain, report)
    logger.info("chain of %s ended by %s: %s", rule, report.ended_by.value, report.message)
    return Completed(message=report.message, data=report.as_json(), name=STATE_NAMES.get(report.ended_by, "Completed"))


#: What to do about a job that ran out of time (a timeout is no RuleFault, so it has no remedy).
TIMED_OUT_REMEDY = (
    "a job ran longer than DELIVERY_BATCH_TIMEOUT_SECONDS; raise it, or lower the rule's batch size or the "
    "target's timeout, then run the rule again"
)


async def _close(chain: Chain, report: ChainReport, fault: str | None = None) -> None:
    """Everything a chain's end publishes: its report, the records it left, how it ended as tags,
    and the rule's health event."""
    await _publish(report)
    await _publish_records(chain)
    await _publish_standing(chain)
    await _tag_ending(chain, report, fault)
    _announce(chain, report)


async def _publish_standing(chain: Chain) -> None:
    """The artifacts that speak of now rather than of this chain, refreshed as it ends: the rule's
    `parked-RULE` and the `delivery-status` of every rule (so it is never a tick behind). Neither
    is the chain's own outcome: a failure to publish them is logged, and the chain ends as it did."""
    try:
        with contextlib.suppress(UnknownName):  # a rule retired while its chain ran: nothing stands
            await publish_parked_set(chain.engine, chain.rule.name)
        await publish_status()
    except Exception as exc:
        get_run_logger().warning(
            "rule %s: the parked-set or status artifact was not refreshed: %s", chain.rule.name, chain.redact(str(exc))
        )


async def _cancelled(chain: Chain, exc: BaseException) -> State[Any]:
    """End a chain stopped from outside: no fault, no alert, and nothing more written. The fence
    is closed first, so a worker of the batch still settling a record finds it closed and stops;
    then the chain records that it was cancelled. Returning the Cancelled state (rather than
    raising) is what makes Prefect end the run Cancelled instead of Crashed."""
    # Shielded: under an anyio cancel scope every await would otherwise be cancelled again.
    with anyio.CancelScope(shield=True):
        liveness.supersede(chain.engine, chain.rule.id, chain.token, "chain cancelled")
        report = chain.finish(exc, cancelled=True)
        await _publish(report)
        await _publish_records(chain)
        await _publish_standing(chain)
        await _tag_ending(chain, report)
        _announce(chain, report)  # `cancelled` tells nothing about the rule: no event
    get_run_logger().warning("chain of %s cancelled (%s): nothing more is written", chain.rule.name, type(exc).__name__)
    return Cancelled(message=report.message, data=report.as_json())


def _state_name(state: State[Any]) -> str:
    if state.is_completed():
        return "COMPLETED"
    return "CANCELLED" if state.is_cancelled() else "FAILED"


def run_now(rule: str) -> dict[str, Any]:
    """Run one chain of `rule` in this process and summarise it (what `delivery run --json` prints)."""

    async def _run() -> Any:
        return await deliver_rule(rule=rule, return_state=True)

    state = asyncio.run(_run())
    flow_run_id = str(state.state_details.flow_run_id)
    with shared_engine().connect().execution_options(readonly=True) as conn:
        chain = chains.chain_by_flow_run(conn, flow_run_id)
    report: dict[str, Any] = dict((chain or {}).get("report") or {})
    empty = {s.value: 0 for s in LedgerStatus}
    return {
        "rule": rule,
        "state": _state_name(state),
        "ended_by": report.get("ended_by", ChainEnd.RULE_FAULT.value),
        "message": report.get("message") or state.message or "",
        "counts": report.get("counts", empty),
        "drained": report.get("drained", empty),
        "scanned": report.get("scanned", empty),
        "cursor_before": report.get("cursor_before"),
        "cursor_after": report.get("cursor_after"),
        "waited_seconds": report.get("waited_seconds", 0.0),
        "flow_run_id": flow_run_id,
    }
