"""Writers: the per-driver objects that talk to a target. A writer's type declares its verbs."""

from __future__ import annotations

from delivery.writers.base import (
    BatchRefused,
    CreateItem,
    Creates,
    CreatesAsync,
    CreatesMany,
    DeleteItem,
    Deletes,
    DeletesAsync,
    DeletesMany,
    UpdateItem,
    Updates,
    UpdatesAsync,
    UpdatesMany,
    Writer,
    async_verbs_of,
    batch_verbs_of,
    offers_async,
    verbs_of,
)
from delivery.writers.registry import find_writer, registered_drivers, writer_for

__all__ = [
    "BatchRefused",
    "CreateItem",
    "Creates",
    "CreatesAsync",
    "CreatesMany",
    "DeleteItem",
    "Deletes",
    "DeletesAsync",
    "DeletesMany",
    "UpdateItem",
    "Updates",
    "UpdatesAsync",
    "UpdatesMany",
    "Writer",
    "async_verbs_of",
    "batch_verbs_of",
    "find_writer",
    "offers_async",
    "registered_drivers",
    "verbs_of",
    "writer_for",
]
