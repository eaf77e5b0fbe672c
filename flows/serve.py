"""`delivery serve`: the long-running job on one machine.

Prefect's ephemeral API has no scheduler, so without PREFECT_API_URL we start a real local Prefect
server first (SQLite under PREFECT_HOME) and serve the two flows against it; with PREFECT_API_URL
set we serve against that server. Ctrl-C or SIGTERM stops the served flows and the server we started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from types import FrameType

import httpx
from prefect import serve
from prefect.settings import PREFECT_API_URL, temporary_settings

from flows.deliver_rule import deliver_rule
from flows.tick import delivery_tick

TICK_CRON = "*/5 * * * *"


def _wait_healthy(api_url: str, server: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the Prefect server exited with code {server.returncode}")
        try:
            if httpx.get(f"{api_url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the Prefect server did not answer on {api_url} within {timeout:.0f} s")


def _on_sigterm(_signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def serve_forever(port: int = 4200) -> None:
    signal.signal(signal.SIGTERM, _on_sigterm)
    api_url = os.environ.get("PREFECT_API_URL")
    server: subprocess.Popen[bytes] | None = None
    if not api_url:
        api_url = f"http://127.0.0.1:{port}/api"
        env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        server = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdout=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C reaches us; we stop the server ourselves, in order
        )
    try:
        if server is not None:
            _wait_healthy(api_url, server)
        ui = api_url.removesuffix("/api")
        print(f"Prefect UI: {ui}  (API {api_url})", flush=True)
        print("serving deliver-rule and delivery-tick (every 5 minutes); Ctrl-C stops", flush=True)
        with temporary_settings({PREFECT_API_URL: api_url}):
            serve(
                deliver_rule.to_deployment(name="deliver-rule"),  # type: ignore[arg-type]
                delivery_tick.to_deployment(name="delivery-tick", cron=TICK_CRON),  # type: ignore[arg-type]
            )
    except KeyboardInterrupt:
        pass
    finally:
        if server is not None and server.poll() is None:
            server.terminate()
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                server.kill()
        print("stopped", flush=True)
