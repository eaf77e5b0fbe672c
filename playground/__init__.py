"""The playground: what a person tries the engine with, kept apart from the product (`delivery`,
`flows`). `playground.sandbox` is a REST target to deliver to, `playground.demo` the scripted tour
`delivery demo` runs, and `playground/examples/` the sample data it ships with (read through
`importlib.resources`, so it is found in an installed wheel as well as in a checkout)."""

from __future__ import annotations
