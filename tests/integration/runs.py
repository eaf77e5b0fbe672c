"""Reading back what a chain left in Prefect: its run's state, its log lines, its artifacts, events.

Whatever API the current settings point at: the test harness, or a real `prefect server start`."""

from __future__ import annotations

import asyncio
from typing import Any
from uuid import UUID


def run_state(flow_run_id: str) -> tuple[str, str]:
    """(state type, state name) of a flow run, as the API holds it."""
    from prefect import get_client

    async def read() -> tuple[str, str]:
        async with get_client() as client:
            run = await client.read_flow_run(UUID(flow_run_id))
        assert run.state is not None
        return run.state.type.value, run.state.name or ""

    return asyncio.run(read())


def run_logs(flow_run_id: str) -> list[str]:
    """The messages of a flow run's log, sent first (they leave in batches)."""
    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=10)

    async def read() -> list[str]:
        async with get_client() as client:
            logs = await client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[UUID(flow_run_id)])), limit=200
            )
        return [log.message for log in logs]

    return asyncio.run(read())


def run_artifacts(flow_run_id: str) -> dict[str, Any]:
    """A flow run's keyed artifacts by key."""
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    async def read() -> dict[str, Any]:
        async with get_client() as client:
            artifacts = await client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[UUID(flow_run_id)]))
            )
        return {a.key: a for a in artifacts if a.key}

    return asyncio.run(read())


def run_tags(flow_run_id: str) -> set[str]:
    """A flow run's tags, as the API holds them."""
    from prefect import get_client

    async def read() -> set[str]:
        async with get_client() as client:
            return set((await client.read_flow_run(UUID(flow_run_id))).tags)

    return asyncio.run(read())


def child_runs(flow_run_id: str) -> list[Any]:
    """The subflow runs of a flow run (drain, scan), oldest first."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
    from prefect.client.schemas.sorting import FlowRunSort

    async def read() -> list[Any]:
        async with get_client() as client:
            return await client.read_flow_runs(
                flow_run_filter=FlowRunFilter(
                    parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[UUID(flow_run_id)])
                ),
                sort=FlowRunSort.START_TIME_ASC,
            )

    return asyncio.run(read())
