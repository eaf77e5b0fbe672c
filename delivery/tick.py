"""What one tick decides: for every enabled rule, leave an alive chain alone, judge a silent one
dead, and start a chain where none is alive and there is something to do. Starting and cancelling
are the flows' business."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa

from delivery import decisions, liveness
from delivery.domain import Rule
from delivery.store import attempts as attempts_store
from delivery.store import catalog, chains, ledger
from delivery.writers.registry import driver_verbs


def run_name(rule: str, target: str) -> str:
    """The name a chain's flow run carries in the UI (`RULE -> TARGET`), given when the run is
    created so that the run list never shows a generated name."""
    return f"{rule} -> {target}"


def run_tags(rule: str, target: str) -> list[str]:
    """The tags operators filter a rule's or a target's chains on."""
    return [f"rule:{rule}", f"target:{target}"]


@dataclass(frozen=True)
class DeadChain:
    rule: str
    rule_id: int
    token: str
    flow_run_id: str | None
    silent_for: timedelta
    #: Launched, and its run never began to run (no worker started it in time).
    never_started: bool = False

    @property
    def why(self) -> str:
        """Why the tick judged it dead, as its run's cancellation and the chain's end say."""
        seconds = int(self.silent_for.total_seconds())
        if self.never_started:
            return f"judged dead by the tick: launched {seconds} s ago, its run never began to run"
        return f"judged dead by the tick: no heartbeat for {seconds} s"

    def as_json(self) -> dict[str, Any]:
        return {
            "chain_token": self.token,
            "flow_run_id": self.flow_run_id,
            "silent_seconds": round(self.silent_for.total_seconds(), 1),
            "never_started": self.never_started,
        }


@dataclass(frozen=True)
class Launch:
    """A rule that gets a new chain this tick."""

    rule: str
    target: str

    @property
    def run_name(self) -> str:
        return run_name(self.rule, self.target)

    @property
    def tags(self) -> list[str]:
        return run_tags(self.rule, self.target)


@dataclass
class TickPlan:
    alive: list[str] = field(default_factory=list)
    dead: list[DeadChain] = field(default_factory=list)
    start: list[Launch] = field(default_factory=list)
    disabled: list[str] = field(default_factory=list)
    #: Enabled rules with no chain alive and nothing to do: no chain, no flow run this tick.
    idle: list[str] = field(default_factory=list)


def misconfigured(rule: Rule) -> bool:
    """No registered writer for the target's driver, or one lacking a verb the policy needs: a
    chain would fail at once (ADR-0029), and it must, on every tick, idle or not, so that a broken
    route never looks like a route with nothing to deliver. A registry lookup, no I/O."""
    verbs = driver_verbs(rule.target.driver)
    return verbs is None or not rule.verbs <= verbs


def has_work(conn: sa.Connection, rule: Rule, now: datetime) -> bool:
    """Whether a chain started now would find anything: a failed row due by now (the drain's
    first page) or a change from where its scan would start (the scan's). One row of each, both
    index seeks: a few hundred idle rules cost a few hundred queries, not a few hundred processes."""
    if ledger.drain_page(conn, rule, now, 1):
        return True
    return bool(ledger.scan_page(conn, rule, decisions.scan_start(rule), 1))


def needs_chain(conn: sa.Connection, rule: Rule, now: datetime) -> bool:
    """Whether an enabled rule with no chain alive gets one now: it has something to do
    (`has_work`), or it is misconfigured (its chain must fail, `misconfigured`). A closed route or
    an open breaker is no reason by itself: their chain would end at once with nothing to do. The
    tick's predicate, and `delivery run`'s: a rule for which it is false is idle, no flow run."""
    return misconfigured(rule) or has_work(conn, rule, now)


def plan_tick(conn: sa.Connection, now: datetime, threshold: timedelta) -> TickPlan:
    """A chain is alive while it has not ended and `liveness.judge_chains` finds its heartbeat
    fresh within `threshold` (`liveness.dead_chain_after`). A rule with none alive gets a chain only
    when `needs_chain`; otherwise it is idle this tick."""
    plan = TickPlan()
    for rule in catalog.list_rules(conn):
        if not rule.enabled:
            plan.disabled.append(rule.name)
            continue
        alive = False
        for chain in liveness.judge_chains(conn, rule.id, now, threshold):
            if chain.alive:
                alive = True
            else:
                plan.dead.append(
                    DeadChain(rule.name, rule.id, chain.token, chain.flow_run_id, chain.silent_for, chain.never_started)
                )
        if alive:
            plan.alive.append(rule.name)
        elif needs_chain(conn, rule, now):
            plan.start.append(Launch(rule.name, rule.target.name))
        else:
            plan.idle.append(rule.name)
    return plan


#: The tick prunes a record's history in deletes of this many rows, at most `PRUNE_BATCHES` a tick:
#: each a short transaction, so a backlog (a first tick after a long pause) never holds the
#: database for long; what is left goes at the next tick.
PRUNE_ROWS = 1000
PRUNE_BATCHES = 50


def prune_attempts(engine: sa.Engine, now: datetime, keep_days: float) -> int:
    """Delete the requests older than `keep_days` from the records' histories, in bounded
    deletes; how many went."""
    before = now - timedelta(days=keep_days)
    pruned = 0
    for _ in range(PRUNE_BATCHES):
        with engine.begin() as conn:
            gone = attempts_store.prune(conn, before, PRUNE_ROWS)
        pruned += gone
        if gone < PRUNE_ROWS:
            break
    return pruned


def record_launch(conn: sa.Connection, rule: str, now: datetime) -> str:
    """Record the chain before its run exists, so the next tick sees it alive while it waits."""
    return chains.start_chain(conn, catalog.get_rule(conn, rule).id, None, now, running=False)


def attach_flow_run(conn: sa.Connection, token: str, flow_run_id: str) -> None:
    chains.attach_flow_run(conn, token, flow_run_id)


@dataclass
class TickOutcome:
    """What a tick did, rule by rule (what `delivery tick --json` prints)."""

    plan: TickPlan
    started: dict[str, dict[str, Any]] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)
    #: Requests pruned from the records' histories (older than DELIVERY_ATTEMPTS_KEEP_DAYS).
    attempts_pruned: int = 0

    def summary(self) -> str:
        plan = self.plan
        # The count started first: what an operator scanning the tick runs looks for.
        text = (
            f"{len(plan.start)} started, {len(plan.idle)} idle, {len(plan.dead)} dead replaced, "
            f"{len(plan.alive)} running left alone"
        )
        return text + (f"; chains failed: {', '.join(self.failed)}" if self.failed else "")

    def rules(self) -> list[dict[str, Any]]:
        replaced: dict[str, list[dict[str, Any]]] = {}
        for dead in self.plan.dead:
            replaced.setdefault(dead.rule, []).append(dead.as_json())
        rows: list[dict[str, Any]] = []
        for launch in self.plan.start:
            # A launch the tick did not get to (it was stopped first) is listed as not started.
            started = self.started.get(launch.rule)
            rows.append(
                {
                    "rule": launch.rule,
                    "action": "started" if started else "not_started",
                    "flow_run_name": launch.run_name,
                    "chain_token": None,
                    "flow_run_id": None,
                    "chain_state": None,
                    **(started or {}),
                    "replaced": replaced.get(launch.rule, []),
                }
            )
        rows += [{"rule": rule, "action": "alive", "replaced": replaced.get(rule, [])} for rule in self.plan.alive]
        rows += [{"rule": rule, "action": "idle", "replaced": replaced.get(rule, [])} for rule in self.plan.idle]
        rows += [{"rule": rule, "action": "disabled", "replaced": []} for rule in self.plan.disabled]
        return rows

    def as_json(self) -> dict[str, Any]:
        return {
            "started": len(self.plan.start),
            "alive": len(self.plan.alive),
            "dead_replaced": len(self.plan.dead),
            "idle": len(self.plan.idle),
            "failed": list(self.failed),
            "attempts_pruned": self.attempts_pruned,
            "rules": self.rules(),
        }
