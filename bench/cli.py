"""The fixed cost of the `delivery` command (issue #17 point 3): `python -m bench.cli` from the
repository root; `--quick` for a CI-sized run, `--json PATH` for the results.

A real `prefect server start` (its own PREFECT_HOME in a temp dir, on its SQLite default), the
sandbox target (`delivery sandbox`) in its own process, and a delivery database on SQLite holding
one rule. Every command is the console script as an operator runs it, a subprocess given the
server in PREFECT_API_URL, timed from its start to its exit (wall) and charged the CPU the kernel
reports for it once it is reaped (user + system, children's rusage: its own children included).

* `delivery --help`, `--runs` times;
* `delivery run RULE` on the rule caught up (nothing to do: no flow run), `--runs` times;
* `delivery run RULE --always` on the rule caught up (a chain that finds nothing: what an empty
  run cost before the command checked first), `--always-runs` times;
* `delivery run RULE` with `--records` changes to deliver (a real chain), once; it is also what
  catches the rule up before the empty runs.

Prints a markdown table (progress to stderr) and writes JSON (default bench/results/cli.json).
Exits 1 when a measurement went wrong (a command failed, an empty run created a flow run, the
chain did not deliver every record); the goal (an empty run <= 1 s wall) not met is reported, not
a failure. `--source DIR` runs the commands from another checkout of the repository (put first on
PYTHONPATH), to measure a version side by side: `git worktree add /tmp/before COMMIT`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx

from bench import mirror
from bench.stack import PREFECT, ROOT, PrefectStack
from bench.target import SandboxProcess
from bench.world import apply, records, rule_entry, use_database
from delivery import db
from delivery.domain import MirrorInput
from delivery.store.mirror import load_records

DEFAULT_JSON = Path("bench/results/cli.json")
DELIVERY = str(Path(sys.executable).with_name("delivery"))
RULE = "cli-bench"
SOURCE = "cli-bench-source"
#: The issue's goal: an empty `delivery run` against a running server.
GOAL_EMPTY_RUN_SECONDS = 1.0

_t0 = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _t0:7.1f}s] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.cli", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CI-sized: 5 runs of each, 1 --always run")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"results file (default {DEFAULT_JSON})")
    parser.add_argument("--runs", type=int, default=10, help="runs of --help and of the empty run (default 10)")
    parser.add_argument("--always-runs", type=int, default=3, help="runs of `run --always` (default 3)")
    parser.add_argument("--records", type=int, default=20, help="changes the non-empty run delivers (default 20)")
    parser.add_argument("--source", type=Path, help="run the commands from this checkout (first on PYTHONPATH)")
    args = parser.parse_args(argv)
    if args.quick:
        args.runs, args.always_runs = 5, 1
    if args.runs < 1 or args.always_runs < 0 or args.records < 1:
        parser.error("--runs and --records must be at least 1, --always-runs at least 0")
    return args


def _start_server(stack: PrefectStack, timeout: float = 180.0) -> None:
    """`prefect server start` as `PrefectStack.start` starts it, without the work pool and the
    deployment: `delivery run` runs its chain in its own process and needs neither."""
    env = stack.env()
    env.pop("PREFECT_API_URL")
    log_file = (stack.workdir / "server.log").open("wb")
    stack._logs.append(log_file)  # closed by stack.stop()
    stack.server = subprocess.Popen(
        [*PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(stack.port)],
        cwd=ROOT,
        env=env,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + timeout
    while True:
        if stack.server.poll() is not None:
            raise RuntimeError(f"prefect server exited with {stack.server.returncode}; see {stack.workdir}/server.log")
        try:
            if httpx.get(f"{stack.api}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"prefect server did not answer within {timeout:.0f} s")
        time.sleep(0.5)


class Runner:
    """Runs `delivery ARGS` as a subprocess and measures it."""

    def __init__(self, env: dict[str, str], cwd: Path) -> None:
        self.env = env
        self.cwd = cwd

    def __call__(self, *args: str) -> tuple[subprocess.CompletedProcess[str], float, float]:
        """The finished process, its wall seconds and its CPU seconds (user + system)."""
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        proc = subprocess.run(
            [DELIVERY, *args], cwd=self.cwd, env=self.env, capture_output=True, text=True, timeout=300, check=False
        )
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        return proc, wall, cpu

    def measure(self, label: str, args: list[str], runs: int, check: Any = None) -> dict[str, Any]:
        """`runs` runs of `delivery ARGS`; each must exit 0 (and pass `check(proc)`)."""
        walls: list[float] = []
        cpus: list[float] = []
        for _ in range(runs):
            proc, wall, cpu = self(*args)
            if proc.returncode != 0:
                raise RuntimeError(f"delivery {' '.join(args)}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
            if check is not None:
                check(proc)
            walls.append(wall)
            cpus.append(cpu)
        entry = {
            "command": label,
            "runs": runs,
            "wall_s_median": round(statistics.median(walls), 3),
            "wall_s_max": round(max(walls), 3),
            "cpu_s_median": round(statistics.median(cpus), 3),
            "cpu_s_max": round(max(cpus), 3),
            "wall_s": [round(w, 3) for w in walls],
            "cpu_s": [round(c, 3) for c in cpus],
        }
        log(f"{label}: wall median {entry['wall_s_median']} s, max {entry['wall_s_max']} s")
        return entry


def _load(count: int, prefix: str) -> None:
    with db.shared_engine().begin() as conn:
        load_records(conn, SOURCE, mirror.DOMAIN, [MirrorInput(i, p) for i, p in records(prefix, count)])


def measure(stack: PrefectStack, sandbox: SandboxProcess, workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    url = f"sqlite:///{workdir / 'delivery.db'}"
    engine = use_database(url)
    db.upgrade(engine)
    apply(engine, sandbox, SOURCE, [rule_entry(RULE, SOURCE, "contacts", batch=50, concurrency=1)])
    env = stack.env(DELIVERY_DATABASE_URL=url, COLUMNS="120")
    if args.source:
        env["PYTHONPATH"] = os.pathsep.join([str(args.source.resolve()), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    run = Runner(env, workdir)

    def ended(ended_by: str, delivered: int = 0) -> Any:
        def check(proc: subprocess.CompletedProcess[str]) -> None:
            result = json.loads(proc.stdout)
            if result["ended_by"] != ended_by or result["counts"]["delivered"] != delivered:
                raise RuntimeError(f"expected {ended_by} with {delivered} delivered, got {proc.stdout}")

        return check

    has_always = "--always" in run("run", "--help")[0].stdout
    if not has_always:
        log("this checkout's `delivery run` has no --always: its empty run is a chain")

    # The non-empty run first: it is also what catches the rule up.
    _load(args.records, "r")
    runs_before = stack.count_flow_runs()
    first = run.measure(
        f"`delivery run RULE` ({args.records} changes)", ["run", RULE, "--json"], 1, ended("caught_up", args.records)
    )
    first["flow_runs"] = stack.count_flow_runs() - runs_before

    help_row = run.measure("`delivery --help`", ["--help"], args.runs)
    help_row["flow_runs"] = 0

    runs_before = stack.count_flow_runs()
    empty = run.measure(
        "`delivery run RULE` (nothing to do)",
        ["run", RULE, "--json"],
        args.runs,
        ended("nothing_to_do" if has_always else "caught_up"),
    )
    empty["flow_runs"] = stack.count_flow_runs() - runs_before
    if has_always and empty["flow_runs"]:
        raise RuntimeError(f"the empty runs created {empty['flow_runs']} flow runs")

    rows = [help_row, empty]
    if args.always_runs and has_always:
        runs_before = stack.count_flow_runs()
        always = run.measure(
            "`delivery run RULE --always` (a chain, nothing to do)",
            ["run", RULE, "--always", "--json"],
            args.always_runs,
            ended("caught_up"),
        )
        always["flow_runs"] = stack.count_flow_runs() - runs_before
        rows.append(always)
    rows.append(first)
    return {"rows": rows, "empty_run_goal_met": empty["wall_s_max"] <= GOAL_EMPTY_RUN_SECONDS}


def render(results: dict[str, Any]) -> str:
    header = ["command", "runs", "wall median s", "wall max s", "CPU median s", "CPU max s", "flow runs"]
    lines = ["| " + " | ".join(header) + " |", "| --- |" + "|".join(" ---: " for _ in header[1:]) + "|"]
    for row in results.get("rows", []):
        cells = [
            row["command"],
            str(row["runs"]),
            f"{row['wall_s_median']:.2f}",
            f"{row['wall_s_max']:.2f}",
            f"{row['cpu_s_median']:.2f}",
            f"{row['cpu_s_max']:.2f}",
            str(row["flow_runs"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if "empty_run_goal_met" in results:
        verdict = "met" if results["empty_run_goal_met"] else "NOT met"
        lines.append("")
        lines.append(f"Goal: an empty `delivery run` <= {GOAL_EMPTY_RUN_SECONDS:.0f} s wall (every run): {verdict}.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="bench-cli-"))
    stack = PrefectStack(workdir, None)
    sandbox = SandboxProcess(0, workdir / "sandbox.log")
    results: dict[str, Any] = {
        "meta": {
            "when": datetime.now(UTC).isoformat(timespec="seconds"),
            "quick": args.quick,
            "prefect": version("prefect"),
            "prefect_database": "SQLite",
            "delivery_database": "SQLite",
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "python": platform.python_version(),
            "source": str(args.source.resolve()) if args.source else str(ROOT),
        },
    }
    failed = False
    try:
        sandbox.start()
        log(f"sandbox on {sandbox.api}; starting prefect server in {workdir}")
        _start_server(stack)
        log(f"prefect server on {stack.api}")
        results.update(measure(stack, sandbox, workdir, args))
    except Exception:
        failed = True
        traceback.print_exc()
        log(f"failed; logs in {workdir}")
    finally:
        stack.stop()
        sandbox.stop()
        db.dispose_engines()
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
