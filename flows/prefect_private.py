"""The one Prefect internal the engine cannot do without, kept in this module.

Everything else the engine asks of Prefect goes through its public API. Telling Prefect's
ephemeral API (which repossesses no expired lease) from a real server needs the ephemeral servers
this process started, which Prefect keeps only in a private class attribute; Prefect 3.9 offers no
public equivalent.

tests/unit/test_prefect_private.py looks each of these names up and checks its shape, so the day a
Prefect upgrade moves or changes one, that test fails instead of the lock at run time.
"""

from __future__ import annotations

import sys

#: Where Prefect keeps its ephemeral servers; looked up, not imported (importing it costs seconds).
EPHEMERAL_SERVER_MODULE = "prefect.server.api.server"


def ephemeral_api_urls() -> set[str]:
    """The API URLs of the ephemeral Prefect servers this process started (none if it started none)."""
    server = sys.modules.get(EPHEMERAL_SERVER_MODULE)
    if server is None:
        return set()
    instances = server.SubprocessASGIServer._instances
    return {str(s.api_url).rstrip("/") for s in instances.values() if s.port is not None}
