"""The one place that holds SQL. The engine and the CLI ask the store; flows never hold a session."""

from __future__ import annotations
