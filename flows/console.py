"""The `delivery` console script: the stop signals first, then the command line.

`delivery serve` takes seconds to start (Prefect, the server), and a `delivery serve` signalled during
those seconds must still stop cleanly (exit 0, see `flows.stop_signals`). So on a `delivery serve`
command line the signals are taken over here, when the command starts and before anything else is
imported. Importing a module of the engine, this one included, installs no handler.
"""

from __future__ import annotations

import sys

from flows.stop_signals import claim_if_serving


def main() -> None:
    claim_if_serving(sys.argv)
    from flows.cli import main as cli_main  # after the claim, so that nothing imported comes first

    cli_main()
