"""Importing the stop-signal module, even on a `delivery serve` command line, installs no handler:
the handlers are installed when the command starts (the `delivery` console script, `flows.console`)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import signal, sys
before = signal.getsignal(signal.SIGTERM)
sys.argv = [sys.argv[0].rsplit("/", 1)[0] + "/delivery", "serve"]
import flows.stop_signals
print(signal.getsignal(signal.SIGTERM) is before)
"""


def test_importing_the_module_leaves_sigterm_alone() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"


def test_the_console_script_takes_the_signals_over_before_the_cli_is_imported() -> None:
    """`flows.console.main` claims the signals on `delivery serve`, then imports the CLI (a stand-in
    here, which reports whether the handler was in place when it was imported)."""
    script = (
        "import signal, sys, types\n"
        "sys.argv = ['delivery', 'serve']\n"
        "import flows.console\n"
        "assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, 'installed at import'\n"
        "cli = types.ModuleType('flows.cli')\n"
        "cli.main = lambda: print(callable(signal.getsignal(signal.SIGTERM)))\n"
        "sys.modules['flows.cli'] = cli\n"
        "flows.console.main()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"
