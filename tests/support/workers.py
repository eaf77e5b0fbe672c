"""`delivery worker` processes and the world they deliver in, for the acceptance tests that run
workers against a real `prefect server start` (test_warm_worker, test_server_restart)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa
import yaml

from delivery.apply import apply_config
from delivery.config import parse_config
from tests.integration.world import World
from tests.prefect_server import api_call, stop_group
from tests.target_server import TargetServer

ROOT = Path(__file__).resolve().parents[2]
PREFECT = [sys.executable, "-m", "prefect"]
DELIVERY = str(Path(sys.executable).parent / "delivery")
# (settle mode, connection): world_of puts the rules on these in turn.
SETTLES = [("grouped", "crm"), ("per_record", "crm-per-record")]


class Workers:
    """`delivery worker` processes of one test, each writing to its own log."""

    def __init__(self, api: str, env: dict[str, str], logs: Path) -> None:
        self.api, self.env, self.logs = api, env, logs
        self.started: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, limit: int = 4, **extra_env: str) -> subprocess.Popen[bytes]:
        with (self.logs / f"{name}.log").open("wb") as log:
            process = subprocess.Popen(
                [DELIVERY, "worker", "--name", name, "--limit", str(limit), "--poll-seconds", "1"],
                cwd=ROOT,
                env={**self.env, **extra_env},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.started[name] = process
        deadline = time.monotonic() + 90
        while name not in {w["name"] for w in api_call("POST", f"{self.api}/work_pools/delivery/workers/filter", {})}:
            assert process.poll() is None, f"worker {name} exited:\n{self.log(name)}"
            assert time.monotonic() < deadline, f"worker {name} did not show up on the server:\n{self.log(name)}"
            time.sleep(0.2)
        return process

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def ran(self, name: str) -> list[str]:
        """The ids of the runs the worker took, from its own output."""
        return re.findall(r"running .* \(([0-9a-f-]{36})\) on chain thread \d+", self.log(name))

    def threads(self, name: str) -> set[str]:
        return set(re.findall(r"on chain thread (\d+)", self.log(name)))

    def assert_alive(self) -> None:
        for name, process in self.started.items():
            assert process.poll() is None, f"worker {name} exited:\n{self.log(name)}"

    def stop(self) -> None:
        for process in self.started.values():
            stop_group(process)


def world_of(engine: sa.Engine, target: TargetServer, names: list[str], records: int, latency_s: float) -> World:
    """Rules from one source, each to its own collection of the target, 5 records a batch (so
    each chain is several jobs), concurrency 1. Both settle modes at once: the odd rules go
    through a `grouped` connection (the async job), the even ones through a `per_record` one to
    the same target (a thread per call), so each test covers both jobs side by side."""
    world = World(engine, target)
    config = world.config()
    grouped = config["connections"][0]
    config["connections"].append({**grouped, "name": "crm-per-record", "settle": "per_record"})
    base = config["rules"][0]
    config["rules"] = [
        {**base, "name": name, "collection": name, "batch_size": 5, "target": SETTLES[i % 2][1]}
        for i, name in enumerate(names)
    ]
    with engine.begin() as conn:
        apply_config(conn, parse_config(yaml.safe_dump(config)))
    world.load(*(f"c-{i}" for i in range(1, records + 1)))
    target.latency_ms = int(latency_s * 1000)
    return world


def run_tick(env: dict[str, str], db_url: str, cwd: Path, **extra_env: str) -> dict[str, Any]:
    done = subprocess.run(
        [DELIVERY, "tick", "--json"],
        cwd=cwd,
        env={**env, "DELIVERY_DATABASE_URL": db_url, **extra_env},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    result: dict[str, Any] = json.loads(done.stdout)
    return result
