"""`delivery preview RULE` as an operator runs it: the console script in a subprocess, on SQLite and
PostgreSQL, with the real local target that must hear nothing from it. The ledger it reads is left
by real chains run in process (`tests.support.chains.drive`); what is checked goes through the CLI:
its JSON, its table at 80 columns and wide, and its refusals (exit 2, one clear message)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from delivery.store.tables import metadata
from tests.integration.world import RULE, World
from tests.support.chains import drive
from tests.support.cli import as_json, delivery, ok, refused
from tests.target_server import Answer, TargetServer

pytestmark = pytest.mark.slow

#: What the next chain would do, in the order it meets the records.
EXPECTED = [
    ("drain", "fail", "create", "due retry, attempt 2 of 3: no remote id in its ledger row"),
    ("scan", "a", "update", "its mapped body differs from what was last delivered"),
    ("scan", "same", "suppress", "identical to what was last delivered"),
    ("scan", "ex", "skip", "parked: exhausted; only a requeue puts it back"),
    ("scan", "b", "skip", "deleted in the source: the scan does not offer it (the rule's deletes: ignore)"),
    ("scan", "new", "create", "new record: no ledger row yet"),
]


def snapshot(engine: sa.Engine) -> dict[str, list[dict[str, Any]]]:
    with engine.connect() as conn:
        return {
            table.name: [r._asdict() for r in conn.execute(sa.select(table).order_by(*table.primary_key.columns))]
            for table in metadata.sorted_tables
        }


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    path = tmp_path / "work"  # not where the SQLite test database lives
    path.mkdir()
    return path


@pytest.fixture
def world(engine: sa.Engine, target: TargetServer) -> World:
    world = World(engine, target).apply(rule={"fields": {"email": "email", "full_name": "name"}})
    world.load("a", "b", "same", "ex", "fail")
    target.program(world.key("ex"), Answer.no_id())
    target.program(world.key("fail"), Answer.status(500))
    drive(engine, RULE)
    world.make_due()
    world.load("a", name="changed")
    world.load("same", phone="+1 555 0100")  # a field the rule does not map
    world.load("ex", name="changed")
    world.load("b", deleted=True)
    world.load("new")
    target.requests.clear()
    return world


def env_without_token() -> dict[str, str]:
    """A chain would fail here (MissingCredential): a preview reads no token."""
    env = dict(os.environ)
    env.pop("CRM_TOKEN", None)
    return env


def test_preview_json_table_and_refusals_change_nothing_and_send_nothing(world: World, workdir: Path) -> None:
    before = snapshot(world.engine)
    env = env_without_token()

    data = as_json(delivery("preview", RULE, "--json", cwd=workdir, env=env))
    assert isinstance(data, dict)
    assert [(r["phase"], r["external_id"], r["action"], r["reason"]) for r in data["rows"]] == EXPECTED
    assert data["counts"] == {"create": 2, "update": 1, "delete": 0, "suppress": 1, "skip": 2}
    assert data["drain"] == {
        "shown": 1,
        "cut": False,
        "counts": {"create": 1, "update": 0, "delete": 0, "suppress": 0, "skip": 0},
    }
    assert data["hold"] is None and data["starts"] is True and data["cut"] is False and data["limit"] == 50
    assert data["rule"] == RULE and data["target"] == "crm"
    rows = {r["external_id"]: r for r in data["rows"]}
    assert rows["new"]["status"] is None and rows["fail"]["status"] == "failed" and rows["fail"]["attempts"] == 1
    assert rows["ex"]["status"] == "exhausted"

    narrow = ok(delivery("preview", RULE, cwd=workdir, env={**env, "COLUMNS": "80"})).stdout
    lines = narrow.splitlines()
    assert lines[0] == f"the chain of {RULE} would start now (target crm)"
    assert lines[1].startswith("cursor: ") and ", scan from " in lines[1]
    assert "…" not in narrow and all(len(line) <= 80 for line in lines), narrow
    for external_id in ("fail", "a", "same", "ex", "b", "new"):
        assert external_id in lines  # each record heads its own block
    words = " ".join(narrow.split())
    for _, _, action, reason in EXPECTED:
        assert f"action {action} reason {reason}" in words
    assert lines[-2:] == ["counts: 2 create, 1 update, 1 suppress, 2 skip", "rows: 1 due retry, 5 changes"]

    wide = ok(delivery("preview", RULE, "--limit", "2", cwd=workdir, env={**env, "COLUMNS": "250"})).stdout
    assert "┃ record" in wide and "…" not in wide
    assert "identical to what was last delivered" in wide and "parked: exhausted" not in wide
    assert wide.splitlines()[-3:] == [
        "counts: 1 create, 1 update, 1 suppress, 0 skip",
        "rows: 1 due retry, the first 2 changes",
        "cut off at --limit 2: more changes follow, not counted",
    ]
    cut = as_json(delivery("preview", RULE, "--limit", "2", "--json", cwd=workdir, env=env))
    assert cut["cut"] is True and cut["scan"]["cut"] is True and len(cut["rows"]) == 3

    for bad in ("0", "-3", "10001", "many"):
        proc = delivery("preview", RULE, "--limit", bad, cwd=workdir, env=env)
        refused(proc, "--limit")
        assert proc.stdout == ""
    unknown = delivery("preview", "nope", "--json", cwd=workdir, env=env)
    assert refused(unknown) == "error: no rule named 'nope'\n"
    assert unknown.stdout == ""

    assert snapshot(world.engine) == before
    assert world.target.requests == []


def _read_only(world: World, workdir: Path, *args: str, env: dict[str, str] | None = None) -> str:
    """`delivery ARGS` succeeds, and leaves the database as it found it; its stdout."""
    before = snapshot(world.engine)
    text = ok(delivery(*args, cwd=workdir, env=env)).stdout
    assert snapshot(world.engine) == before
    return text


def test_preview_says_first_when_the_chain_would_not_start(world: World, workdir: Path) -> None:
    fields = {"email": "email", "full_name": "name"}
    world.apply(rule={"fields": fields, "enabled": False})
    text = _read_only(world, workdir, "preview", RULE, env={**os.environ, "COLUMNS": "80"})
    assert text.splitlines()[0] == f"the chain would not start now (disabled): rule {RULE!r} is disabled"
    assert "counts: 2 create, 1 update, 1 suppress, 2 skip" in text  # what it would do once enabled

    world.set_driver("soap")
    data = json.loads(_read_only(world, workdir, "preview", RULE, "--json"))
    assert data["hold"]["kind"] == "disabled" and data["starts"] is False  # the gate comes first

    world.apply(rule={"fields": fields})
    world.set_driver("soap")
    data = json.loads(_read_only(world, workdir, "preview", RULE, "--json"))
    assert data["hold"] == {
        "kind": "missing_writer",
        "message": f"rule {RULE!r}: no writer is registered for target driver 'soap'",
        "line": f"the chain would fail at once (MissingWriter): rule {RULE!r}: no writer is registered for "
        "target driver 'soap'",
    }
    assert data["starts"] is False and len(data["rows"]) == 6
    assert world.target.requests == []
