"""Writers: the per-driver objects that talk to a target. A writer's type declares its verbs."""

from __future__ import annotations

from delivery.writers.base import Creates, Updates, Writer, verbs_of
from delivery.writers.registry import find_writer, registered_drivers

__all__ = ["Creates", "Updates", "Writer", "find_writer", "registered_drivers", "verbs_of"]
