"""Two process workers against one `prefect server start` and one PostgreSQL delivery database
(issue #12): the production path of README "Deploying" with a second delivering machine.

One tick starts a chain for each of several rules as runs of the `deliver-rule` deployment (made by
`prefect deploy` from prefect.yaml); a second run of every rule is started by hand from the
deployment at the same time. Each worker runs up to four at once, so all eight start together:
two runs of one rule race for it (the rule lock, then the fence; the later one goes on), often on
both workers. Then:

- every record is delivered exactly once: one `delivered` ledger row per record and rule, one POST
  per record in the target's request log, and the chains' reports of a rule add up to its records;
- both workers executed `deliver-rule` runs, each run exactly one of them (read from each worker's
  own output: the runs it submitted less those whose submission the server aborted because the
  other worker had it; every run has an `infrastructure_pid`);
- no rule ever had two jobs at once: each rule writes to its own collection at concurrency 1, and
  the target counts the requests of each collection in flight (from arrival until its answer is
  ready: the next request of a job can only come after it): never more than one per rule, while
  requests of different rules were in flight together (so an overlap could have been seen).

The chains table cannot show overlapping claims directly: a job releases the rule lock before it
clears its holder record, so two holders on record for a moment is normal there.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import yaml

from delivery.apply import apply_config
from delivery.config import parse_config
from delivery.store.tables import chains_table, rules_table
from tests.integration.world import World
from tests.prefect_server import api_call, prefect_server, stop_group
from tests.support.databases import create_postgres_database, drop_postgres_database
from tests.support.in_flight import InFlight
from tests.target_server import TargetServer

ROOT = Path(__file__).resolve().parents[2]
PREFECT = [sys.executable, "-m", "prefect"]
WORKERS = ("delivery-worker-1", "delivery-worker-2")
RULES = [f"contacts-{i}" for i in range(1, 5)]
RECORDS = [f"c-{i}" for i in range(1, 41)]
LATENCY_S = 0.05
FINAL = ["COMPLETED", "FAILED", "CANCELLED", "CRASHED"]

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """A server of the test's own on a PostgreSQL database of its own (as README "Deploying" has
    it for scale: on SQLite, eight runs starting at once on a busy machine stall its API), the
    `delivery` process pool and the deliver-rule deployment."""
    home = tmp_path / "prefect-home"
    name = f"prefect_two_workers_{os.getpid()}"
    database = sa.engine.make_url(create_postgres_database(name)).set(drivername="postgresql+asyncpg")
    extra = {"PREFECT_API_DATABASE_CONNECTION_URL": database.render_as_string(hide_password=False)}
    try:
        with prefect_server(home, extra) as api:
            yield from _deployed(api, home)
    finally:
        drop_postgres_database(name)


def _deployed(api: str, home: Path) -> Iterator[tuple[str, dict[str, str]]]:
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": api}
    for command in (
        ["work-pool", "create", "delivery", "--type", "process"],
        ["--no-prompt", "deploy", "--name", "deliver-rule"],
    ):
        done = subprocess.run([*PREFECT, *command], cwd=ROOT, env=env, capture_output=True, text=True)
        assert done.returncode == 0, f"prefect {' '.join(command)}:\n{done.stdout}\n{done.stderr}"
    yield api, env


@pytest.fixture
def workers(
    server: tuple[str, dict[str, str]], world: World, db_url: str, tmp_path: Path
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Two `prefect worker start` processes, at most four runs each at a time (so that neither can
    take all eight), polling every 2 s; their flow-run processes get the delivery database and
    the target's token from the environment."""
    api, env = server
    started = []
    try:
        for name in WORKERS:
            worker_env = {
                **env,
                "PREFECT_WORKER_QUERY_SECONDS": "2",
                "DELIVERY_DATABASE_URL": db_url,
                "CRM_TOKEN": os.environ["CRM_TOKEN"],
            }
            log = (tmp_path / f"{name}.log").open("wb")
            command = [*PREFECT, "worker", "start", "--pool", "delivery", "--name", name, "--limit", "4"]
            started.append(
                subprocess.Popen(
                    command, cwd=ROOT, env=worker_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
            log.close()
        deadline = time.monotonic() + 90
        while {w["name"] for w in api_call("POST", f"{api}/work_pools/delivery/workers/filter", {})} < set(WORKERS):
            assert all(p.poll() is None for p in started), "a worker exited; see its log in the test's tmp_path"
            assert time.monotonic() < deadline, "the workers did not show up on the server"
            time.sleep(0.5)
        yield started
    finally:
        for process in started:
            stop_group(process)


@pytest.fixture
def in_flight(target: TargetServer) -> InFlight:
    return InFlight(target)


@pytest.fixture
def world(engine: sa.Engine, target: TargetServer) -> World:
    """Four rules from one source, each to its own collection of the target, 5 records a batch
    (so each chain is several jobs), concurrency 1; forty records to deliver."""
    world = World(engine, target)
    config = world.config()
    base = config["rules"][0]
    config["rules"] = [{**base, "name": name, "collection": name, "batch_size": 5} for name in RULES]
    with engine.begin() as conn:
        apply_config(conn, parse_config(yaml.safe_dump(config)))
    world.load(*RECORDS)
    target.latency_ms = int(LATENCY_S * 1000)
    return world


def _deliver_rule_runs(api: str) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = api_call(
        "POST", f"{api}/flow_runs/filter", {"flows": {"name": {"any_": ["deliver-rule"]}}}
    )
    return runs


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_two_workers_share_the_rules_and_no_rule_ever_runs_two_jobs_at_once(
    world: World,
    in_flight: InFlight,
    server: tuple[str, dict[str, str]],
    workers: list[subprocess.Popen[bytes]],
    db_url: str,
    tmp_path: Path,
) -> None:
    api, env = server
    assert db_url.startswith("postgresql")
    tick = subprocess.run(
        [str(Path(sys.executable).parent / "delivery"), "tick", "--json"],
        cwd=tmp_path,
        env={**env, "DELIVERY_DATABASE_URL": db_url},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert tick.returncode == 0, f"stdout:\n{tick.stdout}\nstderr:\n{tick.stderr}"
    deployment = api_call("GET", f"{api}/deployments/name/deliver-rule/deliver-rule")
    for rule in RULES:  # a second run of every rule, by hand, while the tick's runs are in flight
        api_call("POST", f"{api}/deployments/{deployment['id']}/create_flow_run", {"parameters": {"rule": rule}})

    deadline = time.monotonic() + 240
    while True:
        runs = _deliver_rule_runs(api)
        if len(runs) == 2 * len(RULES) and all(run["state_type"] in FINAL for run in runs):
            break
        assert all(p.poll() is None for p in workers), "a worker exited; see its log in the test's tmp_path"
        assert time.monotonic() < deadline, f"runs still open: {Counter(run['state_type'] for run in runs)}"
        time.sleep(1)
    assert {run["state_type"] for run in runs} == {"COMPLETED"}, [(r["name"], r["state_name"]) for r in runs]

    # Every record of every rule delivered exactly once: ledger, target, and the chains' reports.
    for rule in RULES:
        ledger = world.ledger(rule)
        assert sorted(ledger) == sorted(RECORDS) and {row["status"] for row in ledger.values()} == {"delivered"}
        assert sorted(world.target.records(rule)) == sorted(row["remote_id"] for row in ledger.values())
    posts = Counter((r.path, r.key) for r in world.target.requests if r.method == "POST")
    assert posts == Counter({(f"/api/{rule}", world.key(i)): 1 for rule in RULES for i in RECORDS})
    with world.engine.connect() as conn:
        reports = conn.execute(
            sa.select(rules_table.c.name, chains_table.c.report, chains_table.c.ended_by).join(
                rules_table, rules_table.c.id == chains_table.c.rule_id
            )
        ).all()
    delivered = Counter[str]()
    for name, report, ended_by in reports:
        assert ended_by in ("caught_up", "superseded"), (name, ended_by)
        delivered[name] += (report or {}).get("counts", {}).get("delivered", 0)
    assert delivered == Counter({rule: len(RECORDS) for rule in RULES})

    # Both workers ran chains. Both may try to submit one run: the server lets one through and the
    # other logs "Aborted submission" (in its own output; the run's log cannot tell which worker).
    ran: dict[str, set[str]] = {}
    for name in WORKERS:
        text = (tmp_path / f"{name}.log").read_text(errors="replace")
        submitting = set(re.findall(r"submitting flow run '([0-9a-f-]{36})'", text))
        aborted = set(re.findall(r"Aborted submission of flow run '([0-9a-f-]{36})'", text))
        ran[name] = submitting - aborted
    assert all(run["infrastructure_pid"] for run in runs), runs
    assert all(ran.values()), {name: len(ids) for name, ids in ran.items()}
    assert not set.intersection(*ran.values()), ran
    assert set.union(*ran.values()) == {str(run["id"]) for run in runs}, ran

    # One job at a time per rule: never two requests of a rule in flight together, while rules did
    # run side by side.
    assert in_flight.most_at_once >= 2, in_flight.most_at_once
    assert {rule: in_flight.most[rule] for rule in RULES} == dict.fromkeys(RULES, 1), in_flight.most
