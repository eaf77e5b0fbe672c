"""The demo end to end (a smaller sample), judged by the ledger it leaves, not by what it prints."""

from __future__ import annotations

import io
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import yaml
from rich.console import Console

from delivery import db
from delivery.store import ledger
from playground.demo import DEMO_CONFIG
from playground.sandbox import MAX_BODY_BYTES


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _expected_statuses(workdir: Path) -> dict[str, set[str]]:
    """Each record's possible final statuses, worked out from the demo's inputs alone: the mirror
    files it loaded (in order) and the mapped fields of playground/examples/demo-config.yaml, never from the
    ledger. A change of mapped fields is written; a change of unmapped ones only is suppressed.
    What a change met in the target follows from the step that loaded it."""
    rule = yaml.safe_load(DEMO_CONFIG.read_text(encoding="utf-8"))["rules"][0]
    mapped = set(rule["fields"].values())
    last: dict[str, dict[str, Any]] = {}
    expected: dict[str, set[str]] = {}
    #: A step whose lines change nothing the ledger says (the guard stopped their deletes).
    kept: set[str] = set()
    steps: list[tuple[str, set[str] | None]] = [
        ("contacts.jsonl", {"delivered"}),  # a healthy target
        ("changes.jsonl", {"delivered"}),  # a healthy target
        ("parked.jsonl", None),  # deleted in the target, or too large for it
        # An outage parks nothing: 20% 503s, then the target down, then back.
        ("wobbly.jsonl", {"delivered"}),
        ("more.jsonl", {"delivered"}),  # loaded while the target is down, then back
        ("budget.jsonl", {"delivered"}),  # records in play, sent under a rate budget
        ("deleted.jsonl", {"deleted"}),  # deleted in the source: deleted in the target
        ("purge.jsonl", kept),  # more deletes than the guard allows: the chain deletes none
    ]
    for name, written in steps:
        for line in _lines(workdir / name):
            external_id, payload = line["id"], line["payload"]
            before = last.get(external_id)
            last[external_id] = payload
            if written is kept:
                continue
            if line.get("deleted") and written is not None:
                expected[external_id] = written
            elif before is not None and all(before.get(f) == payload.get(f) for f in mapped):
                expected[external_id] = {"suppressed"}
            elif written is not None:
                expected[external_id] = written
            elif len(json.dumps(payload)) > MAX_BODY_BYTES:
                expected[external_id] = {"exhausted"}  # refused until max_attempts
            else:
                expected[external_id] = {"remote_gone"}  # its update found it deleted
    return expected


@pytest.mark.slow
def test_demo_runs_end_to_end_and_leaves_the_promised_ledger(
    prefect_api: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from playground.demo import RULE, run_demo

    monkeypatch.setenv(db.DATABASE_URL_ENV, "sqlite:///unused.db")  # restored after: the demo sets its own
    monkeypatch.setenv("DEMO_CRM_TOKEN", "x")
    output = io.StringIO()
    workdir = tmp_path / "demo"
    counts = run_demo(workdir, records=200, console=Console(file=output, width=120))
    engine = sa.create_engine(f"sqlite:///{workdir / 'delivery.db'}")
    try:
        with engine.connect() as conn:
            rows = {row["external_id"]: row for row in ledger.ledger_rows(conn, RULE)}
    finally:
        engine.dispose()
        db.dispose_engines()

    expected = _expected_statuses(workdir)
    assert set(rows) == set(expected) and len(rows) == 200
    wrong = {
        i: (rows[i]["status"], sorted(allowed)) for i, allowed in expected.items() if rows[i]["status"] not in allowed
    }
    assert wrong == {}
    # The scenario's parked records, exactly: three deleted in the target, three refused.
    assert sum(allowed == {"remote_gone"} for allowed in expected.values()) == 3
    assert sum(allowed == {"exhausted"} for allowed in expected.values()) == 3
    # Step 8: three deleted in the source and so in the target; the purge the guard stopped.
    assert sum(allowed == {"deleted"} for allowed in expected.values()) == 3
    assert "TooManyDeletes" in output.getvalue()
    assert sum(allowed == {"suppressed"} for allowed in expected.values()) > 0
    assert all("HTTP 404" in r["last_error"] for r in rows.values() if r["status"] == "remote_gone")
    assert all("HTTP 413" in (r["last_error"] or "") for r in rows.values() if r["status"] == "exhausted")
    # The summary the demo prints and returns agrees with the ledger it leaves.
    by_status = Counter(r["status"] for r in rows.values())
    assert {k: v for k, v in counts.items() if v} == dict(by_status)
    assert "breaker_open" in output.getvalue()
    # Step 7: every contact to a target that wants OAuth2 tokens, none failed.
    step = re.search(r"(\d+) contacts delivered in [\d.]+ s with (\d+) access tokens?, (\d+) failed", output.getvalue())
    assert step is not None and step.group(1) == "200" and int(step.group(2)) >= 1 and step.group(3) == "0"


@pytest.mark.slow
def test_the_smallest_demo_the_cli_allows_runs_through(
    prefect_api: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`delivery demo --records 20` (the CLI's minimum) leaves fewer than 20 untouched contacts for
    the outage step; it still runs every step and leaves one ledger row per contact."""
    from playground.demo import run_demo

    monkeypatch.setenv(db.DATABASE_URL_ENV, "sqlite:///unused.db")
    monkeypatch.setenv("DEMO_CRM_TOKEN", "x")
    output = io.StringIO()
    try:
        counts = run_demo(tmp_path / "demo", records=20, console=Console(file=output, width=120))
    finally:
        db.dispose_engines()
    assert sum(counts.values()) == 20
    assert counts["remote_gone"] == 3 and counts["deleted"] == 3
    assert "breaker_open" in output.getvalue()
