"""Writers found by driver name: the built-in REST family plus any third-party writer that
registers itself under the `delivery.writers` entry-point group."""

from __future__ import annotations

from functools import cache
from importlib.metadata import entry_points

from delivery.domain import Connection, Verb
from delivery.writers.base import Writer, verbs_of

ENTRY_POINT_GROUP = "delivery.writers"

#: The verbs of the built-in drivers' writers (one record per call, as `verbs_of` reads the
#: registered type), known without importing them: the tick and an idle `delivery run` ask it of
#: every rule, and importing the `rest` writers means httpx and Jinja2 (a fifth of an empty run's
#: start). tests/unit/test_writer_registry.py holds it to the classes.
BUILT_IN_VERBS: dict[str, frozenset[Verb]] = {
    "rest": frozenset({Verb.CREATE, Verb.UPDATE, Verb.DELETE}),
    "rest-create-only": frozenset({Verb.CREATE}),
    "rest-update-only": frozenset({Verb.UPDATE}),
}


@cache
def _registry() -> dict[str, type[Writer]]:
    # Built-ins are named here as well as in pyproject.toml so they work from a plain checkout.
    from delivery.writers.rest import RestCreateOnlyWriter, RestUpdateOnlyWriter, RestWriter

    found: dict[str, type[Writer]] = {
        "rest": RestWriter,
        "rest-create-only": RestCreateOnlyWriter,
        "rest-update-only": RestUpdateOnlyWriter,
    }
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        if entry.name in found:
            continue
        loaded = entry.load()
        if isinstance(loaded, type) and issubclass(loaded, Writer):
            found[entry.name] = loaded
    return found


def find_writer(driver: str | None) -> type[Writer] | None:
    if driver is None:
        return None
    return _registry().get(driver)


def driver_verbs(driver: str | None) -> frozenset[Verb] | None:
    """The verbs the writer registered for `driver` offers (`verbs_of`), None when there is none.
    A built-in driver is answered from `BUILT_IN_VERBS` until the registry has been loaded (built-ins
    win over entry points, and only a loaded registry can be changed by `register_writer`)."""
    if driver in BUILT_IN_VERBS and _registry.cache_info().currsize == 0:
        return BUILT_IN_VERBS[driver]
    writer_type = find_writer(driver)
    return None if writer_type is None else verbs_of(writer_type)


def writer_for(target: Connection) -> type[Writer] | None:
    """The type that writes to `target`: its driver's writer, as that driver equips a connection
    with `target.batch` (the `rest` family adds its batch verbs where the connection names batch
    paths). None when no writer is registered for the driver. The one to build a chain's writer
    from: `find_writer` gives the registered type, on which save-time checks judge the verbs."""
    writer_type = find_writer(target.driver)
    return None if writer_type is None else writer_type.for_batch(target.batch)


def registered_drivers() -> list[str]:
    return sorted(_registry())


def reset_registry() -> None:
    """Forget the cached registry (tests that install a writer at run time)."""
    _registry.cache_clear()


def register_writer(driver: str, writer_type: type[Writer]) -> None:
    """Register a writer in this process (what an entry point does for an installed package)."""
    _registry()[driver] = writer_type
