"""`delivery mirror load` refuses NaN and ±Infinity in a payload: exit 2, the line in the message,
nothing loaded (a real subprocess, on SQLite and PostgreSQL)."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa

from delivery.store.tables import mirror_records_table
from tests.support.cli import config, contact, load, ok, refused, set_up, table_rows, write_jsonl, write_yaml


@pytest.fixture
def applied(engine: sa.Engine, tmp_path: Path) -> Path:
    workdir = tmp_path / "work"
    workdir.mkdir()
    write_yaml(workdir, "delivery.yaml", config())
    set_up(engine, config(), contact("a"))
    return workdir


@pytest.mark.parametrize(
    ("literal", "label"),
    [("NaN", "NaN"), ("Infinity", "Infinity"), ("-Infinity", "-Infinity"), ("1e999", "Infinity")],
)
def test_mirror_load_refuses_a_non_finite_number_exit_2_nothing_loaded(
    engine: sa.Engine, applied: Path, literal: str, label: str
) -> None:
    before = table_rows(engine, mirror_records_table)
    lines = [contact("a", name="Changed"), contact("b"), "", f'{{"id": "c", "payload": {{"score": {literal}}}}}']
    stderr = refused(load(applied, write_jsonl(applied, "bad.jsonl", lines)), "line 4", f"payload.score is {label}")
    assert "JSON cannot carry" in stderr
    assert table_rows(engine, mirror_records_table) == before  # neither a's change nor b went in


def test_mirror_load_of_the_same_file_without_the_bad_line_loads(engine: sa.Engine, applied: Path) -> None:
    good = write_jsonl(applied, "good.jsonl", [contact("b", score=1.5), contact("c", score=-1e308)])
    assert "2 records read: 2 new" in ok(load(applied, good)).stdout
