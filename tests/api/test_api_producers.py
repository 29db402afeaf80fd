"""Weights announced through rollbuf and producers seen live, through the ASGI app on every store: POST /weights
reaches /status-env and heartbeat replies; producers show in /status, /producers, /metrics and the dashboard's
data; a waiting trainer's /batch says why nothing can arrive (`stall_reason`)."""

from __future__ import annotations

import time

import httpx
import pytest

from api.config.settings import Settings
from tests.asgi import serving
from tests.factories import env, group, registration

pytestmark = pytest.mark.anyio


async def start(c: httpx.AsyncClient) -> int:
    assert (await c.post("/register", json=registration(batch_size=4))).status_code == 200
    await c.get("/batch")
    reply = await c.post("/register-env", json=env(group_size=4))
    return int(reply.json()["env_id"])


async def test_announced_weights_reach_env_status_and_heartbeats_and_never_go_back(settings: Settings) -> None:
    async with serving(settings) as c:
        assert (await c.post("/weights", json={"step": 0})).status_code == 409  # no trainer yet
        env_id = await start(c)
        assert (await c.get("/status-env", params={"env_id": env_id})).json()["weights_step"] is None
        assert (await c.get("/weights")).json() == {"weights_step": None}
        assert (await c.post("/weights", json={"step": 0})).json() == {"weights_step": 0}
        past = await c.post("/weights", json={"step": 5})
        assert past.status_code == 409 and past.json()["errors"][0]["loc"] == ["body", "step"]
        assert (await c.get("/status-env", params={"env_id": env_id})).json()["weights_step"] == 0
        hb = await c.post("/producers/heartbeat", json={"producer_id": "p1", "host": "h1", "env_ids": [env_id]})
        assert hb.json()["weights_step"] == 0 and hb.json()["gone_after"] == settings.producer_gone_after
        bad = await c.post("/producers/heartbeat", json={"producer_id": "p1", "env_ids": [99]})
        assert bad.status_code == 404 and bad.json()["errors"][0]["loc"] == ["body", "env_ids", 0]


async def test_producers_show_live_then_gone_and_a_waiting_trainer_is_told_why(settings: Settings) -> None:
    settings.producer_gone_after = 0.5
    async with serving(settings) as c:
        env_id = await start(c)
        beat = {"producer_id": "p1", "host": "h1", "env_ids": [env_id], "in_flight": 4, "groups_per_s": 1.5}
        assert (await c.post("/producers/heartbeat", json=beat)).status_code == 200
        status = (await c.get("/status")).json()
        [p] = status["producers"]
        assert (p["producer_id"], p["envs"], p["live"], p["in_flight"]) == ("p1", ["math_0"], True, 4)
        assert status["stall_reason"] is None
        assert "stall_reason" not in (await c.get("/batch")).json()
        metrics = (await c.get("/metrics")).text
        assert 'rollbuf_producers{env="math_0",state="live"} 1.0' in metrics
        deadline = time.monotonic() + 10
        while (await c.get("/producers")).json()[0]["live"] and time.monotonic() < deadline:
            await c.get("/healthz")  # the clock moves on; nothing to wait for but time
        status = (await c.get("/status")).json()
        assert status["producers"][0]["live"] is False
        assert "no live producer for env(s) math_0" in status["stall_reason"]
        reply = (await c.get("/batch")).json()
        assert reply["batch"] is None and "no live producer" in reply["stall_reason"]
        assert 'state="gone"' in (await c.get("/metrics")).text
        data = (await c.get("/dashboard/data")).json()
        assert data["producers"][0]["producer_id"] == "p1" and data["stall_reason"]
        held = {**beat, "held": {"math_0": "ahead_of_trainer"}, "weights_step": 0}
        await c.post("/producers/heartbeat", json=held)
        assert "held back (ahead_of_trainer)" in (await c.get("/batch")).json()["stall_reason"]


async def test_held_back_counts_as_a_stall_only_when_judged_since_the_trainer_last_moved(settings: Settings) -> None:
    """A held-back verdict from before the trainer's last batch or weights announcement may no longer hold: the
    trainer's no-progress clock must not start on it. It counts again once a heartbeat carries one judged since."""
    async with serving(settings) as c:
        env_id = await start(c)

        async def held(trainer_step: int, weights_step: int = 0) -> None:
            beat = {
                "producer_id": "p1",
                "host": "h1",
                "env_ids": [env_id],
                "held": {"math_0": "ahead_of_trainer"},
                "weights_step": weights_step,
                "trainer_step": trainer_step,
            }
            assert (await c.post("/producers/heartbeat", json=beat)).status_code == 200

        async def stall() -> str | None:
            reply = (await c.get("/batch")).json()
            assert reply["batch"] is None
            why: str | None = reply.get("stall_reason")
            assert (await c.get("/status")).json()["stall_reason"] == why
            return why

        await held(trainer_step=0)
        assert "held back (ahead_of_trainer)" in (await stall() or "")
        await c.post("/scored_data", json=group(4, env_id=env_id))
        assert (await c.get("/batch")).json()["batch"] is not None  # the trainer steps: batch 0, now at step 1
        assert await stall() is None  # the producer judged at step 0: it may start groups at its next read
        await held(trainer_step=0)  # a beat after the step, with a verdict read before it: still no evidence
        assert await stall() is None
        await held(trainer_step=1)
        assert "held back (ahead_of_trainer)" in (await stall() or "")
        assert (await c.post("/weights", json={"step": 1})).status_code == 200
        assert await stall() is None  # new weights announced: it has not judged with them yet
        await held(trainer_step=1, weights_step=0)  # it has not read the announcement: it generates with step 0
        assert await stall() is None
        await held(trainer_step=1, weights_step=1)
        assert "held back (ahead_of_trainer)" in (await stall() or "")


async def test_a_fresh_run_nothing_joined_is_a_stall_only_after_gone_after(settings: Settings) -> None:
    settings.producer_gone_after = 0.3
    async with serving(settings) as c:
        assert (await c.post("/register", json=registration(batch_size=4))).status_code == 200
        assert (await c.get("/batch")).json() == {"batch": None}  # producers register after this first poll
        deadline = time.monotonic() + 10
        while "stall_reason" not in (reply := (await c.get("/batch")).json()) and time.monotonic() < deadline:
            pass  # each poll reads the clock again; nothing else to wait for
        assert reply["stall_reason"].startswith("no environment is registered and no producer has reported")
        assert (await c.get("/status")).json()["stall_reason"] == reply["stall_reason"]


async def test_a_pending_sync_reaches_producers_waits_for_live_drain_producers_and_ends_when_announced(
    settings: Settings,
) -> None:
    settings.producer_gone_after = 0.5
    async with serving(settings) as c:
        assert (await c.post("/weights/pending", json={"step": 0})).status_code == 409  # no trainer yet
        env_id = await start(c)
        await c.post("/weights", json={"step": 0})
        assert (await c.get("/weights/pending")).json()["pending_step"] is None
        # step 0 is announced already: beginning a sync to it changes nothing (a retry after the announcement)
        assert (await c.post("/weights/pending", json={"step": 0})).json()["pending_step"] is None
        await c.post("/scored_data", json=group(4, env_id=env_id))
        assert (await c.get("/batch")).json()["batch"] is not None  # the trainer is at step 1
        past = await c.post("/weights/pending", json={"step": 2})
        assert past.status_code == 409 and past.json()["errors"][0]["loc"] == ["body", "step"]
        drains = {"producer_id": "d1", "host": "h1", "env_ids": [env_id], "drains": True}
        await c.post("/producers/heartbeat", json=drains)
        await c.post("/producers/heartbeat", json={"producer_id": "c1", "host": "h2", "env_ids": [env_id]})
        begun = (await c.post("/weights/pending", json={"step": 1})).json()
        assert begun == {"weights_step": 0, "pending_step": 1, "waiting_on": ["d1 on h1"], "drained": False}
        assert (await c.get("/status-env", params={"env_id": env_id})).json()["weights_pending"] == 1
        assert (await c.post("/producers/heartbeat", json=drains)).json()["weights_pending"] == 1
        await c.post("/producers/heartbeat", json={**drains, "drained_for": 1})
        assert (await c.get("/weights/pending")).json()["drained"] is True
        seen = {p["producer_id"]: (p["drains"], p["drained_for"]) for p in (await c.get("/producers")).json()}
        assert seen == {"d1": (True, 1), "c1": (False, None)}
        await c.post("/producers/heartbeat", json={**drains, "drained_for": None})
        deadline = time.monotonic() + 10
        while not (await c.get("/weights/pending")).json()["drained"] and time.monotonic() < deadline:
            await c.get("/healthz")  # the producer goes quiet: once gone it is not waited for
        assert (await c.get("/weights/pending")).json()["waiting_on"] == []
        assert (await c.post("/weights", json={"step": 1})).json() == {"weights_step": 1}
        assert (await c.get("/weights/pending")).json() == {
            "weights_step": 1,
            "pending_step": None,
            "waiting_on": [],
            "drained": False,
        }
        assert (await c.get("/status-env", params={"env_id": env_id})).json()["weights_pending"] is None
