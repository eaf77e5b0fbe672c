"""Writers: the per-driver objects that talk to a target. A writer's type declares its verbs."""

from __future__ import annotations

from delivery.writers.base import (
    BatchRefused,
    CreateItem,
    Creates,
    CreatesMany,
    UpdateItem,
    Updates,
    UpdatesMany,
    Writer,
    batch_verbs_of,
    verbs_of,
)
from delivery.writers.registry import find_writer, registered_drivers, writer_for

__all__ = [
    "BatchRefused",
    "CreateItem",
    "Creates",
    "CreatesMany",
    "UpdateItem",
    "Updates",
    "UpdatesMany",
    "Writer",
    "batch_verbs_of",
    "find_writer",
    "registered_drivers",
    "verbs_of",
    "writer_for",
]
