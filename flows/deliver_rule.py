"""`deliver-rule`: one chain of one rule, as a Prefect flow.

drain and scan are subflows; every batch (job) is one task, never one task per record (Prefect's
per-task overhead would cap throughput). No retries anywhere: a task timeout fails the chain like
any exception, because every exception that leaves a job is a fault of the rule that a second
attempt would meet again (ADR-0029).
"""

from __future__ import annotations

import os
import re
from typing import Any
from uuid import UUID

from prefect import flow, get_client, get_run_logger, task
from prefect.artifacts import acreate_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas import State
from prefect.events import emit_event
from prefect.runtime import flow_run
from prefect.states import Completed

from delivery.alerts import TELLING, transition
from delivery.db import shared_engine
from delivery.domain import BatchReport, ChainEnd, ChainReport, LedgerStatus, Phase
from delivery.engine import Chain
from delivery.store import chains
from flows.lock import rule_lock

BATCH_TIMEOUT_ENV = "DELIVERY_BATCH_TIMEOUT_SECONDS"
DEFAULT_BATCH_TIMEOUT_SECONDS = 600.0

# Chains in progress in this process, by token: tasks and subflows receive the token, not the
# Chain object, so that nothing unserialisable travels through Prefect's parameter handling.
_chains: dict[str, Chain] = {}


def batch_timeout_seconds() -> float:
    raw = os.environ.get(BATCH_TIMEOUT_ENV)
    return float(raw) if raw else DEFAULT_BATCH_TIMEOUT_SECONDS


@task(name="delivery-batch", retries=0, cache_policy=NO_CACHE, persist_result=False)
def delivery_batch(token: str, phase: Phase) -> BatchReport:
    """One job of the chain."""
    return _chains[token].run_batch(phase)


async def _run_phase(token: str, phase: Phase) -> ChainEnd | None:
    chain = _chains[token]
    logger = get_run_logger()
    batch = delivery_batch.with_options(timeout_seconds=batch_timeout_seconds())
    number = 0
    while True:
        number += 1
        async with rule_lock(chain):  # one job of the rule at a time; waiting writes nothing
            report = batch.with_options(task_run_name=f"{phase.value}-batch-{number}")(token, phase)
        logger.info("%s batch %d: %d attempted %s", phase.value, number, report.attempted, dict(report.counts))
        if report.ended_by is not None:
            return report.ended_by
        # The drain's set is fixed by the chain's start (every row it attempts gets a later
        # time), so a short page is its last; the scan goes on until a page comes back empty.
        if report.attempted == 0 or (phase is Phase.DRAIN and report.attempted < chain.rule.batch_size):
            return None


@flow(name="drain", retries=0, validate_parameters=False)
async def drain(token: str) -> ChainEnd | None:
    """Due retries first, oldest due first."""
    return await _run_phase(token, Phase.DRAIN)


@flow(name="scan", retries=0, validate_parameters=False)
async def scan(token: str) -> ChainEnd | None:
    """Fresh changes from the cursor less the overlap window, in change order."""
    return await _run_phase(token, Phase.SCAN)


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
    before = report.cursor_before.as_json() if report.cursor_before else None
    after = report.cursor_after.as_json() if report.cursor_after else None
    description = (
        f"**{report.rule}** ended by `{report.ended_by.value}`: {report.message or 'caught up'}\n\n"
        f"cursor before: `{before}`  \ncursor after: `{after}`  \nbatches: {report.batches}"
    )
    await acreate_table_artifact(table=rows, key=_artifact_key(report.rule), description=description)


def _announce(chain: Chain, report: ChainReport) -> None:
    """Emit a Prefect event when the rule's health changes; the automations in
    `automations/chain-alerts.yaml` turn these into notifications."""
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


async def _label_run(chain: Chain) -> None:
    """Name and tag the run after the rule and target, so operators can filter on them."""
    run_id = flow_run.get_id()
    if run_id is None:
        return
    tags = sorted({*flow_run.get_tags(), f"rule:{chain.rule.name}", f"target:{chain.rule.target.name}"})
    async with get_client() as client:
        await client.update_flow_run(UUID(run_id), name=f"{chain.rule.name} -> {chain.rule.target.name}", tags=tags)


@flow(name="deliver-rule", retries=0, log_prints=False)
async def deliver_rule(rule: str, chain_token: str | None = None) -> State[Any]:
    """One chain of `rule`: health gate, breaker check, drain, scan. `chain_token` is given by the
    tick, which records the chain when it launches the run."""
    logger = get_run_logger()
    try:
        chain = Chain(shared_engine(), rule, flow_run_id=flow_run.get_id(), token=chain_token)
    except LookupError as exc:  # the tick judged this launch dead before it got to run
        return Completed(message=f"superseded before it started: {exc}", name="Superseded")
    _chains[chain.token] = chain
    try:
        await _label_run(chain)
        ended = chain.open()
        if ended is None:
            ended = await drain(chain.token)
        if ended is None:
            ended = await scan(chain.token)
    except BaseException as exc:
        report = chain.finish(exc)
        await _publish(report)
        _announce(chain, report)
        logger.error("chain of %s failed: %s", rule, report.message)
        raise
    finally:
        _chains.pop(chain.token, None)
    report = chain.finish()
    await _publish(report)
    _announce(chain, report)
    counts = ", ".join(f"{n} {status}" for status, n in sorted(report.counts.items()) if n)
    message = report.message or f"caught up: {counts or 'nothing to deliver'}"
    logger.info("chain of %s ended by %s: %s", rule, report.ended_by.value, message)
    return Completed(message=message, data=report.as_json())


def run_now(rule: str) -> dict[str, Any]:
    """Run one chain of `rule` in this process and summarise it (what `delivery run --json` prints)."""
    import asyncio

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
        "state": "COMPLETED" if state.is_completed() else "FAILED",
        "ended_by": report.get("ended_by", ChainEnd.RULE_FAULT.value),
        "message": report.get("message") or state.message or "",
        "counts": report.get("counts", empty),
        "drained": report.get("drained", empty),
        "scanned": report.get("scanned", empty),
        "cursor_before": report.get("cursor_before"),
        "cursor_after": report.get("cursor_after"),
        "flow_run_id": flow_run_id,
    }
