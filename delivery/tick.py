"""What one tick decides: for every enabled rule, leave an alive chain alone, judge a silent one
dead, and start a chain where none is alive. Starting and cancelling are the flows' business."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import sqlalchemy as sa

from delivery.store import catalog, chains

DEAD_AFTER_ENV = "DELIVERY_DEAD_CHAIN_MINUTES"
DEFAULT_DEAD_AFTER_MINUTES = 15.0


def dead_after(minutes: float | None = None) -> timedelta:
    if minutes is None:
        minutes = float(os.environ.get(DEAD_AFTER_ENV) or DEFAULT_DEAD_AFTER_MINUTES)
    return timedelta(minutes=minutes)


@dataclass(frozen=True)
class DeadChain:
    rule: str
    rule_id: int
    token: str
    flow_run_id: str | None
    silent_for: timedelta


@dataclass
class TickPlan:
    alive: list[str] = field(default_factory=list)
    dead: list[DeadChain] = field(default_factory=list)
    start: list[str] = field(default_factory=list)


def plan_tick(conn: sa.Connection, now: datetime, threshold: timedelta) -> TickPlan:
    """A chain is alive while it has not ended and its heartbeat (written as each job starts, about
    once a second while it settles records, and at launch for a run still waiting for a worker) is
    younger than `threshold`."""
    plan = TickPlan()
    for rule in catalog.list_rules(conn):
        if not rule.enabled:
            continue
        alive = False
        for chain in chains.open_chains(conn, rule.id):
            silent = now - chain["heartbeat_at"]
            if silent <= threshold:
                alive = True
            else:
                plan.dead.append(DeadChain(rule.name, rule.id, chain["token"], chain["flow_run_id"], silent))
        if alive:
            plan.alive.append(rule.name)
        else:
            plan.start.append(rule.name)
    return plan


def record_launch(conn: sa.Connection, rule: str, now: datetime) -> str:
    """Record the chain before its run exists, so the next tick sees it alive while it waits."""
    return chains.start_chain(conn, catalog.get_rule(conn, rule).id, None, now)


def attach_flow_run(conn: sa.Connection, token: str, flow_run_id: str) -> None:
    chains.attach_flow_run(conn, token, flow_run_id)
