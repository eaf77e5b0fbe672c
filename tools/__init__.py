"""Maintainers' tools that are not part of the engine (not packaged): `tools.screenshots`."""
