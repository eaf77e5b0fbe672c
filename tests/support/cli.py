"""The `delivery` console script run as an operator runs it: a real subprocess, judged by its exit
code and what it prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

DELIVERY = Path(sys.executable).parent / "delivery"


def spawn(*args: object, cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Start the console script; env defaults to a copy of os.environ as it is now."""
    run_env = dict(os.environ) if env is None else env
    # Rich tables are sized to the terminal; a pipe has none, so fix a width for stable output.
    run_env.setdefault("COLUMNS", "200")
    return subprocess.Popen(
        [str(DELIVERY), *(str(a) for a in args)],
        cwd=cwd,
        env=run_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(popen: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    try:
        stdout, stderr = popen.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        popen.kill()
        popen.communicate()
        raise
    return subprocess.CompletedProcess(popen.args, popen.returncode, stdout, stderr)


def delivery(*args: object, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return finish(spawn(*args, cwd=cwd, env=env))


def ok(proc: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def refused(proc: subprocess.CompletedProcess[str], *fragments: str) -> str:
    """Exit 2, with every fragment in stderr and no traceback; returns stderr."""
    assert proc.returncode == 2, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    for fragment in fragments:
        assert fragment in proc.stderr, f"{fragment!r} not in stderr:\n{proc.stderr}"
    return proc.stderr


def as_json(proc: subprocess.CompletedProcess[str]) -> Any:
    ok(proc)
    try:
        return json.loads(proc.stdout)
    except json.JSONDecodeError as exc:  # pragma: no cover - the message is the point
        raise AssertionError(f"stdout is not JSON by itself ({exc}):\n{proc.stdout}") from exc


def prefect_env() -> dict[str, str]:
    from prefect.settings import PREFECT_API_URL

    env = dict(os.environ)
    env["PREFECT_API_URL"] = str(PREFECT_API_URL.value())
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    return env
