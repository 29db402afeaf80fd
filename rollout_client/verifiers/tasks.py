"""A verifiers taskset leased from rollbuf (docs/tasks-producers.md, "From a producer"): registered once as a
dataset, then each producer's task source is a `LeasedTasks` over it instead of its own walk of the taskset, so
that many verifiers producers share one taskset, each task rolled out once per epoch, its fate known, resumed
from the true frontier.

    await register_verifiers_dataset(url, "gsm8k", env_config, epochs=2, order="shuffled")   # once
    runner = RolloutRunner(url, [(env, verifiers_leased_tasks("gsm8k", url))], ExternalInference())

A registered task is `{"id": key, "prompt": text, "verifiers_task": data}`: `LeasedTasks`' default mapping turns it
back into the `Task` that `verifiers_tasks` makes (`meta["verifiers_task"]`, what `VerifiersEnvironment` runs).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import httpx

from api.wire.tasks import DatasetView
from client_core.config import DEFAULT_TIMEOUT, DEFAULT_URL, RETRY_DEADLINE_S, auth_headers
from rollout_client.client import RolloutClient
from rollout_client.leases.datasets import register_dataset
from rollout_client.leases.tasks import LeasedTasks
from rollout_client.verifiers.environment import TASK_KEY
from rollout_client.verifiers.pool import resolve


def verifiers_task_rows(env_config: Mapping[str, Any], *, limit: int | None = None) -> Iterator[dict[str, Any]]:
    """The environment's taskset as dataset rows, in its order, streamed. An endless taskset needs `limit`."""
    from verifiers.v1.utils.loaders import load_taskset

    taskset = load_taskset(resolve(env_config).taskset)
    if limit is not None:
        taskset = taskset.take(limit)
    elif not taskset.bounded:
        raise ValueError("an endless taskset has no end to register: give limit")
    for t in taskset:
        yield {"id": str(t.key), "prompt": t.data.prompt_text, TASK_KEY: t.data.model_dump(mode="json")}


async def register_verifiers_dataset(
    base_url: str,
    name: str,
    env_config: Mapping[str, Any],
    *,
    api_key: str | None = None,
    limit: int | None = None,
    page: int | None = None,
    retry_deadline: float = RETRY_DEADLINE_S,
    transport: httpx.AsyncBaseTransport | None = None,
    **spec: Any,
) -> DatasetView:
    """Register the taskset as dataset `name` (`spec`: epochs, seed, order, max_retries... as POST /tasks/datasets
    takes them), a page at a time (`register_dataset`; `page`: most tasks a page, default the server's). Safe to
    run again: a registration already made is answered as the first was, and each page posted again is a no-op."""
    rows = verifiers_task_rows(env_config, limit=limit)
    http = httpx.AsyncClient(
        base_url=base_url, headers=auth_headers(api_key), timeout=DEFAULT_TIMEOUT, transport=transport
    )
    async with http, RolloutClient(base_url, retry_deadline=retry_deadline, http_client=http) as client:
        return await register_dataset(client, name, rows, page=page, **spec)


def verifiers_leased_tasks(dataset: str, base_url: str = DEFAULT_URL, **kw: Any) -> LeasedTasks:
    """The producer's task source: `dataset`'s tasks leased from rollbuf (`kw`: as `LeasedTasks` takes them)."""
    return LeasedTasks(dataset, base_url, **kw)


__all__ = ["register_verifiers_dataset", "verifiers_leased_tasks", "verifiers_task_rows"]
