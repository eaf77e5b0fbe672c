"""The demo end to end (a smaller sample), judged by the ledger it leaves, not by what it prints."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import sqlalchemy as sa
from rich.console import Console

from delivery import db
from delivery.store import ledger as ledger_store


@pytest.mark.slow
def test_demo_runs_end_to_end_and_leaves_the_promised_ledger(
    prefect_api: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flows.demo import RULE, run_demo

    monkeypatch.setenv(db.DATABASE_URL_ENV, "sqlite:///unused.db")  # restored after: the demo sets its own
    monkeypatch.setenv("DEMO_CRM_TOKEN", "x")
    output = io.StringIO()
    counts = run_demo(tmp_path / "demo", records=200, console=Console(file=output, width=120))
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'demo' / 'delivery.db'}")
    try:
        with engine.connect() as conn:
            rows = ledger_store.ledger_rows(conn, RULE)
    finally:
        engine.dispose()
        db.dispose_engines()
    by_status: dict[str, int] = {}
    for row in rows:
        by_status[row["status"]] = by_status.get(row["status"], 0) + 1
    assert len(rows) == 200 and by_status == {k: v for k, v in counts.items() if v}
    assert by_status["remote_gone"] == 3  # deleted in the target on purpose, then updated
    assert by_status["exhausted"] >= 3  # the three refused records at least
    assert by_status["suppressed"] > 0 and by_status["delivered"] > 150
    assert "failed" not in by_status  # recovery drained every due retry
    gone = [r for r in rows if r["status"] == "remote_gone"]
    assert all("HTTP 404" in r["last_error"] for r in gone)
    assert "breaker_open" in output.getvalue()
