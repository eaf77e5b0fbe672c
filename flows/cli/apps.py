"""The `delivery` command and its command groups; the commands register themselves on them."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="delivery",
    help="Outbound record-delivery engine: apply configuration, load mirrors, run and inspect delivery rules.\n\n"
    "The database is DELIVERY_DATABASE_URL (default: SQLite file delivery.db in the working directory).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)
db_app = typer.Typer(help="Database schema.", no_args_is_help=True, rich_markup_mode="markdown")
mirror_app = typer.Typer(help="The local mirror of source records.", no_args_is_help=True, rich_markup_mode="markdown")
app.add_typer(db_app, name="db")
app.add_typer(mirror_app, name="mirror")
alerts_app = typer.Typer(
    help="Alerting through Prefect automations.", no_args_is_help=True, rich_markup_mode="markdown"
)
app.add_typer(alerts_app, name="alerts")
