"""The benchmark: `python -m bench.run` from the repository root (`make bench`); `--quick` for CI.

In one run, side by side:

* end-to-end throughput of `deliver-rule` (the real flow, `flows.deliver_rule.run_now`) creating N
  records in the sandbox target (its own process, fixed latency), on SQLite and on PostgreSQL, at
  each concurrency;
* the same N requests by a bare httpx client at the same concurrency (the physical limit of this
  machine for this target), and the ratio engine/bare;
* a naive Prefect design (one task per record, `bench/naive.py`) on a smaller N;
* per-batch latency of `scan_page` and `drain_page` with the mirror at several sizes (PostgreSQL),
  with the query plans, and the peak Python memory of a chain at each size.

Prints tables and writes JSON (default `bench/results/latest.json`). Exits 1 when anything failed
(a wrong count is a failure); a target that is not met is reported, not a failure.
See docs/performance.md for what the numbers mean.
"""

from __future__ import annotations

# ruff: noqa: E402  (the environment must be set before Prefect is first imported)
import os

# Before anything imports Prefect (see tests/conftest.py and docs/performance.md): the test
# server's task-run recorder, event persister and triggers contend for its SQLite lock and stall
# chains; analytics off; Prefect's per-run INFO lines off.
for _name, _value in {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED": "false",
    "PREFECT_LOGGING_LEVEL": "WARNING",
}.items():
    os.environ.setdefault(_name, _value)

import argparse
import contextlib
import json
import platform
import shutil
import sys
import tempfile
import time
import traceback
import tracemalloc
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench import bare, mirror, naive, pg
from bench.cpu import CpuMeter
from bench.report import THROUGHPUT_HEADER, bare_text, cost_rows
from bench.target import SandboxProcess
from bench.world import StatementCounter, apply, records, rule_entry, use_database
from delivery import db
from delivery.store import catalog
from delivery.store.mirror import MirrorInput, load_records
from flows.deliver_rule import run_now

E2E_DATABASE = "delivery_bench"
MIRROR_DATABASE = "delivery_bench_mirror"
DEFAULT_JSON = Path("bench/results/latest.json")
TARGET_RATIO = 0.8
TARGET_LATENCY_GROWTH = 2.0
TARGET_MEMORY_GROWTH = 1.25
WARM_UP_RECORDS = 50

_t0 = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _t0:7.1f}s] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------ arguments


def _ints(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=None, help="records per end-to-end run (default 10000)")
    parser.add_argument("--naive-records", type=int, default=None, help="records for the naive design (default 500)")
    parser.add_argument("--concurrency", type=_ints, default=[1, 8], help="writes in flight, a list (default 1,8)")
    parser.add_argument(
        "--mirror-sizes", type=_ints, default=None, help="mirror rows, a list (default 10000,100000,1000000)"
    )
    parser.add_argument("--batch-size", type=int, default=500, help="the rule's batch_size (default 500)")
    parser.add_argument("--latency-ms", type=int, default=2, help="the sandbox's fixed latency (default 2)")
    parser.add_argument(
        "--chain-records", type=int, default=None, help="records the memory chain delivers at each size (default 2000)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes (300 records, naive 50, mirror 2000,5000): for CI"
    )
    parser.add_argument("--skip-postgres", action="store_true", help="SQLite only; no mirror-size section")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"where to write the results ({DEFAULT_JSON})")
    args = parser.parse_args(argv)
    quick = args.quick
    args.records = args.records or (300 if quick else 10_000)
    args.naive_records = args.naive_records or (50 if quick else 500)
    args.mirror_sizes = sorted(args.mirror_sizes or ([2_000, 5_000] if quick else [10_000, 100_000, 1_000_000]))
    args.chain_records = args.chain_records or (200 if quick else 2_000)
    if not 1 <= args.batch_size <= 10_000:
        parser.error("--batch-size must be within 1..10000 (a rule's limit)")
    if any(c > 64 for c in args.concurrency):
        parser.error("--concurrency values must be within 1..64 (a rule's limit)")
    if args.chain_records * 2 > min(args.mirror_sizes):
        parser.error("--chain-records must be at most half the smallest mirror size")
    return args


# ------------------------------------------------------------------------------------- helpers


class Failures:
    """Each section runs on its own: a failure is recorded (and makes the exit code 1) and the
    other sections still run, so one broken part does not hide the others' numbers."""

    def __init__(self) -> None:
        self.items: list[dict[str, str]] = []

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        try:
            yield
        except Exception as exc:
            detail = traceback.format_exc()
            log(f"FAILED {name}: {type(exc).__name__}: {exc}")
            print(detail, file=sys.stderr, flush=True)
            self.items.append({"section": name, "error": f"{type(exc).__name__}: {exc}", "traceback": detail})


def _rate(n: int, seconds: float) -> float:
    return round(n / seconds, 1) if seconds > 0 else 0.0


def check_chain(result: dict[str, Any], expected: int) -> None:
    delivered = result["counts"].get("delivered", 0)
    if result["state"] != "COMPLETED" or result["ended_by"] != "caught_up" or delivered != expected:
        raise RuntimeError(
            f"chain of {result['rule']} ended {result['state']}/{result['ended_by']} with {delivered} of "
            f"{expected} delivered: {result['message']}"
        )


# ------------------------------------------------------------------------------- the sections


def _run_client(
    sandbox: SandboxProcess, post: Callable[..., float], prefix: str, collection: str, n: int, concurrency: int
) -> dict[str, Any]:
    """One run of a client that is not the engine (`bare.post_all`, `naive.run`): n creates into
    their own collection, checked against what the sandbox holds."""
    with CpuMeter(sandbox.pid) as cpu:
        elapsed = post(sandbox.api, collection, records(prefix, n), concurrency, f"bench-{collection}")
    if sandbox.creates(collection) != n:
        raise RuntimeError(f"the sandbox holds {sandbox.creates(collection)} of {n} creates in {collection}")
    return {"records": n, "seconds": round(elapsed, 3), "records_per_s": _rate(n, elapsed), "cpu": cpu.result(n)}


def run_bare(sandbox: SandboxProcess, n: int, concurrency: int, when: str) -> dict[str, Any]:
    return _run_client(sandbox, bare.post_all, "b", f"bare_c{concurrency}_{when}", n, concurrency)


def add_ratios(row: dict[str, Any]) -> None:
    """`bare` = the mean of the runs before and after the engine; each other entry gets its ratio."""
    rates = [row[key]["records_per_s"] for key in ("bare_before", "bare_after") if key in row]
    if not rates:
        return
    mean = sum(rates) / len(rates)
    row["bare"] = {
        "records_per_s": round(mean, 1),
        "before": row.get("bare_before", {}).get("records_per_s"),
        "after": row.get("bare_after", {}).get("records_per_s"),
        "cpu": row.get("bare_before", {}).get("cpu"),
    }
    for label in ("sqlite", "postgresql", "naive"):
        entry = row.get(label)
        if isinstance(entry, dict) and "records_per_s" in entry:
            entry["ratio"] = round(entry["records_per_s"] / mean, 3)
            log(f"c={row['concurrency']}: {label} / bare = {entry['ratio']:.2f}")


def prepare_e2e_database(label: str, url: str, sandbox: SandboxProcess, n: int) -> None:
    engine = use_database(url)
    apply(engine, sandbox, "shop", [])
    with engine.begin() as conn:
        load_records(conn, "shop", mirror.DOMAIN, (MirrorInput(e, p) for e, p in records("e", n)))
    log(f"{label}: {n} mirror records loaded")


class ChainTiming:
    """Splits a chain's wall time without changing what runs: the time inside `Chain.run_batch`
    (the engine's work), the time acquiring and releasing the rule lock around each batch, and
    the rest (flow, subflows, one task per batch, artifact, Prefect API calls)."""

    def __init__(self) -> None:
        self.batches_s = self.lock_s = 0.0
        self.batches = 0

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        import flows.deliver_rule as flow_module
        from delivery.engine import Chain

        original_lock, original_batch = flow_module.__dict__["rule_lock"], Chain.run_batch
        timing = self

        @contextlib.asynccontextmanager
        async def timed_lock(chain: Chain) -> AsyncIterator[None]:
            started = time.perf_counter()
            async with original_lock(chain):
                timing.lock_s += time.perf_counter() - started
                try:
                    yield
                finally:
                    started = time.perf_counter()
            timing.lock_s += time.perf_counter() - started

        def timed_batch(chain: Chain, phase: Any) -> Any:
            started = time.perf_counter()
            try:
                return original_batch(chain, phase)
            finally:
                timing.batches_s += time.perf_counter() - started
                timing.batches += 1

        setattr(flow_module, "rule_lock", timed_lock)  # noqa: B010
        setattr(Chain, "run_batch", timed_batch)  # noqa: B010
        try:
            yield
        finally:
            setattr(flow_module, "rule_lock", original_lock)  # noqa: B010
            setattr(Chain, "run_batch", original_batch)  # noqa: B010

    def result(self, total: float) -> dict[str, Any]:
        return {
            "batches": self.batches,
            "engine_work_s": round(self.batches_s, 3),
            "lock_s": round(self.lock_s, 3),
            "prefect_other_s": round(total - self.batches_s - self.lock_s, 3),
        }


def run_engine(label: str, url: str, sandbox: SandboxProcess, n: int, concurrency: int, batch: int) -> dict[str, Any]:
    engine = use_database(url)
    name = f"e2e-{label}-c{concurrency}-b{batch}"
    collection = name.replace("-", "_")
    apply(engine, sandbox, "shop", [rule_entry(name, "shop", collection, batch, concurrency)])
    counter = StatementCounter(engine)
    timing = ChainTiming()
    started = time.perf_counter()
    try:
        with CpuMeter(sandbox.pid) as cpu, timing.measuring():
            result = run_now(name)
    finally:
        elapsed = time.perf_counter() - started
        counter.stop()
    check_chain(result, n)
    if sandbox.creates(collection) != n:
        raise RuntimeError(f"the sandbox holds {sandbox.creates(collection)} of {n} creates of {name}")
    return {
        "records": n,
        "seconds": round(elapsed, 3),
        "records_per_s": _rate(n, elapsed),
        "statements_per_record": round(counter.statements / n, 2),
        "commits_per_record": round(counter.commits / n, 2),
        "split": timing.result(elapsed),
        "cpu": cpu.result(n),
    }


def run_empty_chain(label: str, url: str, sandbox: SandboxProcess, runs: int) -> dict[str, Any]:
    """Chains with nothing to deliver (one empty scan batch): the fixed cost of a chain. The
    first chain of the process pays Prefect's warm-up too, so the best of `runs` is kept."""
    engine = use_database(url)
    apply(engine, sandbox, "nobody", [rule_entry(f"empty-{label}", "nobody", "empty", 500, 1)])
    measured = []
    for _ in range(runs):
        timing = ChainTiming()
        started = time.perf_counter()
        with timing.measuring():
            result = run_now(f"empty-{label}")
        elapsed = time.perf_counter() - started
        check_chain(result, 0)
        measured.append({"seconds": round(elapsed, 3), **timing.result(elapsed)})
    return min(measured, key=lambda run: float(run["seconds"]))


def run_naive(sandbox: SandboxProcess, n: int, concurrency: int) -> dict[str, Any]:
    return _run_client(sandbox, naive.run, "n", f"naive_c{concurrency}", n, concurrency)


def _proc_status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM := VmRSS
        return True
    except OSError:
        return False


def run_mirror_size(
    n: int, sandbox: SandboxProcess, batch: int, chain_records: int, chain_concurrency: int
) -> dict[str, Any]:
    url = pg.create_database(MIRROR_DATABASE)
    try:
        engine = use_database(url)
        scan_rule, chain_rule, warm_rule = f"mirror-scan-{n}", f"mirror-chain-{n}", f"mirror-warm-up-{n}"
        apply(
            engine,
            sandbox,
            "warehouse",
            [
                rule_entry(scan_rule, "warehouse", "mirror_scan", batch, 1),
                rule_entry(chain_rule, "warehouse", f"mirror_chain_{n}", batch, chain_concurrency, overlap=0),
                rule_entry(warm_rule, "warehouse", f"mirror_warm_up_{n}", batch, chain_concurrency, overlap=0),
            ],
        )
        with engine.connect() as conn:
            source_id = catalog.get_rule(conn, scan_rule).source.id
            scan_id, chain_id = catalog.get_rule(conn, scan_rule).id, catalog.get_rule(conn, chain_rule).id
            warm_id = catalog.get_rule(conn, warm_rule).id
        started = time.perf_counter()
        mirror.fill_mirror(engine, source_id, n, mirror.base_time(n))
        mirror.check_content_hash(engine, source_id, n // 3 + 1)
        ledger_counts = mirror.fill_ledger(engine, scan_id, source_id, n, batch, datetime.now(UTC))
        mirror.set_cursor(engine, scan_id, mirror.cursor_at(engine, source_id, n // 2))
        # overlap 0: the scan starts at the cursor's change signal, the cursor's record included.
        mirror.set_cursor(engine, chain_id, mirror.cursor_at(engine, source_id, n - chain_records + 1))
        mirror.set_cursor(engine, warm_id, mirror.cursor_at(engine, source_id, n - WARM_UP_RECORDS + 1))
        mirror.vacuum_analyze(engine)
        load_seconds = time.perf_counter() - started
        log(f"mirror {n}: rows and ledger built in {load_seconds:.1f} s ({ledger_counts})")
        with engine.connect() as conn:
            rule = catalog.get_rule(conn, scan_rule)
            mirror_bytes = int(conn.exec_driver_sql("SELECT pg_total_relation_size('mirror_records')").scalar_one())
        scan = mirror.measure_scan(engine, rule, source_id, n, batch)
        drain = mirror.measure_drain(engine, rule, batch)
        log(f"mirror {n}: scan median {scan['median_ms']} ms, drain median {drain['median_ms']} ms")

        # Peak memory of a whole chain through the flow: tracemalloc's peak of the Python heap
        # allocated during the run (the primary figure) and the growth of the process's peak RSS.
        # A short chain of another rule first, untraced, on this engine: without it the first size
        # measured would also carry one-off allocations (caches, the new connection pool).
        check_chain(run_now(warm_rule), WARM_UP_RECORDS)
        rss_reset = _reset_peak_rss()
        rss_before = _proc_status_kib("VmRSS")
        tracemalloc.start()
        started = time.perf_counter()
        try:
            result = run_now(chain_rule)
        finally:
            elapsed = time.perf_counter() - started
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
        hwm = _proc_status_kib("VmHWM")
        check_chain(result, chain_records)
        chain = {
            "records": chain_records,
            "concurrency": chain_concurrency,
            "seconds": round(elapsed, 3),
            "records_per_s_traced": _rate(chain_records, elapsed),
            "tracemalloc_peak_mib": round(peak / 2**20, 2),
            "rss_peak_growth_mib": round((hwm - rss_before) / 1024, 1) if rss_reset and hwm and rss_before else None,
        }
        log(f"mirror {n}: chain of {chain_records} peak {chain['tracemalloc_peak_mib']} MiB (tracemalloc)")
        return {
            "rows": n,
            "mirror_mib": round(mirror_bytes / 2**20, 1),
            "ledger": ledger_counts,
            "build_seconds": round(load_seconds, 1),
            "scan": scan,
            "drain": drain,
            "chain": chain,
        }
    finally:
        db.dispose_engines()
        pg.drop_database(MIRROR_DATABASE)


# -------------------------------------------------------------------------------------- report


def evaluate(results: dict[str, Any], quick: bool) -> list[dict[str, Any]]:
    targets: list[dict[str, Any]] = []
    ratios = [
        (f"{label} c={row['concurrency']}", row[label]["ratio"])
        for row in results["throughput"]
        for label in ("sqlite", "postgresql")
        if isinstance(row.get(label), dict) and "ratio" in row[label]
    ]
    if ratios:
        worst = min(ratios, key=lambda item: item[1])
        targets.append(
            {
                "target": f"engine/bare >= {TARGET_RATIO} at equal concurrency",
                "measured": ", ".join(f"{name}: {ratio:.2f}" for name, ratio in ratios),
                "met": worst[1] >= TARGET_RATIO,
            }
        )
    sizes = results["mirror"]
    if len(sizes) >= 2:
        small, large = sizes[0], sizes[-1]
        for page in ("scan", "drain"):
            growth = large[page]["median_ms"] / small[page]["median_ms"]
            targets.append(
                {
                    "target": f"{page} batch latency at {large['rows']:,} rows <= {TARGET_LATENCY_GROWTH:g}x "
                    f"{small['rows']:,} rows",
                    "measured": f"{large[page]['median_ms']:.2f} ms / {small[page]['median_ms']:.2f} ms "
                    f"= {growth:.2f}x",
                    "met": growth <= TARGET_LATENCY_GROWTH,
                }
            )
        peaks = [size["chain"]["tracemalloc_peak_mib"] for size in sizes]
        growth = peaks[-1] / peaks[0]
        targets.append(
            {
                "target": f"chain peak memory independent of mirror size (at {large['rows']:,} rows <= "
                f"{TARGET_MEMORY_GROWTH:g}x {small['rows']:,} rows)",
                "measured": " / ".join(f"{p:.2f}" for p in peaks) + f" MiB: {growth:.2f}x",
                "met": growth <= TARGET_MEMORY_GROWTH,
            }
        )
    if quick:
        for target in targets:
            target["note"] = "quick mode: sizes too small to judge"
    return targets


def _cell(entry: Any, key: str = "records_per_s", fmt: str = "{:,.0f}") -> str:
    if not isinstance(entry, dict):
        return "-" if entry is None else str(entry)
    if "error" in entry:
        return "[red]failed[/red]"
    return fmt.format(entry[key]) if key in entry else "-"


def render(results: dict[str, Any], console: Console) -> None:
    meta = results["meta"]
    console.print(
        f"[bold]delivery-engine benchmark[/bold]{' (quick)' if meta['quick'] else ''}: "
        f"{meta['cores']} cores, Python {meta['python']}, prefect {meta['versions']['prefect']}, "
        f"SQLAlchemy {meta['versions']['sqlalchemy']}, httpx {meta['versions']['httpx']}, "
        f"psycopg {meta['versions']['psycopg']}, PostgreSQL {meta['postgresql'] or '-'}, "
        f"SQLite {meta['sqlite']}; sandbox latency {meta['latency_ms']} ms, batch_size {meta['batch_size']}"
    )
    table = Table(title=f"Throughput, records/s ({meta['records']:,} creates; naive: {meta['naive_records']:,})")
    for column in THROUGHPUT_HEADER:
        table.add_column(column, justify="right")
    for row in results["throughput"]:
        table.add_row(
            str(row["concurrency"]),
            bare_text(row.get("bare")),
            _cell(row.get("sqlite")),
            _cell(row.get("sqlite"), "ratio", "{:.2f}"),
            _cell(row.get("postgresql")),
            _cell(row.get("postgresql"), "ratio", "{:.2f}"),
            _cell(row.get("naive")),
            _cell(row.get("naive"), "ratio", "{:.2f}"),
        )
    console.print(table)

    cost = Table(title="Where an engine chain's time goes (seconds) and its SQL per record")
    for column in (
        "database",
        "concurrency",
        "total",
        "batches",
        "engine work",
        "rule lock",
        "Prefect other",
        "SQL/record",
        "commits/record",
    ):
        cost.add_column(column, justify="right")
    for cost_row in cost_rows(results):
        cost.add_row(*cost_row)
    console.print(cost)

    cpu = Table(title="Where the CPU went (machine busy = all cores; ms of CPU per record)")
    for column in ("run", "concurrency", "records/s", "machine busy", "steal", "bench process", "sandbox target"):
        cpu.add_column(column, justify="right")
    for label in ("bare", "sqlite", "postgresql", "naive"):
        for row in results["throughput"]:
            entry = row.get(label)
            if isinstance(entry, dict) and isinstance(entry.get("cpu"), dict):
                usage = entry["cpu"]
                busy = usage["machine_busy"]
                cpu.add_row(
                    label,
                    str(row["concurrency"]),
                    f"{entry['records_per_s']:,.0f}",
                    "-" if busy is None else f"{busy:.0%}",
                    "-" if usage.get("machine_steal") is None else f"{usage['machine_steal']:.0%}",
                    f"{usage['own_cpu_ms_per_record']:.2f}",
                    "-" if usage["target_cpu_ms_per_record"] is None else f"{usage['target_cpu_ms_per_record']:.2f}",
                )
    console.print(cpu)

    if results["mirror"]:
        sizes = Table(title=f"Mirror size (PostgreSQL): per-batch latency ({meta['batch_size']} rows), chain memory")
        for column in (
            "mirror rows",
            "scan p50 ms",
            "scan max ms",
            "drain p50 ms",
            "drain max ms",
            "seq scan?",
            "chain peak MiB",
            "chain RSS growth MiB",
            "chain rec/s (traced)",
        ):
            sizes.add_column(column, justify="right")
        for size in results["mirror"]:
            seq = size["scan"]["plan"]["seq_scan"] or size["drain"]["plan"]["seq_scan"]
            sizes.add_row(
                f"{size['rows']:,}",
                f"{size['scan']['median_ms']:.2f}",
                f"{size['scan']['max_ms']:.2f}",
                f"{size['drain']['median_ms']:.2f}",
                f"{size['drain']['max_ms']:.2f}",
                "[red]yes[/red]" if seq else "no",
                f"{size['chain']['tracemalloc_peak_mib']:.1f}",
                str(size["chain"]["rss_peak_growth_mib"] if size["chain"]["rss_peak_growth_mib"] is not None else "-"),
                f"{size['chain']['records_per_s_traced']:,.0f}",
            )
        console.print(sizes)

    if results["targets"]:
        targets = Table(title="Targets")
        for column in ("target", "measured", "met"):
            targets.add_column(column)
        for target in results["targets"]:
            met = "[green]yes[/green]" if target["met"] else "[red]no[/red]"
            note = f" ({target['note']})" if "note" in target else ""
            targets.add_row(target["target"], target["measured"], met + note)
        console.print(targets)
    for failure in results["errors"]:
        console.print(f"[red]FAILED[/red] {failure['section']}: {failure['error']}")


def metadata(args: argparse.Namespace) -> dict[str, Any]:
    import sqlite3

    return {
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "quick": args.quick,
        "cores": os.cpu_count(),
        "machine": platform.machine(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {
            name: version(dist)
            for name, dist in (
                ("delivery-engine", "delivery-engine"),
                ("prefect", "prefect"),
                ("sqlalchemy", "sqlalchemy"),
                ("httpx", "httpx"),
                ("psycopg", "psycopg"),
                ("pybreaker", "pybreaker"),
                ("uvicorn", "uvicorn"),
            )
        },
        "sqlite": sqlite3.sqlite_version,
        "postgresql": None if args.skip_postgres else pg.server_version(),
        "records": args.records,
        "naive_records": args.naive_records,
        "concurrency": args.concurrency,
        "mirror_sizes": [] if args.skip_postgres else args.mirror_sizes,
        "batch_size": args.batch_size,
        "latency_ms": args.latency_ms,
        "chain_records": args.chain_records,
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "prefect_api": os.environ.get("PREFECT_API_URL") or "prefect_test_harness (ephemeral, subprocess)",
    }


# ---------------------------------------------------------------------------------------- main


def _harness() -> contextlib.AbstractContextManager[Any]:
    if os.environ.get("PREFECT_API_URL"):
        return contextlib.nullcontext()
    from prefect.testing.utilities import prefect_test_harness

    return prefect_test_harness(server_startup_timeout=120)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    failures = Failures()
    results: dict[str, Any] = {
        "meta": metadata(args),
        "throughput": [{"concurrency": c} for c in args.concurrency],
        "empty_chain": {},
        "mirror": [],
        "targets": [],
        "errors": failures.items,
    }
    workdir = Path(tempfile.mkdtemp(prefix="delivery-bench-"))
    sandbox = SandboxProcess(args.latency_ms, workdir / "sandbox.log")
    databases: dict[str, str] = {"sqlite": f"sqlite:///{workdir / 'bench.db'}"}
    created_postgres = False
    try:
        with failures.section("sandbox"):
            sandbox.start()
            log(f"sandbox on {sandbox.api}, latency {args.latency_ms} ms")
        if not args.skip_postgres and not failures.items:
            with failures.section("postgresql database"):
                created_postgres = True
                databases["postgresql"] = pg.create_database(E2E_DATABASE)
        if failures.items:
            raise SystemExit(1)  # nothing can run without the target or the database asked for

        log("starting the Prefect API (test harness)")
        with _harness():
            log("Prefect API up")
            for label, url in databases.items():
                with failures.section(f"{label}: setup"):
                    prepare_e2e_database(label, url, sandbox, args.records)
                    results["empty_chain"][label] = run_empty_chain(label, url, sandbox, 1 if args.quick else 3)
                    log(f"{label}: empty chain {results['empty_chain'][label]}")
            for row in results["throughput"]:
                c = row["concurrency"]
                # The bare client runs before the engine and again after it (a fifth of the records),
                # and the ratios are taken against the mean of the two, so that a machine whose speed
                # drifts (CPU steal on a VM) biases neither side.
                with failures.section(f"bare c={c}"):
                    row["bare_before"] = run_bare(sandbox, args.records, c, "before")
                    log(f"bare c={c}: {row['bare_before']['records_per_s']:,.0f} records/s")
                for label, url in databases.items():
                    with failures.section(f"{label} c={c}"):
                        row[label] = run_engine(label, url, sandbox, args.records, c, args.batch_size)
                        log(f"{label} c={c}: {row[label]['records_per_s']:,.0f} records/s")
                    if label not in row:
                        row[label] = {"error": True}
                with failures.section(f"naive c={c}"):
                    row["naive"] = run_naive(sandbox, args.naive_records, c)
                    log(f"naive c={c}: {row['naive']['records_per_s']:,.0f} records/s")
                if "naive" not in row:
                    row["naive"] = {"error": True}
                with failures.section(f"bare c={c} (again)"):
                    row["bare_after"] = run_bare(sandbox, max(args.records // 5, 50), c, "after")
                    log(f"bare c={c} again: {row['bare_after']['records_per_s']:,.0f} records/s")
                add_ratios(row)
            if not args.skip_postgres:
                db.dispose_engines()
                for n in args.mirror_sizes:
                    with failures.section(f"mirror {n}"):
                        results["mirror"].append(
                            run_mirror_size(n, sandbox, args.batch_size, args.chain_records, max(args.concurrency))
                        )
    except SystemExit:
        pass
    except BaseException as exc:  # Ctrl-C included: still clean up and write what we have
        failures.items.append({"section": "run", "error": f"{type(exc).__name__}: {exc}", "traceback": ""})
        log(f"FAILED: {type(exc).__name__}: {exc}")
    finally:
        sandbox.stop()
        db.dispose_engines()
        if created_postgres:
            for name in (E2E_DATABASE, MIRROR_DATABASE):
                with failures.section(f"drop {name}"):
                    pg.drop_database(name)
        shutil.rmtree(workdir, ignore_errors=True)

    results["targets"] = evaluate(results, args.quick)
    results["meta"]["seconds"] = round(time.perf_counter() - _t0, 1)
    results["meta"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")
    console = Console(width=None if sys.stdout.isatty() else 160)
    render(results, console)
    console.print(f"JSON: {args.json}   total {results['meta']['seconds']} s")
    return 1 if failures.items else 0


if __name__ == "__main__":
    sys.exit(main())
