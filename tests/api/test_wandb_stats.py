"""The buffer's W&B run, offline: the run files it writes hold the stats of a small run."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from api.app import create_app
from api.config.settings import Settings
from api.run.stats import EnvSnapshot, Snapshot
from api.store.base import QueueCounts
from api.store.memory import MemoryStore
from api.views import wandb_stats
from tests.small_run import MAX_ENV_QUEUE_GROUPS, small_run
from tests.wandb_files import history, records, run_info

pytestmark = pytest.mark.anyio


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    return tmp_path


async def test_offline_run_files_hold_the_buffer_stats(offline: Path) -> None:
    settings = Settings(store=f"sqlite:///{offline / 'r.db'}", max_env_queue_groups=MAX_ENV_QUEUE_GROUPS)
    app = create_app(settings.model_copy(update={"wandb_interval": 0.2}))
    async with app.router.lifespan_context(app):
        stats_logger = app.state.wandb_stats
        assert stats_logger is not None
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as c:
            await small_run(c)
        logged = stats_logger.logged
        for _ in range(600):  # wait (polling) for logs that saw the whole run, twice (the last: nothing new)
            if stats_logger.logged >= logged + 3:
                break
            await asyncio.sleep(0.05)
        assert stats_logger.logged >= logged + 3
    [path] = list(offline.glob("wandb/offline-run-*/run-*.wandb"))
    recs = records(path)
    run = run_info(recs)
    assert (run.project, run.run_group, run.job_type, run.display_name) == ("p", "g", "buffer", "rollbuf-buffer")
    rows = history(recs)
    last = rows[-1]
    assert last["buffer/step"] == 3 and last["buffer/batches"] == 3 and last["buffer/blocked"] == 0
    assert last["queue_groups/math_0"] == 2 and last["queue_groups/code_0"] == 0
    assert last["queue_tokens/math_0"] == 64
    assert last["received/math_0"] == 7 and last["received/code_0"] == 3
    assert last["dropped/code_0/stale"] == 1 and last["dropped/code_0/zero_variance"] == 1
    assert last["dropped/all/stale"] == 1
    assert last["backpressure/math_0"] == 1 and last["backpressure/code_0"] == 0
    assert last["mix_weight/math_0"] == pytest.approx(2 / 3) and last["mix_weight/code_0"] == pytest.approx(1 / 3)
    assert last["mix_served_run/math_0"] == pytest.approx(20 / 24)
    assert "mix_served/math_0" not in last and "staleness/mean" not in last  # nothing served since the last log
    served = [row for row in rows if "mix_served/math_0" in row]
    assert served and all(0 <= row["mix_served/math_0"] <= 1 for row in served)
    assert all(0 <= row["staleness/mean"] <= 1 for row in rows if "staleness/mean" in row)
    assert last["staleness/histogram/_type"] == "histogram"
    assert last["staleness/histogram/values"] == [4, 2]
    assert any("buffer/batches_per_s" in row for row in rows)
    assert all(row["buffer/batches_per_s"] >= 0 for row in rows if "buffer/batches_per_s" in row)


async def test_off_unless_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert not wandb_stats.configured()
    app = create_app(Settings(store="memory://"))
    async with app.router.lifespan_context(app):
        assert app.state.wandb_stats is None


async def test_a_failing_wandb_is_logged_never_fatal(offline: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A project name W&B refuses: each tick fails inside wandb; the service keeps serving."""
    store = MemoryStore()
    snap = Snapshot(True, 1, 1, 8, None, {}, [], wandb_project="bad/project:name", wandb_group="g")

    async def snapshot() -> Snapshot:
        return snap

    stats_logger = wandb_stats.BufferStatsLogger(store, snapshot, 0.05)
    stats_logger.start()
    try:
        for _ in range(400):
            if any("W&B buffer stats" in r.getMessage() for r in caplog.records):
                break
            await asyncio.sleep(0.05)
    finally:
        await stats_logger.close()
    assert any(r.levelname == "WARNING" and "W&B buffer stats" in r.getMessage() for r in caplog.records)
    assert stats_logger.logged == 0


async def test_one_process_logs_at_a_time() -> None:
    store = MemoryStore()
    assert await store.transact(lambda t: wandb_stats.take_lease(t, "a", now=100.0, ttl=10.0))
    assert not await store.transact(lambda t: wandb_stats.take_lease(t, "b", now=105.0, ttl=10.0))
    assert await store.transact(lambda t: wandb_stats.take_lease(t, "a", now=105.0, ttl=10.0))  # renewed
    assert await store.transact(lambda t: wandb_stats.take_lease(t, "b", now=116.0, ttl=10.0))  # expired
    await store.transact(lambda t: wandb_stats.release_lease(t, "b"))
    assert await store.transact(lambda t: wandb_stats.take_lease(t, "a", now=117.0, ttl=10.0))


def test_rates_and_mix_over_the_interval() -> None:
    def snap(received: int, served: dict[str, int], batches: int) -> Snapshot:
        envs = [
            EnvSnapshot(n, w, 4, True, None, QueueCounts(), received, 0, served[n], 0, {})
            for n, w in (("a", 3.0), ("b", 1.0))
        ]
        return Snapshot(True, batches, batches, 8, None, {}, envs)

    before = wandb_stats.Tick(10.0, snap(5, {"a": 8, "b": 8}, 2))
    now = wandb_stats.Tick(12.0, snap(9, {"a": 14, "b": 10}, 3))
    out = wandb_stats.buffer_stats(now, before)
    assert out["buffer/batches_per_s"] == 0.5
    assert out["buffer/groups_received_per_s"] == 4.0  # two envs, 4 more groups each, over 2 s
    assert out["received_per_s/a"] == 2.0
    assert out["mix_served/a"] == 0.75 and out["mix_weight/a"] == 0.75  # 6 of 8 served in the interval
