"""The pybreaker internals the engine cannot do without, kept in this module.

`TargetBreaker` (delivery/breaker.py) writes the shared state before the cached one, so that its
listeners can be told which process made a change; pybreaker offers no public hook for that, so its
`open`, `half_open` and `close` are overridden and must take the lock pybreaker holds across a call
and answer what pybreaker's own `open` answers (whether to raise a new error on a trip). Both are
private attributes of `pybreaker.CircuitBreaker`; every other use of pybreaker goes through its
public API.

tests/unit/test_pybreaker_private.py looks each of these names up and checks its shape, so the day a
pybreaker upgrade moves or changes one, that test fails instead of the breaker at run time.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import pybreaker

#: The private attributes of a `pybreaker.CircuitBreaker` read below.
LOCK = "_lock"
THROW_NEW_ERROR_ON_TRIP = "_throw_new_error_on_trip"


def lock(breaker: pybreaker.CircuitBreaker) -> AbstractContextManager[object]:
    """The (reentrant) lock pybreaker holds across a call and each change of state."""
    held: AbstractContextManager[object] = getattr(breaker, LOCK)
    return held


def throws_new_error_on_trip(breaker: pybreaker.CircuitBreaker) -> bool:
    """What pybreaker's `open` returns: the `throw_new_error_on_trip` the breaker was made with."""
    return bool(getattr(breaker, THROW_NEW_ERROR_ON_TRIP))
