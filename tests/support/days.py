"""UTC days for the tests of a daily rate budget that run the engine in another process, where no
fake clock reaches: a budget spent close to midnight is waited out (its reset falls within the
job's deadline), not ended on, so such a test starts clear of midnight."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta


def seconds_to_midnight() -> float:
    now = datetime.now(UTC)
    midnight = datetime.combine(now.date() + timedelta(days=1), datetime.min.time(), UTC)
    return (midnight - now).total_seconds()


def clear_of_midnight(seconds: float) -> None:
    """Returns once the next UTC midnight is more than `seconds` away (at once, but in the last
    `seconds` of a day: then just after midnight)."""
    while seconds_to_midnight() <= seconds:
        time.sleep(min(1.0, seconds_to_midnight() + 0.01))
