"""`delivery sandbox`: a small but real REST target to deliver to, for demos and trying rules out.

It speaks exactly the contract of the built-in `rest` driver (`delivery/writers/rest.py` states it;
the README's "Batch endpoints" gives the batch calls' format), so a connection with
`driver: rest` and `base_url: http://127.0.0.1:8900/api` works against it unchanged:

    POST   /api/{collection}        JSON object -> 201 with the stored record and its string "id";
                                    a repeated `Idempotency-Key` replays the first record (200)
    PATCH  /api/{collection}/{id}   shallow-merges the JSON object -> 200, or 404 for unknown ids
    POST   /api/{collection}/batch  {"items": [{"idempotency_key": K, "record": {...}}, ...]} -> 200
                                    {"results": [{"status": 201, "id": "c-1", "record": {...}}, ...]},
                                    one per item in order, each as the single POST would answer it
    PATCH  /api/{collection}/batch  {"items": [{"id": ID, "record": {...}}, ...]} -> 200 {"results": [...]},
                                    each item 200 or 404 as the single PATCH would answer it
    GET    /api/{collection}        the records in creation order (`?limit=N`)
    GET    /api/{collection}/{id}   one record, or 404
    DELETE /api/{collection}/{id}   204: the record is gone, so the engine's next update parks it
    GET    /api/_stats              requests, batch calls, creates, updates and injected faults per collection
    GET    /api/_faults             the fault settings in force
    PUT    /api/_faults             change them while running (a demo flips an outage on and off)
    GET    /healthz                 {"ok": true}, never behind the token

Why it exists beside `tests/target_server.py`: that one is scripted per record for assertions; this
one is a believable target a person runs, looks into, breaks (fault injection, deleting records) and
restarts (an optional SQLite file keeps the records and idempotency keys).

By concern: `settings` (what it is told), `store` (its SQLite records), `faults` (the injected
faults), `app` (the Starlette routes), `server` (uvicorn on a thread or in the foreground). None of
it imports Prefect or the engine (only `delivery.errors`, whose InputError the CLI shows as bad
input), so `delivery sandbox` starts fast.
"""

from __future__ import annotations

from playground.sandbox.app import MAX_BODY_BYTES, SandboxApp, create_app
from playground.sandbox.server import SandboxServer, serve
from playground.sandbox.settings import SandboxSettings

__all__ = ["MAX_BODY_BYTES", "SandboxApp", "SandboxServer", "SandboxSettings", "create_app", "serve"]
