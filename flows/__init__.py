"""Prefect flows: the wiring of the `delivery` domain into Prefect. Nothing here decides delivery."""

from __future__ import annotations
