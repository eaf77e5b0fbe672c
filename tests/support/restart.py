"""The Prefect-server-restart scenario (issue 29, point 4), shared by its two test modules (one per
database, so that two xdist workers run them side by side: each takes about 2.5 minutes, most of
it the lock's bounded wait). See tests/acceptance/test_server_restart.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import sqlalchemy as sa

from delivery.liveness import UNACCOUNTED_ON_A_SERVER_SECONDS
from tests.integration.world import email
from tests.prefect_server import START_TIMEOUT, free_port, healthy, migrated_home, stop_group
from tests.support.workers import PREFECT, ROOT, Workers, run_tick, world_of
from tests.target_server import TargetServer

RULE = "restart-contacts"
RECORDS = 40
DEAD_AFTER_MINUTES = 1
WAIT_STEP_SECONDS = "3"


class Server:
    """A `prefect server start` on a fixed port and home, which the test can kill and start again."""

    def __init__(self, home: Path) -> None:
        self.home = migrated_home(home)
        self.port = free_port()
        self.api = f"http://127.0.0.1:{self.port}/api"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, "PREFECT_HOME": str(self.home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        env.pop("PREFECT_API_URL", None)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(self.port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + START_TIMEOUT
        while not healthy(self.api):
            assert self.process.poll() is None, f"the Prefect server exited with {self.process.returncode}"
            assert time.monotonic() < deadline, f"the Prefect server did not answer within {START_TIMEOUT:.0f} s"
            time.sleep(0.5)

    def kill(self) -> None:
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process is not None:
            stop_group(self.process)


def restart_mid_chain(engine: sa.Engine, target: TargetServer, db_url: str, tmp_path: Path) -> None:
    """The scenario (see tests/acceptance/test_server_restart.py), on the database of `db_url`."""
    server = Server(tmp_path / "prefect-home")
    server.start()
    try:
        _restart_mid_chain(engine, target, server, db_url, tmp_path)
    finally:
        server.stop()


def _restart_mid_chain(engine: sa.Engine, target: TargetServer, server: Server, db_url: str, tmp_path: Path) -> None:
    env = {**os.environ, "PREFECT_HOME": str(server.home), "PREFECT_API_URL": server.api}
    for command in (
        ["work-pool", "create", "delivery", "--type", "process"],
        ["--no-prompt", "deploy", "--name", "deliver-rule"],
    ):
        done = subprocess.run([*PREFECT, *command], cwd=ROOT, env=env, capture_output=True, text=True)
        assert done.returncode == 0, f"prefect {' '.join(command)}:\n{done.stdout}\n{done.stderr}"
    world = world_of(engine, target, [RULE], RECORDS, latency_s=0.25)
    extra = {"DELIVERY_LOCK_WAIT_STEP_SECONDS": WAIT_STEP_SECONDS}
    workers = Workers(server.api, {**env, "DELIVERY_DATABASE_URL": db_url, **extra}, tmp_path)
    try:
        workers.start("w1")
        run_tick(env, db_url, tmp_path, **extra)

        def delivered() -> int:
            return sum(row["status"] == "delivered" for row in world.ledger(RULE).values())

        deadline = time.monotonic() + 120
        while delivered() < 5:  # mid-chain: its first jobs are done, most records are not
            workers.assert_alive()
            assert time.monotonic() < deadline, workers.log("w1")
            time.sleep(0.2)
        assert delivered() < RECORDS
        # Kill the server while a job holds the rule's lock: the target holds its answers, so the
        # job in flight cannot end (and give the slot back) before the server is gone.
        target.hold()
        while not target.in_flight:
            workers.assert_alive()
            assert time.monotonic() < deadline, workers.log("w1")
            time.sleep(0.05)
        server.kill()
        server.start()
        target.release()
        restarted = time.monotonic()

        # The ticks the schedule would run, every few seconds here; the threshold judges the old
        # chain dead (if it did not go on by itself) and starts another, which waits for the
        # lock's slot, still taken by the lease the server forgot, until it resets it.
        limit = DEAD_AFTER_MINUTES * 60 + 60 + UNACCOUNTED_ON_A_SERVER_SECONDS
        while delivered() < RECORDS:
            assert time.monotonic() - restarted < limit, (
                f"{delivered()} of {RECORDS} delivered {limit:.0f} s after the restart\n" + workers.log("w1")
            )
            run_tick(env, db_url, tmp_path, DELIVERY_DEAD_CHAIN_MINUTES=str(DEAD_AFTER_MINUTES), **extra)
            time.sleep(5)
    finally:
        workers.stop()
    held = Counter(record.get("email") for record in target.records(RULE).values())
    assert held == Counter({email(f"c-{i}"): 1 for i in range(1, RECORDS + 1)})
    assert "freed a lock slot that no live chain holds (the server holds no lease for it" in workers.log("w1")
