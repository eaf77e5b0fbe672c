"""The `delivery` console script run as an operator runs it: a real subprocess, judged by its exit
code and what it prints; and the standard config and records the CLI tests start from, set up in
process through the same store functions the CLI calls."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import sqlalchemy as sa
import yaml

from delivery.apply import apply_config
from delivery.config import parse_config
from delivery.domain import ConnectionStatus, MirrorInput
from delivery.store import catalog
from delivery.store.mirror import load_records
from delivery.store.tables import connections_table, mirror_records_table, rules_table

DELIVERY = Path(sys.executable).parent / "delivery"


def spawn(*args: object, cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Start the console script; env defaults to a copy of os.environ as it is now."""
    run_env = dict(os.environ) if env is None else env
    # Rich tables are sized to the terminal; a pipe has none, so fix a width for stable output.
    run_env.setdefault("COLUMNS", "200")
    return subprocess.Popen(
        [str(DELIVERY), *(str(a) for a in args)],
        cwd=cwd,
        env=run_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(popen: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    try:
        stdout, stderr = popen.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        popen.kill()
        popen.communicate()
        raise
    return subprocess.CompletedProcess(popen.args, popen.returncode, stdout, stderr)


def delivery(*args: object, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return finish(spawn(*args, cwd=cwd, env=env))


def ok(proc: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def refused(proc: subprocess.CompletedProcess[str], *fragments: str) -> str:
    """Exit 2, with every fragment in stderr and no traceback; returns stderr."""
    assert proc.returncode == 2, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    for fragment in fragments:
        assert fragment in proc.stderr, f"{fragment!r} not in stderr:\n{proc.stderr}"
    return proc.stderr


def as_json(proc: subprocess.CompletedProcess[str]) -> Any:
    ok(proc)
    try:
        return json.loads(proc.stdout)
    except json.JSONDecodeError as exc:  # pragma: no cover - the message is the point
        raise AssertionError(f"stdout is not JSON by itself ({exc}):\n{proc.stdout}") from exc


def prefect_env() -> dict[str, str]:
    from prefect.settings import PREFECT_API_URL

    env = dict(os.environ)
    env["PREFECT_API_URL"] = str(PREFECT_API_URL.value())
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    return env


# -- the standard config and records ------------------------------------------------------------

RULE = "contacts-to-crm"
SECRET = "s3cr3t-token-value"
UNREACHABLE = "http://127.0.0.1:9/api"
LEDGER_KEYS = {
    "rule",
    "external_id",
    "status",
    "remote_id",
    "attempts",
    "next_attempt_at",
    "last_error",
    "in_doubt",
    "deleting",
    "updated_at",
}
STATUSES = ("delivered", "suppressed", "failed", "exhausted", "remote_gone", "deleted")
ZERO_COUNTS = dict.fromkeys(STATUSES, 0)


def config(
    base_url: str = UNREACHABLE,
    *,
    target: dict[str, Any] | None = None,
    rule: dict[str, Any] | None = None,
    more_rules: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    return {
        "connections": [
            {
                "name": "crm",
                "driver": "rest",
                "base_url": base_url,
                "token_env": "CRM_TOKEN",
                "timeout_seconds": 2,
                **(target or {}),
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
                "policy": "create_and_update",
                "batch_size": 10,
                **(rule or {}),
            },
            *(more_rules or []),
        ],
    }


def write_yaml(directory: Path, name: str, data: dict[str, Any]) -> str:
    (directory / name).write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return name


def write_jsonl(directory: Path, name: str, lines: Sequence[dict[str, Any] | str]) -> str:
    text = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    (directory / name).write_text(text, encoding="utf-8")
    return name


def contact(external_id: str, **fields: Any) -> dict[str, Any]:
    return {
        "id": external_id,
        "payload": {"email": f"{external_id}@example.com", "name": f"Name {external_id}", **fields},
    }


def table_rows(engine: sa.Engine, table: sa.Table) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        return [row._asdict() for row in conn.execute(sa.select(table).order_by(table.c.id))]


def mirror_by_id(engine: sa.Engine) -> dict[str, dict[str, Any]]:
    return {row["external_id"]: row for row in table_rows(engine, mirror_records_table)}


def assert_catalog_empty(engine: sa.Engine) -> None:
    assert table_rows(engine, connections_table) == []
    assert table_rows(engine, rules_table) == []


def set_up(engine: sa.Engine, data: dict[str, Any], *records: dict[str, Any]) -> None:
    """In-process setup: apply `data` and load `records` into shop/contact."""
    with engine.begin() as conn:
        apply_config(conn, parse_config(yaml.safe_dump(data)))
        if records:
            load_records(conn, "shop", "contact", [MirrorInput(r["id"], r["payload"]) for r in records])


def set_status(engine: sa.Engine, name: str, status: str) -> None:
    with engine.begin() as conn:
        catalog.set_connection_status(conn, name, ConnectionStatus(status))


def load(cwd: Path, name: str, source: str = "shop", domain: str = "contact") -> subprocess.CompletedProcess[str]:
    return delivery("mirror", "load", "--source", source, "--domain", domain, name, cwd=cwd)
