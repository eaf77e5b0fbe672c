"""What the tests of the tick alerts share: a real Prefect server with its triggers and actions
services on, a webhook that records what Prefect's notification action posts, and when an
automation fired."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tests.prefect_server import prefect_server

#: The services a test of an alert needs (the test session turns them off for the harness,
#: tests/conftest.py); the scheduler's loop short, so a schedule's runs are made within seconds.
ALERT_SERVICES = {
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED": "true",
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL": "0.5",
    "PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED": "true",
    "PREFECT_SERVER_SERVICES_ACTIONS_ENABLED": "true",
    "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "2",
}


@contextmanager
def alerting_server(home: Path) -> Iterator[str]:
    with prefect_server(home, ALERT_SERVICES) as api:
        yield api


@contextmanager
def api_of(server: str) -> Iterator[str]:
    """Prefect's settings pointed at `server`, with fresh log and event workers (they keep the API
    they were started with)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import PREFECT_API_URL, temporary_settings

    APILogWorker.drain_all(timeout=10)
    EventsWorker.drain_all(timeout=10)
    with temporary_settings(updates={PREFECT_API_URL: server}):
        yield server
        APILogWorker.drain_all(timeout=10)
        EventsWorker.drain_all(timeout=10)


class Receiver:
    """A webhook that records what Prefect's notification action posts to it, and when."""

    def __init__(self) -> None:
        self.posts: list[dict[str, Any]] = []
        received = self.posts

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                received.append(json.loads(body or b"{}"))
                self.send_response(200)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/hook"


def firings(automation_id: str, since: datetime) -> list[datetime]:
    """When the automation fired (its `prefect.automation.triggered` events), oldest first."""
    from prefect import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter, EventResourceFilter

    async def read() -> list[datetime]:
        async with get_client() as client:
            page = await client.read_events(
                filter=EventFilter(
                    occurred=EventOccurredFilter(since=since, until=datetime.now(UTC) + timedelta(minutes=1)),
                    event=EventNameFilter(name=["prefect.automation.triggered"]),
                    resource=EventResourceFilter(id=[f"prefect.automation.{automation_id}"]),
                ),
                limit=50,
            )
        return sorted(event.occurred for event in page.events)

    return asyncio.run(read())
