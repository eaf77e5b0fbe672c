"""The `delivery` console script imports only what the command needs (issue #17 point 3): importing
`flows.cli`, `delivery --help` and a `delivery run` of a rule with nothing to do load no Prefect, no
`deliver-rule` flow and no chain machinery. Prefect alone costs about a second of start-up.

Each check runs in a fresh interpreter, where a finder placed first on `sys.meta_path` refuses the
heavy modules: a command that reaches for one fails at the import, naming it, instead of paying
for it unnoticed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from delivery import db
from tests.support.cli import RULE, ZERO_COUNTS, config, set_up

#: What no command may import unless it runs a chain, a tick or a server.
HEAVY = ("prefect", "flows.deliver_rule", "flows.tick", "flows.serve", "delivery.chain")

_GUARD = textwrap.dedent(
    """
    import sys

    HEAVY = {heavy!r}

    class Refuse:
        def find_spec(self, name, path=None, target=None):
            if name in HEAVY or name.startswith(tuple(h + "." for h in HEAVY)):
                raise ImportError(f"heavy module imported: {{name}}")
            return None

    sys.meta_path.insert(0, Refuse())
    """
)


def _python(
    body: str, env: dict[str, str] | None = None, heavy: tuple[str, ...] = HEAVY
) -> subprocess.CompletedProcess[str]:
    code = _GUARD.format(heavy=heavy) + textwrap.dedent(body)
    run_env = {**os.environ, "COLUMNS": "200", **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=run_env, timeout=120, check=False
    )


def _main(
    *args: str, env: dict[str, str] | None = None, heavy: tuple[str, ...] = HEAVY
) -> subprocess.CompletedProcess[str]:
    """`delivery ARGS` as the console script runs it (its installed entry point), under the guard."""
    return _python(
        f"""
        from importlib.metadata import entry_points

        [script] = entry_points(group="console_scripts", name="delivery")
        sys.argv = ["delivery", *{list(args)!r}]
        sys.exit(script.load()())
        """,
        env,
        heavy,
    )


def test_importing_the_entry_module_and_every_command_module_loads_nothing_heavy() -> None:
    proc = _python(
        """
        from importlib.metadata import entry_points

        [script] = entry_points(group="console_scripts", name="delivery")
        script.load()
        import flows.cli
        import flows.cli.configure, flows.cli.output, flows.cli.preview, flows.cli.records
        import flows.cli.runs, flows.cli.services
        loaded = sorted(m for m in sys.modules if m.split(".")[0] == "prefect")
        assert not loaded, loaded
        """
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("args", [["--help"], ["run", "--help"], ["tick", "--help"], ["serve", "--help"]])
def test_help_loads_nothing_heavy(args: list[str]) -> None:
    proc = _main(*args)
    assert proc.returncode == 0, proc.stderr
    assert "Usage" in proc.stdout


@pytest.fixture
def idle_database(sqlite_template: Path, tmp_path: Path) -> str:
    """A SQLite database holding the standard rule, caught up: no mirror record, no ledger row."""
    path = tmp_path / "delivery.db"
    shutil.copy(sqlite_template, path)
    url = f"sqlite:///{path}"
    engine = db.create_engine(url)
    try:
        set_up(engine, config())
    finally:
        engine.dispose()
    return url


def test_a_run_with_nothing_to_do_loads_nothing_heavy(idle_database: str) -> None:
    # Without a Prefect API to reach: a run that started a chain would fail here, and at the guard first.
    env = {db.DATABASE_URL_ENV: idle_database, "PREFECT_API_URL": "http://127.0.0.1:9/api"}
    # Nor Alembic: the database is at the head already, and only a migration needs it.
    proc = _main("run", RULE, "--json", env=env, heavy=(*HEAVY, "alembic"))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["ended_by"] == "nothing_to_do" and result["flow_run_id"] is None
    assert result["counts"] == ZERO_COUNTS

    human = _main("run", RULE, env=env)
    assert human.returncode == 0, human.stderr
    assert human.stdout.startswith(f"COMPLETED {RULE}: nothing_to_do - ")


def test_the_guard_refuses_a_heavy_import() -> None:
    """The guard itself works: what would make the checks above pass vacuously."""
    proc = _python("import prefect\n")
    assert proc.returncode != 0 and "heavy module imported: prefect" in proc.stderr
