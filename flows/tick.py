"""`delivery-tick`: every 5 minutes, a chain for every enabled rule that has none alive and has
something to do (a due retry or a change to scan; a misconfigured rule always, so that it fails on
every tick). An idle rule costs two index seeks in the tick and no flow run: on the production path
each `deliver-rule` run is a fresh worker process, seconds of CPU before a record moves.

A chain whose heartbeat went silent for longer than the threshold is judged dead: its Prefect flow
run is set Cancelling (a worker then stops its process, if it still runs, and marks it Cancelled; a
run with nobody to stop it stays Cancelling, and a run still alive in process ends Cancelled at its
next job), its token is superseded (which stops it whatever runs it: its next job finds the fence
closed and writes nothing), and a new chain starts if the rule has something to do. When the
`deliver-rule` deployment exists, chains start as runs of it, so each rule's history is its own in
the UI; otherwise (local use, tests) the tick runs them itself, one after another. Either way each
chain's run is created with its name (`RULE -> TARGET`) and tags, and a run of the deployment carries
the chain token as its idempotency key: a launch repeated with the same token never makes a second run.

Each tick ends by publishing the `delivery-status` table artifact: what `delivery status` prints, one
row per rule, so the UI alone answers "is everything delivering?".
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from datetime import UTC
from typing import Any
from uuid import UUID

import sqlalchemy as sa
from prefect import flow, get_client, get_run_logger, tags
from prefect.client.orchestration import PrefectClient
from prefect.client.schemas import State
from prefect.context import FlowRunContext
from prefect.exceptions import ObjectNotFound
from prefect.states import Cancelled, Cancelling, Completed, Failed

from delivery import liveness
from delivery.clock import SYSTEM, Clock, utcnow
from delivery.db import shared_engine
from delivery.errors import InputError
from delivery.settings import dead_chain_minutes, settings
from delivery.tick import Launch, TickOutcome, attach_flow_run, plan_tick, prune_attempts, record_launch
from flows.deliver_rule import deliver_rule, launch_context, launched
from flows.status_artifact import publish_status
from flows.tick_events import tick_ended

DELIVER_RULE_DEPLOYMENT = "deliver-rule/deliver-rule"
#: How many chains' runs the tick creates at once.
LAUNCHES_AT_ONCE = 8


async def _deployment_exists() -> bool:
    async with get_client() as client:
        try:
            await client.read_deployment_by_name(DELIVER_RULE_DEPLOYMENT)
        except ObjectNotFound:
            return False
    return True


async def _cancel(flow_run_id: str, message: str) -> None:
    """Ask the run to stop. Cancelling, not a forced Cancelled: a worker kills the process of a run
    in Cancelling, while a run forced to Cancelled would go on in a live process. Not forced either,
    so the server keeps its own rules (a run that ended already stays as it ended)."""
    async with get_client() as client:
        with contextlib.suppress(ObjectNotFound):  # a run recorded by another (ephemeral) Prefect API
            await client.set_flow_run_state(UUID(flow_run_id), Cancelling(message=message))


async def _launch(client: PrefectClient, deployment_id: UUID, launch: Launch, token: str) -> dict[str, Any]:
    """Create the chain's run of the `deliver-rule` deployment, named and tagged from the start."""
    run = await client.create_flow_run_from_deployment(
        deployment_id,
        parameters={"rule": launch.rule},
        # The chain goes in the run's context, not its parameters: the Run form and a Retry
        # have no use for it (a retried run starts a fresh chain, see flows.deliver_rule).
        context=launch_context(token),
        name=launch.run_name,
        # The chain token: a launch retried after a lost answer finds the run it made, not a second one.
        idempotency_key=token,
        tags=launch.tags,  # the server adds the deployment's own
    )
    return {"flow_run_id": str(run.id), "chain_state": run.state.type.value if run.state else None}


async def _launch_all(
    engine: sa.Engine, launches: list[Launch], outcome: TickOutcome, logger: Any, clock: Clock
) -> None:
    """Start each chain as a run of the deployment, `LAUNCHES_AT_ONCE` at a time, on one client.

    A tick over a thousand rules may start hundreds of chains: one after another, each on a client
    of its own, starting them took minutes of the five the tick has."""
    gate = asyncio.Semaphore(LAUNCHES_AT_ONCE)
    async with get_client() as client:
        deployment = await client.read_deployment_by_name(DELIVER_RULE_DEPLOYMENT)

        async def one(launch: Launch) -> None:
            async with gate:
                with engine.begin() as conn:
                    token = record_launch(conn, launch.rule, clock.now())
                started = await _launch(client, deployment.id, launch, token)
                with engine.begin() as conn:
                    attach_flow_run(conn, token, started["flow_run_id"])
            outcome.started[launch.rule] = {"chain_token": token, **started}
            logger.info("rule %s: started chain as flow run %s", launch.rule, started["flow_run_id"])

        async with asyncio.TaskGroup() as group:  # the first launch to fail cancels the others
            for launch in launches:
                group.create_task(one(launch))


def tick_run_name() -> str:
    """`tick HH:MM`, the UTC minute the run was scheduled for (or started, run by hand): a list of
    tick runs then reads as a timeline."""
    from prefect.runtime import flow_run

    when = flow_run.scheduled_start_time or utcnow()
    return f"tick {when.astimezone(UTC):%H:%M}"


@flow(name="delivery-tick", flow_run_name=tick_run_name, retries=0)
async def delivery_tick(dead_after_minutes: float = 0) -> State[Any]:
    """Start a chain for every enabled rule that has none alive and something to do; replace the
    dead ones.

    Args:
        dead_after_minutes: How many minutes a chain may go without a heartbeat before this tick
            judges it dead, cancels its run and starts a new chain of its rule (at most 10080, a
            week). 0, the default: DELIVERY_DEAD_CHAIN_MINUTES, 15 minutes unless set.
    """
    run = FlowRunContext.get()
    assert run is not None and run.flow_run is not None
    ended = functools.partial(tick_ended, flow_run_id=str(run.flow_run.id), flow_id=str(run.flow_run.flow_id),
                              run_name=run.flow_run.name)  # fmt: skip
    try:
        state = await _tick(dead_after_minutes)
    except Exception as exc:
        ended(Failed(message=f"{type(exc).__name__}: {exc}"))
        raise
    ended(state)
    return state


async def _tick(dead_after_minutes: float) -> State[Any]:
    logger = get_run_logger()
    # 0 stands for "not given": a number field in the Run form cannot be left empty (None) cleanly.
    if dead_after_minutes != 0:
        try:
            dead_chain_minutes(dead_after_minutes, "dead_after_minutes")
        except InputError as exc:
            # NaN or a negative threshold would judge every live chain dead: nothing is done.
            logger.error("tick refused: %s", exc)
            return Failed(message=str(exc))  # plainly Failed: the tick-failed alert and filters find it
    engine = shared_engine()
    clock = SYSTEM  # the tick's one clock: every moment it judges or stamps
    threshold = liveness.dead_chain_after(dead_after_minutes or None)
    with engine.connect().execution_options(readonly=True) as conn:
        plan = plan_tick(conn, clock.now(), threshold)
    outcome = TickOutcome(plan)
    outcome.attempts_pruned = prune_attempts(engine, clock.now(), settings().attempts_keep_days)

    for dead in plan.dead:
        message = dead.why
        if dead.flow_run_id:
            await _cancel(dead.flow_run_id, message)
        liveness.supersede(engine, dead.rule_id, dead.token, message, clock.now())
        logger.warning("rule %s: chain %s %s", dead.rule, dead.token, message)

    if await _deployment_exists():
        await _launch_all(engine, plan.start, outcome, logger, clock)
    else:  # local use and tests: the tick runs each chain itself, one after another
        for launch in plan.start:
            with engine.begin() as conn:
                token = record_launch(conn, launch.rule, clock.now())
            with tags(*launch.tags), launched(token):
                state = await deliver_rule.with_options(flow_run_name=launch.run_name)(
                    rule=launch.rule, return_state=True
                )
            outcome.started[launch.rule] = {
                "chain_token": token,
                "flow_run_id": str(state.state_details.flow_run_id),
                "chain_state": state.type.value,
            }
            if state.is_cancelled():
                # The chain swallowed the stop to end Cancelled; the tick must not go on to the
                # next rule as if nothing had happened.
                logger.warning("rule %s: chain cancelled; the tick stops here", launch.rule)
                return Cancelled(message=f"cancelled during the chain of {launch.rule}", data=outcome.as_json())
            if not state.is_completed():
                outcome.failed.append(launch.rule)

    summary = outcome.summary()
    logger.info(summary)
    await publish_status(summary)
    # A misconfigured rule fails its chain on every tick until fixed; the tick says so too.
    data = outcome.as_json()
    return Failed(message=summary, data=data) if outcome.failed else Completed(message=summary, data=data)


def run_tick(dead_after_minutes: float | None = None) -> dict[str, Any]:
    """Run one tick in this process and summarise it (what `delivery tick --json` prints)."""
    import asyncio

    async def _run() -> Any:
        return await delivery_tick(dead_after_minutes=dead_after_minutes or 0, return_state=True)

    state = asyncio.run(_run())
    data = state.result(raise_on_failure=False)
    return {
        "state": state.type.value,
        "message": state.message or "",
        "flow_run_id": str(state.state_details.flow_run_id),
        **(data if isinstance(data, dict) else {}),
    }
