"""Outbound record-delivery engine.

The domain lives here and imports no Prefect: `flows/` wires it into Prefect. See README.md and
the decision record (ADR-0029) the engine implements.
"""

from __future__ import annotations

__version__ = "0.1.0"
