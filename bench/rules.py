"""Many rules per tick on the production path (issue #12): `python -m bench.rules` from the
repository root; `--quick` for a CI-sized run, `--json PATH` for the results.

The stack is README "Deploying", every part a process of its own: a real `prefect server start`
(its own PREFECT_HOME in a temp dir, on a PostgreSQL database of the bench's own unless
`--prefect-sqlite`), the `delivery` process work pool, the `deliver-rule` deployment made by
`prefect deploy` from the repository's prefect.yaml, the workers — `delivery worker --pool delivery
--limit N` (warm: the chains run in one long-lived process; the default) or, with `--process-worker`,
`prefect worker start --pool delivery --limit N` (a process per chain, the isolation option) — the
delivery database on PostgreSQL (a fresh database of the bench's own for every
measurement), and the sandbox target (`delivery sandbox`, fixed latency) in its own process. The
tick is `flows.tick.run_tick` in this process (it creates its `delivery-tick` flow run on the
server and starts chains as runs of the deployment, as the scheduled tick does); the
`delivery-tick` deployment is not made, so no scheduled tick runs in the middle of a measurement.

1. Per R (10, 100, 500 enabled rules; `--rules`): 90 % idle (caught up: their records' ledger rows
   settled at the records' change signals, inside the overlap window behind the cursor, so the
   tick's "anything to do?" check has rows to look at), 10 % busy with `--changes` (100) changes
   each, each busy rule to its own collection. One worker. Tick 1: wall time from the tick's start
   until every busy rule's chain has ended, CPU of the tick (this process), of the worker's
   process tree (its flow-run processes included) and of the Prefect server, flow runs created.
   Tick 2, everything caught up: the tick's CPU per rule (what an idle rule costs), flow runs
   created (none expected).
2. Two workers: `--tp-rules` busy rules with `--tp-records` changes each, concurrency 1 (so each
   chain is bound by the target's latency, `--latency-ms` 50, rather than by its process start),
   one tick, with one worker and then with two, each `--limit` `--tp-limit`: records/s from the
   tick's start until every chain ended.

Prints a markdown table to stdout (progress to stderr) and writes JSON (default
bench/results/rules.json). Exits 1 when a measurement went wrong (a wrong count, a chain that did
not catch up); a goal not met is reported, not a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
import yaml

from bench import mirror, pg
from bench.stack import PrefectStack, tree_cpu_seconds
from bench.target import SandboxProcess
from bench.world import records, use_database
from delivery import db
from delivery.apply import apply_config
from delivery.config import parse_config
from delivery.domain import MirrorInput
from delivery.store.mirror import load_records

RULES_DATABASE = "delivery_bench_rules"
PREFECT_DATABASE = "delivery_bench_rules_prefect"
DEFAULT_JSON = Path("bench/results/rules.json")
#: The issue's goals on this 2-core machine.
GOAL_CATCH_UP_SECONDS = 300.0
GOAL_IDLE_CPU_MS = 20.0
GOAL_TWO_WORKER_RATIO = 1.8
#: Issue #17: CPU per busy chain, the worker's and the Prefect server's.
GOAL_WORKER_CPU_PER_CHAIN_S = 0.3
GOAL_SERVER_CPU_PER_CHAIN_S = 0.5

_t0 = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _t0:7.1f}s] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.rules", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CI-sized: R=10, 2 rules x 100 records for two workers")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"results file (default {DEFAULT_JSON})")
    parser.add_argument("--rules", type=str, default="10,100,500", help="enabled rules per measurement (R)")
    parser.add_argument("--busy-share", type=float, default=0.1, help="share of busy rules (default 0.1)")
    parser.add_argument("--changes", type=int, default=100, help="changes per busy rule (default 100)")
    parser.add_argument("--idle-records", type=int, default=20, help="settled records per idle rule (default 20)")
    parser.add_argument("--limit", type=int, default=4, help="the worker's --limit for the R runs (default 4)")
    parser.add_argument("--latency-ms", type=int, default=50, help="the sandbox's latency (default 50)")
    parser.add_argument("--tp-rules", type=int, default=8, help="busy rules for the two-worker figure (default 8)")
    parser.add_argument("--tp-records", type=int, default=1000, help="changes per rule there (default 1000)")
    parser.add_argument("--tp-limit", type=int, default=2, help="each worker's --limit there (default 2)")
    parser.add_argument(
        "--query-seconds",
        type=float,
        default=None,
        help="the workers' poll interval (default the worker's: 5 s warm, Prefect's 10 s process; --quick 2)",
    )
    parser.add_argument(
        "--process-worker",
        action="store_true",
        help="measure `prefect worker start` (a process per chain) instead of the warm `delivery worker`",
    )
    parser.add_argument("--no-two-workers", action="store_true", help="skip the two-worker figure")
    parser.add_argument("--prefect-sqlite", action="store_true", help="the Prefect server on SQLite, not PostgreSQL")
    parser.add_argument("--timeout", type=float, default=1800.0, help="give up on a tick after this many seconds")
    args = parser.parse_args(argv)
    if args.quick:
        args.rules, args.tp_rules, args.tp_records, args.tp_limit = "10", 2, 100, 1
        args.query_seconds = args.query_seconds or 2.0
    args.rule_counts = [int(v) for v in args.rules.split(",") if v.strip()]
    return args


# -- the delivery side ---------------------------------------------------------------------------


def fresh_database() -> sa.Engine:
    db.dispose_engines()
    return use_database(pg.create_database(RULES_DATABASE))


def _rule(name: str, source: str, collection: str, batch: int = 100) -> dict[str, Any]:
    return {
        "name": name,
        "source": source,
        "domain": mirror.DOMAIN,
        "target": "sandbox",
        "collection": collection,
        "batch_size": batch,
        "concurrency": 1,
        "overlap_seconds": 300,
    }


def set_up(
    engine: sa.Engine,
    sandbox: SandboxProcess,
    busy: list[str],
    idle: list[str],
    changes: int,
    idle_records: int,
    tag: str,
) -> None:
    """Busy rules read `shop-busy` (`changes` records, none delivered yet), each to its own
    collection; idle rules read `shop-idle` and have settled every record of it already."""
    rules = [_rule(name, "shop-busy", f"{tag}_{name}") for name in busy]
    rules += [_rule(name, "shop-idle", f"{tag}_{name}") for name in idle]
    config = {
        "connections": [
            {"name": "sandbox", "driver": "rest", "base_url": sandbox.api, "timeout_seconds": 10},
            {"name": "shop-busy"},
            {"name": "shop-idle"},
        ],
        "rules": rules,
    }
    with engine.begin() as conn:
        apply_config(conn, parse_config(yaml.safe_dump(config), "bench config"))
        load_records(conn, "shop-busy", mirror.DOMAIN, (MirrorInput(e, p) for e, p in records("b", changes)))
        load_records(conn, "shop-idle", mirror.DOMAIN, (MirrorInput(e, p) for e, p in records("i", idle_records)))
    if not idle:
        return
    # Caught up, as a chain leaves it: delivered at each record's change signal, the cursor at the
    # last record. Written in SQL: a chain per idle rule would cost minutes before the measurement.
    now = datetime.now(UTC).replace(tzinfo=None)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO ledger (rule_id, record_id, status, remote_id, attempts, settled_changed_at, "
                "fingerprint, create_generation, version, created_at, updated_at) "
                "SELECT r.id, m.id, 'delivered', 'remote-' || m.id, 1, m.changed_at, md5(m.content_hash), 0, 0, "
                ":now, :now FROM rules r JOIN mirror_records m ON m.source_id = r.source_id AND m.domain = r.domain "
                "WHERE r.name = ANY(:names)"
            ),
            {"now": now, "names": idle},
        )
        last = conn.execute(
            sa.text(
                "SELECT m.changed_at, m.id FROM mirror_records m JOIN connections c ON c.id = m.source_id "
                "WHERE c.name = 'shop-idle' ORDER BY m.changed_at DESC, m.id DESC LIMIT 1"
            )
        ).one()
        conn.execute(
            sa.text("UPDATE rules SET cursor_changed_at = :at, cursor_record_id = :id WHERE name = ANY(:names)"),
            {"at": last.changed_at, "id": last.id, "names": idle},
        )


def wait_caught_up(engine: sa.Engine, tokens: list[str], timeout: float) -> dict[str, int]:
    """Until every chain in `tokens` has ended; how they ended."""
    deadline = time.monotonic() + timeout
    while True:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT ended_by FROM chains WHERE token = ANY(:tokens)"), {"tokens": tokens}
            ).all()
        if all(row.ended_by is not None for row in rows):
            ended: dict[str, int] = {}
            for row in rows:
                ended[row.ended_by] = ended.get(row.ended_by, 0) + 1
            return ended
        if time.monotonic() > deadline:
            raise RuntimeError(f"{sum(r.ended_by is None for r in rows)} chain(s) still running after {timeout:.0f} s")
        time.sleep(0.25)


def wait_runs_done(stack: PrefectStack, timeout: float = 120.0) -> None:
    """Until no deliver-rule run is left that is not final and no worker has a flow-run process
    left: the CPU of a run is read once its process has exited (and been waited for)."""
    deadline = time.monotonic() + timeout
    final = ["COMPLETED", "FAILED", "CANCELLED", "CRASHED"]
    while time.monotonic() < deadline:
        open_runs = stack.post(
            "/flow_runs/count",
            {"flows": {"name": {"any_": ["deliver-rule"]}}, "flow_runs": {"state": {"type": {"not_any_": final}}}},
        )
        live = any(_has_children(worker.pid) for worker in stack.workers.values())
        if open_runs == 0 and not live:
            return
        time.sleep(0.5)
    log("warning: deliver-rule runs or their processes still alive; CPU figures may be short")


def _has_children(pid: int) -> bool:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                return True
    return False


def check_delivered(sandbox: SandboxProcess, collections: list[str], expected: int) -> None:
    stats = sandbox.stats()["collections"]
    wrong = {
        c: stats.get(c, {}).get("creates", 0) for c in collections if stats.get(c, {}).get("creates", 0) != expected
    }
    if wrong:
        raise RuntimeError(f"expected {expected} creates per busy collection, got {dict(list(wrong.items())[:5])}")


def workers_cpu(stack: PrefectStack) -> float:
    return sum(tree_cpu_seconds(worker.pid) for worker in stack.workers.values())


def one_tick(stack: PrefectStack, engine: sa.Engine, timeout: float) -> dict[str, Any]:
    """One tick and the chains it started, measured from the tick's start until they all ended."""
    from flows.tick import run_tick

    assert stack.server is not None
    runs_before, worker_before, server_before = (
        stack.count_flow_runs(),
        workers_cpu(stack),
        tree_cpu_seconds(stack.server.pid),
    )
    started_at, cpu_before = time.perf_counter(), time.process_time()
    tick = run_tick()
    tick_cpu, tick_wall = time.process_time() - cpu_before, time.perf_counter() - started_at
    if tick["state"] != "COMPLETED":
        raise RuntimeError(f"tick {tick['state']}: {tick['message']}")
    tokens = [row["chain_token"] for row in tick["rules"] if row["action"] == "started"]
    ended = wait_caught_up(engine, tokens, timeout)
    wall = time.perf_counter() - started_at
    wait_runs_done(stack)
    return {
        "started": tick["started"],
        "idle": tick["idle"],
        "chains_ended_by": ended,
        "tick_wall_s": round(tick_wall, 2),
        "tick_cpu_s": round(tick_cpu, 3),
        "caught_up_wall_s": round(wall, 1),
        "worker_cpu_s": round(workers_cpu(stack) - worker_before, 2),
        "server_cpu_s": round(tree_cpu_seconds(stack.server.pid) - server_before, 2),
        "flow_runs_created": stack.count_flow_runs() - runs_before,
    }


def plan_cpu_ms_per_rule(engine: sa.Engine, rules: int, repeat: int = 3) -> float:
    """The tick's decision alone (`plan_tick`, the "anything to do?" check included), per rule."""
    from delivery.clock import utcnow
    from delivery.liveness import dead_chain_after
    from delivery.tick import plan_tick

    before = time.process_time()
    for _ in range(repeat):
        with engine.connect() as conn:
            plan_tick(conn, utcnow(), dead_chain_after())
    return round(1000 * (time.process_time() - before) / repeat / max(rules, 1), 3)


def run_rules(stack: PrefectStack, sandbox: SandboxProcess, r: int, args: argparse.Namespace) -> dict[str, Any]:
    busy_n = max(1, round(r * args.busy_share))
    busy = [f"busy-{i:03d}" for i in range(busy_n)]
    idle = [f"idle-{i:03d}" for i in range(r - busy_n)]
    tag = f"r{r}"
    engine = fresh_database()
    set_up(engine, sandbox, busy, idle, args.changes, args.idle_records, tag)
    log(f"R={r}: {len(busy)} busy x {args.changes} changes, {len(idle)} idle; tick 1")
    first = one_tick(stack, engine, args.timeout)
    if first["started"] != len(busy) or first["idle"] != len(idle) or first["flow_runs_created"] != len(busy):
        raise RuntimeError(f"R={r}: tick 1 started {first['started']}, idle {first['idle']}: {first}")
    if first["chains_ended_by"] != {"caught_up": len(busy)}:
        raise RuntimeError(f"R={r}: chains ended {first['chains_ended_by']}")
    check_delivered(sandbox, [f"{tag}_{name}" for name in busy], args.changes)
    log(f"R={r}: caught up in {first['caught_up_wall_s']} s; tick 2 (all idle)")
    second = one_tick(stack, engine, args.timeout)
    if second["started"] != 0 or second["idle"] != r or second["flow_runs_created"] != 0:
        raise RuntimeError(f"R={r}: tick 2 started {second['started']}, idle {second['idle']}")
    return {
        "rules": r,
        "busy": len(busy),
        "idle": len(idle),
        "changes_per_busy_rule": args.changes,
        "worker_limit": args.limit,
        "tick_with_work": first,
        "tick_all_idle": second,
        "cpu_s_per_busy_rule": round(first["worker_cpu_s"] / len(busy), 3),
        "server_cpu_s_per_busy_rule": round(first["server_cpu_s"] / len(busy), 3),
        "cpu_ms_per_idle_rule": round(1000 * second["tick_cpu_s"] / r, 2),
        "plan_cpu_ms_per_rule": plan_cpu_ms_per_rule(engine, r),
    }


def start_worker(stack: PrefectStack, name: str, limit: int, args: argparse.Namespace, database_url: str) -> None:
    # The worker is given the database's URL; each measurement recreates the database.
    env = {"DELIVERY_DATABASE_URL": database_url}
    stack.start_worker(name, limit, env, warm=not args.process_worker, poll_seconds=args.query_seconds)


def run_throughput(
    stack: PrefectStack, sandbox: SandboxProcess, workers: int, args: argparse.Namespace
) -> dict[str, Any]:
    rules = [f"tp-{i:03d}" for i in range(args.tp_rules)]
    tag = f"tp{workers}"
    engine = fresh_database()
    set_up(engine, sandbox, rules, [], args.tp_records, 0, tag)
    for i in range(workers):
        start_worker(stack, f"bench-worker-{i + 1}", args.tp_limit, args, os.environ[db.DATABASE_URL_ENV])
    try:
        log(f"two-worker figure: {workers} worker(s), {len(rules)} rules x {args.tp_records} records")
        tick = one_tick(stack, engine, args.timeout)
    finally:
        stack.stop_workers()
    if tick["chains_ended_by"] != {"caught_up": len(rules)}:
        raise RuntimeError(f"{workers} worker(s): chains ended {tick['chains_ended_by']}")
    check_delivered(sandbox, [f"{tag}_{name}" for name in rules], args.tp_records)
    total = len(rules) * args.tp_records
    return {
        "workers": workers,
        "worker_limit": args.tp_limit,
        "rules": len(rules),
        "records": total,
        "wall_s": tick["caught_up_wall_s"],
        "records_per_s": round(total / tick["caught_up_wall_s"], 1),
        "tick": tick,
    }


# -- report ----------------------------------------------------------------------------------------


def render(results: dict[str, Any]) -> str:
    meta = results["meta"]
    lines = [
        f"Prefect {meta['prefect']} server on {meta['prefect_database']}, delivery database PostgreSQL "
        f"{meta['postgres']}; {meta['cpus']} CPUs; sandbox latency {meta['latency_ms']} ms; one "
        f"{meta['worker']} worker, --limit {meta['limit']}; worker query interval {meta['worker_query_seconds']} s.",
        "",
        "| R | busy | idle | tick 1: caught up (s) | flow runs | tick 1 CPU (s) | worker tree CPU (s) "
        "| CPU per busy rule (s) | server CPU per busy rule (s) | tick 2 (all idle) CPU (s) | flow runs "
        "| CPU per idle rule (ms) | plan per rule (ms) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in results["rules"]:
        first, second = row["tick_with_work"], row["tick_all_idle"]
        lines.append(
            f"| {row['rules']} | {row['busy']} | {row['idle']} | {first['caught_up_wall_s']} | "
            f"{first['flow_runs_created']} | {first['tick_cpu_s']} | {first['worker_cpu_s']} | "
            f"{row['cpu_s_per_busy_rule']} | {row['server_cpu_s_per_busy_rule']} | {second['tick_cpu_s']} | "
            f"{second['flow_runs_created']} | "
            f"{row['cpu_ms_per_idle_rule']} | {row['plan_cpu_ms_per_rule']} |"
        )
    if results.get("idle_cpu_ms_marginal") is not None:
        lines.append(f"\nOne more idle rule adds {results['idle_cpu_ms_marginal']} ms of tick CPU (slope over R).")
    if results.get("two_workers"):
        lines += [
            "",
            "| workers | --limit each | rules x records | wall (s) | records/s | worker tree CPU (s) |",
            "| ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for row in results["two_workers"]:
            lines.append(
                f"| {row['workers']} | {row['worker_limit']} | {row['rules']} x {row['records'] // row['rules']} | "
                f"{row['wall_s']} | {row['records_per_s']} | {row['tick']['worker_cpu_s']} |"
            )
        lines.append(f"\nTwo workers / one worker: {results['two_worker_ratio']}x")
    lines += ["", "Goals:"]
    lines += [
        f"- {goal['goal']}: {goal['measured']} ({'met' if goal['met'] else 'NOT met'})" for goal in results["goals"]
    ]
    return "\n".join(lines)


def evaluate(results: dict[str, Any]) -> list[dict[str, Any]]:
    goals: list[dict[str, Any]] = []
    for row in results["rules"]:
        wall = row["tick_with_work"]["caught_up_wall_s"]
        goals.append(
            {
                "goal": f"R={row['rules']}: every busy rule caught up within {GOAL_CATCH_UP_SECONDS:.0f} s",
                "measured": f"{wall} s",
                "met": wall <= GOAL_CATCH_UP_SECONDS,
            }
        )
        goals.append(
            {
                "goal": f"R={row['rules']}: an idle rule costs <= {GOAL_IDLE_CPU_MS:.0f} ms CPU per tick",
                "measured": f"{row['cpu_ms_per_idle_rule']} ms",
                "met": row["cpu_ms_per_idle_rule"] <= GOAL_IDLE_CPU_MS,
            }
        )
        for whose, measured, goal in (
            ("the worker's", row["cpu_s_per_busy_rule"], GOAL_WORKER_CPU_PER_CHAIN_S),
            ("the Prefect server's", row["server_cpu_s_per_busy_rule"], GOAL_SERVER_CPU_PER_CHAIN_S),
        ):
            goals.append(
                {
                    "goal": f"R={row['rules']}: {whose} CPU per busy chain <= {goal} s",
                    "measured": f"{measured} s",
                    "met": measured <= goal,
                }
            )
    if results.get("two_worker_ratio") is not None:
        goals.append(
            {
                "goal": f"two workers >= {GOAL_TWO_WORKER_RATIO}x one worker's busy-rule throughput",
                "measured": f"{results['two_worker_ratio']}x",
                "met": results["two_worker_ratio"] >= GOAL_TWO_WORKER_RATIO,
            }
        )
    return goals


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="bench-rules-"))
    prefect_url = None
    if not args.prefect_sqlite:
        prefect_url = (
            sa.engine.make_url(pg.create_database(PREFECT_DATABASE))
            .set(drivername="postgresql+asyncpg")
            .render_as_string(hide_password=False)
        )
    stack = PrefectStack(workdir, prefect_url)
    # This process is the tick's: its Prefect client must know the server before Prefect is imported.
    os.environ.update(
        {
            "PREFECT_HOME": str(stack.home),
            "PREFECT_API_URL": stack.api,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_LOGGING_LEVEL": "WARNING",
        }
    )
    sandbox = SandboxProcess(args.latency_ms, workdir / "sandbox.log")
    results: dict[str, Any] = {
        "meta": {
            "when": datetime.now(UTC).isoformat(timespec="seconds"),
            "quick": args.quick,
            "prefect": _version("prefect"),
            "prefect_database": "SQLite" if args.prefect_sqlite else "PostgreSQL",
            "postgres": pg.server_version(),
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "latency_ms": args.latency_ms,
            "limit": args.limit,
            "worker": "process (prefect worker start)" if args.process_worker else "warm (delivery worker)",
            "worker_query_seconds": args.query_seconds or ("10 (Prefect's default)" if args.process_worker else "5"),
            "deployments": "deliver-rule from prefect.yaml (prefect deploy); the tick runs in the bench process",
        },
        "rules": [],
        "two_workers": [],
    }
    failed = False
    try:
        sandbox.start()
        log(f"sandbox on {sandbox.api}, latency {args.latency_ms} ms; starting prefect server in {workdir}")
        stack.start()
        log(f"prefect server on {stack.api}; deliver-rule deployed")
        rules_url = pg.create_database(RULES_DATABASE)
        for r in args.rule_counts:
            start_worker(stack, "bench-worker-1", args.limit, args, rules_url)
            try:
                results["rules"].append(run_rules(stack, sandbox, r, args))
            finally:
                stack.stop_workers()
            log(f"R={r}: {json.dumps(results['rules'][-1])}")
        if not args.no_two_workers:
            for workers in (1, 2):
                results["two_workers"].append(run_throughput(stack, sandbox, workers, args))
                log(f"{workers} worker(s): {results['two_workers'][-1]['records_per_s']} records/s")
            one, two = results["two_workers"]
            results["two_worker_ratio"] = round(two["records_per_s"] / one["records_per_s"], 2)
    except Exception:
        failed = True
        traceback.print_exc()
        log(f"failed; logs in {workdir}")
    finally:
        stack.stop()
        sandbox.stop()
        db.dispose_engines()
        pg.drop_database(RULES_DATABASE)
        if prefect_url:
            pg.drop_database(PREFECT_DATABASE)
    if len(results["rules"]) >= 2:
        # What one more idle rule adds to a tick, without the tick's fixed cost (its flow run, the
        # status artifact's fixed part): the slope between the smallest and the largest R.
        small, large = results["rules"][0], results["rules"][-1]
        added = large["tick_all_idle"]["tick_cpu_s"] - small["tick_all_idle"]["tick_cpu_s"]
        results["idle_cpu_ms_marginal"] = round(1000 * added / (large["rules"] - small["rules"]), 2)
    results["goals"] = evaluate(results)
    results["failed"] = failed
    results["seconds"] = round(time.perf_counter() - _t0, 1)
    print(render(results))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    log(f"results in {args.json}; {results['seconds']} s in all")
    if not failed:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
