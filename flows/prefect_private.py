"""The two Prefect internals the engine uses, kept in this module.

Everything else the engine asks of Prefect goes through its public API. Telling Prefect's
ephemeral API (which repossesses no expired lease) from a real server needs the ephemeral servers
this process started, which Prefect keeps only in a private class attribute; Prefect 3.9 offers no
public equivalent. And `delivery worker` runs deployment runs in its own process, where Prefect's
engine would start a suspension observer for each (below); there is no setting to turn it off.

tests/unit/test_prefect_private.py looks each of these names up and checks its shape, so the day a
Prefect upgrade moves or changes one, that test fails instead of the lock at run time.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from typing import Any

#: Where Prefect keeps its ephemeral servers; looked up, not imported (importing it costs seconds).
EPHEMERAL_SERVER_MODULE = "prefect.server.api.server"


def ephemeral_api_urls() -> set[str]:
    """The API URLs of the ephemeral Prefect servers this process started (none if it started none)."""
    server = sys.modules.get(EPHEMERAL_SERVER_MODULE)
    if server is None:
        return set()
    instances = server.SubprocessASGIServer._instances
    return {str(s.api_url).rstrip("/") for s in instances.values() if s.port is not None}


#: Where the flow engine looks up the suspension observer it starts for every deployment run.
FLOW_ENGINE_MODULE = "prefect.flow_engine"
SUSPENSION_OBSERVER = "observe_flow_run_suspension"


@contextlib.contextmanager
def _no_suspension_observer(*_: Any, **__: Any) -> Iterator[None]:
    yield


def skip_suspension_observers() -> None:
    """Start no suspension observer for the flow runs of this process.

    For every run of a deployment, Prefect 3.9's flow engine starts a thread with its own event
    loop, API client and event subscription, polling every 0.2 s, to notice a Suspend asked for in
    the UI; a long-lived worker running hundreds of chains spent about a seventh of its CPU on them
    (docs/performance.md). The chains never suspend (a chain is cancelled, not paused), and the warm
    worker sees Cancel by polling the runs it holds, so nothing here needs the observer."""
    engine = importlib.import_module(FLOW_ENGINE_MODULE)
    setattr(engine, SUSPENSION_OBSERVER, _no_suspension_observer)
