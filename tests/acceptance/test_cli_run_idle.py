"""`delivery run RULE` on a rule with nothing to do (issue #17 point 3): the tick's own predicate
(`delivery.tick.needs_chain`) decides, before Prefect is imported, whether the rule has anything
to do. A rule the tick would leave idle gets no chain and no flow run: `ended_by: nothing_to_do`,
exit 0. `--always` runs the chain anyway; a change, a due retry, a misconfigured rule or a disabled
one still go through the real chain. The console script as a subprocess, on SQLite and PostgreSQL,
against the session's Prefect API."""

from __future__ import annotations

import asyncio
import json
import subprocess
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from delivery.clock import utcnow
from delivery.domain import MirrorInput
from delivery.liveness import dead_chain_after
from delivery.store import catalog
from delivery.store.mirror import load_records
from delivery.store.tables import (
    breaker_states_table,
    chains_table,
    connections_table,
    ledger_table,
    mirror_records_table,
)
from delivery.tick import plan_tick
from tests.support.cli import (
    RULE,
    ZERO_COUNTS,
    as_json,
    config,
    contact,
    delivery,
    ok,
    prefect_env,
    set_status,
    set_up,
)
from tests.target_server import TargetServer

#: The keys of every `delivery run --json`, a chain's or not.
RUN_KEYS = {
    "rule",
    "state",
    "ended_by",
    "message",
    "counts",
    "drained",
    "scanned",
    "cursor_before",
    "cursor_after",
    "waited_seconds",
    "flow_run_id",
}


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    path = tmp_path / "work"
    path.mkdir()
    return path


@pytest.fixture
def rule_set_up(prefect_api: None, engine: sa.Engine, target: TargetServer, workdir: Path) -> Path:
    """The standard rule against the real local target, no record yet; returns the working directory."""
    set_up(engine, config(target.url))
    return workdir


def _run(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return delivery("run", RULE, *args, cwd=cwd, env=prefect_env())


def _tick_would(engine: sa.Engine) -> str:
    """What the tick's plan does with the rule now: `start` or `idle`."""
    with engine.connect() as conn:
        plan = plan_tick(conn, utcnow(), dead_chain_after())
    started = [launch.rule for launch in plan.start]
    assert RULE in started + plan.idle, plan
    return "start" if RULE in started else "idle"


def _chain_count(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(chains_table)).scalar_one())


def _deliver_rule_runs() -> int:
    async def count() -> int:
        from prefect import get_client
        from prefect.client.schemas.filters import FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterTags

        async with get_client() as client:
            return await client.count_flow_runs(
                flow_filter=FlowFilter(name=FlowFilterName(any_=["deliver-rule"])),
                flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[f"rule:{RULE}"])),
            )

    return asyncio.run(count())


def _nothing_to_do(engine: sa.Engine, cwd: Path, cursor: dict[str, Any] | None) -> None:
    """`delivery run` (JSON and human) starts no chain and no flow run, and says so."""
    assert _tick_would(engine) == "idle"
    chains_before, runs_before = _chain_count(engine), _deliver_rule_runs()
    result = as_json(_run(cwd, "--json"))
    assert result == {
        "rule": RULE,
        "state": "COMPLETED",
        "ended_by": "nothing_to_do",
        "message": "no due retries, no changes since the cursor",
        "counts": ZERO_COUNTS,
        "drained": ZERO_COUNTS,
        "scanned": ZERO_COUNTS,
        "cursor_before": cursor,
        "cursor_after": cursor,
        "waited_seconds": 0.0,
        "flow_run_id": None,
    }
    human = ok(_run(cwd))
    [line] = human.stdout.splitlines()
    assert line.startswith(f"COMPLETED {RULE}: nothing_to_do - no due retries, no changes since the cursor")
    assert "no flow run" in line
    assert _chain_count(engine) == chains_before and _deliver_rule_runs() == runs_before


def _chain(engine: sa.Engine, cwd: Path, *args: str, exit_code: int = 0) -> dict[str, Any]:
    """`delivery run --json` went through a real chain: one more chain row and one more flow run."""
    chains_before, runs_before = _chain_count(engine), _deliver_rule_runs()
    proc = _run(cwd, "--json", *args)
    assert proc.returncode == exit_code, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    result: dict[str, Any] = json.loads(proc.stdout)
    assert set(result) == RUN_KEYS and result["flow_run_id"]
    assert _chain_count(engine) == chains_before + 1 and _deliver_rule_runs() == runs_before + 1
    return result


def _load(engine: sa.Engine, *records: dict[str, Any]) -> None:
    with engine.begin() as conn:
        load_records(conn, "shop", "contact", [MirrorInput(r["id"], r["payload"]) for r in records])


def test_a_rule_that_never_had_a_record_gets_no_flow_run(engine: sa.Engine, rule_set_up: Path) -> None:
    _nothing_to_do(engine, rule_set_up, cursor=None)


def test_a_caught_up_rule_runs_a_chain_only_with_always_a_change_or_a_due_retry(
    engine: sa.Engine, rule_set_up: Path, target: TargetServer
) -> None:
    _load(engine, contact("a"), contact("b"))
    assert _tick_would(engine) == "start"
    first = _chain(engine, rule_set_up)
    assert first["ended_by"] == "caught_up" and first["counts"] == {**ZERO_COUNTS, "delivered": 2}
    cursor = first["cursor_after"]

    # Caught up: no flow run, the cursor where the chain left it.
    _nothing_to_do(engine, rule_set_up, cursor)
    assert len(target.requests) == 2

    # --always: a real chain anyway, which finds nothing.
    forced = _chain(engine, rule_set_up, "--always")
    assert forced["state"] == "COMPLETED" and forced["ended_by"] == "caught_up"
    assert forced["counts"] == ZERO_COUNTS and forced["cursor_after"] == cursor
    assert len(target.requests) == 2

    # A change: delivered as today.
    _load(engine, contact("a", name="Renamed"))
    assert _tick_would(engine) == "start"
    changed = _chain(engine, rule_set_up)
    assert changed["ended_by"] == "caught_up" and changed["counts"] == {**ZERO_COUNTS, "delivered": 1}
    assert len(target.requests) == 3
    cursor = changed["cursor_after"]

    # A retry not due yet is nothing to do; once due, the chain drains it.
    with engine.begin() as conn:
        record_id = conn.execute(
            sa.select(mirror_records_table.c.id).where(mirror_records_table.c.external_id == "b")
        ).scalar_one()
        retry = ledger_table.update().where(ledger_table.c.record_id == record_id)
        conn.execute(retry.values(status="failed", attempts=1, next_attempt_at=utcnow() + timedelta(hours=1)))
    _nothing_to_do(engine, rule_set_up, cursor)
    with engine.begin() as conn:
        conn.execute(retry.values(next_attempt_at=utcnow() - timedelta(seconds=1)))
    assert _tick_would(engine) == "start"
    drained = _chain(engine, rule_set_up)
    assert drained["ended_by"] == "caught_up" and sum(drained["drained"].values()) == 1
    with engine.connect() as conn:
        assert (
            conn.execute(sa.select(ledger_table.c.status).where(ledger_table.c.record_id == record_id)).scalar_one()
            != "failed"
        )
    _nothing_to_do(engine, rule_set_up, cursor)


def test_a_closed_route_or_an_open_breaker_with_nothing_to_do_is_idle_as_in_the_tick(
    engine: sa.Engine, rule_set_up: Path, target: TargetServer
) -> None:
    set_status(engine, "crm", "disabled")
    _nothing_to_do(engine, rule_set_up, cursor=None)
    set_status(engine, "crm", "active")
    with engine.begin() as conn:
        target_id = catalog.get_rule(conn, RULE).target.id
        conn.execute(
            breaker_states_table.insert().values(
                connection_id=target_id, state="open", fail_counter=50, success_counter=0, opened_at=utcnow()
            )
        )
    _nothing_to_do(engine, rule_set_up, cursor=None)
    # With a change, the chain runs and ends on the closed route, as before (test_cli.py).
    set_status(engine, "crm", "disabled")
    _load(engine, contact("a"))
    closed = _chain(engine, rule_set_up)
    assert closed["state"] == "COMPLETED" and closed["ended_by"] == "route_closed"
    assert target.requests == []


def test_a_misconfigured_rule_with_nothing_to_do_still_fails(
    engine: sa.Engine, rule_set_up: Path, target: TargetServer
) -> None:
    with engine.begin() as conn:  # the driver changed after the rule was saved
        conn.execute(connections_table.update().where(connections_table.c.name == "crm").values(driver="soap"))
    assert _tick_would(engine) == "start"
    result = _chain(engine, rule_set_up, exit_code=1)
    assert result["state"] == "FAILED" and result["ended_by"] == "rule_fault"
    assert "MissingWriter" in result["message"] and "soap" in result["message"]
    assert target.requests == []


def test_a_disabled_rule_still_runs_its_chain_which_says_disabled(
    engine: sa.Engine, rule_set_up: Path, target: TargetServer
) -> None:
    set_up(engine, config(target.url, rule={"enabled": False}))
    result = _chain(engine, rule_set_up)
    assert result["state"] == "COMPLETED" and result["ended_by"] == "disabled"
    assert target.requests == []
