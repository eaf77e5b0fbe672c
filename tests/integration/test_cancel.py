"""Cancelling is not a fault: a chain stopped mid-batch by SIGTERM, Ctrl-C or a Prefect cancellation
ends `cancelled` with its flow run Cancelled, raises no `delivery.rule.failing`, and writes nothing
after the stop; the tick asks a dead chain's run to stop (Cancelling) instead of forcing Cancelled."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from types import FrameType
from typing import Any
from uuid import UUID

import pytest
import sqlalchemy as sa

import flows.chain_reporting
import flows.deliver_rule
from delivery.chain import Chain
from delivery.clock import utcnow
from delivery.domain import Phase
from delivery.store.ledger import CREATE_IN_FLIGHT
from delivery.store.tables import chains_table, ledger_table
from tests.integration.runs import run_tags
from tests.integration.world import RULE, World
from tests.support.threads import wait_for_engine_threads_to_end
from tests.target_server import TargetServer

DELIVERY = str(Path(sys.executable).parent / "delivery")
FAILING = "delivery.rule.failing"


@pytest.fixture
def world(prefect_api: None, engine: sa.Engine, target: TargetServer) -> World:
    return World(engine, target).apply(rule={"batch_size": 50})


@pytest.fixture
def emitted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    events: list[str] = []

    def record(*, event: str, **_: Any) -> None:
        events.append(event)

    monkeypatch.setattr(flows.chain_reporting, "emit_event", record)
    return events


class Terminated(BaseException):
    """SIGTERM reaching this process outside a flow run's own handler."""


@pytest.fixture
def sigterm_raises() -> Iterator[None]:
    """While a flow runs, Prefect's handler turns SIGTERM into a TerminationSignal; a run that lets
    it escape then sends SIGTERM again to the handler found before. Make that one raise rather than
    end pytest, so such a regression fails the test instead of killing the run."""

    def raise_terminated(signum: int, frame: FrameType | None) -> None:
        raise Terminated(signum)

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    yield
    signal.signal(signal.SIGTERM, previous)


def _ids(n: int) -> list[str]:
    return [f"r{i:03d}" for i in range(n)]


def _ledger_count(world: World) -> int:
    """Rows holding an outcome: not the intents of creates in flight (grouped settles commit a
    window's intents before its first request)."""
    with world.engine.connect() as conn:
        query = (
            sa.select(sa.func.count())
            .select_from(ledger_table)
            .where(ledger_table.c.last_error.is_distinct_from(CREATE_IN_FLIGHT))
        )
        return int(conn.execute(query).scalar_one())


def _wait_for_rows(world: World, n: int, alive: Any, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _ledger_count(world) >= n:
            return
        if not alive():
            raise AssertionError("the chain ended before it got going")
        time.sleep(0.05)
    raise AssertionError("the chain did not get going")


def _last_write(world: World) -> datetime:
    with world.engine.connect() as conn:
        return conn.execute(sa.select(sa.func.max(ledger_table.c.updated_at))).scalar_one()  # type: ignore[no-any-return]


def _chain_row(world: World, flow_run_id: str) -> Any:
    with world.engine.connect() as conn:
        return conn.execute(sa.select(chains_table).where(chains_table.c.flow_run_id == flow_run_id)).one()


async def _state_of(flow_run_id: str) -> str:
    from prefect import get_client

    async with get_client() as client:
        run = await client.read_flow_run(UUID(flow_run_id))
    assert run.state is not None
    return run.state.type.value


def _in_flight_intents(world: World) -> int:
    with world.engine.connect() as conn:
        query = (
            sa.select(sa.func.count()).select_from(ledger_table).where(ledger_table.c.last_error == CREATE_IN_FLIGHT)
        )
        return int(conn.execute(query).scalar_one())


def _assert_stopped_mid_batch_and_wrote_nothing_after(
    world: World, flow_run_id: str, total: int, concurrency: int = 1
) -> None:
    # The intents of creates never sent were taken back (grouped settles commit a window's intents
    # before its first request): "create sent" stays only on the call each worker had in flight and
    # on the answers gathered for a commit the job's end dropped (answers take 200 ms here, and a
    # group is committed 200 ms after its oldest answer: about one per worker).
    assert _in_flight_intents(world) <= 2 * concurrency + 1
    row = _chain_row(world, flow_run_id)
    assert row.ended_by == "cancelled", (row.ended_by, row.message)
    written = _ledger_count(world)
    assert 0 < written < total  # it was stopped in the middle of its one batch
    assert _last_write(world) <= row.ended_at  # nothing reached the ledger after the chain ended
    assert world.cursor() is None  # the batch never concluded: the cursor stays where it was
    requests = len(world.target.requests)
    # Nothing more can come: the run's process has ended, or (in process) the job's threads.
    wait_for_engine_threads_to_end()
    assert (_ledger_count(world), len(world.target.requests)) == (written, requests)
    assert asyncio.run(_state_of(flow_run_id)) == "CANCELLED"
    assert "ended:cancelled" in run_tags(flow_run_id)


# -- `delivery run` stopped by a signal -----------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_delivery_run_stopped_by_a_signal_reports_a_cancelled_chain(
    world: World, tmp_path: Path, signum: signal.Signals
) -> None:
    from prefect.settings import PREFECT_API_URL

    ids = _ids(40)
    world.load(*ids)
    world.target.latency_ms = 200
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_API_URL": str(PREFECT_API_URL.value())}
    run = subprocess.Popen(
        [DELIVERY, "run", RULE, "--json"], env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    _wait_for_rows(world, 3, lambda: run.poll() is None)
    run.send_signal(signum)
    if signum is signal.SIGINT:
        time.sleep(0.3)
        run.send_signal(signum)  # a second Ctrl-C interrupts a batch that asyncio's first one waits on
    out, err = run.communicate(timeout=120)
    assert run.returncode == 1, err[-3000:]
    result = json.loads(out)
    assert (result["state"], result["ended_by"]) == ("CANCELLED", "cancelled"), err[-3000:]
    assert result["message"].startswith("chain cancelled")
    _assert_stopped_mid_batch_and_wrote_nothing_after(world, result["flow_run_id"], len(ids))


# -- in process: the events, and a batch settling with several workers ------------------------------


@pytest.mark.parametrize("concurrency", [1, 4])
def test_a_chain_cancelled_mid_batch_raises_no_alert_and_its_workers_stop(
    prefect_api: None,
    engine: sa.Engine,
    target: TargetServer,
    emitted: list[str],
    sigterm_raises: None,
    concurrency: int,
) -> None:
    world = World(engine, target).apply(rule={"batch_size": 50, "concurrency": concurrency})
    ids = _ids(60)
    world.load(*ids)
    world.target.latency_ms = 200

    def terminate_when_going(main: threading.Thread) -> None:
        _wait_for_rows(world, 2 * concurrency, main.is_alive)
        os.kill(os.getpid(), signal.SIGTERM)  # Prefect's handler turns it into a TerminationSignal

    sender = threading.Thread(target=terminate_when_going, args=(threading.main_thread(),), daemon=True)
    sender.start()
    result = world.run()
    sender.join(timeout=5)
    assert (result["state"], result["ended_by"]) == ("CANCELLED", "cancelled")
    assert emitted == []  # no delivery.rule.failing: a cancel says nothing about the rule
    _assert_stopped_mid_batch_and_wrote_nothing_after(world, result["flow_run_id"], len(ids), concurrency)


def test_a_cancelled_chain_neither_fails_nor_clears_a_rule(
    world: World, emitted: list[str], sigterm_raises: None
) -> None:
    world.load("a")
    world.set_driver("soap")
    assert world.run()["ended_by"] == "rule_fault"
    assert emitted == [FAILING]
    world.set_driver("rest")
    world.load(*_ids(40))
    world.target.latency_ms = 200

    def terminate_when_going(main: threading.Thread) -> None:
        _wait_for_rows(world, 2, main.is_alive)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=terminate_when_going, args=(threading.main_thread(),), daemon=True).start()
    assert world.run()["ended_by"] == "cancelled"
    assert emitted == [FAILING]  # still failing as far as anyone was told: no "recovered"


# -- the tick --------------------------------------------------------------------------------------


def _tick() -> Any:
    from flows.tick import delivery_tick

    return asyncio.run(delivery_tick(return_state=True))  # type: ignore[arg-type]


def test_the_tick_asks_a_dead_chains_run_to_stop_instead_of_forcing_it_cancelled(world: World) -> None:
    from prefect import get_client
    from prefect.states import Running

    async def running_run() -> str:
        async with get_client() as client:
            run = await client.create_flow_run(flows.deliver_rule.deliver_rule, parameters={"rule": RULE})
            await client.set_flow_run_state(run.id, Running(), force=True)
        return str(run.id)

    world.load(*_ids(3))
    flow_run_id = asyncio.run(running_run())
    dead = Chain(world.engine, RULE, flow_run_id=flow_run_id)
    assert dead.open() is None
    assert dead.run_batch(Phase.SCAN).attempted == 3
    with world.engine.begin() as conn:
        conn.execute(
            chains_table.update()
            .where(chains_table.c.token == dead.token)
            .values(heartbeat_at=utcnow() - timedelta(minutes=20))
        )
    state = _tick()
    assert state.is_completed() and "1 dead replaced" in state.message
    # Cancelling is what a worker acts on: it stops the process if it still runs, then marks it Cancelled.
    assert asyncio.run(_state_of(flow_run_id)) == "CANCELLING"


def test_a_tick_stopped_during_a_chain_ends_cancelled_and_starts_no_further_chain(
    world: World, emitted: list[str], sigterm_raises: None
) -> None:
    import yaml

    from delivery.apply import apply_config
    from delivery.config import parse_config

    config = world.config(rule={"batch_size": 50})
    config["rules"].append({**config["rules"][0], "name": "leads-to-crm", "domain": "lead"})
    with world.engine.begin() as conn:
        apply_config(conn, parse_config(yaml.safe_dump(config)))
    world.load(*_ids(40))
    world.load(*_ids(40), domain="lead")
    world.target.latency_ms = 200

    def terminate_when_going(main: threading.Thread) -> None:
        _wait_for_rows(world, 2, main.is_alive)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=terminate_when_going, args=(threading.main_thread(),), daemon=True).start()
    state = _tick()
    assert state.is_cancelled(), state
    with world.engine.connect() as conn:
        ended = [row.ended_by for row in conn.execute(sa.select(chains_table))]
    assert ended == ["cancelled"]  # the other rule's chain was never started
    assert emitted == []
