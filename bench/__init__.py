"""The delivery engine's benchmark: `python -m bench.run` (or `make bench`); see docs/performance.md."""
