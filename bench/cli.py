"""The fixed cost of the `delivery` command (issue #17 point 3, issue #33 point 6): `python -m bench.cli`
from the repository root; `--quick` for a CI-sized run, `--json PATH` for the results.

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

`--baseline DIR` measures another checkout of the repository side by side (DIR put first on
PYTHONPATH; `git worktree add /tmp/base COMMIT`), in turns with this one, run by run, so that both
meet the same load: a checkout whose `delivery run` has no `--always` runs a chain on every run.

Prints a markdown table (progress to stderr) and writes JSON (default bench/results/cli.json).
Exits 1 when a measurement went wrong (a command failed, an empty run of this checkout created a
flow run, a chain did not deliver every record); the goals (issue #33 point 6: `delivery --help`
<= 0.3 s wall, an empty run <= 0.5 s wall, every run of this checkout) not met are reported, not a
failure.
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
#: The console script of a checkout older than flows/console.py (`delivery = "flows.cli:main"`).
OLD_SCRIPT = [sys.executable, "-c", "import sys; from flows.cli import main; sys.exit(main())"]
RULE = "cli-bench"
SOURCE = "cli-bench-source"
#: The goals of issue #33 point 6, in wall seconds: `delivery --help`, and an empty `delivery run`
#: against a running server.
GOAL_HELP_SECONDS = 0.3
GOAL_EMPTY_RUN_SECONDS = 0.5

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
    parser.add_argument(
        "--baseline", type=Path, help="another checkout to measure side by side, in turns (put first on PYTHONPATH)"
    )
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
    """Runs `delivery ARGS` of one checkout as a subprocess and measures it."""

    def __init__(self, name: str, env: dict[str, str], cwd: Path, command: list[str] | None = None) -> None:
        self.name = name
        self.env = env
        self.cwd = cwd
        self.command = command or [DELIVERY]
        self.has_always = "--always" in self("run", "--help")[0].stdout

    def __call__(self, *args: str) -> tuple[subprocess.CompletedProcess[str], float, float]:
        """The finished process, its wall seconds and its CPU seconds (user + system)."""
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        proc = subprocess.run(
            [*self.command, *args], cwd=self.cwd, env=self.env, capture_output=True, text=True, timeout=300, check=False
        )
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        if proc.returncode != 0:
            raise RuntimeError(
                f"{self.name}: delivery {' '.join(args)}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
            )
        return proc, wall, cpu


def _ended(proc: subprocess.CompletedProcess[str], ended_by: str, delivered: int = 0) -> None:
    result = json.loads(proc.stdout)
    if result["ended_by"] != ended_by or result["counts"]["delivered"] != delivered:
        raise RuntimeError(f"expected {ended_by} with {delivered} delivered, got {proc.stdout}")


class Rows:
    """Samples per (command, checkout), taken in turns so that every checkout meets the same load."""

    def __init__(self, stack: PrefectStack) -> None:
        self.stack = stack
        self.rows: dict[tuple[str, str], dict[str, Any]] = {}

    def sample(self, label: str, runner: Runner, args: list[str], check: Any = None) -> None:
        flow_runs = self.stack.count_flow_runs()
        proc, wall, cpu = runner(*args)
        if check is not None:
            check(proc)
        row = self.rows.setdefault(
            (label, runner.name), {"command": label, "checkout": runner.name, "wall_s": [], "cpu_s": [], "flow_runs": 0}
        )
        row["wall_s"].append(round(wall, 3))
        row["cpu_s"].append(round(cpu, 3))
        row["flow_runs"] += self.stack.count_flow_runs() - flow_runs

    def done(self) -> list[dict[str, Any]]:
        out = []
        for row in self.rows.values():
            walls, cpus = row["wall_s"], row["cpu_s"]
            row.update(
                runs=len(walls),
                wall_s_median=round(statistics.median(walls), 3),
                wall_s_max=round(max(walls), 3),
                cpu_s_median=round(statistics.median(cpus), 3),
                cpu_s_max=round(max(cpus), 3),
            )
            log(
                f"{row['command']} [{row['checkout']}]: wall median {row['wall_s_median']} s, max {row['wall_s_max']} s"
            )
            out.append(row)
        return out


def _load(count: int, prefix: str) -> None:
    with db.shared_engine().begin() as conn:
        load_records(conn, SOURCE, mirror.DOMAIN, [MirrorInput(i, p) for i, p in records(prefix, count)])


HELP = "`delivery --help`"
EMPTY = "`delivery run RULE` (nothing to do)"
ALWAYS = "`delivery run RULE --always` (a chain that finds nothing)"


def measure(stack: PrefectStack, sandbox: SandboxProcess, workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    url = f"sqlite:///{workdir / 'delivery.db'}"
    engine = use_database(url)
    db.upgrade(engine)
    apply(engine, sandbox, SOURCE, [rule_entry(RULE, SOURCE, "contacts", batch=50, concurrency=1)])
    env = stack.env(DELIVERY_DATABASE_URL=url, COLUMNS="120")
    runners = [Runner("this checkout", env, workdir)]
    if args.baseline:
        python_path = os.pathsep.join(filter(None, [str(args.baseline.resolve()), env.get("PYTHONPATH")]))
        # A checkout older than flows/console.py had the console script run flows.cli:main itself.
        script = None if (args.baseline / "flows" / "console.py").exists() else OLD_SCRIPT
        runners.append(Runner(f"baseline {args.baseline.name}", {**env, "PYTHONPATH": python_path}, workdir, script))
    rows = Rows(stack)
    changes = f"`delivery run RULE` ({args.records} changes)"

    # A run with changes per checkout, each on changes of its own: it is also what catches the rule up.
    for number, runner in enumerate(runners):
        _load(args.records, f"r{number}")
        rows.sample(changes, runner, ["run", RULE, "--json"], lambda p: _ended(p, "caught_up", args.records))
    for _ in range(args.runs):
        for runner in runners:
            rows.sample(HELP, runner, ["--help"])
    for _ in range(args.runs):
        for runner in runners:
            # A checkout without the check runs a chain, which finds nothing.
            ended_by = "nothing_to_do" if runner.has_always else "caught_up"
            rows.sample(EMPTY, runner, ["run", RULE, "--json"], lambda p, e=ended_by: _ended(p, e))
    for _ in range(args.always_runs):
        for runner in runners:
            if runner.has_always:
                rows.sample(ALWAYS, runner, ["run", RULE, "--always", "--json"], lambda p: _ended(p, "caught_up"))
    done = rows.done()
    order = [HELP, EMPTY, ALWAYS, changes]
    done.sort(key=lambda row: order.index(row["command"]))
    [empty] = [r for r in done if r["command"] == EMPTY and r["checkout"] == runners[0].name]
    [help_row] = [r for r in done if r["command"] == HELP and r["checkout"] == runners[0].name]
    if empty["flow_runs"]:
        raise RuntimeError(f"the empty runs created {empty['flow_runs']} flow runs")
    return {
        "rows": done,
        "help_goal_met": help_row["wall_s_max"] <= GOAL_HELP_SECONDS,
        "empty_run_goal_met": empty["wall_s_max"] <= GOAL_EMPTY_RUN_SECONDS,
    }


def render(results: dict[str, Any]) -> str:
    header = ["command", "checkout", "runs", "wall median s", "wall max s", "CPU median s", "CPU max s", "flow runs"]
    lines = ["| " + " | ".join(header) + " |", "| --- | --- |" + "|".join(" ---: " for _ in header[2:]) + "|"]
    for row in results.get("rows", []):
        cells = [
            row["command"],
            row["checkout"],
            str(row["runs"]),
            f"{row['wall_s_median']:.2f}",
            f"{row['wall_s_max']:.2f}",
            f"{row['cpu_s_median']:.2f}",
            f"{row['cpu_s_max']:.2f}",
            str(row["flow_runs"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    goals = [
        ("help_goal_met", f"`delivery --help` <= {GOAL_HELP_SECONDS:g} s wall"),
        ("empty_run_goal_met", f"an empty `delivery run` <= {GOAL_EMPTY_RUN_SECONDS:g} s wall"),
    ]
    for key, goal in goals:
        if key in results:
            verdict = "met" if results[key] else "NOT met"
            lines.append("")
            lines.append(f"Goal: {goal}, every run of this checkout: {verdict}.")
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
            "checkout": str(ROOT),
            "baseline": str(args.baseline.resolve()) if args.baseline else None,
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
