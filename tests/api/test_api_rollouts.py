"""Groups whose rollouts arrive one by one, through the ASGI app on every store (docs/rollouts.md): a group opened,
its rollouts acknowledged (idempotent by slot, 409 for other content), sealed when all G are in and served by
/batch as a whole group; a lapsed holder's missing slots leased to a sibling, a slot redone keeping the first; a
deadline seal leaving slots out with why; group-level scores at the seal; the bounds."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import orjson
import pytest

from api.app import create_app
from api.config.settings import Settings
from rollout_client.examples import Arithmetic
from rollout_client.leases.open_groups import OpenGroups
from rollout_client.runner.inflight import InFlight
from rollout_client.runner.siblings import SiblingSlots
from rollout_client.runner.stats import RunnerStats
from tests.asgi import service_of, serving, serving_app
from tests.factories import env, group, registration

pytestmark = pytest.mark.anyio


async def start(c: httpx.AsyncClient, group_size: int = 4, **extra: Any) -> None:
    assert (await c.post("/register", json=registration(batch_size=group_size))).status_code == 200
    await c.get("/batch")
    assert (await c.post("/register-env", json=env(group_size=group_size, **extra))).status_code == 200


def rollout(gid: str, slot: int, producer: str = "p1", score: float | None = 1.0, n: int = 6) -> dict[str, Any]:
    tokens = [slot + 1] * n
    return {
        "group_id": gid,
        "slot": slot,
        "producer_id": producer,
        "tokens": tokens,
        "masks": tokens,
        "inference_logprobs": [-0.5] * n,
        "score": score,
    }


async def opened(c: httpx.AsyncClient, gid: str, **extra: Any) -> dict[str, Any]:
    body = {"group_id": gid, "env_id": 0, "producer_id": "p1", "group_size": 4, "deadline_s": 600.0, **extra}
    reply = await c.post("/rollouts/open", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()  # type: ignore[no-any-return]


async def post(c: httpx.AsyncClient, body: dict[str, Any], status: int = 200) -> dict[str, Any]:
    reply = await c.post("/rollouts/post", json=body)
    assert reply.status_code == status, reply.text
    return reply.json()  # type: ignore[no-any-return]


async def test_rollouts_acknowledged_one_by_one_are_served_as_one_group(settings: Settings) -> None:
    async with serving(settings) as c:
        await start(c)
        await opened(c, "g1", task={"q": 1})
        assert (await opened(c, "g1", task={"q": 1}))["state"] == "open", "opening again is a no-op"
        other = {"group_id": "g1", "env_id": 0, "producer_id": "p1", "group_size": 8, "deadline_s": 600.0}
        assert (await c.post("/rollouts/open", json=other)).status_code == 409
        for slot in (2, 0, 1):
            assert (await post(c, rollout("g1", slot)))["status"] == "accepted"
        assert (await post(c, rollout("g1", 1)))["status"] == "duplicate"
        await post(c, {**rollout("g1", 1), "score": 0.0}, 409)
        assert (await c.get("/batch")).json()["batch"] is None, "nothing is served before the seal"
        last = await post(c, rollout("g1", 3))
        assert last["group"]["state"] == "sealed" and last["group"]["slots_done"] == 4
        assert (last["group"]["done"], last["group"]["leased"], last["group"]["turns"]) == (None, None, None)
        full = (await c.get("/rollouts/group", params={"group_id": "g1"})).json()
        assert (full["done"], full["slots_done"], full["leased"]) == ([0, 1, 2, 3], 4, {})
        batch = (await c.get("/batch")).json()["batch"]
        assert batch is not None and len(batch) == 1
        assert sorted(t[0] for t in batch[0]["tokens"]) == [1, 2, 3, 4]
        assert (await post(c, rollout("g1", 3, producer="p2", score=0.5)))["status"] == "redone"
        totals = (await c.get("/rollouts")).json()
        seen = (totals["opened"], totals["sealed"], totals["slots"], totals["open"], totals["redone"])
        assert seen == (1, 1, 4, 0, 1)
        exposition = (await c.get("/metrics")).text
        assert "rollbuf_rollout_groups_open 0.0" in exposition
        assert 'rollbuf_rollout_events_total{event="slots"} 4.0' in exposition


async def test_a_lapsed_holders_missing_slots_go_to_a_sibling_and_the_first_is_kept(settings: Settings) -> None:
    async with serving(settings, rollout_lease_s=0.001, rollout_sweep_every_s=3600.0) as c:  # no lease dropped
        await start(c)
        await opened(c, "g2", task="prompt")
        await post(c, rollout("g2", 0))
        leases = await leased(c, "p2", 8)  # once the holder's lease (1 ms) lapsed
        assert sorted(x["slot"] for x in leases) == [1, 2, 3] and leases[0]["task"] == "prompt"
        beat = (await c.post("/rollouts/heartbeat", json={"producer_id": "p2", "group_ids": ["g2", "nope"]})).json()
        assert beat["expires_at"]["nope"] is None and beat["expires_at"]["g2"] is not None
        assert (await post(c, rollout("g2", 1, producer="p1")))["status"] == "accepted", "the slow holder's first"
        assert (await post(c, rollout("g2", 1, producer="p2", score=0.0)))["status"] == "redone"
        for slot in (2, 3):
            await post(c, rollout("g2", slot, producer="p2"))
        view = (await c.get("/rollouts/group", params={"group_id": "g2"})).json()
        assert view["state"] == "sealed" and view["redispatched"] == 3
        batch = (await c.get("/batch")).json()["batch"]
        assert batch[0]["scores"] == [1.0] * 4, "slot 1 is the holder's (score 1.0), not the redo's (0.0)"


async def test_a_deadline_seals_what_is_in_or_expires_the_group(settings: Settings) -> None:
    async with serving(settings) as c:
        await start(c, variable_group_size=True)
        g3 = await opened(c, "g3", min_group_size=2, deadline_s=0.001)
        g4 = await opened(c, "g4", min_group_size=2, deadline_s=0.001)
        await post(c, rollout("g3", 0))
        await post(c, rollout("g3", 2))
        await post(c, rollout("g4", 0))
        await past(max(g3["deadline"], g4["deadline"]))
        assert (await c.post("/rollouts/lease", json={"producer_id": "p9"})).status_code == 200  # sweeps
        g3 = (await c.get("/rollouts/group", params={"group_id": "g3"})).json()
        assert g3["state"] == "sealed" and g3["left_out"] == {"1": "not_done_by_deadline", "3": "not_done_by_deadline"}
        g4 = (await c.get("/rollouts/group", params={"group_id": "g4"})).json()
        assert g4["state"] == "expired" and g4["left_out"] == {"group": "too_few_by_deadline"}
        totals = (await c.get("/rollouts")).json()
        assert (totals["sealed_partial"], totals["left_out"], totals["expired:too_few_by_deadline"]) == (1, 2, 1)


async def test_group_scores_come_with_the_producers_seal_and_bounds_hold(settings: Settings) -> None:
    async with serving(settings, rollout_max_open_groups=1) as c:
        await start(c)
        await opened(c, "g5", scores_at_seal=True)
        g6 = {"group_id": "g6", "env_id": 0, "producer_id": "p1", "group_size": 4, "deadline_s": 60.0}
        assert (await c.post("/rollouts/open", json=g6)).status_code == 503
        for slot in range(4):
            await post(c, rollout("g5", slot, score=None))
        assert (await c.get("/rollouts/group", params={"group_id": "g5"})).json()["state"] == "open"
        seal = {"group_id": "g5", "producer_id": "p1"}
        assert (await c.post("/rollouts/seal", json=seal)).status_code == 422, "scored at its seal: scores needed"
        done = await c.post("/rollouts/seal", json={**seal, "scores": {str(s): s / 4 for s in range(4)}})
        assert done.status_code == 200 and done.json()["state"] == "sealed", done.text
        batch = (await c.get("/batch")).json()["batch"]
        assert sorted(batch[0]["scores"]) == [0.0, 0.25, 0.5, 0.75]
        assert (await c.post("/rollouts/open", json=g6)).status_code == 200
        await post(c, {**rollout("nope", 0)}, 404)


async def test_posts_past_the_envs_open_bytes_are_refused_and_counted(settings: Settings) -> None:
    """A post that would take its env's open groups past `rollout_max_open_bytes` is a 503 with nothing stored; the
    refusals are counted (`refused`) by the next sweep, though each 503 undid its own transaction."""
    async with serving(settings, rollout_max_open_bytes=4000, rollout_sweep_every_s=0.02) as c:
        await start(c)
        await opened(c, "g")
        await post(c, rollout("g", 0, n=200))  # 2-3 KB packed: one fits, two do not
        for slot in (1, 2):
            refused = await c.post("/rollouts/post", json=rollout("g", slot, n=200))
            assert refused.status_code == 503 and "rollout_max_open_bytes" in refused.text, refused.text
            assert refused.headers["retry-after"]
        deadline = time.monotonic() + 10.0
        while (await c.get("/rollouts")).json().get("refused", 0) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert (await c.get("/rollouts")).json()["refused"] == 2
        assert (await c.get("/rollouts/group", params={"group_id": "g"})).json()["done"] == [0], "nothing stored"


async def past(at: float) -> None:
    """Return once the clock the server reads is past `at` (a deadline or lease end it gave), polled."""
    while time.time() <= at:
        await asyncio.sleep(0.001)


async def leased(c: httpx.AsyncClient, producer: str, n: int, timeout: float = 10.0) -> list[dict[str, Any]]:
    """The first sibling leases handed out, polled (bounded) until a holder lapsed."""
    deadline = time.monotonic() + timeout
    while True:
        got: list[dict[str, Any]] = (await c.post("/rollouts/lease", json={"producer_id": producer, "n": n})).json()[
            "leases"
        ]
        if got or time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.01)


async def settled(c: httpx.AsyncClient, gid: str, timeout: float = 10.0) -> dict[str, Any]:
    """The group's view once it is no longer open, polled (bounded) while only the clock moves."""
    deadline = time.monotonic() + timeout
    while True:
        view: dict[str, Any] = (await c.get("/rollouts/group", params={"group_id": gid})).json()
        if view["state"] in ("sealed", "expired") or time.monotonic() > deadline:
            return view
        await asyncio.sleep(0.01)  # a poll's pause: the background job runs meanwhile


async def test_the_background_sweep_seals_and_expires_at_the_deadline_with_no_lease_request(
    settings: Settings,
) -> None:
    async with serving(settings, rollout_sweep_every_s=0.02) as c:
        await start(c, variable_group_size=True)
        await opened(c, "g7", min_group_size=2, deadline_s=0.2)
        await opened(c, "g8", min_group_size=2, deadline_s=0.2)
        await post(c, rollout("g7", 0))
        await post(c, rollout("g7", 1))
        await post(c, rollout("g8", 3))
        g7, g8 = await settled(c, "g7"), await settled(c, "g8")
        assert g7["state"] == "sealed" and g7["done"] == [0, 1]
        assert g8["state"] == "expired" and g8["left_out"] == {"group": "too_few_by_deadline"}
        status = (await c.get("/status")).json()
        assert status["queue_size"] == 1, "g7 is queued, whole"
        assert status["dropped"] == {"math_0": {"rollouts_too_few_by_deadline": 1}}
        [row] = (await c.get("/ledger/groups/g8")).json()["groups"]
        assert (row["fate"], row["reason"], row["seqs"], row["producer_id"]) == (
            "dropped",
            "rollouts_too_few_by_deadline",
            1,
            "p1",
        ), "an expired group's ledger row says why"


async def test_status_and_the_dashboard_show_open_groups_only_once_one_was_opened(settings: Settings) -> None:
    async with serving(settings, rollout_lease_s=0.001, rollout_sweep_every_s=3600.0) as c:  # no lease dropped
        await start(c)
        assert "rollouts" not in (await c.get("/status")).json(), "a run without per-rollout groups: nothing new"
        assert "rollouts" not in (await c.get("/dashboard/data")).json()
        assert "rollbuf_rollout_open_slots" not in (await c.get("/metrics")).text
        await opened(c, "g9")
        await post(c, rollout("g9", 0))
        leases = await leased(c, "p2", 2)  # once the holder's lease (1 ms) lapsed
        assert len(leases) == 2
        block = {"open": 1, "slots_done": 1, "slots_leased": 2, "redispatched": 2, "sealed": 0, "expired": 0}
        block |= {"resumed": 0, "restarted": 2, "tokens_saved": 0}  # leased with no turn: started again
        assert (await c.get("/status")).json()["rollouts"] == block
        assert (await c.get("/dashboard/data")).json()["rollouts"] == block
        exposition = (await c.get("/metrics")).text
        assert 'rollbuf_rollout_open_slots{state="leased"} 2.0' in exposition
        await post(c, rollout("g9", leases[0]["slot"], producer="p2"))
        block |= {"slots_done": 2, "slots_leased": 1}
        assert (await c.get("/status")).json()["rollouts"] == block, "a leased slot that came in is done"
        for slot in range(1, 4):
            await post(c, rollout("g9", slot, producer="p2"))
        block |= {"open": 0, "slots_done": 0, "slots_leased": 0, "sealed": 1}
        assert (await c.get("/status")).json()["rollouts"] == block


async def test_the_export_has_a_rollouts_table_of_every_group_opened(settings: Settings) -> None:
    """One row per group opened, in any state, its slots as lists; paged by key (pages of 2 give the same)."""
    import io

    import pyarrow.parquet as pq

    from api.app import create_app
    from api.export.stream import ExportLimits, pages, parquet_stream

    app = create_app(settings.model_copy(update={"rollout_lease_s": 2.0, "rollout_sweep_every_s": 0.02}))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            await start(c, variable_group_size=True)
            await opened(c, "d-open", env_id=None)  # its holder lapses in 2 s; its sibling's lease holds 2 s more
            await post(c, rollout("d-open", 2))
            await opened(c, "a-sealed")
            for slot in range(4):
                await post(c, rollout("a-sealed", slot))
            await opened(c, "b-partial", min_group_size=2, deadline_s=0.2)
            await opened(c, "c-expired", min_group_size=2, deadline_s=0.2)
            for gid, slot in (("b-partial", 0), ("b-partial", 3), ("c-expired", 1)):
                await post(c, rollout(gid, slot))
            await settled(c, "b-partial")
            await settled(c, "c-expired")
            await leased(c, "p2", 1)
            exported = await c.get("/export", params={"table": "rollouts"})
            assert exported.status_code == 200, exported.text
            rows = {r["group_id"]: r for r in pq.read_table(io.BytesIO(exported.content)).to_pylist()}
            assert list(rows) == ["a-sealed", "b-partial", "c-expired", "d-open"]
            a, b, x, d = rows.values()
            assert (a["state"], [s["slot"] for s in a["done"]], a["left_out"]) == ("sealed", [0, 1, 2, 3], [])
            assert (b["state"], b["left_out"]) == (
                "sealed",
                [{"slot": 1, "reason": "not_done_by_deadline"}, {"slot": 2, "reason": "not_done_by_deadline"}],
            )
            assert (x["state"], x["expired_reason"], x["done"]) == (
                "expired",
                "too_few_by_deadline",
                [{"slot": 1, "producer": "p1"}],
            )
            assert (d["state"], d["env_id"], d["env"], d["redispatched"]) == ("open", None, "(no env_id)", 1)
            assert [(s["slot"], s["producer"]) for s in d["leased"]] == [(0, "p2")]
            restart = {"slot": 0, "resumes": 0, "restarts": 1, "tokens_saved": 0, "turns": []}
            assert (d["lineage"], a["lineage"]) == ([restart], []), "leased with no turn: a restart"
            assert a["env"] == "math_0" and a["bytes"] > 0 and a["deadline"] is not None
            store = app.state.service.store
            small = ExportLimits(page_groups=2)
            assert [len(p.rollouts) async for p in pages("rollouts", store, small)] == [2, 2]
            data = b"".join([chunk async for chunk in parquet_stream("rollouts", store, small)])
            assert pq.read_table(io.BytesIO(data)).to_pylist() == list(rows.values())


async def test_an_expired_group_under_a_task_lease_gives_its_task_back_with_why(settings: Settings) -> None:
    async with serving(settings, rollout_sweep_every_s=0.02) as c:
        await start(c)
        spec = {"name": "math", "tasks": [{"q": 0}], "max_retries": 1, "env": "math"}
        assert (await c.post("/tasks/datasets", json=spec)).status_code == 200
        leased = await c.post("/tasks/lease", json={"dataset": "math", "producer_id": "p1", "n": 1})
        [task] = leased.json()["leases"]
        await opened(c, task["token"], min_group_size=2, deadline_s=0.2)
        await post(c, rollout(task["token"], 0))
        assert (await settled(c, task["token"]))["state"] == "expired"
        [row] = (await c.get("/tasks/rows", params={"dataset": "math"})).json()["tasks"]
        assert (row["state"], row["retries"], row["reason"]) == ("waiting", 1, "dropped: rollouts_too_few_by_deadline")


async def test_a_sealed_group_refused_at_ingest_expires_with_a_ledger_row(settings: Settings) -> None:
    """What no post can foresee: a whole group acknowledged under the group's id, with other content, while it is
    open. /scored_data refuses one (below); replicas on PostgreSQL that each checked the other's absence
    before either committed could still let one through, which is written here past that check, as a seal's ingest
    is. (Its rollouts' data is held to every rule of ingest as each is posted.)"""
    async with serving_app(settings) as (c, app):
        await start(c)
        await opened(c, "long")
        for slot in range(3):
            await post(c, rollout("long", slot, n=100))
        whole = orjson.dumps(group(4, length=6, group_id="long"))
        await service_of(app).ingest.submit(whole, "application/json", many=False, sealed=True)
        last = await post(c, rollout("long", 3, n=100))
        assert last["group"]["state"] == "expired" and last["group"]["left_out"]["group"].startswith("refused: ")
        assert "group_id" in last["group"]["left_out"]["group"], last["group"]["left_out"]
        [row] = [r for r in (await c.get("/ledger/groups/long")).json()["groups"] if r["fate"] == "dropped"]
        assert (row["fate"], row["reason"], row["seqs"], row["tokens"]) == ("dropped", "rollouts_refused", 4, 400)
        assert (await c.get("/status")).json()["rollouts"]["expired"] == 1
        assert (await c.get("/rollouts")).json()["expired:refused"] == 1


async def test_a_restarted_server_sweeps_the_open_groups_it_finds(settings: Settings) -> None:
    """The sweep reads nothing until per-rollout groups are in use; live groups in the store at start are."""
    if settings.store.startswith("memory"):
        pytest.skip("a memory store does not outlive its server")
    async with serving(settings) as c:
        await start(c, variable_group_size=True)
        await opened(c, "g10", min_group_size=1, deadline_s=0.5)
        await post(c, rollout("g10", 0))
    async with serving(settings, rollout_sweep_every_s=0.02) as c:
        g10 = await settled(c, "g10")  # no rollout route is called by this server: the sweep starts on its own
        assert (g10["state"], g10["done"]) == ("sealed", [0])


async def test_a_sealed_group_carries_its_oldest_policy_step_and_each_rollouts_record(settings: Settings) -> None:
    """Rollouts posted with the weights' step they were generated with and their records: the sealed group's
    policy_step is the oldest (staleness counts from it) and its overrides hold each rollout's record, as a whole
    group sent by the runner would."""
    async with serving(settings) as c:
        await start(c)
        for i in range(3):  # the trainer takes three batches: at step 3
            assert (await c.post("/scored_data", json=group(4, length=6, seed=i))).status_code == 200
            assert (await c.get("/batch")).json()["batch"] is not None
        await opened(c, "g9")
        for slot, step in ((0, 3), (1, 2), (2, 3), (3, 3)):
            await post(c, {**rollout("g9", slot), "policy_step": step, "overrides": {"num_turns": slot}})
        batch = (await c.get("/batch")).json()["batch"]
        assert batch is not None and len(batch) == 1
        by_first = {t[0]: o["num_turns"] for t, o in zip(batch[0]["tokens"], batch[0]["overrides"], strict=True)}
        assert by_first == {1: 0, 2: 1, 3: 2, 4: 3}
        (row,) = (await c.get("/ledger/groups/g9")).json()["groups"]
        assert row["policy_step"] == 2 and row["step"] == 3, row
        await post(c, {**rollout("g9", 0), "policy_step": 1}, 409)  # another content for an acknowledged slot


async def test_decided_groups_are_pruned_after_rollout_keep_s_and_the_views_stay_right(settings: Settings) -> None:
    """The bound on what the server keeps: sealed and expired groups (rows and slots) go `rollout_keep_s` after
    their decision, a sweep at a time of at most `rollout_sweep_limit`; open ones stay, and the views' counters
    (open, slots done and leased, sealed, expired) read as before."""
    async with serving(settings, rollout_sweep_every_s=0.02, rollout_keep_s=0.3, rollout_sweep_limit=2) as c:
        await start(c, variable_group_size=True)
        for gid in ("s1", "s2", "s3"):
            await opened(c, gid)
            for slot in range(4):
                await post(c, rollout(gid, slot))
        await opened(c, "x1", min_group_size=2, deadline_s=0.001)
        await post(c, rollout("x1", 0))
        assert (await settled(c, "x1"))["state"] == "expired"
        await opened(c, "live", deadline_s=600.0)
        await post(c, rollout("live", 0))
        block = {"open": 1, "slots_done": 1, "slots_leased": 0, "redispatched": 0, "sealed": 3, "expired": 1}
        block |= {"resumed": 0, "restarted": 0, "tokens_saved": 0}
        assert (await c.get("/status")).json()["rollouts"] == block
        deadline = time.monotonic() + 10.0
        while (await c.get("/rollouts")).json().get("pruned", 0) < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for gid in ("s1", "s2", "s3", "x1"):
            assert (await c.get("/rollouts/group", params={"group_id": gid})).status_code == 404, gid
        assert (await c.get("/rollouts/group", params={"group_id": "live"})).json()["done"] == [0]
        assert (await c.get("/rollouts")).json()["pruned"] == 4
        assert (await c.get("/status")).json()["rollouts"] == block, "pruning moves no view's counter"
        assert 'rollbuf_rollout_events_total{event="pruned"} 4.0' in (await c.get("/metrics")).text
        await post(c, rollout("s1", 0, producer="p3"), 404)
        assert (await c.get("/status")).json()["queue_size"] == 3, "what was sealed stays queued"


async def test_a_sibling_lease_can_be_asked_for_of_named_envs_only(settings: Settings) -> None:
    async with serving(settings, rollout_lease_s=0.001) as c:
        await start(c)
        assert (await c.post("/register-env", json=env(name="code"))).status_code == 200  # env 1
        m1 = await opened(c, "m1", env_id=0)
        c1 = await opened(c, "c1", env_id=1)
        await past(max(m1["expires_at"], c1["expires_at"]))

        async def lease(**extra: Any) -> list[tuple[str, int]]:
            reply = await c.post("/rollouts/lease", json={"producer_id": "p2", "n": 2, **extra})
            assert reply.status_code == 200, reply.text
            return sorted((x["group_id"], x["slot"]) for x in reply.json()["leases"])

        assert await lease(envs=["nope"]) == [], "no env of that name: nothing"
        assert await lease(envs=[]) == []
        assert await lease(envs=["code"]) == [("c1", 0), ("c1", 1)]
        assert await lease(envs=["math", "nope"]) == [("m1", 0), ("m1", 1)]
        assert len(await lease()) == 2, "no envs: any env's"
        assert (await c.post("/rollouts/lease", json={"producer_id": "p2", "envs": ["x" * 201]})).status_code == 422
        many = {"producer_id": "p2", "envs": [f"e{i}" for i in range(65)]}  # past ENVS_MAX (64)
        assert (await c.post("/rollouts/lease", json=many)).status_code == 422


async def test_a_producer_heartbeat_says_when_sibling_slots_may_be_leased(settings: Settings) -> None:
    """A producer that takes sibling slots names its envs in its heartbeat; the reply says when a group of theirs
    is next due (its holder's lapse, a sibling lease's end), so it leases only then instead of polling."""
    settings.producer_gone_after = 60.0
    async with serving(settings, rollout_lease_s=0.5, rollout_sweep_every_s=3600.0) as c:
        await start(c)

        async def due(**extra: Any) -> float | None:
            beat = {"producer_id": "p2", "env_ids": [0], "sibling_envs": ["math"], **extra}
            reply = await c.post("/producers/heartbeat", json=beat)
            assert reply.status_code == 200, reply.text
            due_in: float | None = reply.json()["siblings_due_in"]
            return due_in

        assert await due() == 60.0, "no open group: none before the next beat (gone_after)"
        g = await opened(c, "g")
        assert 0.0 < (await due() or 0.0) <= 0.5, "when its holder lapses, unless it heartbeats"
        assert await due(sibling_envs=["code"]) == 60.0, "another env's group is not due for this producer"
        assert await due(sibling_envs=None) is None, "a producer that takes no sibling slot is not told"
        await past(g["expires_at"])
        assert await due() == 0.0, "its holder lapsed: lease now"
        assert len(await leased(c, "p3", 8)) == 4
        assert 0.0 < (await due() or 0.0) <= 0.5, "every missing slot leased: when the first lease ends"


async def test_the_runners_sibling_taker_leases_slots_of_the_envs_it_runs_only(settings: Settings) -> None:
    """The runner's sibling taker asks for its per-rollout envs' slots by name (`OpenGroups.lease(envs=...)`):
    another env's group, open on the same server, is never leased to it."""
    app = create_app(settings.model_copy(update={"rollout_lease_s": 0.001}))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            await start(c)
            assert (await c.post("/register-env", json=env(name="code"))).status_code == 200  # env 1
            await opened(c, "m1", env_id=0)
            await opened(c, "c1", env_id=1)
            groups = OpenGroups("http://localhost", producer_id="runner", transport=transport)
            stats, math = RunnerStats(), Arithmetic(name="math")
            math.posts_each_rollout = math.scores_each_rollout = True
            taker = SiblingSlots(
                groups,
                [math, Arithmetic(name="code")],
                None,  # type: ignore[arg-type]
                InFlight(4, stats),
                stats,
                poll_s=0.01,
                may_take=lambda: True,
                policy_step=lambda: 0,
                rollout_ended=lambda _: None,
                changed=lambda: None,
            )
            assert taker.names == ["math"], "code is submitted whole: no sibling slot of it is taken"
            leases = await groups.lease(8, taker.names)
            assert sorted((x.group_id, x.slot) for x in leases) == [("m1", s) for s in range(4)]
            assert "c1" in {x.group_id for x in await groups.lease(8)}, "without names: any env's"
            await groups.aclose()


async def test_a_lapsed_sibling_lease_stops_counting_as_leased_at_the_next_sweep(settings: Settings) -> None:
    """The background sweep re-leases nothing, but drops a sibling lease that lapsed (counted `lease_lapsed`): its
    slot is missing again, for the next taker, and `slots_leased` counts only leases that hold."""
    async with serving(settings, rollout_lease_s=0.001, rollout_sweep_every_s=0.02) as c:
        await start(c)
        await opened(c, "g")
        await post(c, rollout("g", 0))
        assert len(await leased(c, "p2", 8)) == 3
        deadline = time.monotonic() + 10.0
        while (await c.get("/rollouts")).json().get("lease_lapsed", 0) < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        block = {"open": 1, "slots_done": 1, "slots_leased": 0, "redispatched": 3, "sealed": 0, "expired": 0}
        block |= {"resumed": 0, "restarted": 3, "tokens_saved": 0}
        assert (await c.get("/status")).json()["rollouts"] == block
        assert (await c.get("/rollouts/group", params={"group_id": "g"})).json()["leased"] == {}
        assert 'rollbuf_rollout_events_total{event="lease_lapsed"} 3.0' in (await c.get("/metrics")).text
        assert sorted(x["slot"] for x in await leased(c, "p3", 8)) == [1, 2, 3], "missing again: handed out"
        assert (await post(c, rollout("g", 1, producer="p2")))["status"] == "accepted", "a late rollout still counts"


async def test_slots_nobody_leased_are_handed_out_at_once_and_lapsed_leases_dropped_on_the_way(
    settings: Settings,
) -> None:
    """A sibling that takes fewer slots than are missing leaves the rest to the next taker at once (they were
    hidden until its lease ended: `rollout_lease_s`); a lapsed sibling lease in such a group is dropped when the
    group is leased from again, so `slots_leased` counts only leases that hold. The leases last 3 s: the three
    takers must come within one lease of each other, on a machine as busy as a test run's."""
    async with serving(settings, rollout_lease_s=3.0, rollout_sweep_every_s=3600) as c:
        await start(c)
        await opened(c, "g")
        assert [x["slot"] for x in await leased(c, "p2", 1)] == [0]  # once the holder lapsed
        assert [x["slot"] for x in await leased(c, "p3", 1)] == [1], "the next missing slot, at once"
        assert [x["slot"] for x in await leased(c, "p4", 8)] == [2, 3]
        again: set[int] = set()
        while again != {0, 1, 2, 3}:  # each slot again once its lease lapsed (`leased` polls, bounded)
            again |= {x["slot"] for x in await leased(c, "p5", 8)}
        totals = (await c.get("/rollouts")).json()
        assert totals["lease_lapsed"] == 4 and totals["redispatched"] == 8, totals
        assert (await c.get("/status")).json()["rollouts"]["slots_leased"] == 4


async def test_a_whole_group_cannot_take_the_id_of_an_open_group_nor_an_open_group_that_of_a_whole_one(
    settings: Settings,
) -> None:
    """A buggy producer sends a whole group under the id of one of its env's open per-rollout groups: refused (409
    naming `group_id`), so the open group's acknowledged rollouts are sealed and served under their id, not expired
    by a seal that would have found the id taken. The other way round, an open group under the id of a whole group
    already acknowledged is refused at its open. Ids are scoped by env: another env's whole group of that id is its
    own."""
    async with serving(settings) as c:
        await start(c)
        assert (await c.post("/register-env", json=env("other", group_size=4))).status_code == 200
        await opened(c, "x")
        await post(c, rollout("x", 0))
        taken = await c.post("/scored_data", json=group(env_id=0, group_id="x"))
        assert taken.status_code == 409, taken.text
        assert taken.json()["errors"][0]["loc"] == ["body", "group_id"]
        assert (await c.post("/scored_data_list", json=[group(env_id=0, group_id="x")])).status_code == 409
        assert (await c.post("/scored_data", json=group(env_id=1, group_id="x"))).status_code == 200
        for slot in (1, 2, 3):
            await post(c, rollout("x", slot))
        assert (await c.get("/rollouts/group", params={"group_id": "x"})).json()["state"] == "sealed"
        assert (await c.post("/scored_data", json=group(env_id=0, group_id="w"))).status_code == 200
        refused = await c.post(
            "/rollouts/open",
            json={"group_id": "w", "env_id": 0, "producer_id": "p1", "group_size": 4, "deadline_s": 600.0},
        )
        assert refused.status_code == 409 and refused.json()["errors"][0]["loc"] == ["body", "group_id"]
        served = [g for s in range(3) if (b := (await c.get("/batch")).json()["batch"]) for g in b]
        ids = sorted((g["env_id"], g["group_id"]) for g in served)
        assert ids == [(0, "w"), (0, "x"), (1, "x")], ids
