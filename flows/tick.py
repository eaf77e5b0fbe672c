"""`delivery-tick`: every 5 minutes, a chain for every enabled rule that has none alive.

A chain whose heartbeat went silent for longer than the threshold is judged dead: its Prefect flow
run is cancelled (which does not stop an in-process run), its token is superseded (which does: its
next job finds the fence closed and writes nothing), and a new chain starts. When the
`deliver-rule` deployment exists, chains start as runs of it, so each rule's history is its own in
the UI; otherwise (local use, tests) the tick runs them itself, one after another.
"""

from __future__ import annotations

import contextlib
from typing import Any
from uuid import UUID

from prefect import flow, get_client, get_run_logger
from prefect.client.schemas import State
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound
from prefect.states import Cancelled, Completed, Failed

from delivery import liveness
from delivery.clock import utcnow
from delivery.db import shared_engine
from delivery.tick import attach_flow_run, dead_after, plan_tick, record_launch
from flows.deliver_rule import deliver_rule

DELIVER_RULE_DEPLOYMENT = "deliver-rule/deliver-rule"


async def _deployment_exists() -> bool:
    async with get_client() as client:
        try:
            await client.read_deployment_by_name(DELIVER_RULE_DEPLOYMENT)
        except ObjectNotFound:
            return False
    return True


async def _cancel(flow_run_id: str, message: str) -> None:
    async with get_client() as client:
        with contextlib.suppress(ObjectNotFound):  # a run recorded by another (ephemeral) Prefect API
            await client.set_flow_run_state(UUID(flow_run_id), Cancelled(message=message), force=True)


@flow(name="delivery-tick", retries=0)
async def delivery_tick(dead_after_minutes: float | None = None) -> State[Any]:
    """Start a chain for every enabled rule that has none alive; replace the dead ones."""
    logger = get_run_logger()
    engine = shared_engine()
    threshold = dead_after(dead_after_minutes)
    with engine.connect().execution_options(readonly=True) as conn:
        plan = plan_tick(conn, utcnow(), threshold)

    for dead in plan.dead:
        message = f"judged dead by the tick: no heartbeat for {int(dead.silent_for.total_seconds())} s"
        if dead.flow_run_id:
            await _cancel(dead.flow_run_id, message)
        liveness.supersede(engine, dead.rule_id, dead.token, message)
        logger.warning("rule %s: chain %s %s", dead.rule, dead.token, message)

    deployed = await _deployment_exists()
    failed: list[str] = []
    for rule in plan.start:
        with engine.begin() as conn:
            token = record_launch(conn, rule, utcnow())
        if deployed:
            run = await run_deployment(  # type: ignore[misc]
                DELIVER_RULE_DEPLOYMENT,
                parameters={"rule": rule, "chain_token": token},
                timeout=0,
                as_subflow=False,
                tags=[f"rule:{rule}"],
            )
            with engine.begin() as conn:
                attach_flow_run(conn, token, str(run.id))
            logger.info("rule %s: started chain as flow run %s", rule, run.id)
        else:
            state = await deliver_rule(rule=rule, chain_token=token, return_state=True)
            if not state.is_completed():
                failed.append(rule)

    summary = f"{len(plan.start)} started, {len(plan.alive)} alive left alone, {len(plan.dead)} dead replaced" + (
        f"; chains failed: {', '.join(failed)}" if failed else ""
    )
    logger.info(summary)
    # A misconfigured rule fails its chain on every tick until fixed; the tick says so too.
    return Failed(message=summary) if failed else Completed(message=summary)
