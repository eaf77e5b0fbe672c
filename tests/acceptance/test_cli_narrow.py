"""The `delivery` tables as a new user sees them in an 80-column terminal, and the `--json` of the
commands that had none (`mirror load`, `tick`).

Rich fits a table that is too wide by cutting its cells: the old `delivery status` showed every rule
as `contact…` and a fault as `Missing…`. Each listing here runs as a real subprocess with
COLUMNS=80 (what a terminal of that width tells it) on SQLite and PostgreSQL: every rule name, the
fault class and the whole fault message must be readable, and nothing may be cut (`…`). A wide
terminal still gets the table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import yaml
from typer.testing import CliRunner

from delivery.apply import apply_config
from delivery.chain import Chain
from delivery.config import parse_config
from delivery.domain import Phase
from delivery.errors import MissingWriter
from delivery.store.tables import connections_table
from flows.cli import app
from tests.integration.world import World
from tests.target_server import Answer, TargetServer

DELIVERY = Path(sys.executable).parent / "delivery"
CONTACTS = "contacts-to-crm-enterprise-eu"
COMPANIES = "companies-to-erp-enterprise-eu"
LONG_ERROR = "the email address given for this contact is not valid for the enterprise tenant"


def _run(*args: str, columns: int, cwd: Path) -> str:
    env = {**os.environ, "COLUMNS": str(columns)}
    proc = subprocess.run([str(DELIVERY), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


def _words(text: str) -> str:
    """The output with its line breaks and indentation folded: a message wrapped over lines reads whole."""
    return " ".join(text.split())


@pytest.fixture
def narrow_world(engine: sa.Engine, target: TargetServer) -> World:
    """Two rules with long names: one whose last chain delivered a record and left one failed (with
    a long error), one whose last chain failed with MissingWriter (its target's driver is gone)."""
    world = World(engine, target)
    config = world.config(rule={"name": CONTACTS})
    config["connections"].append({"name": "erp", "driver": "rest", "base_url": target.url})
    config["rules"].append(
        {"name": COMPANIES, "source": "shop", "domain": "company", "target": "erp", "collection": "companies"}
    )
    with engine.begin() as conn:
        apply_config(conn, parse_config(yaml.safe_dump(config)))
    world.load("good", "bad")
    target.program(world.key("bad"), Answer.status(422, body={"error": LONG_ERROR}))
    chain = Chain(engine, CONTACTS)
    assert chain.open() is None
    while chain.run_batch(Phase.SCAN).attempted:
        pass
    chain.finish()
    with engine.begin() as conn:
        conn.execute(connections_table.update().where(connections_table.c.name == "erp").values(driver="soap"))
    broken = Chain(engine, COMPANIES)
    with pytest.raises(MissingWriter) as fault:
        broken.open()
    broken.finish(fault.value)
    return world


def test_status_at_80_columns_names_every_rule_and_the_fault_in_full(narrow_world: World, tmp_path: Path) -> None:
    text = _run("status", columns=80, cwd=tmp_path)
    assert "…" not in text, text
    assert all(len(line) <= 80 for line in text.splitlines()), text
    lines = text.splitlines()
    assert CONTACTS in lines and COMPANIES in lines  # each rule heads its own block, whole
    words = _words(text)
    assert "Failed: MissingWriter" in words  # how the last chain ended, as its run's state is named
    assert f"MissingWriter: rule '{COMPANIES}': no writer is registered for target driver 'soap'" in words
    assert "CaughtUp" in words and "1 (0)" in words  # the contacts rule: caught up, one failed row, none due

    wide = _run("status", columns=300, cwd=tmp_path)
    assert "┃ rule" in wide and "…" not in wide  # wide enough: the table, whole


@pytest.mark.parametrize("command", [["rules"], ["connections"], ["ledger"], ["requeues"]])
def test_other_listings_at_80_columns_cut_nothing(narrow_world: World, tmp_path: Path, command: list[str]) -> None:
    if command == ["requeues"]:
        _run(
            "requeue",
            CONTACTS,
            "--status",
            "failed",
            "--error-contains",
            "enterprise",
            "--by",
            "ops",
            columns=80,
            cwd=tmp_path,
        )
    text = _run(*command, columns=80, cwd=tmp_path)
    assert "…" not in text, text
    assert all(len(line) <= 80 for line in text.splitlines()), text
    words = _words(text)
    if command == ["rules"]:
        assert CONTACTS in words and COMPANIES in words and "shop/company -> erp/companies" in words
    if command == ["connections"]:
        assert narrow_world.target.url in words and "CRM_TOKEN" in words
    if command == ["ledger"]:
        assert f"{CONTACTS} / bad" in words and LONG_ERROR in words
    if command == ["requeues"]:
        assert CONTACTS in words and "statuses failed; error contains 'enterprise'" in words


def test_mirror_load_json_reports_the_load(engine: sa.Engine, tmp_path: Path) -> None:
    with engine.begin() as conn:
        apply_config(conn, parse_config(yaml.safe_dump({"connections": [{"name": "shop"}], "rules": []})))
    file = tmp_path / "contacts.jsonl"
    file.write_text("".join(json.dumps({"id": f"c-{i}", "payload": {"n": i}}) + "\n" for i in range(3)))
    runner = CliRunner()

    def load() -> dict[str, Any]:
        result = runner.invoke(app, ["mirror", "load", "--source", "shop", "--domain", "contact", str(file), "--json"])
        assert result.exit_code == 0, result.output
        loaded = json.loads(result.stdout)
        assert isinstance(loaded, dict)
        return loaded

    common = {"source": "shop", "domain": "contact", "file": str(file), "read": 3}
    assert load() == {**common, "inserted": 3, "changed": 0, "unchanged": 0, "repeated": 0}
    file.write_text("".join(json.dumps({"id": f"c-{i}", "payload": {"n": i if i else 99}}) + "\n" for i in range(3)))
    assert load() == {**common, "inserted": 0, "changed": 1, "unchanged": 2, "repeated": 0}
    text = runner.invoke(app, ["mirror", "load", "--source", "shop", "--domain", "contact", str(file)])
    assert "3 records read: 0 new, 0 changed, 3 unchanged" in text.stdout  # the text output stays


@pytest.mark.parametrize(
    ("args", "hint"),
    [
        (["connections"], "no connections yet"),
        (["rules"], "no rules yet"),
        (["status"], "no rules yet"),
        (["ledger"], "no ledger rows yet"),
        (["requeues"], "no requeues recorded"),
    ],
)
def test_a_listing_with_nothing_to_list_says_so(engine: sa.Engine, args: list[str], hint: str) -> None:
    """An empty answer reads as a command that did nothing: each listing says there is nothing yet."""
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert result.output.startswith(hint), result.output
