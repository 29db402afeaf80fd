"""A slot's turns, through the ASGI app on every store (docs/rollouts.md, Turns): acknowledged as they end by the
slot's holder, in order and idempotently; carried by the slot's lease to the producer that continues; a final post
`after_turns` completing the rollout, whose sealed group equals the one sent whole; the 409s, 422s and 503s naming
what they refuse; turns freed with their group's decision."""

from __future__ import annotations

import base64
from typing import Any

import httpx
import pytest

from api.config.settings import Settings
from tests.api.test_api_rollouts import leased, opened, past, post, rollout, settled, start
from tests.asgi import serving
from tests.factories import env, registration

pytestmark = pytest.mark.anyio


def turn(gid: str, slot: int, k: int, producer: str = "p1", n: int = 3, **extra: Any) -> dict[str, Any]:
    """Turn `k` of a slot: `n` tokens, each `10 * (k + 1) + i` (so the turns of a rollout are told apart)."""
    tokens = [10 * (k + 1) + i for i in range(n)]
    return {
        "group_id": gid,
        "slot": slot,
        "producer_id": producer,
        "turn": k,
        "tokens": tokens,
        "masks": [-100] + tokens[1:],
        "inference_logprobs": [-0.25] * n,
        **extra,
    }


async def sent(c: httpx.AsyncClient, body: dict[str, Any], status: int = 200) -> dict[str, Any]:
    reply = await c.post("/rollouts/turn", json=body)
    assert reply.status_code == status, reply.text
    return reply.json()  # type: ignore[no-any-return]


def refused_at(reply: dict[str, Any]) -> list[Any]:
    """Where the refusal's first error is (a snapshot matching neither of its forms has one error per form)."""
    return reply["errors"][0]["loc"]  # type: ignore[no-any-return]


LINEAGE = {
    "0": {
        "resumes": 1,
        "restarts": 0,
        "tokens_saved": 6,
        "turns": [
            {"producer": "p1", "turns": 2, "start": 0, "end": 6},
            {"producer": "p2", "turns": 1, "start": 6, "end": 9},
        ],
    },
    "1": {"resumes": 0, "restarts": 1, "tokens_saved": 0, "turns": []},
}
"""Group t1's lineage: slot 0 resumed by p2 from p1's 2 turns (6 tokens), slot 1 restarted by p2."""


async def test_turns_carried_by_a_lease_finish_as_the_rollout_sent_whole(settings: Settings) -> None:
    """p1 posts two turns of slot 0 and lapses; p2 takes the slot's lease with those turns, posts a third and the
    final post after them: the sealed group's slot 0 is the concatenation, equal to a group whose slot 0 was sent
    whole. The lapsed p1's turns are refused from then on; nothing acknowledged is lost or doubled. The group's
    lineage (who generated which turns, the resume and the restart, the tokens saved) is kept with it once its
    turns are freed, and after a restart of the server."""
    snap = base64.b64encode(b"env state after turn 1").decode()
    async with serving(settings, rollout_lease_s=0.001, rollout_sweep_every_s=3600.0) as c:
        await start(c, group_size=2)
        await opened(c, "t1", group_size=2, task="prompt")
        assert (await sent(c, turn("t1", 0, 0, tool_results=[{"sum": 3}]))) == {
            "status": "accepted",
            "turns": 1,
            "tokens": 3,
        }
        assert (await sent(c, turn("t1", 0, 1, snapshot={"data": snap})))["turns"] == 2
        assert (await sent(c, turn("t1", 0, 1, snapshot={"data": snap})))["status"] == "duplicate"
        other = await sent(c, turn("t1", 0, 1, n=4), 409)
        assert refused_at(other) == ["body", "turn"]
        gap = await sent(c, turn("t1", 0, 3), 409)
        assert refused_at(gap) == ["body", "turn"] and "next turn is 2" in gap["message"]
        view = (await c.get("/rollouts/group", params={"group_id": "t1"})).json()
        assert view["turns"] == {"0": {"n": 2, "producers": ["p1"]}}

        leases = sorted(await leased(c, "p2", 8), key=lambda x: x["slot"])
        assert [x["slot"] for x in leases] == [0, 1] and leases[1]["prefix"] is None
        prefix = leases[0]["prefix"]
        assert (prefix["turns"], prefix["tokens"], prefix["complete"]) == (2, 6, True)
        assert [t["tokens"] for t in prefix["items"]] == [turn("t1", 0, 0)["tokens"], turn("t1", 0, 1)["tokens"]]
        assert prefix["items"][0]["tool_results"] == [{"sum": 3}] and prefix["snapshot"] == {"data": snap, "uri": None}
        assert {t["producer"] for t in prefix["items"]} == {"p1"}

        stale = await sent(c, turn("t1", 0, 2), 409)
        assert refused_at(stale) == ["body", "producer_id"], "the slot's lease passed from p1"
        await sent(c, turn("t1", 0, 2, producer="p2"))
        assert (await c.get("/rollouts/group", params={"group_id": "t1"})).json()["lineage"] == LINEAGE, "while open"
        read = (await c.get("/rollouts/turns", params={"group_id": "t1", "slot": 0, "start": 1})).json()
        assert [t["turn"] for t in read["items"]] == [1, 2] and read["complete"] and read["turns"] == 3

        tail = {**turn("t1", 0, 3, producer="p2"), "score": 1.0, "after_turns": True}
        del tail["turn"]
        stale_tail = await post(
            c, {**tail, "producer_id": "p1", "tokens": [9], "masks": [9], "inference_logprobs": [0.0]}, 409
        )
        assert refused_at(stale_tail) == ["body", "producer_id"], "p1's end would follow p2's turn"
        assert (await post(c, tail))["status"] == "accepted"
        assert (await post(c, tail))["status"] == "duplicate", "the same turns and tail: the same rollout"
        closed = await sent(c, turn("t1", 0, 3, producer="p2"), 409)
        assert refused_at(closed) == ["body", "slot"]
        whole = [t for k in range(4) for t in turn("t1", 0, k)["tokens"]]
        await post(
            c,
            {**rollout("t1", 1, producer="p2"), "tokens": [7] * 5, "masks": [7] * 5, "inference_logprobs": [-0.5] * 5},
        )
        view = await settled(c, "t1")
        assert view["state"] == "sealed" and view["turns"] == {}, "turns are freed with the decision"
        assert view["lineage"] == LINEAGE, "kept with the group"
        status = (await c.get("/status")).json()["rollouts"]
        assert (status["resumed"], status["restarted"], status["tokens_saved"]) == (1, 1, 6)
        assert (await c.get("/rollouts/turns", params={"group_id": "t1", "slot": 0})).json()["turns"] == 0
        batch = (await c.get("/batch")).json()["batch"]
        assert [batch[0]["tokens"][0], batch[0]["masks"][0]] == [
            whole,
            [x for k in range(4) for x in turn("t1", 0, k)["masks"]],
        ]
        assert batch[0]["inference_logprobs"][0] == [-0.25] * 12
        totals = (await c.get("/rollouts")).json()
        assert (totals["turns"], totals["resumed"], totals["tokens_carried"]) == (3, 1, 6)
        assert totals["turn_bytes"] > 0
        exposition = (await c.get("/metrics")).text
        assert 'rollbuf_rollout_events_total{event="resumed"} 1.0' in exposition
        live = (await c.get("/rollouts/group", params={"group_id": "t1"})).json()
    if not settings.store.startswith("memory"):  # a memory store does not outlive its server
        async with serving(settings, rollout_sweep_every_s=3600.0) as c:
            again = (await c.get("/rollouts/group", params={"group_id": "t1"})).json()
            assert again["lineage"] == live["lineage"] == LINEAGE


async def test_a_turn_is_checked_against_what_its_seal_requires(settings: Settings) -> None:
    async with serving(settings, rollout_max_snapshot_bytes=8, rollout_max_turns_per_slot=2) as c:
        await start(c)
        await opened(c, "t2", group_size=2)
        await sent(c, turn("t2", 0, 0))
        bad = turn("t2", 0, 1)
        bad["tokens"][2] = 2**31
        assert refused_at(await sent(c, bad, 422)) == ["body", "tokens", 2], "the turn's own index"
        assert refused_at(await sent(c, {**turn("t2", 0, 1), "masks": [1]}, 422)) == ["body", "masks"]
        without = {**turn("t2", 0, 1), "inference_logprobs": None}
        assert refused_at(await sent(c, without, 422)) == ["body", "inference_logprobs"], "some turns have them"
        long = turn("t2", 0, 1, n=510)
        assert refused_at(await sent(c, long, 422)) == ["body", "tokens"], "the slot's tokens past max_token_len"
        both = {**turn("t2", 0, 1), "snapshot": {"data": "AAAA", "uri": "s3://x"}}
        assert refused_at(await sent(c, both, 422))[:2] == ["body", "snapshot"], "one of them"
        big = {**turn("t2", 0, 1), "snapshot": {"data": base64.b64encode(b"x" * 9).decode()}}
        assert refused_at(await sent(c, big, 422)) == ["body", "snapshot", "data"]
        unpadded = await sent(c, {**turn("t2", 0, 1), "snapshot": {"data": "AAA"}}, 422)
        assert refused_at(unpadded)[:2] == ["body", "snapshot"] and refused_at(unpadded)[-1] == "data"
        await sent(c, {**turn("t2", 0, 1), "snapshot": {"uri": "s3://bucket/state-1"}})
        assert refused_at(await sent(c, turn("t2", 0, 2), 409)) == ["body", "turn"], "rollout_max_turns_per_slot"
        unknown = await sent(c, turn("nope", 0, 0), 404)
        assert refused_at(unknown) == ["body", "group_id"]
        assert refused_at(await sent(c, turn("t2", 2, 0), 409)) == ["body", "slot"]
        tail = {**turn("t2", 0, 2), "tokens": [], "masks": [], "inference_logprobs": [], "after_turns": True}
        del tail["turn"]
        whole = {**tail, "slot": 1, "after_turns": False, "score": 1.0}
        assert refused_at(await post(c, whole, 422)) == ["body", "tokens"], "a rollout has a token at least"
        ends = {**tail, "tokens": [5] * 510, "masks": [5] * 510, "inference_logprobs": [-0.25] * 510, "score": 1.0}
        assert refused_at(await post(c, ends, 422)) == ["body", "tokens"], "past max_token_len with its turns"
        assert (await post(c, {**tail, "score": 1.0}))["status"] == "accepted", "its turns are the whole rollout"


async def test_turn_bytes_are_bounded_per_env_and_freed_with_the_groups_decision(settings: Settings) -> None:
    one = len(b'{"tokens":[10,11,12],"masks":[-100,11,12],"inference_logprobs":[-0.25,-0.25,-0.25],')
    async with serving(settings, rollout_max_turn_bytes_per_env=one + 120, rollout_max_turn_bytes=one + 120) as c:
        await start(c)
        await opened(c, "a", group_size=2, min_group_size=1)
        await opened(c, "b", group_size=2)
        await sent(c, turn("a", 0, 0))
        full = await c.post("/rollouts/turn", json=turn("b", 0, 0))
        assert full.status_code == 503 and full.headers["retry-after"] == "1"
        assert "rollout_max_turn_bytes_per_env" in full.json()["message"]
        too_big = await sent(c, turn("b", 0, 0, n=100), 422)
        assert "rollout_max_turn_bytes" in too_big["message"]
        await post(c, rollout("a", 1))
        assert (await c.post("/rollouts/seal", json={"group_id": "a", "producer_id": "p1"})).status_code == 200
        assert (await settled(c, "a"))["turns"] == {}
        assert (await sent(c, turn("b", 0, 0)))["status"] == "accepted", "a's turns no longer count"


async def test_a_prefix_past_the_reply_bound_is_left_out_of_the_lease_and_read_in_pages(settings: Settings) -> None:
    async with serving(settings, rollout_lease_s=0.001, rollout_max_prefix_reply_bytes=200) as c:
        await start(c, group_size=2)
        await opened(c, "t4", group_size=2)
        for k in range(3):
            await sent(c, turn("t4", 1, k))
        [lease] = [x for x in await leased(c, "p2", 8) if x["slot"] == 1]
        assert lease["prefix"] == {"turns": 3, "tokens": 9, "complete": False, "items": [], "snapshot": None}
        got: list[int] = []
        while True:
            page = (await c.get("/rollouts/turns", params={"group_id": "t4", "slot": 1, "start": len(got)})).json()
            got += [t["turn"] for t in page["items"]]
            assert page["items"], "one turn at least a page"
            if page["complete"]:
                break
        assert got == [0, 1, 2]
        await sent(c, turn("t4", 1, 3, producer="p2"))


async def test_turn_bytes_are_bounded_per_key_over_its_envs(settings: Settings) -> None:
    """A key's turns over all its envs stay within `rollout_max_turn_bytes_per_key` (the env's own bound, larger,
    is not reached): a 503 beyond for that key, while another key's turns go on."""
    secrets = {"env-1": "env-one-secret-0123456789", "env-2": "env-two-secret-0123456789", "t": "trainer-0123456789ab"}
    keys = f"env-1 env {secrets['env-1']}; env-2 env {secrets['env-2']}; t trainer {secrets['t']}"

    def auth(name: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {secrets[name]}"}

    keyed = Settings(**{**settings.model_dump(), "api_keys": keys})
    async with serving(keyed, rollout_max_turn_bytes_per_key=200) as c:
        assert (await c.post("/register", json=registration(batch_size=4), headers=auth("t"))).status_code == 200
        await c.get("/batch", headers=auth("t"))
        envs: dict[str, list[int]] = {}
        for name in ("env-1", "env-1", "env-2"):
            reply = await c.post("/register-env", json=env(group_size=2), headers=auth(name))
            envs.setdefault(name, []).append(reply.json()["env_id"])
        opens = [
            ("k1", "env-1", envs["env-1"][0]),
            ("k2", "env-1", envs["env-1"][1]),
            ("k3", "env-2", envs["env-2"][0]),
        ]
        for gid, name, env_id in opens:
            spec = {"group_id": gid, "env_id": env_id, "producer_id": "p1", "group_size": 2, "deadline_s": 60}
            assert (await c.post("/rollouts/open", json=spec, headers=auth(name))).status_code == 200
        assert (await c.post("/rollouts/turn", json=turn("k1", 0, 0), headers=auth("env-1"))).status_code == 200
        full = await c.post("/rollouts/turn", json=turn("k2", 0, 0), headers=auth("env-1"))
        assert full.status_code == 503 and "rollout_max_turn_bytes_per_key" in full.json()["message"]
        assert (await c.post("/rollouts/turn", json=turn("k3", 0, 0), headers=auth("env-2"))).status_code == 200


async def test_an_expired_groups_turns_are_freed_with_its_expiry(settings: Settings) -> None:
    async with serving(settings, rollout_sweep_every_s=0.05) as c:
        await start(c, group_size=2)
        g = await opened(c, "t5", group_size=2, deadline_s=0.2)
        await sent(c, turn("t5", 0, 0))
        await sent(c, turn("t5", 1, 0, snapshot={"uri": "s3://bucket/t5"}))
        await past(g["deadline"])
        view = await settled(c, "t5")
        assert view["state"] == "expired" and view["turns"] == {}
        for slot in (0, 1):
            assert (await c.get("/rollouts/turns", params={"group_id": "t5", "slot": slot})).json()["turns"] == 0
        assert (await c.post("/rollouts/turn", json=turn("t5", 0, 1))).status_code == 409, "no more turns"


async def test_a_turn_past_the_trainers_token_budget_with_the_slots_in_is_refused(settings: Settings) -> None:
    """With `max_batch_tokens`, the group's acknowledged slots and this slot's turns stay within it (what its seal
    requires), each within `max_token_len`."""
    async with serving(settings) as c:
        reg = registration(batch_size=2, max_token_len=8, max_batch_tokens=10)
        assert (await c.post("/register", json=reg)).status_code == 200
        await c.get("/batch")
        assert (await c.post("/register-env", json=env(group_size=2, max_token_length=8))).status_code == 200
        await opened(c, "t6", group_size=2)
        await post(c, rollout("t6", 1, n=4))
        for k in range(3):
            await sent(c, turn("t6", 0, k, n=2))
        over = await sent(c, turn("t6", 0, 3, n=2), 422)
        assert refused_at(over) == ["body", "tokens"] and "max_batch_tokens of 10" in over["message"]


async def test_two_producers_turns_racing_to_the_token_budget_leave_every_acknowledged_slot_completable(
    settings: Settings,
) -> None:
    """An attack on the trainer's `max_batch_tokens` (10): p1 posts a turn of slot 0 and lapses; p2 takes slot 0's
    lease and continues it while p1 goes on with slot 1 (its own still). Every slot's acknowledged turns count at
    turn time: the turn that would pass the budget is refused (422 naming `tokens` and the rule) whichever slot
    sends it, and each slot is then completed by its score alone, the sealed group holding every acknowledged
    token; a tail past the budget is refused, never what was acknowledged."""
    async with serving(settings, rollout_lease_s=0.001, rollout_sweep_every_s=3600.0) as c:
        reg = registration(batch_size=2, max_token_len=8, max_batch_tokens=10)
        assert (await c.post("/register", json=reg)).status_code == 200
        await c.get("/batch")
        assert (await c.post("/register-env", json=env(group_size=2, max_token_length=8))).status_code == 200
        await opened(c, "t9", group_size=2)
        await sent(c, turn("t9", 0, 0, n=4))
        [lease] = await leased(c, "p2", 1)
        assert (lease["slot"], lease["prefix"]["tokens"]) == (0, 4)
        await sent(c, turn("t9", 0, 1, producer="p2", n=2))
        await sent(c, turn("t9", 1, 0, n=3))  # p1's slot 1: 9 acknowledged of 10
        over = await sent(c, turn("t9", 0, 2, producer="p2", n=2), 422)
        assert refused_at(over) == ["body", "tokens"] and "9 tokens acknowledged" in over["message"]
        assert "max_batch_tokens of 10" in over["message"]
        assert refused_at(await sent(c, turn("t9", 1, 1, n=2), 422)) == ["body", "tokens"], "either slot"
        await sent(c, turn("t9", 1, 1, n=1))  # 10 of 10: the budget is the bound, not less
        final = {"tokens": [], "masks": [], "inference_logprobs": [], "score": 1.0, "after_turns": True}
        tail = {**final, "group_id": "t9", "slot": 0, "producer_id": "p2", "tokens": [7], "masks": [7]}
        tail["inference_logprobs"] = [-0.25]
        assert refused_at(await post(c, tail, 422)) == ["body", "tokens"], "new content past the budget"
        assert (await post(c, {**final, "group_id": "t9", "slot": 0, "producer_id": "p2"}))["status"] == "accepted"
        done = await post(c, {**final, "group_id": "t9", "slot": 1, "producer_id": "p1"})
        assert done["group"]["state"] == "sealed"
        [row] = (await c.get("/ledger/groups/t9")).json()["groups"]
        assert (row["seqs"], row["tokens"]) == (2, 10), "every acknowledged token, none lost"
        await opened(c, "t10", group_size=2)
        bare = {**final, "group_id": "t10", "slot": 0, "producer_id": "p1"}
        assert refused_at(await post(c, bare, 422)) == ["body", "tokens"], "no turn, no token: no rollout"
