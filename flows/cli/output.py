"""What every command prints with: lines that never break, tables that fit 80 columns, JSON for
scripts; and the database the commands read and write.

Rich and SQLAlchemy are imported where they are first used, not here: every command module
imports this one, and `delivery --help` or a `--json` answer needs neither (issue #33 point 6)."""

from __future__ import annotations

import functools
import json
import sys
import textwrap
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    import sqlalchemy as sa
    from rich.console import Console


@functools.cache
def console() -> Console:
    """The console every command prints to, made on first use. It writes to `sys.stdout` as it is
    at each print, so a test's captured output receives it."""
    from rich.console import Console

    return Console()


def say(text: str, *, markup: bool = False) -> None:
    """One line for a person, never broken by Rich at the console's width: piped into a script
    or a file (where Rich assumes 80 columns) a line stays one line."""
    console().print(text, soft_wrap=True, markup=markup, highlight=False)


def json_cursor_text(cursor: dict[str, Any] | None) -> str:
    """A cursor as `delivery run --json` gives it, written as `_cursor_text` writes a saved one."""
    return "-" if cursor is None else f"{cursor['changed_at']} #{cursor['record_id']}"


# A flag takes no value: an empty metavar keeps Typer from showing one (`<bool>`) in --help.
JsonFlag = Annotated[bool, typer.Option("--json", metavar="", help="Print JSON for scripts instead of a table.")]


def engine() -> sa.Engine:
    from delivery.db import shared_engine

    return shared_engine()


def read_only() -> sa.Connection:
    return engine().connect().execution_options(readonly=True)


def iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def show(rows: list[dict[str, str]], columns: list[str] | None = None, *, empty: str) -> None:
    """Rows of text as a table when the whole table fits the terminal, else one block per row
    (the first column as its heading, then one `label  value` line per other column).

    Rich fits a table that is too wide by cutting cells (`contact…`); a name or a fault class cut
    that way says nothing, so a narrow terminal gets blocks, whose values wrap and are never cut."""
    if not rows:
        say(empty)  # a blank answer reads as a command that did nothing
        return
    from rich.measure import Measurement
    from rich.table import Table
    from rich.text import Text

    out = console()
    columns = columns or list(rows[0])
    table = Table(*columns)
    for row in rows:
        table.add_row(*(Text(row[c]) for c in columns))
    # Measured without a width limit: Rich clamps a measurement to the width it is given.
    unbounded = out.options.update(width=sys.maxsize, max_width=sys.maxsize)
    if Measurement.get(out, unbounded, table).maximum <= out.width:
        out.print(table)
        return
    heading, *fields = columns
    label_width = max(len(field) for field in fields)
    indent = " " * (2 + label_width + 2)
    for number, row in enumerate(rows):
        if number:
            out.print()
        out.print(Text(row[heading], style="bold"), soft_wrap=True)
        for field in fields:
            # Wrapped here rather than by Rich, so lines carry no padding; a word longer than the
            # line (a URL, say) is broken, never cut.
            lines = textwrap.wrap(row[field], max(20, out.width - len(indent)), break_on_hyphens=False) or [""]
            out.print(f"  {field.ljust(label_width)}  {lines[0]}", markup=False, highlight=False, soft_wrap=True)
            for line in lines[1:]:
                out.print(indent + line, markup=False, highlight=False, soft_wrap=True)


def cursor_text(cursor: Any) -> str:
    """A saved cursor as time and record."""
    return "-" if cursor is None else f"{cursor.changed_at.isoformat(timespec='seconds')} #{cursor.record_id}"
