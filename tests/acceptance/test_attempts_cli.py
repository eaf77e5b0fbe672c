"""`delivery attempts RULE RECORD_ID` through the console script (issue 32, point 5), on SQLite and
PostgreSQL: the record's requests newest first as JSON (`--json`, `--limit`) and as a table, and
exit 2 for an unknown rule or record."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.support.cli import RULE, as_json, config, contact, delivery, ok, prefect_env, refused, set_up
from tests.target_server import Answer, TargetServer

pytestmark = pytest.mark.through_prefect

KEYS = {
    "at",
    "chain_run_id",
    "verb",
    "method",
    "path",
    "status_code",
    "error",
    "duration_ms",
    "answer_excerpt",
    "outcome",
}


@pytest.fixture
def workdir(prefect_api: None, tmp_path: Path) -> Path:
    path = tmp_path / "work"
    path.mkdir()
    return path


def test_attempts_lists_a_records_requests_newest_first(workdir: Path, engine: sa.Engine, target: TargetServer) -> None:
    set_up(engine, config(target.url, rule={"retry_schedule_seconds": [0]}), contact("a"))
    target.program("a@example.com", Answer.status(503, {"error": "busy"}))
    run = as_json(delivery("run", RULE, "--json", cwd=workdir, env=prefect_env()))
    as_json(delivery("run", RULE, "--json", cwd=workdir, env=prefect_env()))
    tried = as_json(delivery("attempts", RULE, "a", "--json", cwd=workdir))
    assert [(a["method"], a["path"], a["status_code"], a["outcome"]) for a in tried] == [
        ("POST", "contacts", 201, "delivered"),
        ("POST", "contacts", 503, "failed"),
    ]
    assert all(set(a) == KEYS for a in tried)
    assert tried[1]["chain_run_id"] == run["flow_run_id"] and tried[1]["answer_excerpt"] == '{"error": "busy"}'
    assert as_json(delivery("attempts", RULE, "a", "--json", "--limit", "1", cwd=workdir)) == tried[:1]
    table = ok(delivery("attempts", RULE, "a", cwd=workdir, env={**os.environ, "COLUMNS": "80"})).stdout
    assert table.splitlines()[0].startswith(f"{RULE} / a: delivered, remote id r-")
    assert "POST contacts" in table and "503" in table
    assert max(len(line) for line in table.splitlines()) <= 80


def test_attempts_refuses_an_unknown_rule_or_record_exit_2(
    workdir: Path, engine: sa.Engine, target: TargetServer
) -> None:
    set_up(engine, config(target.url), contact("a"))
    refused(delivery("attempts", "nope", "a", cwd=workdir), "no rule named 'nope'")
    refused(
        delivery("attempts", RULE, "zz", cwd=workdir),
        "record 'zz': source 'shop' has no such 'contact' record in the mirror",
    )
