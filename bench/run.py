"""The benchmark: `python -m bench.run` from the repository root (`make bench`); `--quick` for CI.

In one run, side by side:

* end-to-end throughput of `deliver-rule` (the real flow, `flows.deliver_rule.run_now`) creating N
  records in the sandbox target (its own process, fixed latency), on SQLite and on PostgreSQL, with
  the target's connection settled `grouped` and `per_record`, in two profiles: the short one (2 ms
  latency at concurrency 1 and 8) and the long one real targets have (50 ms at 32 and 64);
* the same N requests by a bare httpx client at the same concurrency, its pool sized likewise (the
  physical limit of this machine for this target), before and after the engines, and the ratio
  engine/bare;
* a naive Prefect design (one task per record, `bench/naive.py`) on a smaller N, short profile;
* per-batch latency of `scan_page` and `drain_page` with the mirror at several sizes (PostgreSQL),
  with the query plans, and the peak Python memory of a chain at each size.

`--parts`, `--db` and `--settle` select what runs. Prints Markdown tables (`bench.report`) and
writes JSON (default `bench/results/latest.json`). Exits 1 when anything failed (a wrong count is a
failure); a target that is not met is reported, not a failure. See docs/performance.md for what the
numbers mean.
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
import functools
import json
import platform
import shutil
import sys
import tempfile
import time
import traceback
import tracemalloc
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path
from typing import Any

from bench import bare, mirror, naive, pg
from bench.cpu import CpuMeter
from bench.report import markdown
from bench.target import SandboxProcess
from bench.world import StatementCounter, apply, records, rule_entry, target_connection, use_database
from delivery import db
from delivery.domain import MirrorInput
from delivery.store import catalog
from delivery.store.mirror import load_records
from flows.deliver_rule import run_now

E2E_DATABASE = "delivery_bench"
MIRROR_DATABASE = "delivery_bench_mirror"
DEFAULT_JSON = Path("bench/results/latest.json")
TARGET_RATIO = 0.8
TARGET_RATIO_LONG = 0.9
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


PARTS = ("short", "long", "naive", "mirror")
SETTLES = ("grouped", "per_record")
DATABASES = ("sqlite", "postgresql")


def _choices(allowed: tuple[str, ...]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        values = [part.strip() for part in text.split(",") if part.strip()]
        wrong = [v for v in values if v not in allowed]
        if not values or wrong:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(allowed)}, got {text!r}")
        return [v for v in allowed if v in values]  # in the canonical order, once each

    return parse


@dataclass(frozen=True)
class Profile:
    """A target latency and the concurrencies the engine and the bare client are measured at."""

    name: str
    latency_ms: int
    concurrency: list[int]
    engines: bool
    naive: bool


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=None, help="records per end-to-end run (default 8000)")
    parser.add_argument("--naive-records", type=int, default=None, help="records for the naive design (default 500)")
    parser.add_argument(
        "--concurrency", type=_ints, default=[1, 8], help="short profile: writes in flight, a list (default 1,8)"
    )
    parser.add_argument("--latency-ms", type=int, default=2, help="short profile: the sandbox's latency (default 2)")
    parser.add_argument(
        "--long-concurrency", type=_ints, default=[32, 64], help="long profile: writes in flight (default 32,64)"
    )
    parser.add_argument(
        "--long-latency-ms", type=int, default=50, help="long profile: the sandbox's latency (default 50)"
    )
    parser.add_argument(
        "--parts",
        type=_choices(PARTS),
        default=list(PARTS),
        help="what to run, a list of short (the short-latency profile), long (the long-latency profile), "
        "naive (the naive design, at the short profile's concurrencies), mirror (default all)",
    )
    parser.add_argument(
        "--settle", type=_choices(SETTLES), default=list(SETTLES), help="settle modes (default grouped,per_record)"
    )
    parser.add_argument(
        "--db", type=_choices(DATABASES), default=list(DATABASES), help="databases (default sqlite,postgresql)"
    )
    parser.add_argument(
        "--mirror-sizes", type=_ints, default=None, help="mirror rows, a list (default 10000,100000,1000000)"
    )
    parser.add_argument("--batch-size", type=int, default=500, help="the rule's batch_size (default 500)")
    parser.add_argument(
        "--chain-records", type=int, default=None, help="records the memory chain delivers at each size (default 2000)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes (300 records, naive 50, mirror 2000,5000): for CI"
    )
    parser.add_argument(
        "--skip-postgres", action="store_true", help="SQLite only (= --db sqlite); no mirror-size section"
    )
    parser.add_argument(
        "--bare-client",
        choices=sorted(BARE_CLIENTS),
        default="threads",
        help="the bare client the engine is compared with: threads sharing an httpx.Client (the thread "
        "path's limit), asyncio tasks over httpx.AsyncClients split into pools of at most 2 connections "
        "as the engine's async verbs are (the async path's), or asyncio-one-pool, one AsyncClient holding "
        "every connection; default threads",
    )
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"where to write the results ({DEFAULT_JSON})")
    args = parser.parse_args(argv)
    quick = args.quick
    args.records = args.records or (300 if quick else 8_000)
    args.naive_records = args.naive_records or (50 if quick else 500)
    args.mirror_sizes = sorted(args.mirror_sizes or ([2_000, 5_000] if quick else [10_000, 100_000, 1_000_000]))
    args.chain_records = args.chain_records or (200 if quick else 2_000)
    if args.skip_postgres:
        args.db = ["sqlite"]
    if "postgresql" not in args.db and "mirror" in args.parts:
        args.parts = [part for part in args.parts if part != "mirror"]  # the mirror section is PostgreSQL's
    if not 1 <= args.batch_size <= 10_000:
        parser.error("--batch-size must be within 1..10000 (a rule's limit)")
    if any(c > 64 for c in [*args.concurrency, *args.long_concurrency]):
        parser.error("--concurrency and --long-concurrency values must be within 1..64 (a rule's limit)")
    if args.chain_records * 2 > min(args.mirror_sizes):
        parser.error("--chain-records must be at most half the smallest mirror size")
    args.profiles = [
        profile
        for profile in (
            Profile("short", args.latency_ms, args.concurrency, "short" in args.parts, "naive" in args.parts),
            Profile("long", args.long_latency_ms, args.long_concurrency, "long" in args.parts, False),
        )
        if profile.engines or profile.naive
    ]
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
    return {
        "records": n,
        "seconds": round(elapsed, 3),
        "records_per_s": _rate(n, elapsed),
        "cpu": cpu.result(n),
    }


#: The bare clients (`--bare-client`): threads sharing one `httpx.Client` (the thread path's
#: limit), tasks on one event loop over `httpx.AsyncClient`s split into pools as the engine's
#: async verbs are (the async path's), or the same tasks over one AsyncClient holding every connection.
BARE_CLIENTS: dict[str, Callable[..., float]] = {
    "threads": bare.post_all,
    "asyncio": bare.post_all_async,
    "asyncio-one-pool": functools.partial(bare.post_all_async, one_pool=True),
}


def run_bare(sandbox: SandboxProcess, n: int, concurrency: int, when: str, client: str = "threads") -> dict[str, Any]:
    collection = f"bare_{client}_l{sandbox.latency_ms}_c{concurrency}_{when}"
    return _run_client(sandbox, BARE_CLIENTS[client], "b", collection, n, concurrency)


def add_ratios(row: dict[str, Any], labels: list[str]) -> None:
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
    for label in [*labels, "naive"]:
        entry = row.get(label)
        if isinstance(entry, dict) and "records_per_s" in entry:
            entry["ratio"] = round(entry["records_per_s"] / mean, 3)
            log(f"{row['latency_ms']} ms c={row['concurrency']}: {label} / bare = {entry['ratio']:.2f}")


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
        from delivery.chain import Chain

        original_lock, original_batch = flow_module.__dict__["rule_lock"], Chain.run_batch
        timing = self

        @contextlib.asynccontextmanager
        async def timed_lock(chain: Chain, *args: Any, **kwargs: Any) -> AsyncIterator[None]:
            started = time.perf_counter()
            async with original_lock(chain, *args, **kwargs):
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


def target_name(sandbox: SandboxProcess, settle: str) -> str:
    """The connection to `sandbox` whose chains settle `settle`."""
    return f"sandbox-{sandbox.latency_ms}ms-{settle}"


def run_engine(
    label: str, url: str, sandbox: SandboxProcess, n: int, concurrency: int, batch: int, settle: str
) -> dict[str, Any]:
    engine = use_database(url)
    name = f"e2e-{label}-{settle}-l{sandbox.latency_ms}-c{concurrency}-b{batch}"
    collection = name.replace("-", "_")
    target = target_name(sandbox, settle)
    apply(
        engine,
        sandbox,
        "shop",
        [rule_entry(name, "shop", collection, batch, concurrency, target=target)],
        [target_connection(target, sandbox, settle)],
    )
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
    return _run_client(sandbox, naive.run, "n", f"naive_l{sandbox.latency_ms}_c{concurrency}", n, concurrency)


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
        mirror.check_record_digest(engine, source_id, n // 3 + 1)
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
    meta = results["meta"]
    for profile, goal in (("short", TARGET_RATIO), ("long", TARGET_RATIO_LONG)):
        rows = [row for row in results["throughput"] if row.get("profile") == profile]
        for settle in SETTLES:
            ratios = [
                (f"{label.split('/')[0]} c={row['concurrency']}", row[label]["ratio"])
                for row in rows
                for label in meta["engines"]
                if label.endswith("/" + settle) and isinstance(row.get(label), dict) and "ratio" in row[label]
            ]
            if ratios:
                latency = rows[0]["latency_ms"]
                targets.append(
                    {
                        "target": f"engine/bare >= {goal} at {latency} ms latency, settle {settle}",
                        "measured": ", ".join(f"{name}: {ratio:.2f}" for name, ratio in ratios),
                        "met": min(ratio for _, ratio in ratios) >= goal,
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
        "postgresql": pg.server_version() if "postgresql" in args.db else None,
        "records": args.records,
        "naive_records": args.naive_records,
        "concurrency": args.concurrency,
        "long_concurrency": args.long_concurrency,
        "long_latency_ms": args.long_latency_ms,
        "parts": args.parts,
        "engines": [f"{label}/{settle}" for label in args.db for settle in args.settle],
        "bare_client": args.bare_client,
        "mirror_sizes": args.mirror_sizes if "mirror" in args.parts else [],
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


def measure_profile(
    profile: Profile,
    sandbox: SandboxProcess,
    databases: dict[str, str],
    args: argparse.Namespace,
    failures: Failures,
    rows: list[dict[str, Any]],
) -> None:
    """At each of the profile's concurrencies: the bare client, the engine on each database in each
    settle mode, the naive design (if asked), the bare client again; then the ratios."""
    labels = [f"{label}/{settle}" for label in databases for settle in args.settle]
    for c in profile.concurrency:
        row: dict[str, Any] = {"profile": profile.name, "latency_ms": profile.latency_ms, "concurrency": c}
        rows.append(row)
        where = f"{profile.latency_ms} ms c={c}"
        # The bare client runs before the engine and again after it (a fifth of the records), and
        # the ratios are taken against the mean of the two, so that a machine whose speed drifts
        # (CPU steal on a VM) biases neither side.
        with failures.section(f"bare {where}"):
            row["bare_before"] = run_bare(sandbox, args.records, c, "before", args.bare_client)
            log(f"bare {where}: {row['bare_before']['records_per_s']:,.0f} records/s")
        if profile.engines:
            for label, url in databases.items():
                for settle in args.settle:
                    key = f"{label}/{settle}"
                    with failures.section(f"{key} {where}"):
                        row[key] = run_engine(label, url, sandbox, args.records, c, args.batch_size, settle)
                        log(f"{key} {where}: {row[key]['records_per_s']:,.0f} records/s")
                    if key not in row:
                        row[key] = {"error": True}
        if profile.naive:
            with failures.section(f"naive {where}"):
                row["naive"] = run_naive(sandbox, args.naive_records, c)
                log(f"naive {where}: {row['naive']['records_per_s']:,.0f} records/s")
            if "naive" not in row:
                row["naive"] = {"error": True}
        with failures.section(f"bare {where} (again)"):
            row["bare_after"] = run_bare(sandbox, max(args.records // 5, 50), c, "after", args.bare_client)
            log(f"bare {where} again: {row['bare_after']['records_per_s']:,.0f} records/s")
        add_ratios(row, labels)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    failures = Failures()
    results: dict[str, Any] = {
        "meta": metadata(args),
        "throughput": [],
        "empty_chain": {},
        "mirror": [],
        "targets": [],
        "errors": failures.items,
    }
    workdir = Path(tempfile.mkdtemp(prefix="delivery-bench-"))
    # A sandbox per latency, each in its own process; the short profile's also serves the mirror section.
    sandboxes = {
        latency: SandboxProcess(latency, workdir / f"sandbox-{latency}ms.log")
        for latency in dict.fromkeys([args.latency_ms, *(p.latency_ms for p in args.profiles)])
    }
    main_sandbox = sandboxes[args.latency_ms]
    databases: dict[str, str] = {}
    if "sqlite" in args.db:
        databases["sqlite"] = f"sqlite:///{workdir / 'bench.db'}"
    created_postgres = False
    try:
        with failures.section("sandbox"):
            for sandbox in sandboxes.values():
                sandbox.start()
                log(f"sandbox on {sandbox.api}, latency {sandbox.latency_ms} ms")
        if "postgresql" in args.db and not failures.items:
            with failures.section("postgresql database"):
                created_postgres = True
                databases["postgresql"] = pg.create_database(E2E_DATABASE)
        if failures.items:
            raise SystemExit(1)  # nothing can run without the target or the database asked for

        log("starting the Prefect API (test harness)")
        with _harness():
            log("Prefect API up")
            if any(profile.engines for profile in args.profiles):
                for label, url in databases.items():
                    with failures.section(f"{label}: setup"):
                        prepare_e2e_database(label, url, main_sandbox, args.records)
                        results["empty_chain"][label] = run_empty_chain(
                            label, url, main_sandbox, 1 if args.quick else 3
                        )
                        log(f"{label}: empty chain {results['empty_chain'][label]}")
            for profile in args.profiles:
                measure_profile(
                    profile, sandboxes[profile.latency_ms], databases, args, failures, results["throughput"]
                )
            if "mirror" in args.parts:
                db.dispose_engines()
                for n in args.mirror_sizes:
                    with failures.section(f"mirror {n}"):
                        results["mirror"].append(
                            run_mirror_size(n, main_sandbox, args.batch_size, args.chain_records, max(args.concurrency))
                        )
    except SystemExit:
        pass
    except BaseException as exc:  # Ctrl-C included: still clean up and write what we have
        failures.items.append({"section": "run", "error": f"{type(exc).__name__}: {exc}", "traceback": ""})
        log(f"FAILED: {type(exc).__name__}: {exc}")
    finally:
        for sandbox in sandboxes.values():
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
    sys.stdout.write(markdown(results))
    sys.stdout.write(f"\nJSON: {args.json}   total {results['meta']['seconds']} s\n")
    return 1 if failures.items else 0


if __name__ == "__main__":
    sys.exit(main())
