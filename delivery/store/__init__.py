"""The one place that holds SQL (SQLAlchemy Core; there is no ORM session anywhere in the engine).

Every store function takes a `sqlalchemy.Connection` and runs its statements on it; the caller owns
the transaction. So the callers do hold connections, and that is by design: the unit of work (what
commits together) is decided where the operation is, not in the SQL. Who opens them:

- the engine (`delivery.chain` and its jobs, `delivery.liveness`, the services in `delivery/`):
  one transaction per fence check and settle, per claim, per heartbeat;
- the flows, only to hand a connection to a service of `delivery/` (no module of `flows` imports
  the store: a contract in pyproject.toml): `flows/tick.py` (the tick's plan read-only, then one
  transaction per launch it records), `flows/requeue.py` (the rule's target read-only, then the
  requeue in one transaction), and read-only connections for what the runs publish, read through
  `delivery.reports` and `delivery.status`: `flows/chain_reporting.py` (the chain's report, the
  records it left behind, the rule's previous end for its health event), `flows/parked_artifact.py`,
  `flows/status_artifact.py`;
- the CLI (`flows/cli/`): `apply`, `mirror load`, `requeue` and `connection-status NAME STATUS` each in
  one transaction, the read commands on read-only connections;
- the demo (`playground/demo.py`).

The store runs SQL and decides little. The few rules it does apply must hold in the same
transaction as the read they depend on (under the row lock the statement takes), so they sit
beside those rows; docs/architecture.md lists them ("What the store decides").
"""

from __future__ import annotations
