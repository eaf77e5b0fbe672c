"""The outer layer: the Prefect flows that wire the `delivery` domain into Prefect, and the `delivery`
command line (`flows.cli`) over both. Nothing here decides delivery; `delivery/` imports nothing from here."""

from __future__ import annotations
