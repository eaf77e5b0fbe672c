"""Where a record's time goes inside the engine, and what a change would win: `python -m bench.profile`.

Runs chains of the real `delivery.chain.Chain` directly (open, scan batches until one comes back
empty, finish): no Prefect, no rule lock, so what is measured is the engine's per-record path,
against the same sandbox target (own process, fixed latency) as `bench.run`.

Every record's wall time is split into buckets by wrapping the functions on its path (the
outermost wrapped call owns the time, so the buckets do not overlap): the HTTP round trip, the
breaker's storage (its own transactions included), the fence check, the settle, the heartbeat,
the pool checkout (and its pre-ping), BEGIN, COMMIT, the release to the pool, the page queries;
what is left is Python in the engine, pybreaker and SQLAlchemy. With concurrency > 1 the buckets
are summed over the worker threads, so they add up to more than the wall time.

`--variant` runs what-if experiments: each one monkeypatches one piece of the engine *in this
process only* to estimate what a source change would win. They are measurements for a decision,
not proposals to ship as they are (see docs/performance.md for which keep the semantics):

  baseline              the engine as it is
  memory-breaker        pybreaker's in-process storage (an upper bound: the breaker costs nothing;
                        it would no longer be shared between processes)
  no-pre-ping           PostgreSQL pool without pool_pre_ping
  no-history            no record history (`delivery attempts`): the writer keeps no request and the
                        settle writes no `delivery_attempts` row; baseline against it is the
                        history's cost, measured in one run (list both, several times, to alternate)
  no-history-rows       the writer keeps its requests, the settle writes no row (splits the cost
                        of no-history between the writer's side and the database's)
  no-record-db          ceiling, not a design: memory-breaker, and no fence check, ledger write or
                        heartbeat per record (no database work per record at all)
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import json
import pstats
import shutil
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pybreaker
import sqlalchemy as sa
from rich.console import Console
from rich.table import Table

import delivery.breaker as breaker_module
from bench import pg
from bench.target import SandboxProcess
from bench.world import StatementCounter, apply, records, rule_entry, target_connection
from delivery import attempts, db
from delivery.chain import Chain
from delivery.domain import MirrorInput, Phase
from delivery.step import RecordStep
from delivery.store import attempts as attempts_store
from delivery.store import breaker, chains, ledger
from delivery.store.mirror import load_records
from delivery.writers import rest as rest_module

PROFILE_DATABASE = "delivery_bench_profile"
VARIANTS = (
    "baseline",
    "memory-breaker",
    "no-pre-ping",
    "no-record-db",
    "no-history",
    "no-history-rows",
)

# -------------------------------------------------------------------------------- the buckets

BUCKET_LABELS = {
    "http round trip": "HTTP",
    "breaker storage": "breaker",
    "fence check": "fence",
    "settle": "settle",
    "heartbeat": "heartbeat",
    "pool checkout": "checkout",
    "BEGIN": "BEGIN",
    "COMMIT": "COMMIT",
    "release to pool": "release",
    "page query": "page",
    "cursor": "cursor",
    "rest": "rest (Python)",
}
BUCKET_ORDER = list(BUCKET_LABELS)


class Buckets:
    """Wall time per bucket, owned by the outermost wrapped call of each thread."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, attr: str, bucket: str) -> None:
        original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        function: Callable[..., Any] = original.fget if isinstance(original, property) else original  # type: ignore[assignment]

        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._local, "inside", False):
                return function(*args, **kwargs)
            self._local.inside = True
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - started
                self._local.inside = False
                with self._lock:
                    self.seconds[bucket] += elapsed
                    self.calls[bucket] += 1

        replacement = property(timed, original.fset) if isinstance(original, property) else timed
        setattr(owner, attr, replacement)
        self._undo.append((owner, attr, original))

    def undo(self) -> None:
        for owner, attr, original in reversed(self._undo):
            setattr(owner, attr, original)
        self._undo.clear()


def instrument(buckets: Buckets) -> None:
    buckets.wrap(httpx.Client, "send", "http round trip")
    for attr in ("_get", "_set", "reset_counter", "_ensure_row"):
        buckets.wrap(breaker.DatabaseBreakerStorage, attr, "breaker storage")
    buckets.wrap(chains, "holds_fence_for_settle", "fence check")
    buckets.wrap(chains, "holds_fence", "fence check")
    buckets.wrap(chains, "claim", "fence check")
    buckets.wrap(ledger, "settle", "settle")
    buckets.wrap(chains, "heartbeat", "heartbeat")
    buckets.wrap(ledger, "scan_page", "page query")
    buckets.wrap(chains, "move_cursor", "cursor")
    buckets.wrap(sa.engine.Engine, "raw_connection", "pool checkout")
    buckets.wrap(sa.engine.Connection, "_begin_impl", "BEGIN")
    buckets.wrap(sa.engine.Connection, "_commit_impl", "COMMIT")
    buckets.wrap(sa.engine.Connection, "close", "release to pool")


class HistoryClock:
    """The CPU the record's history takes (its own code, every thread): the writer telling what it
    sent and heard, the step listening around each call and carrying what it heard on the outcome,
    the settle writing their rows. Counted apart from the buckets (it runs inside some of them),
    with each thread's CPU clock, so that its share of the run's CPU is measured in the same run:
    records/s on this machine drifts by more than the history costs (docs/performance.md)."""

    PIECES = (
        (rest_module._RestWriter, "_tell"),
        (RecordStep, "listening"),
        (attempts.Listening, "__enter__"),
        (attempts.Listening, "__exit__"),
        (RecordStep, "with_tried"),
        (attempts_store, "write"),
        # PostgreSQL writes a per_record settle's request in the ledger's own statement: its
        # parameters are counted here, the statement's added work only by --variant no-history.
        (attempts_store, "parameters_after"),
    )

    def __init__(self, overhead: float | None = None) -> None:
        #: CPU seconds per piece (its function's name), less the clock's own cost; the pieces do
        #: not call each other.
        self.raw: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()
        self._undo: list[tuple[Any, str, Any]] = []
        #: What reading the clock around a call adds to the call's count (about one thread_time()
        #: call, 0.5 µs here): measured on an empty function, taken off every call counted. The
        #: small pieces are called several times a record, where it would add up to 5 µs.
        self.overhead = self._clock_cost() if overhead is None else overhead

    @staticmethod
    def _clock_cost(calls: int = 20_000) -> float:
        probe = HistoryClock(overhead=0.0)
        timed = probe._timed(lambda: None, "empty")
        for _ in range(calls):
            timed()
        return probe.raw["empty"] / calls

    @property
    def pieces(self) -> dict[str, float]:
        return {name: max(0.0, seconds - self.calls[name] * self.overhead) for name, seconds in self.raw.items()}

    @property
    def seconds(self) -> float:
        return sum(self.pieces.values())

    def _timed(self, function: Callable[..., Any], name: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                elapsed = time.thread_time() - started
                with self._lock:
                    self.raw[name] += elapsed
                    self.calls[name] += 1

        return timed

    def wrap_all(self) -> None:
        for owner, attr in self.PIECES:
            original = owner.__dict__[attr]
            function = original.__func__ if isinstance(original, staticmethod) else original
            timed = self._timed(function, attr)
            setattr(owner, attr, staticmethod(timed) if isinstance(original, staticmethod) else timed)
            self._undo.append((owner, attr, original))

    def undo(self) -> None:
        for owner, attr, original in reversed(self._undo):
            setattr(owner, attr, original)
        self._undo.clear()


# ------------------------------------------------------------------------------- the variants


class MemoryBreakerStorage(pybreaker.CircuitMemoryStorage):
    """pybreaker's in-process storage, built the way the engine builds the database one."""

    def __init__(self, _engine: sa.Engine, _connection_id: int) -> None:
        super().__init__(pybreaker.STATE_CLOSED)

    def observe(self, _conn: sa.Connection, _row: Any) -> None:
        """Nothing to refresh: the state is in this process."""


@contextlib.contextmanager
def variant(name: str) -> Iterator[dict[str, Any]]:
    """Patch the engine for `name`; yields options for the engine the chain gets."""
    undo: list[Callable[[], None]] = []
    options: dict[str, Any] = {"pre_ping": True}
    parts = {"no-record-db": {"no-settle", "memory-breaker"}}.get(name, {name})
    if "memory-breaker" in parts:
        setattr(breaker_module, "DatabaseBreakerStorage", MemoryBreakerStorage)  # noqa: B010
        undo.append(lambda: setattr(breaker_module, "DatabaseBreakerStorage", breaker.DatabaseBreakerStorage))
    if "no-pre-ping" in parts:
        options["pre_ping"] = False
    if "no-history" in parts or "no-history-rows" in parts:
        kept = (rest_module._RestWriter._tell, attempts_store.write, attempts_store.one_statement)
        if "no-history" in parts:
            setattr(rest_module._RestWriter, "_tell", lambda *_: None)  # noqa: B010
        setattr(attempts_store, "write", lambda *_: None)  # noqa: B010
        # Nor with the ledger's row, in one statement (PostgreSQL's per_record settle).
        setattr(attempts_store, "one_statement", lambda *_: False)  # noqa: B010

        def keep_history() -> None:
            rest_module._RestWriter._tell, attempts_store.write, attempts_store.one_statement = kept  # type: ignore[method-assign]

        undo.append(keep_history)
    if "no-settle" in parts:
        saved = (chains.holds_fence_for_settle, ledger.settle, chains.heartbeat)

        def skip(*_: Any) -> None:
            return None

        setattr(chains, "holds_fence_for_settle", lambda *_: (True, None))  # noqa: B010
        setattr(ledger, "settle", lambda *_: True)  # noqa: B010  (True: "settled", as a real one says)
        setattr(chains, "heartbeat", skip)  # noqa: B010

        def restore() -> None:
            chains.holds_fence_for_settle, ledger.settle, chains.heartbeat = saved

        undo.append(restore)
    try:
        yield options
    finally:
        for step in reversed(undo):
            step()


# ---------------------------------------------------------------------------------- one chain


def make_engine(url: str, pre_ping: bool) -> sa.Engine:
    engine = db.create_engine(url)
    if url.startswith("postgresql") and not pre_ping:
        engine.dispose()
        engine = sa.create_engine(url, pool_pre_ping=False, **db.POOL_OPTIONS)
    return engine


def prepare(url: str, sandbox: SandboxProcess, n: int) -> None:
    engine = db.create_engine(url)
    try:
        db.upgrade(engine)
        apply(engine, sandbox, "shop", [])
        with engine.begin() as conn:
            load_records(conn, "shop", "contact", (MirrorInput(e, p) for e, p in records("p", n)))
    finally:
        engine.dispose()


def run_chain(
    url: str,
    sandbox: SandboxProcess,
    name: str,
    n: int,
    concurrency: int,
    batch: int,
    pre_ping: bool,
    profile: bool,
    settle: str = "grouped",
) -> dict[str, Any]:
    engine = make_engine(url, pre_ping)
    try:
        target = f"sandbox-{settle}"
        apply(
            engine,
            sandbox,
            "shop",
            [rule_entry(name, "shop", name.replace("-", "_"), batch, concurrency, target=target)],
            [target_connection(target, sandbox, settle)],
        )
        buckets = Buckets()
        instrument(buckets)
        history = HistoryClock()
        history.wrap_all()
        counter = StatementCounter(engine)
        profiler = cProfile.Profile() if profile else None
        cpu_started, started = time.process_time(), time.perf_counter()
        try:
            if profiler:
                profiler.enable()
            chain = Chain(engine, name)
            if chain.open() is not None:
                raise RuntimeError(f"chain of {name} did not open: {chain.report.message}")
            while chain.run_batch(Phase.SCAN).attempted:
                pass
            report = chain.finish()
        finally:
            if profiler:
                profiler.disable()
            elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
            buckets.undo()
            history.undo()
            counter.stop()
        if report.counts.get("delivered") != n:
            raise RuntimeError(f"chain of {name} delivered {report.counts.get('delivered')} of {n}")
        result: dict[str, Any] = {
            "records_per_s": round(n / elapsed, 1),
            "ms_per_record": round(1000 * elapsed / n, 3),
            "cpu_ms_per_record": round(1000 * cpu / n, 3),
            "history_cpu_ms_per_record": round(1000 * history.seconds / n, 4),
            "history_share_of_cpu": round(history.seconds / cpu, 4),
            "history_cpu_us_per_record_by_piece": {k: round(1e6 * v / n, 1) for k, v in history.pieces.items()},
            "statements_per_record": round(counter.statements / n, 2),
            "commits_per_record": round(counter.commits / n, 2),
            "buckets_ms_per_record": {k: round(1000 * v / n, 3) for k, v in sorted(buckets.seconds.items())},
        }
        if concurrency == 1:
            result["buckets_ms_per_record"]["rest"] = round(1000 * (elapsed - sum(buckets.seconds.values())) / n, 3)
        if profiler:
            stream = _Capture()
            stats = pstats.Stats(profiler, stream=stream)  # type: ignore[arg-type]
            stats.sort_stats("tottime").print_stats(25)
            result["profile_tottime"] = stream.text
        return result
    finally:
        engine.dispose()


class _Capture:
    def __init__(self) -> None:
        self.text = ""

    def write(self, text: str) -> int:
        self.text += text
        return len(text)


# --------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", choices=("sqlite", "postgresql"), action="append", help="default: both")
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, action="append", help="default: 1 and 8")
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--latency-ms", type=int, default=2)
    parser.add_argument("--variant", choices=VARIANTS, action="append", help="default: baseline")
    parser.add_argument(
        "--settle",
        choices=("grouped", "per_record"),
        action="append",
        help="the target's settle mode (default grouped)",
    )
    parser.add_argument("--cprofile", action="store_true", help="also print cProfile's top functions (tottime)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    databases = args.db or ["sqlite", "postgresql"]
    concurrencies = args.concurrency or [1, 8]
    variants = args.variant or ["baseline"]
    settles = args.settle or ["grouped"]

    console = Console(width=None if sys.stdout.isatty() else 160)
    workdir = Path(tempfile.mkdtemp(prefix="delivery-profile-"))
    sandbox = SandboxProcess(args.latency_ms, workdir / "sandbox.log")
    rows: list[dict[str, Any]] = []
    failed = False
    try:
        sandbox.start()
        run = 0
        for label in databases:
            for name in variants:
                for settle in settles:
                    for c in concurrencies:
                        run += 1  # a fresh database and rule name every run (a variant may be listed twice)
                        url = (
                            pg.create_database(PROFILE_DATABASE)
                            if label == "postgresql"
                            else f"sqlite:///{workdir / f'run-{run}.db'}"
                        )
                        prepare(url, sandbox, args.records)
                        with variant(name) as options:
                            rule = f"profile-{run}-{label}-{name}-{settle}-c{c}"
                            try:
                                result = run_chain(
                                    url,
                                    sandbox,
                                    rule,
                                    args.records,
                                    c,
                                    args.batch_size,
                                    options["pre_ping"],
                                    args.cprofile,
                                    settle,
                                )
                            except Exception as exc:
                                failed = True
                                console.print(f"[red]FAILED[/red] {rule}: {exc}")
                                continue
                            finally:
                                if label == "postgresql":
                                    pg.drop_database(PROFILE_DATABASE)
                        rows.append({"db": label, "variant": name, "settle": settle, "concurrency": c, **result})
                        console.print(
                            f"{label} {name} {settle} c={c}: {result['records_per_s']:,.0f} records/s, "
                            f"{result['ms_per_record']:.2f} ms/record, "
                            f"CPU {result['cpu_ms_per_record']:.2f} ms/record, "
                            f"of which the history {1000 * result['history_cpu_ms_per_record']:.0f} µs "
                            f"({100 * result['history_share_of_cpu']:.1f}%: "
                            + ", ".join(f"{k} {v:.0f}" for k, v in result["history_cpu_us_per_record_by_piece"].items())
                            + ")"
                        )
                        if "profile_tottime" in result:
                            console.print(result["profile_tottime"], markup=False, highlight=False)
    finally:
        sandbox.stop()
        if "postgresql" in databases:
            pg.drop_database(PROFILE_DATABASE)
        shutil.rmtree(workdir, ignore_errors=True)

    table = Table(title=f"Engine per-record path ({args.records} creates, latency {args.latency_ms} ms, no Prefect)")
    for column in (
        "db",
        "variant",
        "settle",
        "c",
        "records/s",
        "ms/record",
        "CPU ms/record",
        "SQL/record",
        "commits/record",
    ):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            row["db"],
            row["variant"],
            row["settle"],
            str(row["concurrency"]),
            f"{row['records_per_s']:,.0f}",
            f"{row['ms_per_record']:.2f}",
            f"{row['cpu_ms_per_record']:.2f}",
            f"{row['statements_per_record']:.2f}",
            f"{row['commits_per_record']:.2f}",
        )
    console.print(table)
    names = [name for name in BUCKET_ORDER if any(name in row["buckets_ms_per_record"] for row in rows)]
    split = Table(title="Where the time goes, ms per record (summed over the threads when c > 1)")
    for column in ("run", *(BUCKET_LABELS[name] for name in names)):
        split.add_column(column, justify="right")
    for row in rows:
        split.add_row(
            f"{row['db']} {row['variant']} {row['settle']} c={row['concurrency']}",
            *(f"{row['buckets_ms_per_record'].get(name, 0):.2f}" for name in names),
        )
    console.print(split)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({"records": args.records, "latency_ms": args.latency_ms, "runs": rows}, indent=2)
        )
        console.print(f"JSON: {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
