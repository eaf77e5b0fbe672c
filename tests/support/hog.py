"""A CPU hog: busy processes beside a test, so that what it checks holds on a loaded machine (the
issue that asked for it saw a load average of 5 on two cores)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def cpu_hog(processes: int = 2) -> Iterator[list[subprocess.Popen[bytes]]]:
    """`processes` Python processes spinning on the CPU for the length of the block."""
    started = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True) for _ in range(processes)
    ]
    try:
        yield started
    finally:
        for process in started:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
