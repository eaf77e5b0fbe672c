"""Where the machine's CPU went during a measurement (Linux /proc; None elsewhere).

On a small machine the engine, the target, PostgreSQL and the Prefect API share the same cores,
so "how busy was the machine" and "whose CPU was it" say what bounds a throughput figure.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine() -> tuple[int, int, int] | None:
    """(busy, steal, total) jiffies over all cores; steal is time the hypervisor gave to others."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    except (OSError, ValueError, IndexError):
        return None
    fields += [0] * (8 - len(fields))
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return user + nice + system + irq + softirq, steal, sum(fields)


def _process_seconds(pid: int) -> float | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime + stime


class CpuMeter:
    """`with CpuMeter(target_pid) as meter: ...`, then `meter.result(n)`: the machine's busy share,
    the CPU seconds per record of this process (all threads) and of the target process, and the
    share of a core each of them used."""

    def __init__(self, target_pid: int | None) -> None:
        self.target_pid = target_pid

    def __enter__(self) -> CpuMeter:
        self._machine = _machine()
        self._wall = time.perf_counter()
        self._own = time.process_time()
        self._target = _process_seconds(self.target_pid) if self.target_pid else None
        return self

    def __exit__(self, *_: Any) -> None:
        machine = _machine()
        self.own_seconds = time.process_time() - self._own
        self.wall_seconds = time.perf_counter() - self._wall
        target = _process_seconds(self.target_pid) if self.target_pid else None
        self.target_seconds = target - self._target if target is not None and self._target is not None else None
        self.machine_busy: float | None = None
        self.machine_steal: float | None = None
        if machine is not None and self._machine is not None and machine[2] > self._machine[2]:
            total = machine[2] - self._machine[2]
            self.machine_busy = (machine[0] - self._machine[0]) / total
            self.machine_steal = (machine[1] - self._machine[1]) / total

    def result(self, records: int) -> dict[str, Any]:
        per = max(records, 1)
        return {
            "machine_busy": None if self.machine_busy is None else round(self.machine_busy, 3),
            "machine_steal": None if self.machine_steal is None else round(self.machine_steal, 3),
            "own_cpu_ms_per_record": round(1000 * self.own_seconds / per, 3),
            "target_cpu_ms_per_record": None
            if self.target_seconds is None
            else round(1000 * self.target_seconds / per, 3),
            # The cores each process kept busy: near 1.0 a Python process is bound by its own CPU
            # (the GIL runs its Python on one core at a time, whatever its threads).
            "own_core_share": round(self.own_seconds / self.wall_seconds, 3) if self.wall_seconds > 0 else None,
            "target_core_share": None
            if self.target_seconds is None or self.wall_seconds <= 0
            else round(self.target_seconds / self.wall_seconds, 3),
        }
