"""`delivery worker`, the warm worker, against a real `prefect server start` with prefect.yaml's
deliver-rule deployment, as README "Deploying" runs it:

- two warm workers share the tick's chains and a second run of every rule started by hand: every
  record is delivered exactly once, each run is run by exactly one worker, several chains ran side
  by side in one process, and no rule ever had two jobs at once (SQLite and PostgreSQL);
- a run set Cancelling through the API (Cancel in the UI) ends Cancelled and its chain `cancelled`,
  with everything it sent settled; SIGTERM cancels the run in flight and the worker exits 0;
- kill -9 of a worker holding several chains: the next tick judges them dead and starts new ones,
  which a second worker takes; every record ends delivered and the target holds one copy of each.

Every test's rules are split over both settle modes (a `grouped` and a `per_record` connection to
the same target), so the async job and the per-record job share each worker.

One Prefect server for the module, on a PostgreSQL database of its own (it starts in 15-20 s).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from delivery.store.tables import chains_table, rules_table
from tests.integration.world import World
from tests.prefect_server import api_call, prefect_server
from tests.support.databases import create_postgres_database, drop_postgres_database
from tests.support.hog import cpu_hog
from tests.support.in_flight import InFlight
from tests.support.workers import DELIVERY, PREFECT, ROOT, Workers, run_tick, world_of
from tests.target_server import TargetServer

FINAL = ["COMPLETED", "FAILED", "CANCELLED", "CRASHED"]

pytestmark = [pytest.mark.slow]

CANCELLING_TIMEOUT_ENV = "PREFECT_SERVER_SERVICES_CANCELLATION_CLEANUP_CANCELLING_TIMEOUT_SECONDS"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    """The module's server with the `delivery` pool and the deliver-rule deployment; the
    environment a process needs to use it."""
    home = tmp_path_factory.mktemp("prefect-home")
    name = f"prefect_warm_worker_{os.getpid()}"
    database = sa.engine.make_url(create_postgres_database(name)).set(drivername="postgresql+asyncpg")
    extra = {
        "PREFECT_API_DATABASE_CONNECTION_URL": database.render_as_string(hide_password=False),
        # How long the server leaves a run Cancelling with nobody to finish it (a killed worker's)
        # before it marks it Cancelled itself: 300 s unless set. Longer than a live worker's poll
        # (5 s), so a live worker still finishes its own runs' cancellations.
        CANCELLING_TIMEOUT_ENV: "20",
    }
    try:
        with prefect_server(home, extra) as api:
            env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": api}
            for command in (
                ["work-pool", "create", "delivery", "--type", "process"],
                ["--no-prompt", "deploy", "--name", "deliver-rule"],
            ):
                done = subprocess.run([*PREFECT, *command], cwd=ROOT, env=env, capture_output=True, text=True)
                assert done.returncode == 0, f"prefect {' '.join(command)}:\n{done.stdout}\n{done.stderr}"
            yield api, env
    finally:
        drop_postgres_database(name)


@pytest.fixture
def workers(server: tuple[str, dict[str, str]], db_url: str, tmp_path: Path) -> Iterator[Workers]:
    api, env = server
    worker_env = {**env, "DELIVERY_DATABASE_URL": db_url, "CRM_TOKEN": os.environ["CRM_TOKEN"]}
    started = Workers(api, worker_env, tmp_path)
    try:
        yield started
    finally:
        started.stop()


def _runs(api: str, after: Collection[str] = ()) -> list[dict[str, Any]]:
    """The deliver-rule runs on the module's server, less those in `after` (earlier tests')."""
    runs: list[dict[str, Any]] = api_call(
        "POST", f"{api}/flow_runs/filter", {"flows": {"name": {"any_": ["deliver-rule"]}}}
    )
    return [run for run in runs if str(run["id"]) not in after]


def _wait(what: str, done: Callable[[], bool], workers: Workers, seconds: float = 240) -> None:
    deadline = time.monotonic() + seconds
    while not done():
        workers.assert_alive()
        assert time.monotonic() < deadline, f"waited {seconds:.0f} s for {what}"
        time.sleep(0.3)


def _delivered(world: World, rule: str) -> int:
    return sum(row["status"] == "delivered" for row in world.ledger(rule).values())


@pytest.mark.parametrize("db_url", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True)
def test_two_warm_workers_share_the_chains_and_deliver_every_record_once(
    engine: sa.Engine,
    target: TargetServer,
    server: tuple[str, dict[str, str]],
    workers: Workers,
    db_url: str,
    tmp_path: Path,
) -> None:
    names = [f"contacts-{i}" for i in range(1, 5)]
    world = world_of(engine, target, names, records=30, latency_s=0.05)
    in_flight = InFlight(target)
    api, env = server
    earlier = {str(run["id"]) for run in _runs(api)}
    for name in ("warm-1", "warm-2"):
        workers.start(name, limit=4)

    tick = run_tick(env, db_url, tmp_path)
    assert tick["started"] == len(names), tick
    deployment = api_call("GET", f"{api}/deployments/name/deliver-rule/deliver-rule")
    for rule in names:  # a second run of every rule while the tick's are in flight: two chains race
        api_call("POST", f"{api}/deployments/{deployment['id']}/create_flow_run", {"parameters": {"rule": rule}})

    def all_ended() -> bool:
        runs = _runs(api, earlier)
        return len(runs) == 2 * len(names) and all(run["state_type"] in FINAL for run in runs)

    _wait("every run to end", all_ended, workers)
    runs = _runs(api, earlier)
    assert {run["state_type"] for run in runs} == {"COMPLETED"}, [(r["name"], r["state_name"]) for r in runs]

    for rule in names:
        ledger = world.ledger(rule)
        assert len(ledger) == 30 and {row["status"] for row in ledger.values()} == {"delivered"}
        assert sorted(target.records(rule)) == sorted(row["remote_id"] for row in ledger.values())
    posts = Counter((r.path, r.key) for r in target.requests if r.method == "POST")
    assert posts == Counter({(f"/api/{rule}", world.key(f"c-{i}")): 1 for rule in names for i in range(1, 31)})
    with engine.connect() as conn:
        ended = conn.execute(sa.select(chains_table.c.ended_by)).scalars().all()
    assert set(ended) <= {"caught_up", "superseded"}, ended

    # Each run was taken by exactly one worker; both took some; a worker ran chains side by side.
    taken = {name: workers.ran(name) for name in ("warm-1", "warm-2")}
    assert all(taken.values()), workers.log("warm-1") + workers.log("warm-2")
    assert sorted(taken["warm-1"] + taken["warm-2"]) == sorted(str(run["id"]) for run in runs)
    assert max(len(workers.threads(name)) for name in taken) >= 2
    # No line per batch about Prefect's task timeout off the main thread (the chain has its own).
    assert not [name for name in taken if "worker thread" in workers.log(name)]
    assert in_flight.most_at_once >= 2, in_flight.most_at_once
    assert {rule: in_flight.most[rule] for rule in names} == dict.fromkeys(names, 1), in_flight.most


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_run_cancelled_from_the_api_ends_cancelled_and_sigterm_cancels_the_run_in_flight(
    engine: sa.Engine,
    target: TargetServer,
    server: tuple[str, dict[str, str]],
    workers: Workers,
    db_url: str,
    tmp_path: Path,
) -> None:
    rule = "contacts-slow"
    world = world_of(engine, target, [rule], records=400, latency_s=0.05)
    api, env = server
    worker = workers.start("warm-cancel", limit=2)

    tick = run_tick(env, db_url, tmp_path)
    run_id = tick["rules"][0]["flow_run_id"]

    def state(flow_run_id: str) -> str:
        return str(api_call("GET", f"{api}/flow_runs/{flow_run_id}")["state_type"])

    _wait("the chain to deliver", lambda: _delivered(world, rule) >= 10, workers)
    api_call("POST", f"{api}/flow_runs/{run_id}/set_state", {"state": {"type": "CANCELLING"}, "force": True})
    _wait("the run to end", lambda: state(run_id) in FINAL, workers, seconds=120)
    assert state(run_id) == "CANCELLED"
    with engine.connect() as conn:
        assert conn.execute(sa.select(chains_table.c.ended_by)).scalar_one() == "cancelled"
    # It stopped before the end, and whatever it sent is settled in the ledger.
    ledger = world.ledger(rule)
    sent = {r.key for r in target.requests if r.method == "POST"}
    assert 10 <= len(ledger) < 400
    assert sent == {world.key(external_id) for external_id in ledger}

    # SIGTERM with a run in flight: the run ends Cancelled and the worker exits 0.
    deployment = api_call("GET", f"{api}/deployments/name/deliver-rule/deliver-rule")
    second = api_call("POST", f"{api}/deployments/{deployment['id']}/create_flow_run", {"parameters": {"rule": rule}})
    before = len(ledger)
    _wait("the second chain to deliver", lambda: len(world.ledger(rule)) >= before + 10, workers)
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=120) == 0, workers.log("warm-cancel")
    assert state(second["id"]) == "CANCELLED", workers.log("warm-cancel")
    assert "stopped after 2 run(s)" in workers.log("warm-cancel")
    # The cancelled chain let go of the rule lock: the next one did not wait for its lease to expire.
    assert "waiting for the rule lock" not in workers.log("warm-cancel")


@pytest.mark.parametrize("db_url", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True)
def test_kill_9_of_a_warm_worker_holding_several_chains_the_next_tick_takes_them_all_over(
    engine: sa.Engine,
    target: TargetServer,
    server: tuple[str, dict[str, str]],
    workers: Workers,
    db_url: str,
    tmp_path: Path,
) -> None:
    names = [f"contacts-k{i}" for i in range(1, 4)]
    world = world_of(engine, target, names, records=150, latency_s=0.03)
    api, env = server
    first = workers.start("warm-doomed", limit=4)
    tick = run_tick(env, db_url, tmp_path)
    doomed = {r["flow_run_id"] for r in tick["rules"]}
    assert tick["started"] == len(names)

    def all_under_way() -> bool:
        return all(10 <= _delivered(world, rule) < 150 for rule in names)

    _wait("every chain under way", all_under_way, workers)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    del workers.started["warm-doomed"]
    assert not all(_delivered(world, rule) == 150 for rule in names)

    # A new worker; ticks judge a chain dead after 3 s without a heartbeat. A job waiting on a rule
    # lock the killed worker held looks for a dead holder every second.
    workers.start("warm-heir", limit=4, DELIVERY_LOCK_WAIT_STEP_SECONDS="1")
    replaced: set[str] = set()

    def all_replaced() -> bool:
        result = run_tick(env, db_url, tmp_path, DELIVERY_DEAD_CHAIN_MINUTES="0.05")
        replaced.update(rule["rule"] for rule in result["rules"] if rule["replaced"])
        return replaced == set(names)

    _wait("the tick to replace every dead chain", all_replaced, workers)

    def all_delivered() -> bool:
        return all(_delivered(world, rule) == 150 for rule in names)

    _wait("every record delivered", all_delivered, workers)
    for rule in names:
        ledger = world.ledger(rule)
        assert {row["status"] for row in ledger.values()} == {"delivered"}
        held = target.records(rule)
        assert len(held) == 150 and sorted(held) == sorted(row["remote_id"] for row in ledger.values())
        assert len({record["email"] for record in held.values()}) == 150

    # The killed worker's runs, set Cancelling by the tick, have nobody to finish that: the Prefect
    # server marks them Cancelled itself once they have been Cancelling for its timeout.
    def doomed_cancelled() -> bool:
        runs = {str(run["id"]): run for run in _runs(api)}
        return all(runs[run_id]["state_type"] == "CANCELLED" for run_id in doomed)

    _wait("the server to close the killed worker's runs", doomed_cancelled, workers, seconds=180)
    heirs = set(workers.ran("warm-heir"))
    assert heirs and not heirs & doomed
    with engine.connect() as conn:
        dead = (
            conn.execute(
                sa.select(rules_table.c.name)
                .join(chains_table, chains_table.c.rule_id == rules_table.c.id)
                .where(chains_table.c.flow_run_id.in_(doomed), chains_table.c.ended_at.is_not(None))
            )
            .scalars()
            .all()
        )
    assert sorted(dead) == sorted(names)


def _states(api: str, run_id: str) -> list[tuple[str, datetime]]:
    """A run's states as the server recorded them, oldest first: (type, timestamp)."""
    found = api_call("GET", f"{api}/flow_run_states/?flow_run_id={run_id}")
    return sorted(((s["type"], datetime.fromisoformat(s["timestamp"])) for s in found), key=lambda s: s[1])


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_worker_at_its_limit_on_a_loaded_machine_starts_every_run_it_claims_at_once(
    engine: sa.Engine,
    target: TargetServer,
    server: tuple[str, dict[str, str]],
    workers: Workers,
    db_url: str,
    tmp_path: Path,
) -> None:
    """Issue 32, point 1: a run `delivery worker` set Pending sat there for 15 minutes, its threads
    idle, at a load average of 5. Here three times more chains than the worker's limit, beside two
    processes that keep both cores busy: the worker claims a run only when a thread is free (never
    more than its limit Pending or Running at once), every run it claims goes on to Running, none is
    left Pending, and every chain ends CaughtUp."""
    names = [f"contacts-l{i}" for i in range(1, 7)]
    limit = 2
    world = world_of(engine, target, names, records=10, latency_s=0.02)
    api, env = server
    earlier = {str(run["id"]) for run in _runs(api)}
    with cpu_hog(2):
        workers.start("warm-loaded", limit=limit)
        tick = run_tick(env, db_url, tmp_path)
        assert tick["started"] == len(names), tick

        def all_ended() -> bool:
            runs = _runs(api, earlier)
            return len(runs) == len(names) and all(run["state_type"] in FINAL for run in runs)

        _wait("every run to end", all_ended, workers, seconds=600)
    runs = _runs(api, earlier)
    assert {run["state_name"] for run in runs} == {"CaughtUp"}, [(r["name"], r["state_name"]) for r in runs]
    assert all(_delivered(world, rule) == 10 for rule in names)
    assert sorted(workers.ran("warm-loaded")) == sorted(str(run["id"]) for run in runs)

    held: list[tuple[datetime, int]] = []  # +1 when a run is claimed (Pending), -1 when it ends
    waits = []
    for run in runs:
        states = _states(api, str(run["id"]))
        kinds = [kind for kind, _ in states]
        assert kinds[-1] == "COMPLETED" and "PENDING" in kinds and "RUNNING" in kinds, (run["name"], kinds)
        pending = max(at for kind, at in states if kind == "PENDING")
        running = min(at for kind, at in states if kind == "RUNNING" and at >= pending)
        waits.append((running - pending).total_seconds())
        held += [(pending, 1), (states[-1][1], -1)]
    at_once = most = 0
    for _, step in sorted(held):
        at_once += step
        most = max(most, at_once)
    assert most <= limit, f"{most} runs claimed at once by a worker with --limit {limit}"
    # "At once": what is left between Pending and Running is the engine starting the run in a
    # thread the worker already had free (API calls to a server on a loaded machine), not a wait
    # for a thread; nothing like the 62 s and 15 minutes the issue saw.
    assert max(waits) < 30, f"Pending to Running, seconds: {sorted(waits)}"


def test_delivery_worker_refuses_to_start_without_a_server_or_a_pool(
    server: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    _, env = server
    alone = {k: v for k, v in env.items() if k != "PREFECT_API_URL"}
    for run_env, args, said in (
        (alone, [], "set PREFECT_API_URL"),
        (env, ["--pool", "no-such-pool"], "work pool 'no-such-pool' does not exist"),
    ):
        done = subprocess.run(
            [DELIVERY, "worker", *args], cwd=tmp_path, env=run_env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 2, (done.stdout, done.stderr)
        assert said in done.stderr and done.stderr.startswith("error: "), done.stderr
