"""Prometheus metrics (issue 32, point 6): the counters, histogram and gauges a process serves with
`--metrics-port`, filled by the chains it runs (here: on the Prefect test harness, in this
process, as `delivery worker` runs them), read over real HTTP; and the multi-process form
`delivery serve` uses, where each chain runs in a process of its own."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import httpx
import sqlalchemy as sa

from flows import metrics
from tests.integration.world import RULE, World
from tests.target_server import Answer, TargetServer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of metric `name` with exactly these labels in a scrape, or None."""
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_a_chain_fills_the_metrics_a_scrape_reads(prefect_api: None, engine: sa.Engine, target: TargetServer) -> None:
    port = free_port()
    metrics.serve_metrics(port, address="127.0.0.1")
    world = World(engine, target).apply()
    before = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    delivered = sample(before, "delivery_records_total", rule=RULE, target="crm", outcome="delivered") or 0.0
    timed = sample(before, "delivery_request_seconds_count", target="crm", verb="create") or 0.0
    world.load("a", "b")
    target.program(world.key("b"), Answer.status(429, headers={"Retry-After": "600"}))
    world.run()
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    assert sample(text, "delivery_records_total", rule=RULE, target="crm", outcome="delivered") == delivered + 1
    assert sample(text, "delivery_request_seconds_count", target="crm", verb="create") == timed + 2
    assert (sample(text, "delivery_chains_total", rule=RULE, ending="rate_limited") or 0) >= 1
    assert sample(text, "delivery_target_paused", target="crm") == 1.0
    assert "delivery_rate_wait_seconds_total" in text and "delivery_breaker_open" in text


def test_the_metrics_of_many_processes_are_served_added_up(tmp_path: object) -> None:
    """As under `delivery serve`: two processes count records into the directory, one serves both."""
    directory = str(tmp_path)
    child = textwrap.dedent(
        """
        from datetime import UTC, datetime
        from delivery import attempts
        from flows import metrics
        metrics.RECORDS.labels(rule="r", target="t", outcome="delivered").inc(3)
        metrics.TARGET_PAUSED.labels(target="t").set(1)
        # A chain's request in a run's process, where nothing serves metrics: timed all the same.
        with attempts.Listening("t", "create", None):
            attempts.heard(datetime.now(UTC), "POST", "contacts", 201, None, 12, None)
        """
    )
    env = {**os.environ, metrics.MULTIPROC_ENV: directory}
    for _ in range(2):
        subprocess.run([sys.executable, "-c", child], env=env, check=True, timeout=120)
    port = free_port()
    saved = os.environ.get(metrics.MULTIPROC_ENV)
    os.environ[metrics.MULTIPROC_ENV] = directory
    try:
        metrics.serve_metrics_of_processes(port, address="127.0.0.1")
    finally:
        if saved is None:
            os.environ.pop(metrics.MULTIPROC_ENV, None)
        else:
            os.environ[metrics.MULTIPROC_ENV] = saved
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    assert sample(text, "delivery_records_total", rule="r", target="t", outcome="delivered") == 6.0
    assert sample(text, "delivery_target_paused", target="t") == 1.0
    assert sample(text, "delivery_request_seconds_count", target="t", verb="create") == 2.0
