"""One job of a rule at a time, and a database fence behind the lock: concurrent chains, a tick
racing a manual run, dead chains, and a holder killed with SIGKILL mid-batch."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from delivery.clock import utcnow
from delivery.domain import Phase
from delivery.engine import Chain
from delivery.store.tables import chains, ledger
from tests.integration.world import RULE, World
from tests.target_server import TargetServer

DELIVERY = str(Path(sys.executable).parent / "delivery")


@pytest.fixture
def world(prefect_api: None, engine: sa.Engine, target: TargetServer) -> World:
    return World(engine, target).apply(rule={"batch_size": 5})


def _env(**extra: str) -> dict[str, str]:
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", **extra}
    env["PREFECT_API_URL"] = str(PREFECT_API_URL.value())
    return env


def _spawn(env: dict[str, str], cwd: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [DELIVERY, "run", RULE, "--json", *args], env=env, cwd=cwd, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip


def _ids(n: int) -> list[str]:
    return [f"r{i:03d}" for i in range(n)]


def _assert_each_created_once(world: World, ids: list[str]) -> None:
    posts: dict[str, int] = {}
    for request in world.target.requests:
        if request.method == "POST":
            posts[request.key] = posts.get(request.key, 0) + 1
    assert {world.key(i) for i in ids} == set(posts)
    assert set(posts.values()) == {1}, {k: v for k, v in posts.items() if v != 1}
    rows = world.ledger()
    assert {rows[i]["status"] for i in ids} == {"delivered"}


# -- the fence --------------------------------------------------------------------------------------


def test_a_superseded_chains_job_writes_nothing(world: World) -> None:
    world.load(*_ids(12))
    older = Chain(world.engine, RULE)
    assert older.open() is None
    assert older.run_batch(Phase.SCAN).attempted == 5
    newer = Chain(world.engine, RULE)
    assert newer.open() is None
    assert newer.run_batch(Phase.SCAN).attempted == 5  # claims the rule: the older chain is superseded
    before = (world.ledger(), world.cursor(), len(world.target.requests))
    late = older.run_batch(Phase.SCAN)
    assert late.ended_by is not None and late.ended_by.value == "superseded" and late.attempted == 0
    assert (world.ledger(), world.cursor(), len(world.target.requests)) == before
    older.finish()
    newer.finish()


def test_an_older_chain_cannot_take_the_rule_back(world: World) -> None:
    world.load(*_ids(3))
    older = Chain(world.engine, RULE)
    newer = Chain(world.engine, RULE)
    assert older.open() is None and newer.open() is None
    assert newer.run_batch(Phase.SCAN).attempted == 3
    assert older.run_batch(Phase.SCAN).ended_by is not None  # started earlier: superseded at its first job
    assert world.rule_row()["chain_token"] == newer.token
    older.finish()
    newer.finish()


# -- concurrent runs ----------------------------------------------------------------------------------


def test_two_delivery_runs_started_together_deliver_every_record_exactly_once(world: World, tmp_path: Path) -> None:
    ids = _ids(40)
    world.load(*ids)
    world.target.latency_ms = 15
    env = _env()
    runs = [_spawn(env, tmp_path) for _ in range(2)]
    results = [run.communicate(timeout=300) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], [err[-2000:] for _, err in results]
    _assert_each_created_once(world, ids)
    import json

    ended = sorted(json.loads(out)["ended_by"] for out, _ in results)
    assert set(ended) <= {"caught_up", "superseded"}


def test_a_tick_racing_a_manual_run_delivers_every_record_exactly_once(world: World, tmp_path: Path) -> None:
    from flows.tick import delivery_tick

    ids = _ids(30)
    world.load(*ids)
    world.target.latency_ms = 15
    manual = _spawn(_env(), tmp_path)
    time.sleep(1.0)
    tick_state = asyncio.run(delivery_tick(return_state=True))  # type: ignore[call-overload]
    _out, err = manual.communicate(timeout=300)
    assert manual.returncode == 0, err[-2000:]
    assert tick_state.is_completed()
    _assert_each_created_once(world, ids)


# -- the tick -----------------------------------------------------------------------------------------


def _tick(**kwargs: Any) -> Any:
    from flows.tick import delivery_tick

    return asyncio.run(delivery_tick(return_state=True, **kwargs))  # type: ignore[call-overload]


def test_tick_starts_a_chain_per_enabled_rule_and_leaves_alive_ones_alone(world: World) -> None:
    config = world.config()
    config["rules"].append({**config["rules"][0], "name": "paused", "domain": "lead", "enabled": False})
    import yaml

    from delivery.config import parse_config
    from delivery.store import catalog

    with world.engine.begin() as conn:
        catalog.apply_config(conn, parse_config(yaml.safe_dump(config)))
    world.load(*_ids(3))
    state = _tick()
    assert state.is_completed() and "1 started" in state.message
    assert len(world.ledger()) == 3 and world.ledger("paused") == {}

    alive = Chain(world.engine, RULE)  # a chain in flight (fresh heartbeat): the tick leaves the rule alone
    state = _tick()
    assert "0 started, 1 alive" in state.message
    alive.finish()


def test_tick_fails_loudly_while_a_rule_is_misconfigured(world: World) -> None:
    world.load("a")
    world.set_driver("soap")
    state = _tick()
    assert state.is_failed() and RULE in state.message


async def _scheduled_flow_run() -> str:
    from prefect import get_client
    from prefect.states import Running

    from flows.deliver_rule import deliver_rule

    async with get_client() as client:
        run = await client.create_flow_run(deliver_rule, parameters={"rule": RULE})
        await client.set_flow_run_state(run.id, Running(), force=True)
    return str(run.id)


async def _state_of(flow_run_id: str) -> str:
    from uuid import UUID

    from prefect import get_client

    async with get_client() as client:
        run = await client.read_flow_run(UUID(flow_run_id))
    assert run.state is not None
    return run.state.type.value


def test_tick_judges_a_silent_chain_dead_cancels_its_run_and_its_late_job_writes_nothing(world: World) -> None:
    world.load(*_ids(10))
    flow_run_id = asyncio.run(_scheduled_flow_run())
    dead = Chain(world.engine, RULE, flow_run_id=flow_run_id)
    assert dead.open() is None
    assert dead.run_batch(Phase.SCAN).attempted == 5
    with world.engine.begin() as conn:  # ...then it went silent for 20 minutes
        conn.execute(
            chains.update().where(chains.c.token == dead.token).values(heartbeat_at=utcnow() - timedelta(minutes=20))
        )

    state = _tick()
    assert state.is_completed() and "1 dead replaced" in state.message and "1 started" in state.message
    assert asyncio.run(_state_of(flow_run_id)) == "CANCELLED"
    assert world.rule_row()["chain_token"] != dead.token
    with world.engine.connect() as conn:
        old = conn.execute(sa.select(chains).where(chains.c.token == dead.token)).one()
    assert old.ended_by == "superseded" and "judged dead" in old.message
    assert {r["status"] for r in world.ledger().values()} == {"delivered"} and len(world.ledger()) == 10

    world.load("r000", name="changed after")  # something the late job would deliver if it could
    before = (world.ledger(), world.cursor(), len(world.target.requests))
    late = dead.run_batch(Phase.SCAN)
    assert late.ended_by is not None and late.ended_by.value == "superseded"
    assert (world.ledger(), world.cursor(), len(world.target.requests)) == before


def test_tick_threshold_is_configurable(world: World) -> None:
    world.load("a")
    chain = Chain(world.engine, RULE)
    with world.engine.begin() as conn:
        conn.execute(
            chains.update().where(chains.c.token == chain.token).values(heartbeat_at=utcnow() - timedelta(minutes=3))
        )
    assert "1 alive" in _tick().message  # default 15 minutes: still alive
    assert "1 dead replaced" in _tick(dead_after_minutes=2).message


# -- a holder killed with SIGKILL mid-batch ---------------------------------------------------------------


def _wait_for_rows(world: World, n: int, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with world.engine.connect() as conn:
            if conn.execute(sa.select(sa.func.count()).select_from(ledger)).scalar_one() >= n:
                return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended early: {proc.communicate()[1][-2000:]}")
        time.sleep(0.1)
    raise AssertionError("the run did not get going")


def _kill(proc: subprocess.Popen[str]) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)


def test_a_run_killed_mid_batch_does_not_block_the_rule(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = _ids(20)
    world.load(*ids)
    world.target.latency_ms = 200
    victim = _spawn(_env(), tmp_path)
    _wait_for_rows(world, 2, victim)
    _kill(victim)  # holds the rule lock, mid-batch
    world.target.latency_ms = 0
    monkeypatch.setenv("DELIVERY_LOCK_WAIT_STEP_SECONDS", "2")
    started = time.monotonic()
    result = world.run()
    elapsed = time.monotonic() - started
    assert result["state"] == "COMPLETED" and elapsed < 120
    rows = world.ledger()
    assert {rows[i]["status"] for i in ids} == {"delivered"}
    assert len(world.target.records("contacts")) == 20  # the in-flight create was retried with its key


@pytest.mark.slow
def test_on_the_embedded_api_a_killed_holders_slot_is_repaired(world: World, tmp_path: Path, db_url: str) -> None:
    if not db_url.startswith("sqlite"):
        pytest.skip("the embedded-API case is about Prefect's own storage; once is enough")
    ids = _ids(20)
    world.load(*ids)
    world.target.latency_ms = 200
    env = {
        **os.environ,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "DELIVERY_LOCK_WAIT_STEP_SECONDS": "3",
    }
    env.pop("PREFECT_API_URL", None)
    victim = _spawn(env, tmp_path)
    _wait_for_rows(world, 2, victim, timeout=180)
    _kill(victim)
    world.target.latency_ms = 0
    started = time.monotonic()
    survivor = _spawn(env, tmp_path)
    _out, err = survivor.communicate(timeout=240)
    assert survivor.returncode == 0, err[-3000:]
    assert time.monotonic() - started < 150
    assert "freed the lock" in err or "freed a lock slot" in err  # it was stuck, and was repaired
    rows = world.ledger()
    assert {rows[i]["status"] for i in ids} == {"delivered"}
    assert len(world.target.records("contacts")) == 20


def test_rule_lock_is_a_visible_concurrency_limit(world: World) -> None:
    from prefect import get_client

    world.load("a")
    world.run()

    async def read() -> Any:
        async with get_client() as client:
            return await client.read_global_concurrency_limit_by_name(f"delivery-rule-{RULE}")

    limit = asyncio.run(read())
    assert limit.limit == 1 and limit.active_slots == 0
