"""`delivery`: everything an operator does, from the command line.

Refused input exits 2 with a message naming what is wrong and where, and writes nothing. The
commands live by concern: `configure` (schema, connections, rules, mirror), `runs` (run, tick,
status), `records` (ledger, requeue), `services` (serve, sandbox, alerts, demo); `output`
holds how they print.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import get_args

from delivery.errors import InputError
from delivery.storable import text_problem

# The command modules register their commands on the apps when imported.
from flows.cli import configure, preview, records, runs, services  # noqa: F401
from flows.cli.apps import app

__all__ = ["app", "main"]


def _prefect_defaults() -> None:
    """Defaults for Prefect's own settings. Prefect reads them once, when it is first imported, which
    no command does before this runs; set here rather than at import, so that importing this module
    changes nothing in the environment."""
    # The ephemeral Prefect server would otherwise try to phone home from machines with no internet.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # Without PREFECT_API_URL, Prefect starts a local API server and gives it 20 s by default; with a
    # fresh PREFECT_HOME it first migrates its own database, which takes longer on a busy small machine.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")


def _options_taking_a_value() -> tuple[set[str], set[str]]:
    """The options that take a value, and those of them whose value is a path."""
    import typer.main

    values: set[str] = set()
    paths: set[str] = set()
    pending = [typer.main.get_command(app)]
    while pending:
        command = pending.pop()
        for param in command.params:
            if param.param_type_name == "option" and not getattr(param, "is_flag", False):
                values.update(param.opts)
                annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
                if annotation is Path or Path in get_args(annotation):
                    paths.update(param.opts)
        pending.extend(getattr(command, "commands", {}).values())
    return values, paths


def _check_arguments(args: list[str]) -> None:
    """A byte of the command line that is not UTF-8 reaches Python as a lone surrogate, which no
    database or target takes: refused here, naming the option or the argument's position, instead
    of as a driver's traceback wherever the value first meets a database. Paths are exempt: the
    file system takes the bytes back as they were (a file that exists, or the value of a path
    option)."""
    if not any(text_problem(arg) is not None for arg in args):
        return
    value_options, path_options = _options_taking_a_value()
    for number, arg in enumerate(args, start=1):
        if text_problem(arg) is None:
            continue
        before = args[number - 2] if number > 1 else ""
        option, equals, value = arg.partition("=")
        if arg.startswith("--") and equals and text_problem(option) is None:
            where, arg = option, value
        elif before in value_options:
            where = before
        else:
            where = f"argument {number}"
        if where in path_options or (where.startswith("argument") and os.path.exists(arg)):
            continue
        shown = arg.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        raise InputError(f"{where}: '{shown}' is not UTF-8 text; names, ids and values must be")


def one_line(text: str) -> str:
    """`text` with every character that is not printable written as its escape (`\\n`, `\\x1b`,
    `\\u2028`, a lone surrogate's `\\udcff`): a problem quotes what it was given (a path, a key, a
    value), and a line break there would print a line that is no `error:` line, a terminal escape
    would act on the terminal."""
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else char.encode("unicode_escape").decode("ascii") for char in text)


def _database_unavailable(exc: Exception) -> bool:
    """Whether `exc` is `delivery.db.DatabaseUnavailable`. Only a command that imported
    `delivery.db` can raise it, and importing it to ask would cost every other command SQLAlchemy."""
    db = sys.modules.get("delivery.db")
    return db is not None and isinstance(exc, db.DatabaseUnavailable)


def main() -> None:
    from delivery.settings import settings

    _prefect_defaults()
    try:
        _check_arguments(sys.argv[1:])
        settings()  # a bad DELIVERY_* value is refused here, naming it, before any command runs
        app()
    except InputError as exc:
        # Plain writes: rich markup would eat "[0]" in paths like rules[0].policy. One line each.
        problems = getattr(exc, "problems", None) or [str(exc)]
        for problem in problems:
            sys.stderr.write(f"error: {one_line(problem)}\n")
        sys.exit(2)
    except Exception as exc:
        if not _database_unavailable(exc):
            raise
        # Not refused input: the same command works once the database takes connections.
        sys.stderr.write(f"error: {one_line(str(exc))}\n")
        sys.exit(1)
