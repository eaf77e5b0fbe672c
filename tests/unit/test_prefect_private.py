"""The Prefect internals `flows/prefect_private.py` relies on are still where it expects them and
still take what it passes. When a Prefect upgrade moves or reshapes one, this fails, naming it,
rather than the rule lock failing at run time."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import flows.prefect_private

ROOT = Path(__file__).resolve().parents[2]


def test_the_ephemeral_servers_are_where_we_look_for_them() -> None:
    server = importlib.import_module(flows.prefect_private.EPHEMERAL_SERVER_MODULE)
    servers = server.SubprocessASGIServer
    assert isinstance(servers._instances, dict)
    assert isinstance(inspect.getattr_static(servers, "api_url"), property)
    assert "port" in inspect.signature(servers.__init__).parameters
    # It sets .port on the instance from that parameter.
    assert "self.port" in inspect.getsource(servers.__init__)


def test_the_flow_engine_starts_the_suspension_observer_where_we_replace_it() -> None:
    engine = importlib.import_module(flows.prefect_private.FLOW_ENGINE_MODULE)
    observer = getattr(engine, flows.prefect_private.SUSPENSION_OBSERVER)
    assert observer.__module__ == "prefect._flow_run_suspension"
    # The engine calls it through its module global, at each run of a deployment, as a context manager.
    setup = inspect.getsource(engine.BaseFlowRunEngine.setup_flow_run_suspension_request)
    assert f"{flows.prefect_private.SUSPENSION_OBSERVER}(" in setup and "deployment_id" in setup
    assert list(inspect.signature(observer).parameters)[:2] == ["flow_run_id", "suspension_request"]


def test_skipping_the_suspension_observer_leaves_a_context_manager_in_its_place() -> None:
    engine = importlib.import_module(flows.prefect_private.FLOW_ENGINE_MODULE)
    name = flows.prefect_private.SUSPENSION_OBSERVER
    real = getattr(engine, name)
    try:
        flows.prefect_private.skip_suspension_observers()
        with getattr(engine, name)("run-id", object()):
            pass
    finally:
        setattr(engine, name, real)


def test_only_the_private_module_imports_prefect_internals() -> None:
    """Any other `prefect.<...>._x` import in the engine would escape the test above."""
    offenders = []
    for package in ("delivery", "flows", "playground"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == ROOT / "flows" / "prefect_private.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.Import | ast.ImportFrom):
                    continue
                modules: list[str] = []
                if isinstance(node, ast.ImportFrom) and node.module:
                    modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                elif isinstance(node, ast.Import):
                    modules = [a.name for a in node.names]
                for module in modules:
                    parts = module.split(".")
                    if parts[0] == "prefect" and any(part.startswith("_") for part in parts[1:]):
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {module}")
    assert offenders == []
