"""`delivery serve` as an operator starts it: a local Prefect server, both flows served, and a
clean stop on SIGTERM that leaves nothing running."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.prefect_server import api_call

DELIVERY = str(Path(sys.executable).parent / "delivery")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.slow
def test_serve_starts_a_local_server_serves_both_flows_and_stops_cleanly(tmp_path: Path) -> None:
    port = _free_port()
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DELIVERY_DATABASE_URL": f"sqlite:///{tmp_path / 'delivery.db'}",
    }
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.Popen(
        [DELIVERY, "serve", "--port", str(port)],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    api = f"http://127.0.0.1:{port}/api"
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert f"Prefect UI: http://127.0.0.1:{port}" in first
        names: list[str] = []
        deadline = time.monotonic() + 90
        served = ["deliver-rule", "delivery-preview", "delivery-record", "delivery-requeue", "delivery-tick"]
        while time.monotonic() < deadline and sorted(names) != served:
            time.sleep(1)
            answer = httpx.post(f"{api}/deployments/filter", json={}, timeout=10)
            names = [d["name"] for d in answer.json()] if answer.status_code == 200 else []
        assert sorted(names) == served
        deployments = api_call("POST", f"{api}/deployments/filter", json={})
        assert isinstance(deployments, list)
        tick = next(d for d in deployments if d["name"] == "delivery-tick")
        assert tick["schedules"][0]["schedule"]["cron"] == "*/5 * * * *"
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    assert "stopped" in out
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{api}/health", timeout=2)
