"""The production path in processes of the bench's own: a real `prefect server start` (its own
PREFECT_HOME, on PostgreSQL or SQLite), the `delivery` process work pool, the `deliver-rule`
deployment from the repository's prefect.yaml (`prefect deploy`, as README "Deploying" does it),
and the workers: `delivery worker` (warm: every chain in one long-lived process) or `prefect
worker start` (a process per chain, the isolation option); plus the CPU seconds of a process tree, read from /proc."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
PREFECT = [sys.executable, "-m", "prefect"]
DELIVERY = str(Path(sys.executable).parent / "delivery")
POOL = "delivery"
DEPLOYMENT = "deliver-rule/deliver-rule"
_TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def _children() -> dict[int, list[int]]:
    by_parent: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields is not None:
                by_parent.setdefault(int(fields[1]), []).append(int(entry.name))
    return by_parent


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU of `pid`, of its children it has waited for (cutime, cstime: a worker's
    finished flow-run processes), and of its live descendants."""
    by_parent = _children()
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        fields = _stat(current)
        if fields is not None:
            # utime, stime, cutime, cstime (fields 14-17 of proc(5), here 0-based after the name).
            total += sum(int(v) for v in fields[11:15]) / _TICKS
        todo.extend(by_parent.get(current, []))
    return total


def _stop(process: subprocess.Popen[bytes], grace: float = 30.0) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


class PrefectStack:
    """`start()` the server and deploy; `start_worker()` as many as wanted; `stop()` is always safe."""

    def __init__(self, workdir: Path, database_url: str | None, log: Any = print) -> None:
        """`database_url`: the Prefect server's own database (postgresql+asyncpg://...), None for
        its SQLite default under its PREFECT_HOME."""
        self.workdir = workdir
        self.home = workdir / "prefect-home"
        self.home.mkdir(parents=True, exist_ok=True)
        self.database_url = database_url
        self.port = free_port()
        self.api = f"http://127.0.0.1:{self.port}/api"
        self.log = log
        self.server: subprocess.Popen[bytes] | None = None
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[Any] = []

    def env(self, **extra: str) -> dict[str, str]:
        """What a client process (the tick, a worker, `prefect deploy`) needs to use the server."""
        env = {
            **os.environ,
            "PREFECT_HOME": str(self.home),
            "PREFECT_API_URL": self.api,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            **extra,
        }
        return env

    def _popen(self, command: list[str], log_name: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
        out = (self.workdir / log_name).open("wb")
        self._logs.append(out)
        return subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )

    def start(self, timeout: float = 180.0) -> PrefectStack:
        env = self.env()
        env.pop("PREFECT_API_URL")
        if self.database_url:
            env["PREFECT_API_DATABASE_CONNECTION_URL"] = self.database_url
        self.server = self._popen(
            [*PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(self.port)], "server.log", env
        )
        deadline = time.monotonic() + timeout
        while True:
            if self.server.poll() is not None:
                raise RuntimeError(
                    f"prefect server exited with {self.server.returncode}; see {self.workdir}/server.log"
                )
            try:
                if httpx.get(f"{self.api}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"prefect server did not answer within {timeout:.0f} s")
            time.sleep(0.5)
        # As README "Deploying": the process pool, then the deployment from prefect.yaml. Only
        # deliver-rule: the delivery-tick deployment's */5 schedule would start ticks of its own
        # in the middle of a measurement; the bench runs each tick itself (`run_tick`).
        for command in (
            ["work-pool", "create", POOL, "--type", "process"],
            ["--no-prompt", "deploy", "--name", "deliver-rule"],
        ):
            done = subprocess.run([*PREFECT, *command], cwd=ROOT, env=self.env(), capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"prefect {' '.join(command)}:\n{done.stdout}\n{done.stderr}")
        return self

    def start_worker(
        self, name: str, limit: int, env: dict[str, str], warm: bool = True, poll_seconds: float | None = None
    ) -> subprocess.Popen[bytes]:
        """`delivery worker` (warm) or `prefect worker start` (a process per run); `poll_seconds`
        None: the worker's own default (5 s warm, Prefect's 10 s for the process worker)."""
        if warm:
            command = [DELIVERY, "worker", "--pool", POOL, "--name", name, "--limit", str(limit)]
            if poll_seconds is not None:
                command += ["--poll-seconds", str(poll_seconds)]
        else:
            command = [*PREFECT, "worker", "start", "--pool", POOL, "--name", name, "--limit", str(limit)]
            if poll_seconds is not None:
                env = {**env, "PREFECT_WORKER_QUERY_SECONDS": str(poll_seconds)}
        worker = self._popen(command, f"{name}.log", self.env(**env))
        self.workers[name] = worker
        deadline = time.monotonic() + 60
        # Ready once the server lists it (it has polled the pool at least once).
        while not any(w.get("name") == name for w in self.post(f"/work_pools/{POOL}/workers/filter", {})):
            if worker.poll() is not None:
                raise RuntimeError(f"worker {name} exited with {worker.returncode}; see {self.workdir}/{name}.log")
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker {name} did not show up within 60 s")
            time.sleep(0.5)
        return worker

    def stop_workers(self) -> None:
        for worker in self.workers.values():
            _stop(worker)
        self.workers.clear()

    def post(self, path: str, body: Any) -> Any:
        answer = httpx.post(f"{self.api}{path}", json=body, timeout=30)
        answer.raise_for_status()
        return answer.json()

    def count_flow_runs(self, flow_name: str = "deliver-rule") -> int:
        return int(self.post("/flow_runs/count", {"flows": {"name": {"any_": [flow_name]}}}))

    def stop(self) -> None:
        self.stop_workers()
        if self.server is not None:
            _stop(self.server)
            self.server = None
        for out in self._logs:
            out.close()
        self._logs.clear()
