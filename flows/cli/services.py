"""Long-running services and tours: serve, the sandbox target, alerts, the demo."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from delivery.errors import InputError
from flows.cli.apps import alerts_app, app
from flows.cli.output import (
    JsonFlag,
    console,
    print_json,
    say,
)

#: `--metrics-port`: Prometheus metrics of the chains this process runs (see flows/metrics.py).
MetricsPort = typer.Option(
    "--metrics-port",
    min=1,
    max=65535,
    help="Serve Prometheus metrics of the chains run here on this port (/metrics); a scrape never holds a chain.",
)


def _serve_metrics(port: int, *, of_processes: bool) -> None:
    """`--metrics-port`: this process's metrics, or those of the runs' processes added up; a port
    that cannot be listened on is refused, naming it."""
    from flows.metrics import serve_metrics, serve_metrics_of_processes

    try:
        if of_processes:
            serve_metrics_of_processes(port)
        else:
            serve_metrics(port)
    except OSError as exc:
        raise InputError(f"--metrics-port: cannot listen on {port}: {exc.strerror or exc}") from None
    say(f"metrics: http://127.0.0.1:{port}/metrics")


@app.command("serve")
def serve_command(
    port: Annotated[
        int, typer.Option("--port", help="Port of the local Prefect server (without PREFECT_API_URL).")
    ] = 4200,
    metrics_port: Annotated[int | None, MetricsPort] = None,
) -> None:
    """The long-running job on one machine: serves delivery-tick (every 5 minutes), deliver-rule,
    delivery-requeue, delivery-preview and delivery-record.

    Without PREFECT_API_URL it first starts a local Prefect server (SQLite under PREFECT_HOME) and prints
    the UI address; Ctrl-C or SIGTERM stops everything (exit 0), a second one stops it at once."""
    if metrics_port is not None:
        _serve_metrics(metrics_port, of_processes=True)
    from flows.serve import serve_forever

    serve_forever(port)


@app.command("worker")
def worker_command(
    pool: Annotated[str, typer.Option("--pool", help="The work pool to take runs from.")] = "delivery",
    limit: Annotated[int, typer.Option("--limit", min=1, max=256, help="Runs in flight at once.")] = 16,
    name: Annotated[str | None, typer.Option("--name", help="Worker name in the UI (default: host and pid).")] = None,
    poll_seconds: Annotated[
        float, typer.Option("--poll-seconds", min=0.5, max=300, help="How often to look for runs and for Cancels.")
    ] = 5.0,
    metrics_port: Annotated[int | None, MetricsPort] = None,
) -> None:
    """Run chains in this long-lived process: takes deliver-rule (and tick, requeue, preview and
    record) runs from the pool.

    The warm alternative to `prefect worker start --pool delivery`, which starts a process per run. Needs
    PREFECT_API_URL. Ctrl-C or SIGTERM cancels the runs in flight and stops (exit 0); a second one at once."""
    from flows.worker import NoPool, NoServer, run_worker

    if metrics_port is not None:
        _serve_metrics(metrics_port, of_processes=False)

    try:
        raise typer.Exit(run_worker(pool=pool, name=name, limit=limit, poll_seconds=poll_seconds, say=say))
    except (NoServer, NoPool) as exc:
        raise InputError(str(exc)) from None


@app.command("sandbox")
def sandbox_command(
    port: Annotated[int, typer.Option("--port", help="Port to listen on.")] = 8900,
    fail_rate: Annotated[float, typer.Option("--fail-rate", help="Share of writes answered 503 (0..1).")] = 0.0,
    latency_ms: Annotated[int, typer.Option("--latency-ms", help="Latency added to every request.")] = 0,
    timeout_share: Annotated[
        float, typer.Option("--timeout-share", help="Share of the failures that hang instead (client timeouts).")
    ] = 0.0,
    token_env: Annotated[
        str | None, typer.Option("--token-env", help="Require this environment variable's value as bearer token.")
    ] = None,
    db: Annotated[Path | None, typer.Option("--db", help="Keep records in this SQLite file (default: memory).")] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="Make the fault sequence repeatable.")] = None,
) -> None:
    """A small but real REST target for trying the engine: POST creates, PATCH updates, GET shows what arrived."""
    from delivery.settings import secret
    from playground.sandbox import SandboxSettings, serve

    token = None
    if token_env:
        token = secret(token_env)
        if not token:
            raise InputError(f"--token-env: ${token_env} is not set")
    try:
        settings = SandboxSettings(
            port=port,
            fail_rate=fail_rate,
            latency_ms=latency_ms,
            timeout_share=timeout_share,
            token=token,
            db_path=str(db) if db else None,
            seed=seed,
        )
    except ValueError as exc:
        raise InputError(str(exc)) from exc
    serve(settings)


@alerts_app.command("install")
def alerts_install(
    block: Annotated[
        str, typer.Option("--block", help="Notification block as BLOCK-TYPE/NAME, e.g. slack-webhook/ops.")
    ],
    enable: Annotated[
        bool, typer.Option("--enable/--disabled", help="Create the automations enabled or paused.")
    ] = True,
    directory: Annotated[
        Path | None,
        typer.Option("--dir", help="Where the automation files are (default: those shipped with the package)."),
    ] = None,
    tick_missing_minutes: Annotated[
        float | None,
        typer.Option(
            "--tick-missing-minutes",
            help="Alert when no delivery-tick run Completed for this many minutes (default 15, the file's).",
        ),
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Create the alert automations of automations/*.yaml, or update in place those installed before.

    They notify through the block: when a rule starts failing and when it recovers, when a target's
    breaker opens and closes again, when no delivery-tick run Completed for 15 minutes (or
    --tick-missing-minutes), when a tick fails."""
    import asyncio
    import dataclasses

    from flows.automations import AUTOMATIONS_DIR, install, tick_missing_window

    within = None if tick_missing_minutes is None else tick_missing_window(tick_missing_minutes)
    installed = asyncio.run(install(block, enable, directory or AUTOMATIONS_DIR, within))
    if as_json:
        print_json([dataclasses.asdict(i) for i in installed])
        return
    for i in installed:
        say(f"{i.action} automation {i.name!r} ({i.file}), {'enabled' if enable else 'paused'}")


@app.command("demo")
def demo_command(
    workdir: Annotated[
        Path, typer.Option("--workdir", help="Where the demo keeps its database and files (emptied first).")
    ] = Path("demo-run"),
    records: Annotated[int, typer.Option("--records", min=20, max=100_000, help="Size of the sample mirror.")] = 3000,
) -> None:
    """Show the engine end to end on the embedded defaults: sandbox target, sample config and mirror,
    deliveries, updates and suppressions, faults with parked records and a breaker opening, recovery."""
    # Prefect's per-run log lines would drown the story the demo tells; the runs are in the ledger.
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    from playground.demo import run_demo

    run_demo(workdir.resolve(), records, console())
