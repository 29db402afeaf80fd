"""/dashboard/data with many envs stays small: per env for the first `metrics_max_envs`, the rest summed (10,000
envs made every poll a 9 MB body and 0.2-0.5 s of the event loop)."""

from __future__ import annotations

import httpx
import pytest

from api.app import create_app
from api.config.settings import Settings
from api.store.base import QueueCounts
from tests.factories import env, group, registration

pytestmark = pytest.mark.anyio


async def test_env_rows_past_the_cap_are_summed_and_the_totals_stay_whole() -> None:
    app = create_app(Settings(store="memory://", metrics_max_envs=3))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as c:
            await c.post("/register", json=registration(batch_size=8))
            await c.get("/batch")
            for i in range(12):
                env_id = (await c.post("/register-env", json=env(f"e{i}", 4))).json()["env_id"]
                for seed in range(2):
                    r = await c.post("/scored_data", json=group(4, env_id=env_id, seed=10 * i + seed))
                    assert r.status_code == 200
            assert (await c.get("/batch")).json()["batch"]
            d = (await c.get("/dashboard/data")).json()
            service = app.state.service
            whole, capped = await service.snapshot(), await service.snapshot(3)
    for field in ("received", "served_groups", "served_seqs", "backpressure", "passed_over", "weight"):
        assert sum(getattr(e, field) for e in capped.envs) == sum(getattr(e, field) for e in whole.envs), field
    assert sum((e.queue for e in capped.envs), QueueCounts()) == sum((e.queue for e in whole.envs), QueueCounts())
    assert capped.envs[:3] == whole.envs[:3] and capped.envs_total == whole.envs_total == len(whole.envs) == 12
    assert [e["name"] for e in d["envs"]] == ["e0_0", "e1_0", "e2_0", "(other envs)"]
    assert d["envs_total"] == 12
    assert sum(e["received"] for e in d["envs"]) == 24  # the page's totals add up the rows
    assert sum(e["queue_groups"] for e in d["envs"]) == 24 - 2
    other = d["envs"][-1]
    assert other["received"] == 18 and other["weight"] == 9.0
    bias = d["drop_bias"]
    assert bias is not None and len(bias["envs"]) == 3 and bias["envs_total"] == 12


async def test_datasets_come_in_aggregate_only_when_the_run_uses_tasks() -> None:
    app = create_app(Settings(store="memory://", views_max_datasets=2))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as c:
            before = (await c.get("/dashboard/data")).json()
            for name in ("a", "b", "c"):
                spec = {"name": name, "tasks": [{"q": i} for i in range(4)]}
                assert (await c.post("/tasks/datasets", json=spec)).status_code == 200
            leased = await c.post("/tasks/lease", json={"dataset": "a", "producer_id": "p", "n": 3})
            token = leased.json()["leases"][0]["token"]
            assert (await c.post("/tasks/fail", json={"token": token, "reason": "crashed"})).status_code == 200
            after = (await c.get("/dashboard/data")).json()
    assert (before["tasks"], before["tasks_total"]) == ([], 0)
    assert [t["name"] for t in after["tasks"]] == ["a", "b"] and after["tasks_total"] == 3, "views_max_datasets"
    assert after["tasks"][0]["counts"] == {"leased": 2, "failed": 1} and after["tasks"][0]["position"] == 3
