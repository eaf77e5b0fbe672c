"""The Prefect-server-restart scenario of test_server_restart.py on PostgreSQL: a module of its own,
so that another xdist worker runs it beside the SQLite one."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.support.restart import restart_mid_chain
from tests.target_server import TargetServer

pytestmark = [pytest.mark.slow]


@pytest.mark.parametrize("db_url", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True)
def test_a_server_killed_and_started_again_mid_chain_does_not_stop_the_rule(
    engine: sa.Engine, target: TargetServer, db_url: str, tmp_path: Path
) -> None:
    restart_mid_chain(engine, target, db_url, tmp_path)
