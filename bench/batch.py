"""Batch endpoints against one record per call: `python -m bench.batch` (see docs/performance.md).

One sandbox target (its own process) at `--latency-ms` (default 50) a request, three connections to
it: `single` (one record per call), `batch` (its batch endpoint, `--max-items` a call) and
`templated` (the same endpoint and wire format, described by `batch.create` / `batch.update`
templates), a rule each on a source of its own, the same records. Each rule's chain creates them
all, then updates them all (every record changed), driven in this process without Prefect (the engine's job and settle
paths, which are what batching changes; Prefect's share per chain is the same for both). Wall
time and this process's CPU time, side by side in one run, on SQLite and on PostgreSQL.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa
import yaml

from bench import pg
from bench.target import SandboxProcess
from bench.world import records, rule_entry, target_connection, use_database
from delivery import db
from delivery.apply import apply_config
from delivery.chain import Chain
from delivery.config import parse_config
from delivery.domain import ChainEnd, MirrorInput, Phase
from delivery.phase import run_phase
from delivery.store.mirror import load_records

#: One record per call, the built-in batch wire format, and that same format described by templates.
MODES = ("single", "batch", "templated")


def drive(engine: sa.Engine, rule: str) -> dict[str, Any]:
    """One chain, job after job, as the deliver-rule flow runs it (without Prefect)."""
    chain = Chain(engine, rule)
    ended = chain.open()
    for phase in (Phase.DRAIN, Phase.SCAN):
        if ended is None:
            ended = run_phase(chain, phase, chain.run_batch)
    report = chain.finish()
    if report.ended_by is not ChainEnd.CAUGHT_UP:
        raise RuntimeError(f"{rule}: the chain ended {report.ended_by.value}: {report.message}")
    return dict(report.counts)


def measure(engine: sa.Engine, rule: str, expected: int) -> dict[str, Any]:
    wall, cpu = time.perf_counter(), time.process_time()
    counts = drive(engine, rule)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if counts.get("delivered") != expected:
        raise RuntimeError(f"{rule}: expected {expected} delivered, got {counts}")
    return {"seconds": round(wall, 3), "cpu_seconds": round(cpu, 3), "records_per_second": round(expected / wall, 1)}


def run_database(
    label: str, url: str, sandbox: SandboxProcess, n: int, max_items: int, concurrency: int
) -> list[dict[str, Any]]:
    engine = use_database(url)
    batch_target = {
        **target_connection("batch", sandbox),
        "batch": {"create_path": "contacts/batch", "update_path": "contacts/batch", "max_items": max_items},
    }
    # The same wire format, described by templates (`batch.create` / `batch.update`): what the
    # templated path costs beside the built-in one, on the very same requests.
    templated_target = {
        **target_connection("templated", sandbox),
        "batch": {
            "max_items": max_items,
            "create": {
                "path": "{{ collection }}/batch",
                "body": {"items": "{{ items }}"},
                "item": {"idempotency_key": "{{ idempotency_key }}", "record": "{{ fields }}"},
                "results_at": "results",
                "id_at": "id",
            },
            "update": {
                "path": "{{ collection }}/batch",
                "body": {"items": "{{ items }}"},
                "item": {"id": "{{ remote_id }}", "record": "{{ fields }}"},
                "results_at": "results",
            },
        },
    }
    rules = [
        rule_entry(name, f"{name}-source", "contacts", batch=500, concurrency=concurrency, target=name)
        for name in MODES
    ]
    config = {
        "connections": [
            target_connection("single", sandbox),
            batch_target,
            templated_target,
            *({"name": f"{name}-source"} for name in MODES),
        ],
        "rules": rules,
    }
    with engine.begin() as conn:
        apply_config(conn, parse_config(yaml.safe_dump(config), "bench config"))
    rows: list[dict[str, Any]] = []
    for verb in ("create", "update"):
        for name in MODES:
            with engine.begin() as conn:
                items = [MirrorInput(ext, {**body, "rev": verb}) for ext, body in records(f"{label}-{name}", n)]
                load_records(conn, f"{name}-source", "contact", items)
            rows.append({"database": label, "verb": verb, "mode": name, "records": n, **measure(engine, name, n)})
        single, batch, templated = rows[-3], rows[-2], rows[-1]
        batch["batch_vs_single"] = round(batch["records_per_second"] / single["records_per_second"], 1)
        templated["batch_vs_single"] = round(templated["records_per_second"] / single["records_per_second"], 1)
        templated["templated_vs_batch"] = round(templated["records_per_second"] / batch["records_per_second"], 2)
    db.dispose_engines()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.batch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=2000, help="records per rule (default 2000)")
    parser.add_argument("--latency-ms", type=int, default=50, help="the sandbox's latency (default 50)")
    parser.add_argument("--max-items", type=int, default=100, help="items per batch call (default 100)")
    parser.add_argument("--concurrency", type=int, default=8, help="the rules' concurrency (default 8)")
    parser.add_argument("--sqlite-only", action="store_true", help="skip PostgreSQL")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-batch-") as tmp:
        sandbox = SandboxProcess(args.latency_ms, Path(tmp) / "sandbox.log").start()
        try:
            rows += run_database(
                "sqlite", f"sqlite:///{Path(tmp) / 'bench.db'}", sandbox, args.records, args.max_items, args.concurrency
            )
            if not args.sqlite_only and pg.server_version() is not None:
                name = f"bench_batch_{os.getpid()}"
                try:
                    url = pg.create_database(name)
                    rows += run_database("postgresql", url, sandbox, args.records, args.max_items, args.concurrency)
                finally:
                    pg.drop_database(name)
        finally:
            sandbox.stop()
    print(
        f"{'database':<11} {'verb':<7} {'mode':<9} {'records':>7} {'seconds':>8} {'rec/s':>8} {'cpu s':>6} "
        f"{'x':>5} {'vs batch':>8}"
    )
    for r in rows:
        ratio = f"{r['batch_vs_single']:.1f}" if "batch_vs_single" in r else ""
        versus = f"{r['templated_vs_batch']:.2f}" if "templated_vs_batch" in r else ""
        print(
            f"{r['database']:<11} {r['verb']:<7} {r['mode']:<9} {r['records']:>7} {r['seconds']:>8.2f} "
            f"{r['records_per_second']:>8.1f} {r['cpu_seconds']:>6.2f} {ratio:>5} {versus:>8}"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
