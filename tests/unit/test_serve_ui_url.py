"""`delivery serve --port P` starts a Prefect server whose UI calls the API on P, not on 4200."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest

from flows import serve


class _Captured:
    env: dict[str, str] = {}

    def __init__(self, args: list[str], **kwargs: Any) -> None:
        _Captured.env = kwargs["env"]
        self.args = args


def test_the_ui_is_told_the_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PREFECT_UI_API_URL", raising=False)
    monkeypatch.setattr(subprocess, "Popen", _Captured)
    serve._start_server(4321)
    assert _Captured.env["PREFECT_UI_API_URL"] == "http://127.0.0.1:4321/api"


def test_an_operators_ui_api_url_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFECT_UI_API_URL", "https://prefect.example.com/api")
    monkeypatch.setattr(subprocess, "Popen", _Captured)
    serve._start_server(4321)
    assert _Captured.env["PREFECT_UI_API_URL"] == "https://prefect.example.com/api"
