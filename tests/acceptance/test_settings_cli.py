"""The `delivery` console script refuses a bad DELIVERY_* value before it does anything: exit 2,
the variable named, no traceback, and not even the database created."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.support.cli import delivery, refused


@pytest.mark.parametrize(
    ("variable", "value", "command"),
    [
        ("DELIVERY_BATCH_TIMEOUT_SECONDS", "abc", ["rules"]),
        ("DELIVERY_LOCK_WAIT_STEP_SECONDS", "0", ["run", "contacts-to-crm"]),
        ("DELIVERY_DEAD_CHAIN_MINUTES", "-5", ["tick"]),
        # Before: taken, and then every chain failed as a rule fault (an OverflowError, Prefect's
        # "generator didn't yield"), or a tiny wait step spun against Prefect's lock API for ever.
        ("DELIVERY_DEAD_CHAIN_MINUTES", "1e300", ["tick"]),
        ("DELIVERY_BATCH_TIMEOUT_SECONDS", "1e300", ["run", "contacts-to-crm"]),
        ("DELIVERY_BATCH_TIMEOUT_SECONDS", "1e-300", ["run", "contacts-to-crm"]),
        ("DELIVERY_LOCK_WAIT_STEP_SECONDS", "1e300", ["run", "contacts-to-crm"]),
        ("DELIVERY_LOCK_WAIT_STEP_SECONDS", "1e-300", ["run", "contacts-to-crm"]),
    ],
)
def test_a_bad_setting_is_refused_before_any_command_runs(
    tmp_path: Path, variable: str, value: str, command: list[str]
) -> None:
    database = tmp_path / "fresh.db"
    env = {**os.environ, "DELIVERY_DATABASE_URL": f"sqlite:///{database}", variable: value}
    proc = delivery(*command, cwd=tmp_path, env=env)
    stderr = refused(proc, f"error: {variable}: ")
    assert proc.stdout == ""
    assert not database.exists()
    assert stderr.count("error:") == 1


PREFECT_DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
}


def test_the_console_script_sets_prefects_defaults_when_it_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Set in main(), before any command imports Prefect, now that importing the module sets nothing."""
    from flows.cli import main

    for name in PREFECT_DEFAULTS:
        monkeypatch.setenv(name, "placeholder")  # so that the teardown restores what was there before
        monkeypatch.delenv(name)
    monkeypatch.setattr(sys, "argv", ["delivery", "--help"])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 0
    assert {name: os.environ.get(name) for name in PREFECT_DEFAULTS} == PREFECT_DEFAULTS
    monkeypatch.setenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "300")
    with pytest.raises(SystemExit):
        main()
    assert os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] == "300"  # a user's own value wins
