"""The `delivery` console script imports only what the command needs (issue #17 point 3): importing
`flows.cli`, `delivery --help` and a `delivery run` of a rule with nothing to do load no Prefect, no
`deliver-rule` flow and no chain machinery. Prefect alone costs about a second of start-up.

Each check runs in a fresh interpreter, where a finder placed first on `sys.meta_path` refuses the
heavy modules: a command that reaches for one fails at the import, naming it, instead of paying
for it unnoticed.

Issue #33 point 6 goes further for what every command pays: importing the console script and the
command modules loads no SQLAlchemy, httpx, Rich, pybreaker (and redis), pydantic-settings or writer,
and `delivery --help` only the Rich that Typer renders its help with. Those are checked by what
`sys.modules` holds at the end, every offender named."""

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
    # Nor Alembic: the database is at the head already, and only a migration needs it. Nor what only
    # some commands or a chain need (issue #33 point 6): the breaker's pybreaker and redis, Authlib
    # (no token is fetched), pydantic-settings (the settings are plain). Nor the writers, httpx or
    # Jinja2: a built-in driver's verbs are known without them (`registry.BUILT_IN_VERBS`).
    idle_heavy = (
        *HEAVY,
        *("alembic", "pybreaker", "redis", "authlib", "pydantic_settings", "delivery.writers.rest", "httpx", "jinja2"),
    )
    proc = _main("run", RULE, "--json", env=env, heavy=idle_heavy)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["ended_by"] == "nothing_to_do" and result["flow_run_id"] is None
    assert result["counts"] == ZERO_COUNTS

    human = _main("run", RULE, env=env, heavy=idle_heavy)
    assert human.returncode == 0, human.stderr
    assert human.stdout.startswith(f"COMPLETED {RULE}: nothing_to_do - ")


#: What importing the console script and the command modules, or `delivery --help`, must not load:
#: each is tens to hundreds of milliseconds of every command's start (docs/performance.md, "The CLI's
#: fixed cost").
FIXED_COST = (
    *HEAVY,
    "sqlalchemy",
    "httpx",
    "pybreaker",
    "redis",
    # Not pydantic itself: Typer coerces a command's parameters with it.
    "pydantic_settings",
    "alembic",
    "delivery.writers",
    "delivery.db",
    "delivery.store",
)

_LOADED = """
prefixes = {forbidden!r}
loaded = sorted(m for m in sys.modules if m in prefixes or m.startswith(tuple(p + "." for p in prefixes)))
sys.stderr.write("loaded: " + " ".join(loaded) + "\\n")
"""


def _offenders(proc: subprocess.CompletedProcess[str]) -> list[str]:
    [line] = [line for line in proc.stderr.splitlines() if line.startswith("loaded:")]
    return line.removeprefix("loaded:").split()


def test_importing_the_console_script_and_the_command_modules_loads_no_fixed_cost() -> None:
    forbidden = (*FIXED_COST, "rich")
    body = textwrap.dedent(
        """
        from importlib.metadata import entry_points

        [script] = entry_points(group="console_scripts", name="delivery")
        script.load()
        import flows.console, flows.cli
        import flows.cli.apps, flows.cli.configure, flows.cli.output, flows.cli.preview, flows.cli.records
        import flows.cli.runs, flows.cli.services
        """
    )
    proc = _python(
        body + _LOADED.format(forbidden=forbidden),
        heavy=(),
    )
    assert proc.returncode == 0, proc.stderr
    assert _offenders(proc) == [], f"importing the delivery command loaded {_offenders(proc)}"


@pytest.mark.parametrize(
    ("args", "also"),
    [
        # The command's own help: pydantic neither, which Typer needs only to parse a command's parameters.
        (["--help"], ("pydantic",)),
        ([], ("pydantic",)),
        (["run", "--help"], ()),
        (["status", "--help"], ()),
    ],
)
def test_help_loads_no_fixed_cost(args: list[str], also: tuple[str, ...]) -> None:
    """Rich is allowed here: Typer renders its help with it."""
    body = textwrap.dedent(
        f"""
        from importlib.metadata import entry_points

        [script] = entry_points(group="console_scripts", name="delivery")
        sys.argv = ["delivery", *{args!r}]
        try:
            script.load()()
        except SystemExit as exc:
            code = exc.code
        """
    )
    proc = _python(
        body + _LOADED.format(forbidden=(*FIXED_COST, *also)) + "sys.exit(code)\n",
        # Set variables of the plain forms are checked without pydantic and SQLAlchemy too.
        env={db.DATABASE_URL_ENV: "sqlite:///some/where/delivery.db", "DELIVERY_DEAD_CHAIN_MINUTES": "30"},
        heavy=(),
    )
    assert proc.returncode in (0, 2), proc.stderr  # no arguments: the help, exit 2 (Typer's no_args_is_help)
    assert "Usage" in proc.stdout
    assert _offenders(proc) == [], f"delivery {' '.join(args)} loaded {_offenders(proc)}"


def test_the_check_of_loaded_modules_names_what_was_loaded() -> None:
    """The checks above can fail: a module they forbid shows up, named."""
    proc = _python("import sqlalchemy, rich.table\n" + _LOADED.format(forbidden=("rich", "sqlalchemy")), heavy=())
    assert proc.returncode == 0, proc.stderr
    assert {"rich", "rich.table", "sqlalchemy"} <= set(_offenders(proc))


def test_the_attempts_limits_of_the_command_are_those_of_listings() -> None:
    """Repeated in flows.cli.records so that its import needs no store."""
    from delivery import listings
    from flows.cli import records

    assert (records.DEFAULT_ATTEMPTS, records.MAX_ATTEMPTS) == (listings.DEFAULT_ATTEMPTS, listings.MAX_ATTEMPTS)


def test_the_guard_refuses_a_heavy_import() -> None:
    """The guard itself works: what would make the checks above pass vacuously."""
    proc = _python("import prefect\n")
    assert proc.returncode != 0 and "heavy module imported: prefect" in proc.stderr
