"""Prometheus metrics of the chains a process runs (`delivery worker --metrics-port PORT`, `delivery
serve --metrics-port PORT`), with `prometheus_client` (installed with Prefect).

Counters and gauges live in this process's memory and are updated where the chain already reports
(a job's end, a chain's end, a request heard, a breaker's or a pause's change); a scrape only reads
them, on the exporter's own thread: it never waits for a chain, nor a chain for it.

    delivery_records_total{rule,target,outcome}     records settled, by ledger outcome
    delivery_request_seconds{target,verb}            requests to targets (histogram)
    delivery_chains_total{rule,ending}               chains ended, by how (caught_up, rule_fault...)
    delivery_breaker_open{target}                    1 while a target's breaker is open (as seen here)
    delivery_target_paused{target}                   1 while a target's Retry-After pause holds
    delivery_rate_wait_seconds_total{target}         seconds chains waited for a target's traffic
"""

from __future__ import annotations

import os
import tempfile
import threading

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.multiprocess import MultiProcessCollector

from delivery import attempts
from delivery.domain import Attempt

RECORDS = Counter("delivery_records_total", "Records settled, by ledger outcome.", ["rule", "target", "outcome"])
REQUEST_SECONDS = Histogram(
    "delivery_request_seconds",
    "Requests to a target, by verb: from the request's start to its answer or transport error.",
    ["target", "verb"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)
CHAINS = Counter("delivery_chains_total", "Chains ended, by how they ended.", ["rule", "ending"])
# `mostrecent`: under `delivery serve` each chain runs in a process of its own, and the state a
# target was last seen in wins, whichever process saw it (`serve_metrics_of_processes`).
BREAKER_OPEN = Gauge(
    "delivery_breaker_open", "1 while the target's circuit breaker is open.", ["target"], multiprocess_mode="mostrecent"
)
TARGET_PAUSED = Gauge(
    "delivery_target_paused",
    "1 while the target's Retry-After pause holds.",
    ["target"],
    multiprocess_mode="mostrecent",
)
RATE_WAIT = Counter(
    "delivery_rate_wait_seconds_total", "Seconds chains waited for the target's traffic (budget, pauses).", ["target"]
)

_started: set[int] = set()
_lock = threading.Lock()


def _heard(target: str, attempt: Attempt) -> None:
    REQUEST_SECONDS.labels(target=target, verb=attempt.verb).observe(attempt.duration_ms / 1000)


# Every process that reports chains times their requests, whether it serves the metrics itself
# (`delivery worker`) or a parent adds up its files (a run's process under `delivery serve`).
attempts.observe(_heard)


def _start(port: int, address: str, registry: CollectorRegistry | None = None) -> None:
    """The exporter's thread on `port`, once per port and process."""
    with _lock:
        if port not in _started:
            start_http_server(port, addr=address, registry=registry or REGISTRY)
            _started.add(port)


def serve_metrics(port: int, address: str = "0.0.0.0") -> None:
    """Serve this process's metrics on `port` from a daemon thread (`delivery worker`)."""
    _start(port, address)


#: prometheus_client's directory for the metrics of many processes (set before they start).
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def serve_metrics_of_processes(port: int, address: str = "0.0.0.0") -> str:
    """For `delivery serve`, whose runner starts a process per flow run: the runs' processes,
    started after this, write their metrics to a directory of files (prometheus_client's
    multiprocess mode, through `PROMETHEUS_MULTIPROC_DIR`, which they inherit), and this process
    serves them added up on `port`. Returns the directory."""
    directory = os.environ.get(MULTIPROC_ENV) or tempfile.mkdtemp(prefix="delivery-metrics-")
    os.environ[MULTIPROC_ENV] = directory
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=directory)  # type: ignore[no-untyped-call]
    _start(port, address, registry)
    return directory
