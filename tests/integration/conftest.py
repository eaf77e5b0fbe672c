"""The small world of one rule that most integration tests share (tests/integration/world.py)."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from tests.integration.world import World
from tests.target_server import TargetServer


@pytest.fixture
def world(engine: sa.Engine, target: TargetServer, request: pytest.FixtureRequest) -> World:
    """One rule, applied, delivering to the real local target. Its chains run in this process
    without Prefect: the engine's behaviour is the subject. A test marked `through_prefect` runs
    them through the real `deliver-rule` flow on the session's Prefect API instead, for what the
    flow adds (its run's state and record, its logs, the batch timeout, the rule lock)."""
    through_prefect = request.node.get_closest_marker("through_prefect") is not None
    if through_prefect:
        request.getfixturevalue("prefect_api")
    return World(engine, target, through_prefect=through_prefect).apply()
