"""The pybreaker internals `delivery/pybreaker_private.py` relies on are still where it expects them
and still behave as `TargetBreaker` assumes. When a pybreaker upgrade moves or reshapes one, this
fails, naming it, rather than the breaker failing (or silently mis-telling its listeners) at run time."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pybreaker

import delivery.pybreaker_private as private
from delivery.breaker import TargetBreaker
from delivery.store.breaker import DatabaseBreakerStorage

ROOT = Path(__file__).resolve().parents[2]
WALL = ROOT / "delivery" / "pybreaker_private.py"


def _breaker(throw: bool) -> pybreaker.CircuitBreaker:
    return pybreaker.CircuitBreaker(
        state_storage=pybreaker.CircuitMemoryStorage(pybreaker.STATE_CLOSED), throw_new_error_on_trip=throw
    )


def _private_names() -> set[str]:
    """Every private name a pybreaker breaker or storage holds, on the instance or the class."""
    names: set[str] = set()
    for obj in (_breaker(True), pybreaker.CircuitMemoryStorage(pybreaker.STATE_CLOSED)):
        for cls in type(obj).__mro__:
            names |= {n for n in vars(cls) if n.startswith("_") and not n.startswith("__")}
        names |= {n for n in vars(obj) if n.startswith("_")}
    return names


def test_the_lock_is_the_one_pybreaker_holds_across_a_change_of_state() -> None:
    breaker = _breaker(True)
    held = private.lock(breaker)
    assert hasattr(held, "__enter__") and hasattr(held, "__exit__")
    with held, held:  # reentrant: pybreaker calls open() from inside a call that holds it
        pass
    for method in ("open", "half_open", "close", "call"):
        assert f"self.{private.LOCK}" in inspect.getsource(getattr(pybreaker.CircuitBreaker, method)), method


def test_open_answers_what_the_breaker_was_made_with() -> None:
    assert private.throws_new_error_on_trip(_breaker(True)) is True
    assert private.throws_new_error_on_trip(_breaker(False)) is False
    assert f"return self.{private.THROW_NEW_ERROR_ON_TRIP}" in inspect.getsource(pybreaker.CircuitBreaker.open)


def test_the_overridden_state_changes_are_still_the_ones_pybreaker_makes() -> None:
    """`TargetBreaker` overrides these three; pybreaker must still change state through them (and its
    state setter, which tells the listeners), or the overrides would be bypassed."""
    assert "opened_at" in inspect.getsource(pybreaker.CircuitBreaker.open)
    assert "reset_success_counter" in inspect.getsource(pybreaker.CircuitBreaker.close)
    assert isinstance(inspect.getattr_static(pybreaker.CircuitBreaker, "state"), property)
    assert "notify=True" in inspect.getsource(pybreaker.CircuitBreaker.state.fset)
    states = inspect.getsource(pybreaker)
    for method in ("open", "half_open", "close"):
        assert f"self._breaker.{method}()" in states, method


def test_our_subclasses_set_no_private_name_pybreaker_uses() -> None:
    """An attribute of ours named like one of pybreaker's would silently replace it."""
    ours: set[str] = set()
    for cls in (TargetBreaker, DatabaseBreakerStorage):
        for node in ast.walk(ast.parse(inspect.getsource(cls))):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
                and node.attr.startswith("_")
            ):
                ours.add(node.attr)
    assert ours, "the scan found no attributes: it no longer reads the classes"
    assert ours & _private_names() == set()


def _uses_a_breaker(tree: ast.Module) -> bool:
    """Imports pybreaker or one of our breaker modules (other modules' own `_lock`s are theirs)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "pybreaker" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            if any(n.split(".")[0] == "pybreaker" or n.endswith(".breaker") for n in names):
                return True
    return False


def test_only_the_private_module_touches_pybreaker_internals() -> None:
    """Any other `x._name` with one of pybreaker's private names, in a module that handles a breaker,
    would escape the tests above."""
    private_names = _private_names()
    offenders = []
    scanned = 0
    for package in ("delivery", "flows", "playground"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == WALL:
                continue
            tree = ast.parse(path.read_text(), str(path))
            if not _uses_a_breaker(tree):
                continue
            scanned += 1
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and node.attr in private_names:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
                elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pybreaker"):
                    offenders += [
                        f"{path.relative_to(ROOT)}:{node.lineno} {a.name}" for a in node.names if a.name.startswith("_")
                    ]
    assert scanned >= 5, "the scan found too few breaker modules: it no longer recognises them"
    assert offenders == []


#: The breaker's modules: its rules, its shared state, and the wall around pybreaker's internals.
BREAKER_MODULES = {"delivery/breaker.py", "delivery/store/breaker.py", "delivery/pybreaker_private.py"}


def _imports_pybreaker(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "pybreaker" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "pybreaker":
            return True
    return False


def test_only_the_breaker_modules_import_pybreaker() -> None:
    """One module owns the breaker's rules: a module that needs to know what a refused call or an
    open breaker is asks `delivery.breaker` (`Refused`, `OPEN`, `outage_change`), so no rule of the
    breaker grows beside it, and a pybreaker upgrade is read in three files."""
    importers = {
        str(path.relative_to(ROOT))
        for package in ("delivery", "flows", "playground")
        for path in sorted((ROOT / package).rglob("*.py"))
        if _imports_pybreaker(ast.parse(path.read_text(), str(path)))
    }
    assert importers == BREAKER_MODULES
