"""The registry's answer for the built-in drivers, given without importing their writers, is what
their classes offer; and the tick's question about a rule does not import httpx."""

from __future__ import annotations

import subprocess
import sys

import pytest

from delivery.writers.base import verbs_of
from delivery.writers.registry import BUILT_IN_VERBS, _registry, driver_verbs, find_writer


@pytest.mark.parametrize("driver", sorted(BUILT_IN_VERBS))
def test_the_built_in_verbs_are_the_classes_verbs(driver: str) -> None:
    writer_type = find_writer(driver)
    assert writer_type is not None
    assert BUILT_IN_VERBS[driver] == verbs_of(writer_type)
    assert driver_verbs(driver) == verbs_of(writer_type)  # the registry loaded: read from the class


def test_every_built_in_driver_is_in_the_table() -> None:
    from delivery.writers import rest

    built_in = {name for name, kind in _registry().items() if kind.__module__ == rest.__name__}
    assert built_in == set(BUILT_IN_VERBS)


def test_an_unknown_driver_has_no_verbs() -> None:
    assert driver_verbs("no-such-driver") is None
    assert driver_verbs(None) is None


def test_judging_a_rule_misconfigured_imports_no_writer() -> None:
    code = (
        "import sys\n"
        "from delivery.writers.registry import driver_verbs\n"
        "assert driver_verbs('rest-create-only') is not None\n"
        "print(sorted(m for m in ('httpx', 'jinja2', 'delivery.writers.rest') if m in sys.modules))\n"
    )
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert found.stdout.strip() == "[]"
