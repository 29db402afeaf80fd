"""A verifiers taskset leased from rollbuf (rollout_client/verifiers_tasks.py): registered a page at a time, then
leased by two producers, each task once per epoch and as `verifiers_tasks` makes it (what the env runs)."""

from __future__ import annotations

import httpx
import pytest

from api.app import create_app
from api.settings import Settings
from rollout_client.verifiers import verifiers_tasks
from rollout_client.verifiers_tasks import register_verifiers_dataset, verifiers_leased_tasks, verifiers_task_rows
from tests.integration.test_verifiers_producer import offline
from tests.verifiers_tiny import env_config_data

pytestmark = [pytest.mark.integration, pytest.mark.anyio]
__all__ = ["offline"]  # the fixture, used by name


@pytest.mark.usefixtures("offline")
async def test_producers_lease_a_verifiers_taskset_once_per_epoch() -> None:
    config = env_config_data()
    walked = verifiers_tasks(config, cycle=False)
    expected = {t.id: t for t in iter(walked.next_task, None)}
    assert len(expected) >= 3
    with pytest.raises(ValueError, match="give limit"):
        next(verifiers_task_rows({**config, "taskset": {"id": "rollbuf_endless_vf"}}))
    app = create_app(Settings(store="memory://"))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)  # the server in process, as the producers' transport
        spec = {"page": 2, "epochs": 2, "order": "shuffled", "seed": 3, "transport": transport}
        view = await register_verifiers_dataset("http://localhost", "vf", config, **spec)
        again = await register_verifiers_dataset("http://localhost", "vf", config, **spec)
        assert view.size == again.size == len(expected) and view.sealed, "a second run is a no-op"
        sources = [verifiers_leased_tasks("vf", "http://localhost", transport=transport, batch=2) for _ in range(2)]
        got = []
        while len(got) < len(expected):  # the first epoch, the two producers in turn
            source = sources[len(got) % 2]
            task = await source.anext_task()
            assert task is not None
            got.append(task)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            [dataset] = (await c.get("/tasks")).json()
        for source in sources:
            await source.aclose()
    assert sorted(t.id for t in got) == sorted(expected), "each task once in the epoch"
    for t in got:
        assert (t.prompt, t.meta["verifiers_task"]) == (expected[t.id].prompt, expected[t.id].meta["verifiers_task"])
    assert dataset["counts"] == {"leased": len(expected)} and dataset["epoch"] == 0
