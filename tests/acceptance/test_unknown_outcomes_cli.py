"""Black box, through `delivery run` (a real process running the deliver-rule flow on the test Prefect
API) on SQLite and PostgreSQL: a write whose answer never came leaves the target's body unknown, so
a later revert is sent and the target ends on the mirror's body; and a rule saved with `delivery
apply` while its chain runs counts from the chain's next job.

The kills are SIGKILLs of the `delivery run` process timed by the target: it has the request in
hand (and applies it a moment later, answering no one), which is exactly a process dying between a
write the target took and the commit of its outcome.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import yaml

from delivery.apply import apply_config
from delivery.clock import utcnow
from delivery.config import parse_config
from delivery.domain import MirrorInput
from delivery.store.mirror import load_records
from delivery.store.tables import ledger_table
from tests.support.cli import as_json, delivery, finish, ok, prefect_env, spawn
from tests.target_server import Answer, TargetServer

pytestmark = pytest.mark.slow

RULE = "contacts-to-crm"
#: How long the target holds a request before applying it: the kill lands in that time.
STALL = 2.0


def config(base_url: str, *, timeout_seconds: float = 0.5, **rule: Any) -> dict[str, Any]:
    return {
        "connections": [
            {
                "name": "crm",
                "driver": "rest",
                "base_url": base_url,
                "token_env": "CRM_TOKEN",
                "timeout_seconds": timeout_seconds,
                "settle": "grouped",
            },
            {"name": "shop"},
        ],
        "rules": [
            {
                "name": RULE,
                "source": "shop",
                "domain": "contact",
                "target": "crm",
                "collection": "contacts",
                "retry_schedule_seconds": [60],
                **rule,
            }
        ],
    }


def apply(engine: sa.Engine, data: dict[str, Any]) -> None:
    with engine.begin() as conn:
        apply_config(conn, parse_config(yaml.safe_dump(data)))


def load(engine: sa.Engine, external_id: str, name: str) -> None:
    """The source's change, as the hub mirrors it."""
    payload = {"email": f"{external_id}@example.com", "name": name}
    with engine.begin() as conn:
        load_records(conn, "shop", "contact", [MirrorInput(external_id, payload)])


def make_due(engine: sa.Engine) -> None:
    """Time travel: the failed rows' retries are due now."""
    with engine.begin() as conn:
        conn.execute(
            ledger_table.update()
            .where(ledger_table.c.status == "failed")
            .values(next_attempt_at=utcnow() - timedelta(seconds=1))
        )


def env() -> dict[str, str]:
    """The test Prefect API; a lock held by a killed run is found dead within a second's step."""
    return {**prefect_env(), "DELIVERY_LOCK_WAIT_STEP_SECONDS": "1"}


def run(workdir: Path) -> dict[str, Any]:
    result: dict[str, Any] = as_json(delivery("run", RULE, "--json", cwd=workdir, env=env()))
    return result


def ledger_rows(workdir: Path) -> dict[str, dict[str, Any]]:
    return {r["external_id"]: r for r in as_json(delivery("ledger", "--rule", RULE, "--json", cwd=workdir))}


def held(target: TargetServer, external_id: str) -> dict[str, Any]:
    copies = [r for r in target.records("contacts").values() if r.get("email") == f"{external_id}@example.com"]
    assert len(copies) == 1, copies
    return copies[0]


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def killed_when(target: TargetServer, workdir: Path, method: str) -> None:
    """Start `delivery run`, and SIGKILL it once the target has a `method` request in hand."""
    seen = sum(1 for r in target.requests if r.method == method)
    proc = spawn("run", RULE, cwd=workdir, env=env())
    try:
        wait_for(lambda: sum(1 for r in target.requests if r.method == method) > seen, f"a {method}")
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        finish(proc)
    assert proc.returncode == -signal.SIGKILL


@pytest.fixture
def workdir(prefect_api: None, tmp_path: Path, target: TargetServer) -> Path:
    path = tmp_path / "work"
    path.mkdir()
    return path


def test_an_update_answered_late_then_reverted_ends_on_the_mirrors_body(
    engine: sa.Engine, target: TargetServer, workdir: Path
) -> None:
    apply(engine, config(target.url))
    load(engine, "a", "A")
    assert run(workdir)["counts"]["delivered"] == 1
    remote_id = ledger_rows(workdir)["a"]["remote_id"]

    load(engine, "a", "B")
    target.program_remote(remote_id, Answer.timeout(1.5))  # applied after the client gave up
    assert run(workdir)["counts"]["failed"] == 1
    row = ledger_rows(workdir)["a"]
    assert row["status"] == "failed" and row["in_doubt"] is True, row
    wait_for(lambda: held(target, "a")["name"] == "B", "the late update to land")

    load(engine, "a", "A")  # back to the body last confirmed
    make_due(engine)
    assert run(workdir)["counts"]["delivered"] == 1
    assert held(target, "a")["name"] == "A"
    row = ledger_rows(workdir)["a"]
    assert row["status"] == "delivered" and row["in_doubt"] is False, row


def test_an_update_killed_before_its_settle_then_reverted_ends_on_the_mirrors_body(
    engine: sa.Engine, target: TargetServer, workdir: Path
) -> None:
    apply(engine, config(target.url, timeout_seconds=30))
    load(engine, "a", "A")
    run(workdir)
    remote_id = ledger_rows(workdir)["a"]["remote_id"]

    load(engine, "a", "B")
    target.program_remote(remote_id, Answer.timeout(STALL))
    killed_when(target, workdir, "PATCH")
    wait_for(lambda: held(target, "a")["name"] == "B", "the update to land")
    assert ledger_rows(workdir)["a"]["in_doubt"] is True
    table = ok(delivery("ledger", "--rule", RULE, cwd=workdir)).stdout
    assert "delivered (in doubt)" in table

    load(engine, "a", "A")
    run(workdir)
    assert held(target, "a")["name"] == "A"
    assert ledger_rows(workdir)["a"]["status"] == "delivered"


def test_a_replays_follow_up_killed_before_its_settle_then_reverted_ends_on_the_mirrors_body(
    engine: sa.Engine, target: TargetServer, workdir: Path
) -> None:
    apply(engine, config(target.url))
    load(engine, "a", "A")
    target.program("a@example.com", Answer.timeout(STALL))
    killed_when(target, workdir, "POST")  # the create lands, its outcome never recorded
    wait_for(lambda: len(target.records("contacts")) == 1, "the create to land")
    remote_id = held(target, "a")["id"]

    load(engine, "a", "B")
    target.program_remote(remote_id, Answer.timeout(STALL))
    killed_when(target, workdir, "PATCH")  # a replayed create, then its follow-up update with B
    wait_for(lambda: held(target, "a")["name"] == "B", "the follow-up update to land")

    load(engine, "a", "A")  # back to the create's first body
    run(workdir)
    assert held(target, "a")["name"] == "A"  # one copy, the latest body
    row = ledger_rows(workdir)["a"]
    assert row["status"] == "delivered" and row["remote_id"] == remote_id, row


def test_update_only_saved_by_apply_mid_chain_sends_no_create_after_the_job_in_flight(
    engine: sa.Engine, target: TargetServer, workdir: Path
) -> None:
    batch = 5
    data = config(target.url, batch_size=batch)
    apply(engine, data)
    ids = [f"m{n:02d}" for n in range(40)]
    with engine.begin() as conn:
        load_records(conn, "shop", "contact", [MirrorInput(i, {"email": f"{i}@example.com"}) for i in ids])
    target.latency_ms = 150  # a long scan: about 6 s of requests
    (workdir / "config.yaml").write_text(yaml.safe_dump(config(target.url, batch_size=batch, policy="update_only")))

    proc = spawn("run", RULE, "--json", cwd=workdir, env=env())
    wait_for(lambda: len(target.requests) >= batch, "the first job's creates")
    ok(delivery("apply", "config.yaml", cwd=workdir))
    at_save = len(target.requests)
    result = finish(proc)
    ok(result)

    posts = [r for r in target.requests if r.method == "POST"]
    assert at_save < len(ids)  # the save landed mid-chain
    assert len(posts) <= at_save + batch  # at most the job in flight finished as it began
    rows = ledger_rows(workdir)
    suppressed = [i for i in ids if rows[i]["last_error"] == "policy update_only excludes create"]
    assert len(suppressed) == len(ids) - len(posts) > 0
