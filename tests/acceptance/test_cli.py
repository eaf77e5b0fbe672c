"""The `delivery` console script as an operator runs it: a real subprocess, on SQLite and on
PostgreSQL, checked by its exit code, what it prints, and what it left in the database.

A subprocess costs over a second (imports), so the state a test *starts from* is set up in
process through the same store functions the CLI calls; what a test checks goes through the CLI.

Every subprocess gets a copy of os.environ (DELIVERY_DATABASE_URL comes from the `db_url`
fixture) and runs in a scratch directory under tmp_path that is *not* where the SQLite test
database lives, so a CLI that ignored the variable and fell back to ./delivery.db would show.
"""

from __future__ import annotations

import json
import os
import subprocess
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import yaml

from delivery.store.tables import connections_table, ledger_table, mirror_records_table, rules_table
from tests.support.cli import (
    LEDGER_KEYS,
    RULE,
    SECRET,
    STATUSES,
    UNREACHABLE,
    ZERO_COUNTS,
    as_json,
    assert_catalog_empty,
    config,
    contact,
    delivery,
    finish,
    load,
    mirror_by_id,
    ok,
    prefect_env,
    refused,
    set_status,
    set_up,
    spawn,
    table_rows,
    write_jsonl,
    write_yaml,
)
from tests.support.days import clear_of_midnight
from tests.target_server import TargetServer


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    path = tmp_path / "work"
    path.mkdir()
    return path


@pytest.fixture
def applied(engine: sa.Engine, workdir: Path) -> Path:
    """The standard config (also written to delivery.yaml) applied; returns the working directory."""
    write_yaml(workdir, "delivery.yaml", config())
    set_up(engine, config())
    return workdir


# -- 1. apply -----------------------------------------------------------------------------------


def test_apply_creates_and_reapplying_the_same_file_is_a_no_op(db_url: str, engine: sa.Engine, workdir: Path) -> None:
    name = write_yaml(workdir, "delivery.yaml", config())
    first = ok(delivery("apply", name, cwd=workdir))
    assert "created: connection crm, connection shop, rule contacts-to-crm" in first.stdout
    before_connections = table_rows(engine, connections_table)
    before_rules = table_rows(engine, rules_table)
    assert [c["name"] for c in before_connections] == ["crm", "shop"]
    assert [r["name"] for r in before_rules] == [RULE]

    again = ok(delivery("apply", name, cwd=workdir))
    assert "unchanged: connection crm, connection shop, rule contacts-to-crm" in again.stdout
    assert "created" not in again.stdout and "updated" not in again.stdout
    assert table_rows(engine, connections_table) == before_connections  # updated_at included
    assert table_rows(engine, rules_table) == before_rules

    # A real change updates exactly what changed.
    changed = ok(delivery("apply", write_yaml(workdir, "changed.yaml", config(rule={"batch_size": 50})), cwd=workdir))
    assert "updated: rule contacts-to-crm" in changed.stdout
    assert "unchanged: connection crm, connection shop" in changed.stdout
    after_rule = table_rows(engine, rules_table)
    assert after_rule[0]["batch_size"] == 50 and after_rule[0]["updated_at"] > before_rules[0]["updated_at"]
    assert table_rows(engine, connections_table) == before_connections

    # A refused file changes nothing of what is there, not even the parts that were fine.
    bad = config(
        target={"base_url": "http://elsewhere.example/api"},
        rule={"batch_size": 99},
        more_rules=[{"name": "second", "source": "shop", "domain": "order", "target": "erp", "collection": "x"}],
    )
    refused(delivery("apply", write_yaml(workdir, "bad.yaml", bad), cwd=workdir), "rules[1].target", "'erp'")
    assert table_rows(engine, connections_table) == before_connections
    assert table_rows(engine, rules_table) == after_rule


def _cfg(**kwargs: Any) -> str:
    return yaml.safe_dump(config(**kwargs), sort_keys=False)


BAD_YAML = "connections:\n  - name: shop\n  - name: crm\n    driver: rest: x\nrules: []\n"

REFUSED_CONFIGS: list[tuple[str, str, list[str]]] = [
    ("bad-yaml", BAD_YAML, ["bad-yaml.yaml", "line 4", "not valid YAML"]),
    ("unknown-key", _cfg(rule={"polcy": "create_only"}), ["rules[0].polcy"]),
    ("bad-policy", _cfg(rule={"policy": "create_or_whatever"}), ["rules[0].policy", "create_and_update"]),
    ("unknown-driver", _cfg(target={"driver": "soap"}), ["rules[0].target", f"'{RULE}'", "'soap'"]),
    (
        "verb-the-driver-lacks",
        _cfg(target={"driver": "rest-create-only"}),
        ["rules[0].policy", f"'{RULE}'", "'rest-create-only'", "'update'"],
    ),
    ("missing-connection", _cfg(rule={"target": "erp"}), ["rules[0].target", f"'{RULE}'", "'erp'"]),
    (
        "second-rule-bad",
        _cfg(more_rules=[{"name": "second", "source": "warehouse", "domain": "o", "target": "crm", "collection": "x"}]),
        ["rules[1].source", "'second'", "'warehouse'"],
    ),
]


def test_refused_configs_exit_2_naming_the_place_and_write_nothing(
    db_url: str, engine: sa.Engine, workdir: Path
) -> None:
    """Every case in its own process, all at once: none may write, so they cannot disturb each other.
    The last case's first rule and both connections are fine, and still nothing of them is written."""
    started = {}
    for case, text, _ in REFUSED_CONFIGS:
        (workdir / f"{case}.yaml").write_text(text, encoding="utf-8")
        started[case] = spawn("apply", f"{case}.yaml", cwd=workdir)
    failures = []
    for case, _, fragments in REFUSED_CONFIGS:
        proc = finish(started[case])
        try:
            refused(proc, "error: ", *fragments)
            assert "created" not in proc.stdout, proc.stdout
        except AssertionError as exc:
            failures.append(f"[{case}] {exc}")
    assert not failures, "\n\n".join(failures)
    assert_catalog_empty(engine)


def test_a_value_longer_than_its_column_is_refused_as_input(db_url: str, engine: sa.Engine, workdir: Path) -> None:
    too_long = UNREACHABLE + "/" + "a" * 2100
    proc = delivery("apply", write_yaml(workdir, "long.yaml", config(too_long)), cwd=workdir)
    refused(proc, "connections[0].base_url")
    assert_catalog_empty(engine)


# -- 2. mirror load -----------------------------------------------------------------------------


def test_mirror_load_moves_the_change_signal_only_on_a_real_change(engine: sa.Engine, applied: Path) -> None:
    records = [contact("a"), contact("b"), contact("c")]
    first = ok(load(applied, write_jsonl(applied, "one.jsonl", records)))
    assert "3 records read: 3 new, 0 changed, 0 unchanged" in first.stdout
    before = mirror_by_id(engine)
    assert set(before) == {"a", "b", "c"}
    assert before["a"]["payload"] == records[0]["payload"] and before["a"]["deleted"] is False

    again = ok(load(applied, write_jsonl(applied, "same.jsonl", records)))
    assert "3 records read: 0 new, 0 changed, 3 unchanged" in again.stdout
    assert mirror_by_id(engine) == before

    # b's payload really changes; a's keys come in another order, which is no change at all.
    a_reordered = {"id": "a", "payload": dict(reversed(list(records[0]["payload"].items())))}
    edited = [a_reordered, contact("b", name="Renamed"), contact("c")]
    third = ok(load(applied, write_jsonl(applied, "edited.jsonl", edited)))
    assert "3 records read: 0 new, 1 changed, 2 unchanged" in third.stdout
    after = mirror_by_id(engine)
    assert after["b"]["changed_at"] > before["b"]["changed_at"]
    assert after["b"]["payload"]["name"] == "Renamed"
    assert after["a"] == before["a"] and after["c"] == before["c"]


def test_mirror_load_refuses_a_bad_line_and_loads_nothing(engine: sa.Engine, applied: Path) -> None:
    bad = write_jsonl(
        applied,
        "bad.jsonl",
        [contact("a", name="Changed"), contact("d"), '{"id": "e", "payload": {', contact("f"), contact("g")],
    )
    refused(load(applied, bad), "line 3")
    assert table_rows(engine, mirror_records_table) == []

    set_up(engine, config(), contact("a"), contact("b"))
    before = table_rows(engine, mirror_records_table)
    refused(load(applied, bad), "line 3")
    assert table_rows(engine, mirror_records_table) == before  # neither a's change nor d went in


def test_mirror_load_from_an_unknown_source_exits_2(engine: sa.Engine, applied: Path) -> None:
    name = write_jsonl(applied, "one.jsonl", [contact("a")])
    refused(load(applied, name, source="warehouse"), "'warehouse'")
    assert table_rows(engine, mirror_records_table) == []


@pytest.mark.parametrize("domain", ["", "d" * 300], ids=["empty", "longer-than-200"])
def test_mirror_load_refuses_a_domain_no_rule_can_have(engine: sa.Engine, applied: Path, domain: str) -> None:
    refused(load(applied, write_jsonl(applied, "one.jsonl", [contact("a")]), domain=domain), "domain")
    assert table_rows(engine, mirror_records_table) == []


@pytest.mark.slow
def test_mirror_load_of_100k_lines(db_url: str, request: pytest.FixtureRequest) -> None:
    if db_url.startswith("postgresql"):
        pytest.skip("the 100k load is measured on SQLite; PostgreSQL takes the same code path")
    engine: sa.Engine = request.getfixturevalue("engine")
    workdir: Path = request.getfixturevalue("applied")
    count = 100_000
    with (workdir / "big.jsonl").open("w", encoding="utf-8") as handle:
        for i in range(count):
            handle.write(json.dumps(contact(f"c{i:06d}", n=i)) + "\n")
    proc = ok(load(workdir, "big.jsonl"))
    assert f"{count} records read: {count} new, 0 changed, 0 unchanged" in proc.stdout
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(mirror_records_table)).scalar_one() == count


# -- 3. connections -----------------------------------------------------------------------------


def test_connections_listing_and_status(engine: sa.Engine, applied: Path) -> None:
    table = ok(delivery("connections", cwd=applied)).stdout
    for text in ("crm", "shop", "rest", "active", UNREACHABLE, "CRM_TOKEN"):
        assert text in table
    expected: list[dict[str, Any]] = [
        {
            "name": "crm",
            "driver": "rest",
            "status": "active",
            "base_url": UNREACHABLE,
            "token_env": "CRM_TOKEN",
            "token_secret": None,
            "auth": {"kind": "bearer", "token_env": "CRM_TOKEN"},
            "settle": "grouped",
        },
        {
            "name": "shop",
            "driver": None,
            "status": "active",
            "base_url": None,
            "token_env": None,
            "token_secret": None,
            "auth": None,
            "settle": "grouped",
        },
    ]
    assert as_json(delivery("connections", "--json", cwd=applied)) == expected

    assert "connection crm is now error" in ok(delivery("connection-status", "crm", "error", cwd=applied)).stdout
    # Re-applying the config keeps the status the operator gave (the file does not name one).
    set_up(engine, config())
    expected[0]["status"] = "error"
    assert as_json(delivery("connections", "--json", cwd=applied)) == expected

    unknown, bad_value = (
        spawn("connection-status", "erp", "active", cwd=applied),
        spawn("connection-status", "crm", "bogus", cwd=applied),
    )
    refused(finish(unknown), "'erp'")
    usage_error = finish(bad_value)
    refused(usage_error, "bogus")
    assert "Usage" in usage_error.stderr
    assert [c["status"] for c in table_rows(engine, connections_table)] == ["error", "active"]


# -- 4. rules -----------------------------------------------------------------------------------


def test_rules_listing(engine: sa.Engine, applied: Path) -> None:
    expected = {
        "rule": RULE,
        "route": "shop/contact -> crm/contacts",
        "route_open": True,
        "policy": "create_and_update",
        "enabled": True,
        "cursor": None,
        "counts": ZERO_COUNTS,
    }
    assert as_json(delivery("rules", "--json", cwd=applied)) == [expected]

    set_status(engine, "shop", "disabled")
    assert as_json(delivery("rules", "--json", cwd=applied)) == [{**expected, "route_open": False}]
    table = ok(delivery("rules", cwd=applied)).stdout
    for text in (RULE, "shop/contact -> crm/contacts", "(closed)", "create_and_update", *STATUSES):
        assert text in table


# -- 5. ledger (its rows are checked after a real run, below) -----------------------------------


def test_ledger_refuses_an_unknown_rule_and_a_bad_status(applied: Path) -> None:
    unknown, bogus = (
        spawn("ledger", "--rule", "nope", "--json", cwd=applied),
        spawn("ledger", "--status", "bogus", "--json", cwd=applied),
    )
    refused(finish(unknown), "'nope'")
    proc = finish(bogus)
    refused(proc, "bogus")
    assert "Usage" in proc.stderr and proc.stdout == ""


# -- 6. run -------------------------------------------------------------------------------------


@pytest.fixture
def live(prefect_api: None, engine: sa.Engine, target: TargetServer, workdir: Path) -> Path:
    """The config pointing at the real local target, applied; records a and b loaded."""
    set_up(engine, config(target.url), contact("a"), contact("b"))
    return workdir


def no_secret(*procs: subprocess.CompletedProcess[str]) -> None:
    for proc in procs:
        assert SECRET not in proc.stdout and SECRET not in proc.stderr


def test_run_delivers_and_prints_json_alone_on_stdout(live: Path, target: TargetServer) -> None:
    proc = delivery("run", RULE, "--json", cwd=live, env=prefect_env())
    result = as_json(proc)
    assert {"rule", "state", "ended_by", "message", "counts", "cursor_before", "cursor_after", "flow_run_id"} <= set(
        result
    )
    assert result["rule"] == RULE
    assert result["state"] == "COMPLETED" and result["ended_by"] == "caught_up"
    assert isinstance(result["message"], str)
    assert result["counts"] == {**ZERO_COUNTS, "delivered": 2}
    assert result["cursor_before"] is None
    assert set(result["cursor_after"]) == {"changed_at", "record_id"}
    datetime.fromisoformat(result["cursor_after"]["changed_at"])
    assert result["flow_run_id"]
    stored = target.records("contacts")
    assert sorted(r["email"] for r in stored.values()) == ["a@example.com", "b@example.com"]
    assert f"chain of {RULE} ended CaughtUp" in proc.stderr  # Prefect's logs: on stderr, not mixed in
    no_secret(proc)

    rows = as_json(delivery("ledger", "--json", cwd=live))
    assert isinstance(rows, list) and len(rows) == 2
    for row in rows:
        assert set(row) == LEDGER_KEYS
        assert row["rule"] == RULE and row["status"] == "delivered" and row["remote_id"] in stored
        assert row["attempts"] == 0 and row["next_attempt_at"] is None and row["last_error"] is None
        datetime.fromisoformat(row["updated_at"])
    assert sorted(r["external_id"] for r in rows) == ["a", "b"]
    filtered = as_json(delivery("ledger", "--rule", RULE, "--status", "delivered", "--limit", 1, "--json", cwd=live))
    assert filtered == rows[:1]
    table = ok(delivery("ledger", cwd=live)).stdout
    assert RULE in table and "delivered" in table and rows[0]["remote_id"] in table

    listed = as_json(delivery("rules", "--json", cwd=live))[0]
    assert listed["route_open"] is True
    assert listed["counts"] == {**ZERO_COUNTS, "delivered": 2}
    assert listed["cursor"] == result["cursor_after"]


def test_run_on_a_closed_route_completes_without_sending(live: Path, engine: sa.Engine, target: TargetServer) -> None:
    set_status(engine, "crm", "disabled")
    # Without --json: the human summary, and the same exit code as with it.
    human = ok(delivery("run", RULE, cwd=live, env=prefect_env()))
    assert "COMPLETED" in human.stdout and RULE in human.stdout and "route_closed" in human.stdout
    assert "crm" in human.stdout
    assert target.requests == [] and table_rows(engine, ledger_table) == []

    result = as_json(delivery("run", RULE, "--json", cwd=live, env=prefect_env()))
    assert result["state"] == "COMPLETED" and result["ended_by"] == "route_closed"
    assert "crm" in result["message"]
    assert result["counts"] == ZERO_COUNTS
    assert target.requests == []


def test_run_with_a_rule_fault_fails_with_exit_1(live: Path, engine: sa.Engine, target: TargetServer) -> None:
    with engine.begin() as conn:  # the driver changed after the rule was saved
        conn.execute(connections_table.update().where(connections_table.c.name == "crm").values(driver="soap"))
    proc = delivery("run", RULE, "--json", cwd=live, env=prefect_env())
    assert proc.returncode == 1, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    result = json.loads(proc.stdout)
    assert result["state"] == "FAILED" and result["ended_by"] == "rule_fault"
    assert "MissingWriter" in result["message"] and "soap" in result["message"]
    assert target.requests == [] and table_rows(engine, ledger_table) == []

    human = delivery("run", RULE, cwd=live, env=prefect_env())
    assert human.returncode == 1, f"stdout:\n{human.stdout}\nstderr:\n{human.stderr}"
    assert "FAILED" in human.stdout and "rule_fault" in human.stdout and "MissingWriter" in human.stdout
    no_secret(proc, human)


def test_run_against_a_daily_budget_ends_rate_limited_and_shows_the_budget(
    live: Path, engine: sa.Engine, target: TargetServer
) -> None:
    # The job's deadline a minute on, and midnight beyond the test: the spent budget (reset at
    # midnight) ends the chain instead of being waited out.
    clear_of_midnight(180)
    name = write_yaml(live, "limited.yaml", config(target.url, target={"rate_limit": {"per_day": 1}}))
    ok(delivery("apply", name, cwd=live))
    proc = delivery("run", RULE, "--json", cwd=live, env={**prefect_env(), "DELIVERY_BATCH_TIMEOUT_SECONDS": "60"})
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    result = json.loads(proc.stdout)
    assert result["state"] == "COMPLETED" and result["ended_by"] == "rate_limited"
    assert "rate budget" in result["message"] and result["counts"]["delivered"] == 1
    assert len(target.requests) == 1
    shown = as_json(delivery("connection-status", "crm", "--json", cwd=live))
    assert shown["rate_limit"] == {"per_second": None, "per_day": 1} and shown["sent_today"] == 1
    assert shown["paused_until"] is None
    human = ok(delivery("connection-status", "crm", cwd=live)).stdout
    assert "traffic: 1/day (1 today)" in human
    overview = as_json(delivery("status", "--json", cwd=live))[0]
    assert overview["traffic"] == "1/day (1 today)" and overview["last_ending"] == "RateLimited"
    no_secret(proc)


def test_run_against_batch_endpoints_sends_one_call(live: Path, target: TargetServer) -> None:
    batch = {"create_path": "contacts/batch", "update_path": "contacts/batch", "max_items": 50}
    name = write_yaml(live, "batch.yaml", config(target.url, target={"batch": batch}))
    ok(delivery("apply", name, cwd=live))
    result = as_json(delivery("run", RULE, "--json", cwd=live, env=prefect_env()))
    assert result["state"] == "COMPLETED" and result["counts"]["delivered"] == 2
    assert [(c.method, len(c.items)) for c in target.requests] == [("POST", 2)]
    assert sorted(r["email"] for r in target.records("contacts").values()) == ["a@example.com", "b@example.com"]


def test_run_of_an_unknown_rule_exits_2(applied: Path) -> None:
    proc = delivery("run", "nope", "--json", cwd=applied)
    refused(proc, "'nope'")
    assert proc.stdout == ""


# -- 7. help and the database -------------------------------------------------------------------


def env_without_database() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("DELIVERY_DATABASE_URL", None)
    return env


def test_help_lists_every_command(tmp_path: Path) -> None:
    import typer.main

    from flows.cli import app

    registered = set(typer.main.get_command(app).commands)  # type: ignore[attr-defined]
    assert {"apply", "mirror", "connections", "connection-status", "rules", "ledger", "run", "db"} <= registered
    env = env_without_database()
    top = ok(delivery("--help", cwd=tmp_path, env=env)).stdout
    for command in sorted(registered):
        assert f" {command} " in top, command
    assert not (tmp_path / "delivery.db").exists()


TABLES = {"alembic_version", "connections", "mirror_records", "rules", "ledger", "chains", "breaker_states"}


def test_db_upgrade_creates_the_schema_in_a_fresh_sqlite_file(tmp_path: Path) -> None:
    path = tmp_path / "fresh.db"
    env = {**env_without_database(), "DELIVERY_DATABASE_URL": f"sqlite:///{path}"}
    assert "latest schema" in ok(delivery("db", "upgrade", cwd=tmp_path, env=env)).stdout
    engine = sa.create_engine(f"sqlite:///{path}")
    try:
        assert set(sa.inspect(engine).get_table_names()) >= TABLES
    finally:
        engine.dispose()


def test_db_upgrade_on_a_migrated_database_is_a_no_op(engine: sa.Engine, applied: Path) -> None:
    before = table_rows(engine, connections_table)
    assert "latest schema" in ok(delivery("db", "upgrade", cwd=applied)).stdout
    assert table_rows(engine, connections_table) == before


def test_default_database_is_delivery_db_in_the_working_directory(tmp_path: Path) -> None:
    assert as_json(delivery("connections", "--json", cwd=tmp_path, env=env_without_database())) == []
    path = tmp_path / "delivery.db"
    assert path.is_file()
    engine = sa.create_engine(f"sqlite:///{path}")
    try:
        assert set(sa.inspect(engine).get_table_names()) >= TABLES
    finally:
        engine.dispose()
