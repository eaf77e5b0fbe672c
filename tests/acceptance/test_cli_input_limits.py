"""Input that one database would take and the other refuse, as a black-box tester fed it to the
`delivery` command: a NUL character (PostgreSQL's text and JSON cannot hold one), a lone surrogate
(not Unicode), a value longer than its column (PostgreSQL refuses it, SQLite keeps it whole), a
`--dead-after-minutes` that judges every chain dead, and a `DELIVERY_DATABASE_URL` the engine cannot
use. Each is refused the same way on SQLite and PostgreSQL: exit 2, one `error:` line naming the
line, field or flag, no traceback, nothing written. Also: an id repeated in one mirror file is
counted once, as what its last line did.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from delivery.clock import utcnow
from delivery.store.tables import chains_table, ledger_table, mirror_records_table, requeues_table, rules_table
from delivery.tick import record_launch
from tests.integration.world import World
from tests.support.cli import (
    RULE,
    assert_catalog_empty,
    config,
    delivery,
    finish,
    load,
    ok,
    refused,
    set_up,
    spawn,
    table_rows,
    write_jsonl,
)
from tests.support.ledger import park
from tests.target_server import TargetServer

NUL = "holds a NUL character (\\u0000), which PostgreSQL cannot store"

BAD_LINES: list[tuple[str, str, list[str]]] = [
    ("nul-id", '{"id": "a\\u0000b", "payload": {"v": 1}}', [f"line 2: 'id' {NUL}"]),
    ("nul-value", '{"id": "a", "payload": {"name": "x\\u0000"}}', [f"line 2: payload.name {NUL}"]),
    ("nul-key", '{"id": "a", "payload": {"k\\u0000": 1}}', [f'line 2: the key payload["k\\u0000"] {NUL}']),
    ("surrogate-value", '{"id": "a", "payload": {"v": "\\ud800"}}', ["line 2: payload.v holds a lone surrogate"]),
    ("surrogate-id", '{"id": "\\udc00", "payload": {}}', ["line 2: 'id' holds a lone surrogate (\\udc00)"]),
    ("float-id", '{"id": 1.5, "payload": {}}', ["line 2: 'id' must be a non-empty string or an integer"]),
    ("long-id", json.dumps({"id": "x" * 501, "payload": {}}), ["line 2: 'id' is longer than 500 characters"]),
]


@pytest.fixture
def applied(engine: sa.Engine, tmp_path: Path) -> Path:
    workdir = tmp_path / "work"
    workdir.mkdir()
    set_up(engine, config(), {"id": "kept", "payload": {"v": 1}})
    return workdir


def test_mirror_load_refuses_text_no_database_stores_alike_exit_2_nothing_loaded(
    engine: sa.Engine, applied: Path
) -> None:
    """Before: a NUL gave a psycopg DataError traceback (exit 1) on PostgreSQL and was stored on
    SQLite; a lone surrogate loaded on both, and every chain then parked the record exhausted."""
    before = table_rows(engine, mirror_records_table)
    started = {}
    for case, line, _ in BAD_LINES:
        name = write_jsonl(applied, f"{case}.jsonl", ['{"id": "kept", "payload": {"v": 2}}', line])
        started[case] = spawn("mirror", "load", "--source", "shop", "--domain", "contact", name, cwd=applied)
    failures = []
    for case, _, fragments in BAD_LINES:
        try:
            refused(finish(started[case]), *fragments)
        except AssertionError as exc:
            failures.append(f"[{case}] {exc}")
    assert not failures, "\n\n".join(failures)
    assert table_rows(engine, mirror_records_table) == before  # not even kept's change on line 1


def test_an_id_repeated_in_one_file_is_counted_once_as_new_and_its_last_line_is_stored(
    engine: sa.Engine, applied: Path
) -> None:
    """Before: "2 records read: 1 new, 0 changed, 1 unchanged" while v: 2 was stored."""
    name = write_jsonl(applied, "dup.jsonl", ['{"id":"a","payload":{"v":1}}', '{"id":"a","payload":{"v":2}}'])
    proc = ok(load(applied, name))
    assert "2 records read: 1 new, 0 changed, 0 unchanged, 1 repeated (last one kept)" in proc.stdout
    assert {k: r["payload"] for k, r in _mirror(engine).items()} == {"kept": {"v": 1}, "a": {"v": 2}}
    again = ok(delivery("mirror", "load", "--source", "shop", "--domain", "contact", name, "--json", cwd=applied))
    assert json.loads(again.stdout) == {
        "source": "shop",
        "domain": "contact",
        "file": name,
        "read": 2,
        "inserted": 0,
        "changed": 0,
        "unchanged": 1,  # its last line is what is stored already
        "repeated": 1,
    }


def _mirror(engine: sa.Engine) -> dict[str, dict[str, Any]]:
    return {r["external_id"]: r for r in table_rows(engine, mirror_records_table)}


def _chains(engine: sa.Engine) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        return [row._asdict() for row in conn.execute(sa.select(chains_table).order_by(chains_table.c.token))]


def test_apply_refuses_a_nul_naming_its_path_exit_2_nothing_written(
    db_url: str, engine: sa.Engine, tmp_path: Path
) -> None:
    """Before: a traceback on PostgreSQL, the rule saved on SQLite with a NUL in its domain."""
    (tmp_path / "nul.yaml").write_text(
        "connections:\n  - name: shop\n  - {name: crm, driver: rest, base_url: 'http://127.0.0.1:9/api'}\n"
        'rules:\n  - {name: r, source: shop, domain: "con\\0tact", target: crm, collection: contacts}\n',
        encoding="utf-8",
    )
    refused(delivery("apply", "nul.yaml", cwd=tmp_path), f"error: rules[0].domain: {NUL}")
    assert_catalog_empty(engine)


def test_requeue_refuses_a_by_longer_than_the_audit_row_keeps_exit_2_nothing_written(
    engine: sa.Engine, target: TargetServer, tmp_path: Path
) -> None:
    """`requeues.requested_by` holds 200 characters. Before: a StringDataRightTruncation traceback
    (exit 1) on PostgreSQL, the 500 characters stored (exit 0) on SQLite."""
    world = World(engine, target).apply()
    world.load("p1")
    park(world, "p1", "exhausted", updated_at=utcnow())
    before = table_rows(engine, ledger_table)
    for extra in ([], ["--dry-run"]):
        proc = delivery("requeue", RULE, "--by", "x" * 500, *extra, cwd=tmp_path)
        refused(proc, "error: --by: the value is longer than 200 characters")
    # An undecodable byte in an argument becomes a lone surrogate, which no database encodes.
    refused(delivery("requeue", RULE, "--by", "ops\udcff", cwd=tmp_path), "error: --by: 'ops\\xff' is not UTF-8 text")
    assert table_rows(engine, ledger_table) == before and table_rows(engine, requeues_table) == []
    ok(delivery("requeue", RULE, "--by", "x" * 200, cwd=tmp_path))
    assert [r["requested_by"] for r in table_rows(engine, requeues_table)] == ["x" * 200]


#: Command lines with a byte that is not UTF-8 (Python reads it as the lone surrogate \udcff), and
#: the option or position the refusal names.
UNDECODABLE: list[tuple[list[str], str]] = [
    (["run", "r\udcff"], "argument 2: 'r\\xff'"),
    (["ledger", "--rule", "r\udcff"], "--rule: 'r\\xff'"),
    (["connection-status", "cr\udcffm", "error"], "argument 2: 'cr\\xffm'"),
    (["requeue", "--dry-run", "r\udcff"], "argument 3: 'r\\xff'"),
    (["requeue", RULE, "--id=p\udcff"], "--id: 'p\\xff'"),
    (["requeues", "--rule", "é\udcff"], "--rule: 'é\\xff'"),
    (["mirror", "load", "--source", "sh\udcffop", "--domain", "contact", "x.jsonl"], "--source: 'sh\\xffop'"),
    (["ledger", "--ru\udcffle=x"], "argument 2: '--ru\\xffle=x'"),
]


def test_a_byte_that_is_not_utf8_in_any_argument_is_refused_naming_it_exit_2_nothing_written(
    engine: sa.Engine, applied: Path
) -> None:
    """Before: a UnicodeEncodeError traceback from the database driver (exit 1), on both databases,
    wherever the value first met a query."""
    before = (
        table_rows(engine, rules_table),
        table_rows(engine, mirror_records_table),
        table_rows(engine, ledger_table),
    )
    started = [(args, where, spawn(*args, cwd=applied)) for args, where in UNDECODABLE]
    failures = []
    for args, where, popen in started:
        try:
            refused(finish(popen), f"error: {where} is not UTF-8 text")
        except AssertionError as exc:
            failures.append(f"{args}: {exc}")
    assert not failures, "\n\n".join(failures)
    after = (
        table_rows(engine, rules_table),
        table_rows(engine, mirror_records_table),
        table_rows(engine, ledger_table),
    )
    assert after == before
    # A path is not text for a database: a file whose name is not UTF-8 is read as before.
    (applied / "conf\udcff.jsonl").write_text('{"id": "kept", "payload": {"v": 7}}\n', encoding="utf-8")
    ok(delivery("mirror", "load", "--source", "shop", "--domain", "contact", "conf\udcff.jsonl", cwd=applied))


def test_values_past_what_a_database_or_the_calendar_holds_are_refused_exit_2_nothing_written(
    engine: sa.Engine, applied: Path
) -> None:
    """Before: tracebacks (exit 1) on both databases: a --since that leaves the years 1-9999 once
    turned to UTC, and a --limit beyond a 64-bit integer."""
    before = (table_rows(engine, ledger_table), table_rows(engine, requeues_table))
    cases = [
        (["requeue", RULE, "--since", "0001-01-01T00:00:00+05:00", "--dry-run"], "error: --since: falls outside"),
        (["requeue", RULE, "--since", "9999-12-31T23:59:59-05:00"], "error: --since: falls outside the years 1"),
        (["ledger", "--limit", "9223372036854775808"], "'--limit'"),
    ]
    started = [(args, fragment, spawn(*args, cwd=applied)) for args, fragment in cases]
    for _, fragment, popen in started:
        refused(finish(popen), fragment)
    assert (table_rows(engine, ledger_table), table_rows(engine, requeues_table)) == before
    ok(delivery("requeue", RULE, "--since", "0001-01-01", "--dry-run", cwd=applied))


@pytest.mark.parametrize(
    ("value", "problem"),
    [("-1", "greater than 0"), ("0", "greater than 0"), ("nan", "finite"), ("1e300", "less than or equal to 10080")],
)
def test_tick_refuses_a_dead_after_minutes_that_would_judge_live_chains_dead(
    engine: sa.Engine, applied: Path, value: str, problem: str
) -> None:
    """Before: -1 or 0 superseded a live chain as dead, nan gave a ValueError traceback (exit 1)."""
    with engine.begin() as conn:
        record_launch(conn, RULE, utcnow())  # a chain alive, as the tick sees one
    before = (table_rows(engine, rules_table), _chains(engine))
    proc = delivery("tick", f"--dead-after-minutes={value}", cwd=applied)
    refused(proc, f"error: --dead-after-minutes: Input should be {'a finite number' if value == 'nan' else problem}")
    assert (table_rows(engine, rules_table), _chains(engine)) == before


def test_the_tick_flow_refuses_the_same_parameter(prefect_api: None, engine: sa.Engine, applied: Path) -> None:
    """The `delivery-tick` deployment's `dead_after_minutes`, set in the UI: the run Fails saying
    why, and no chain is judged dead."""
    from flows.tick import delivery_tick

    with engine.begin() as conn:
        record_launch(conn, RULE, utcnow())
    before = (table_rows(engine, rules_table), _chains(engine))
    state: Any = asyncio.run(delivery_tick(dead_after_minutes=-5, return_state=True))  # type: ignore[arg-type]
    assert state.is_failed() and state.name == "Failed"
    assert state.message == "dead_after_minutes: Input should be greater than 0"
    assert (table_rows(engine, rules_table), _chains(engine)) == before


# -- DELIVERY_DATABASE_URL ------------------------------------------------------------------------


def _with_url(url: str) -> dict[str, str]:
    return {**os.environ, "DELIVERY_DATABASE_URL": url}


def test_a_database_url_the_engine_cannot_use_is_one_error_line_exit_2(tmp_path: Path) -> None:
    """Before: a raw SQLAlchemy traceback and exit 1 from any command. Never the password."""
    cases = {
        "garbage": ("garbage", "not a database URL"),
        "mysql": ("mysql://u:s3cret@db/x", "not 'mysql'"),
        "no-directory": (
            f"sqlite:///{tmp_path}/missing/delivery.db",
            f"its directory {tmp_path}/missing does not exist",
        ),
        "not-a-database": (f"sqlite:///{tmp_path / 'plain.txt'}", "file is not a database"),
    }
    (tmp_path / "plain.txt").write_text("not a database, " * 100, encoding="utf-8")
    started = {case: spawn("rules", cwd=tmp_path, env=_with_url(url)) for case, (url, _) in cases.items()}
    failures = []
    for case, (_, fragment) in cases.items():
        try:
            stderr = refused(finish(started[case]), "error: DELIVERY_DATABASE_URL: ", fragment)
            assert stderr.count("\n") == 1 and "s3cret" not in stderr, stderr
        except AssertionError as exc:
            failures.append(f"[{case}] {exc}")
    assert not failures, "\n\n".join(failures)
    assert not (tmp_path / "missing").exists()


def test_an_unreachable_database_is_one_error_line_exit_1_without_the_password(tmp_path: Path) -> None:
    """Exit 1, not 2: nothing the command was given is refused (README: exit 2 is refused input);
    the same command works once the server takes connections."""
    for command in (["rules"], ["db", "upgrade"]):
        proc = delivery(*command, cwd=tmp_path, env=_with_url("postgresql://ops:s3cret@127.0.0.1:9/delivery"))
        assert proc.returncode == 1, proc
        assert proc.stderr.startswith("error: DELIVERY_DATABASE_URL: cannot connect to postgresql+psycopg://ops:***@")
        assert "Connection refused" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
        assert "s3cret" not in proc.stderr + proc.stdout and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("key", "value", "path"),
    [
        ("rate_limit", {"per_second": 1e-300}, "connections[0].rate_limit.per_second"),
        ("rate_limit", {"per_second": 5e-324}, "connections[0].rate_limit.per_second"),
        ("timeout_seconds", 1e-300, "connections[0].timeout_seconds"),
        ("breaker", {"reset_seconds": 1e-300}, "connections[0].breaker.reset_seconds"),
        ("max_pause_seconds", 1e-300, "connections[0].max_pause_seconds"),
    ],
    ids=["per-second", "per-second-subnormal", "timeout", "reset", "max-pause"],
)
def test_apply_refuses_numbers_the_engine_cannot_compute_with_exit_2_nothing_written(
    engine: sa.Engine, tmp_path: Path, key: str, value: Any, path: str
) -> None:
    """Before: `rate_limit: {per_second: 1e-300}` was saved and every chain then failed with an
    OverflowError (issue 29, point 6)."""
    import yaml

    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(config(target={key: value})), encoding="utf-8")
    refused(delivery("apply", "tiny.yaml", cwd=tmp_path), f"error: {path}: Input should be greater than or equal to")
    assert_catalog_empty(engine)
