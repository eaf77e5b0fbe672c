"""A Prefect server restart does not stop a rule for good (issue 29, point 4).

`prefect server start` keeps concurrency leases in memory. Killed (-9) and started again while a
`delivery worker` runs a chain, it still counts the rule lock's slot as taken, by a lease it no
longer knows and will never repossess. Before, every later chain waited "for the rule lock ... held
by no chain on record" for as long as anyone watched. The delivery database decides who works a
rule: once the slot has stood taken with nobody on record for longer than any lease could live and
be repossessed, a waiter resets it, on any server, and the chain goes on.

The test: a worker delivers a rule's records through a slow target; the server is killed -9 in the
middle of the chain and started again on the same port and database; ticks go on as the schedule
would run them. Every record is delivered within the dead-chain threshold plus a minute (and the
lock's bounded wait), and the target holds exactly one copy of each.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.support.restart import restart_mid_chain
from tests.target_server import TargetServer

pytestmark = [pytest.mark.slow]


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_server_killed_and_started_again_mid_chain_does_not_stop_the_rule(
    engine: sa.Engine, target: TargetServer, db_url: str, tmp_path: Path
) -> None:
    restart_mid_chain(engine, target, db_url, tmp_path)
