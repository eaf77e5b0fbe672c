"""`delivery serve` prints from two threads (the runner's "serving ..." line, the main thread's stop
announcement); each line must reach stdout whole. A CI run once read
"...; Ctrl-C stopsstopping on SIGTERM, received while serving": `print` writes a line's text and
its newline separately, and the other thread's line landed in between."""

from __future__ import annotations

import threading
import time

import pytest

from flows import serve


class _SlowStdout:
    """A stdout that gives the other thread its turn after every write, as a busy machine may."""

    def __init__(self) -> None:
        self.text = ""

    def write(self, chunk: str) -> int:
        self.text += chunk
        time.sleep(0.001)
        return len(chunk)

    def flush(self) -> None:
        pass


def test_lines_printed_from_two_threads_stay_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    out = _SlowStdout()
    monkeypatch.setattr("sys.stdout", out)
    lines = {"runner": "serving deliver-rule; Ctrl-C stops", "main": "stopping on SIGTERM, received while serving"}

    def say(which: str) -> None:
        for _ in range(50):
            serve._say(lines[which])

    threads = [threading.Thread(target=say, args=(which,)) for which in lines]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    written = out.text.splitlines()
    assert len(written) == 100 and set(written) == set(lines.values()), written[:6]
