"""What the acceptance modules of the tick alerts share: a real Prefect server with the alert
services on, one per module (the automations a module installs stay its own), Prefect's settings
pointed at it for a test, and a webhook receiving what the alerts post."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.alerts import Receiver, alerting_server, api_of


@pytest.fixture(scope="module")
def alerting_server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with alerting_server(tmp_path_factory.mktemp("prefect-server")) as api:
        yield api


@pytest.fixture
def alerting_api(alerting_server_url: str) -> Iterator[str]:
    with api_of(alerting_server_url) as api:
        yield api


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    made = Receiver()
    yield made
    made.httpd.shutdown()
