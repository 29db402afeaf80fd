"""Turns posted by the runner and slots resumed from them, against the in-process app (rollout_client/runner/turns.py,
siblings.py, docs/episodes.md): a producer posts a slot's turns as they end and stops mid-episode (its task
cancelled, its heartbeats stopped: what a kill leaves); another takes the slot's lease and continues it from the
acknowledged turns (replaying the deterministic tools, or restoring the snapshot) or from the prompt (an env that
can do neither). The sealed rollout equals the uninterrupted one, token for token; the turns are acknowledged once
each; the lapsed producer's next turn is refused and stops its rollout; a prefix too large for the lease is read in
pages."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.app import create_app
from api.config.settings import Settings
from rollout_client import Environment, FailurePolicy, Gate, ScriptedPolicy, Session, Task, Timeouts
from rollout_client.episodes import SlotLost
from rollout_client.examples import RestartWalk, SnapshotWalk, Walk, WalkEpisode, walk_script
from rollout_client.group import Rollout, run_rollout
from rollout_client.leases.open_groups import OpenGroups
from rollout_client.policy import Completion
from rollout_client.resources import Capacity
from rollout_client.runner.accounting import Tally
from rollout_client.runner.execution import GroupExecutor
from rollout_client.runner.inflight import InFlight
from rollout_client.runner.per_rollout import Poster, Posting, task_to_wire
from rollout_client.runner.siblings import SiblingSlots
from rollout_client.runner.stats import RunnerStats
from rollout_client.runner.turns import BACKLOG, TurnPoster
from tests.asgi import serving
from tests.factories import env as env_body
from tests.factories import registration

pytestmark = pytest.mark.anyio

TASK = Task("t", "go")
TURNS = 6
CUT = 3
"""The first producer stops while generating its 4th step: 3 turns acknowledged."""


class Stalling(ScriptedPolicy):
    """The walk policy, counting its generations; with `stall_at`, that generation never returns (a producer
    killed while the model works)."""

    def __init__(self, stall_at: int | None = None, script: Callable[[str, int], str] = walk_script) -> None:
        super().__init__(script)
        self.calls = 0
        self.stall_at = stall_at
        self.go_on = asyncio.Event()

    async def generate(self, prompt_ids: list[int], **kw: Any) -> Completion:
        self.calls += 1
        if self.calls == self.stall_at:
            await self.go_on.wait()
        return await super().generate(prompt_ids, **kw)


@asynccontextmanager
async def app(max_token_len: int = 512, **update: Any) -> AsyncIterator[httpx.AsyncClient]:
    """The app in process, a trainer (rollouts of up to `max_token_len` tokens) and a G=1 env registered, with
    `update` to its settings."""
    settings = Settings(store="memory://")
    application = create_app(settings.model_copy(update={"rollout_lease_s": 0.3, **update}))
    async with application.router.lifespan_context(application):
        transport = httpx.ASGITransport(app=application)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            body = registration(batch_size=1, max_token_len=max_token_len)
            assert (await c.post("/register", json=body)).status_code == 200
            await c.get("/batch")
            env = env_body(group_size=1, max_token_length=max_token_len)
            assert (await c.post("/register-env", json=env)).status_code == 200
            yield c


def producer(c: httpx.AsyncClient, name: str) -> OpenGroups:
    return OpenGroups("http://localhost", producer_id=name, transport=c._transport)


def executor(env: Environment, policy: Any, groups: OpenGroups, stats: RunnerStats) -> GroupExecutor:
    in_flight = InFlight(8, stats)
    out = GroupExecutor(
        [env],
        pool=None,
        policy=policy,
        limits=Timeouts().limits(),
        group_timeout=None,
        in_flight=in_flight,
        capacity=[Capacity(None)],
        gate=Gate(),
        stats=stats,
        stopping=asyncio.Event(),
        on_rollout_end=in_flight.ended,
    )
    out.turn_posters = lambda group_id, k, prefix: TurnPoster(groups, group_id, k, prefix)
    return out


async def killed_mid_episode(
    c: httpx.AsyncClient, env: Environment, gid: str, script: Callable[[str, int], str] = walk_script
) -> int:
    """p1 opens the group and runs slot 0 until its 4th generation, then stops as a kill would (its task
    cancelled, its heartbeats stopped); the turns the server acknowledged by then."""
    p1 = producer(c, "p1")
    await p1.open(gid, 1, env_id=0, deadline_s=600.0, task=task_to_wire(env.name, TASK))
    policy = Stalling(stall_at=CUT + 1, script=script)
    run = asyncio.create_task(executor(env, policy, p1, RunnerStats()).run_slot(0, TASK, gid, 0))
    while policy.calls <= CUT or (env.resumes != "restart" and await turns_in(c, gid) < CUT):
        await asyncio.sleep(0.01)
    run.cancel()
    await p1.aclose()  # no more heartbeats: its hold of the slot lapses
    return await turns_in(c, gid)


async def turns_in(c: httpx.AsyncClient, gid: str) -> int:
    view = (await c.get("/rollouts/group", params={"group_id": gid})).json()
    return int(view.get("turns", {}).get("0", {}).get("n", 0))


async def lease_of(groups: OpenGroups) -> Any:
    for _ in range(500):
        if leases := await groups.lease(1):
            return leases[0]
        await asyncio.sleep(0.01)
    raise AssertionError("the slot was never leased")


STATES: dict[str, bytes] = {}
"""Where `ByReference` keeps its states (a volume, a sandbox image, for a real env)."""


class ByReference(SnapshotWalk):
    """`SnapshotWalk` whose state is kept outside rollbuf: each turn posts the URI where it lies."""

    def snapshot(self, task: Task, session: Session) -> str:
        uri = f"mem://state/{len(STATES)}"
        STATES[uri] = super().snapshot(task, session)
        return uri

    def restore(self, task: Task, snapshot: bytes | str) -> dict[str, Any]:
        assert isinstance(snapshot, str) and snapshot.startswith("mem://"), "a reference, not the state"
        return super().restore(task, STATES[snapshot])


def siblings(p2: OpenGroups, env: Environment, policy: Any, stats: RunnerStats) -> SiblingSlots:
    return SiblingSlots(
        p2, [env], executor(env, policy, p2, stats), InFlight(8, stats), stats, poll_s=0.05,
        may_take=lambda: True, policy_step=lambda: 0, rollout_ended=lambda key: None, changed=lambda: None,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("env_type", "reply_bytes"),
    [
        (Walk, 16 << 20),
        (SnapshotWalk, 16 << 20),
        (ByReference, 16 << 20),
        (RestartWalk, 16 << 20),
        (Walk, 300),
        (SnapshotWalk, 300),
    ],
)
async def test_a_slot_whose_producer_stopped_mid_episode_is_continued_token_exact(
    env_type: type[Walk], reply_bytes: int
) -> None:
    """(With a reply bound of 300 bytes the lease leaves the turns out, and they are read page by page.)"""
    env = env_type()
    env.turns, env.group_size = TURNS, 1
    whole = await run_rollout(env, TASK, ScriptedPolicy(walk_script), 0, group_key="g1")
    async with app(rollout_max_prefix_reply_bytes=reply_bytes) as c:
        acked = await killed_mid_episode(c, env, "g1")
        resumes = env.resumes != "restart"
        assert acked == (CUT if resumes else 0), "an env that restarts posts no turn"
        p2, stats, policy = producer(c, "p2"), RunnerStats(), Stalling()
        slots = siblings(p2, env, policy, stats)
        lease = await lease_of(p2)
        assert (lease.prefix is not None) == resumes
        assert lease.prefix is None or lease.prefix.complete == (reply_bytes > 300)
        rollout = await slots._resumed(0, TASK, "g1", 0, lease.prefix)
        await Poster(p2, "g1", stats, 0)(0, rollout)
        await p2.aclose()
        assert policy.calls == (TURNS - CUT if resumes else TURNS), "the prefix is not generated again"
        assert (stats.slots_resumed, stats.slots_restarted) == ((1, 0) if resumes else (0, 0))
        assert (
            stats.tokens_resumed == (rollout.resumed_tokens if resumes else 0)
            and (rollout.resumed_tokens > 0) == resumes
        )
        batch = (await c.get("/batch")).json()["batch"]
        assert batch is not None and batch[0]["tokens"] == [whole.tokens], "the sealed rollout is the uninterrupted one"
        assert batch[0]["masks"] == [whole.masks]
        totals = (await c.get("/rollouts")).json()
        expected = (TURNS - 1, 1) if resumes else (0, 0)
        got = (totals.get("turns", 0), totals.get("resumed", 0))
        assert got == expected, "each turn acknowledged once: none lost or doubled"


class Drifting(Walk):
    """A `Walk` whose tool does not answer the same twice (it claims to be deterministic, wrongly)."""

    def episode(self, task: Task) -> WalkEpisode:
        return WalkEpisode(self.turns, position=1000)


async def test_a_replay_that_diverges_restarts_the_slot_from_the_prompt_and_posts_it_whole() -> None:
    first, second = Walk(), Drifting()
    for e in (first, second):
        e.turns, e.group_size = TURNS, 1
    whole = await run_rollout(second, TASK, ScriptedPolicy(walk_script), 0, group_key="g1")
    async with app() as c:
        assert await killed_mid_episode(c, first, "g1") == CUT
        p2, stats, policy = producer(c, "p2"), RunnerStats(), Stalling()
        lease = await lease_of(p2)
        rollout = await siblings(p2, second, policy, stats)._resumed(0, TASK, "g1", 0, lease.prefix)
        assert (stats.slots_resumed, stats.slots_restarted, policy.calls) == (0, 1, TURNS)
        assert rollout.acked_turns == 0, "a restarted slot posts no turn: the server holds the first producer's"
        await Poster(p2, "g1", stats, 0)(0, rollout)
        await p2.aclose()
        batch = (await c.get("/batch")).json()["batch"]
        assert batch is not None and batch[0]["tokens"] == [whole.tokens], "posted whole, the turns set aside"


async def test_a_producer_whose_lease_passed_on_stops_at_its_next_turn() -> None:
    """p1 stalls past its lease; p2 takes the slot; p1 goes on and its next turn is refused (409 naming
    `producer_id`): its rollout ends with SlotLost, nothing of it is acknowledged after p2 took over."""
    env = Walk()
    env.turns, env.group_size = TURNS, 1
    async with app() as c:
        p1 = producer(c, "p1")
        await p1.open("g1", 1, env_id=0, deadline_s=600.0, task=task_to_wire(env.name, TASK))
        policy = Stalling(stall_at=CUT + 1)
        run = asyncio.create_task(executor(env, policy, p1, RunnerStats()).run_slot(0, TASK, "g1", 0))
        while policy.calls <= CUT or await turns_in(c, "g1") < CUT:
            await asyncio.sleep(0.01)
        p1.let_go("g1")  # stops heartbeating it, as a partitioned producer would
        p2 = producer(c, "p2")
        lease = await lease_of(p2)
        assert lease.prefix is not None and lease.prefix.turns == CUT
        policy.go_on.set()
        with pytest.raises(SlotLost, match="another producer"):
            await run
        assert await turns_in(c, "g1") == CUT
        await p1.aclose()
        await p2.aclose()


async def test_a_producer_whose_slot_another_finished_stops_at_its_next_turn() -> None:
    """p1 stalls past its lease; p2 takes the slot and posts it whole, which seals the group; p1 goes on and its next
    turn is refused (409 naming `group_id`: the group takes no more turns): its rollout ends with SlotLost at once,
    instead of generating the rest of an episode whose final post would be `redone`."""
    env = Walk()
    env.turns, env.group_size = 4 * TURNS, 1
    async with app() as c:
        p1 = producer(c, "p1")
        await p1.open("g1", 1, env_id=0, deadline_s=600.0, task=task_to_wire(env.name, TASK))
        policy = Stalling(stall_at=CUT + 1)
        run = asyncio.create_task(executor(env, policy, p1, RunnerStats()).run_slot(0, TASK, "g1", 0))
        while policy.calls <= CUT or await turns_in(c, "g1") < CUT:
            await asyncio.sleep(0.01)
        p1.let_go("g1")
        p2 = producer(c, "p2")
        assert (await lease_of(p2)).prefix is not None
        reply = await p2.post("g1", 0, [7, 8, 9], [7, 8, 9], score=1.0, inference_logprobs=[-0.5] * 3, after_turns=True)
        assert reply.group.state == "sealed"
        policy.go_on.set()
        with pytest.raises(SlotLost, match="another producer"):
            await run
        assert policy.calls <= CUT + 2 + BACKLOG < env.turns, "it stops once a turn is refused, not at the end"
        await p1.aclose()
        await p2.aclose()


PAGE = Path(__file__).resolve().parents[4] / "docs" / "episodes.md"


@pytest.mark.parametrize("block", [0, 1])
async def test_the_pages_examples_resume_token_exact(block: int) -> None:
    """docs/episodes.md's two envs (snapshot hook, deterministic tools) as the page writes them: killed after 3
    turns, continued by another producer, sealed equal to the uninterrupted rollout, the prefix not generated
    again."""
    code = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)[block]
    scope: dict[str, Any] = {"__name__": f"episodes_example_{block}"}
    exec(compile(code, str(PAGE), "exec"), scope)
    [kind] = [
        v
        for v in scope.values()
        if isinstance(v, type) and issubclass(v, Environment) and v.__module__ != "rollout_client.env"
    ]
    env, script = kind(), scope["policy"].script
    env.group_size = 1
    whole = await run_rollout(env, TASK, ScriptedPolicy(script), 0, group_key="g1")
    async with app() as c:
        assert await killed_mid_episode(c, env, "g1", script) == CUT
        p2, stats, policy = producer(c, "p2"), RunnerStats(), Stalling(script=script)
        lease = await lease_of(p2)
        rollout = await siblings(p2, env, policy, stats)._resumed(0, TASK, "g1", 0, lease.prefix)
        await Poster(p2, "g1", stats, 0)(0, rollout)
        await p2.aclose()
        assert (stats.slots_resumed, policy.calls) == (1, len(whole.turns) - CUT)
        batch = (await c.get("/batch")).json()["batch"]
        assert batch is not None and batch[0]["tokens"] == [whole.tokens]


async def test_each_token_keeps_the_weights_version_that_sampled_it_across_the_resume() -> None:
    """p1 samples its turns under weights 0, p2 continues under the same weights (an env that `continue`s keeps the
    prefix with its versions): turns and the final post carry one version per token, and the served batch has them."""
    env = Walk()
    env.turns, env.group_size = TURNS, 1
    async with app() as c:
        p1 = producer(c, "p1")
        await p1.open("g1", 1, env_id=0, deadline_s=600.0, task=task_to_wire(env.name, TASK))
        policy = Stalling(stall_at=CUT + 1)
        first = executor(env, policy, p1, RunnerStats())
        first.gate.weights = 0
        run = asyncio.create_task(first.run_slot(0, TASK, "g1", 0))
        while policy.calls <= CUT or await turns_in(c, "g1") < CUT:
            await asyncio.sleep(0.01)
        run.cancel()
        await p1.aclose()
        p2, stats = producer(c, "p2"), RunnerStats()
        lease = await lease_of(p2)
        assert lease.prefix is not None and all(t.token_weight_versions for t in lease.prefix.items)
        slots = siblings(p2, env, Stalling(), stats)
        slots.executor.gate.weights = 0
        rollout = await slots._resumed(0, TASK, "g1", 0, lease.prefix)
        assert rollout.versions == [0] * len(rollout.tokens)
        await Poster(p2, "g1", stats, 0)(0, rollout)
        await p2.aclose()
        batch = (await c.get("/batch")).json()["batch"]
        assert batch is not None and batch[0]["token_weight_versions"] == [[0] * len(rollout.tokens)]


async def test_a_runner_that_lost_a_slot_to_another_producer_leaves_the_seal_to_the_server() -> None:
    """p1's rollouts of a G=2 group end with slot 0 posted and slot 1 lost to p2 (its lease passed on while p1 was
    cut off: `SlotLost`). p1 must not seal the group with its survivors: that would cut off p2, which continues slot
    1 from its acknowledged turns. p1 lets the group go; p2's post of slot 1 seals it whole."""
    env = Walk()
    env.group_size = 2
    async with serving(Settings(store="memory://")) as c:
        assert (await c.post("/register", json=registration(batch_size=2))).status_code == 200
        await c.get("/batch")
        assert (await c.post("/register-env", json=env_body(group_size=2))).status_code == 200
        p1, p2 = producer(c, "p1"), producer(c, "p2")
        await p1.open("g", 2, env_id=0, deadline_s=600.0, task=task_to_wire(env.name, TASK))
        stats = RunnerStats()
        poster = Poster(p1, "g", stats)
        await poster(0, Rollout([1, 2, 3], [1, 2, 3], [-0.5] * 3, [], False, "stop", {}, score=1.0))
        poster.handed_over.add(1)
        posting = Posting(p1, [env], lambda i: 0, stats, Tally([env.name], stats, FailurePolicy()), no_end, None)
        assert await posting.sealed(0, "g", poster)
        view = (await c.get("/rollouts/group", params={"group_id": "g"})).json()
        assert view["state"] == "open" and view["done"] == [0], "p1 left the group to the server and p2"
        reply = await p2.post("g", 1, [4, 5], [4, 5], score=0.0, inference_logprobs=[-0.5] * 2)
        assert reply.group.state == "sealed" and reply.group.slots_done == 2
        await p1.aclose()
        await p2.aclose()


def no_end(reason: str, exc: BaseException | None) -> None:
    raise AssertionError(f"the run would end: {reason}")


async def test_a_runner_does_not_seal_away_a_failed_slot_whose_turns_were_acknowledged() -> None:
    """Slot 1's rollout failed after 2 of its turns were acknowledged (its final post never sent: an outage).
    Sealing with the survivor would drop those turns; the runner lets the group go instead, and a producer that
    leases the slot continues it from them."""
    env = Walk()
    env.group_size = 2
    async with serving(Settings(store="memory://")) as c:
        assert (await c.post("/register", json=registration(batch_size=2))).status_code == 200
        await c.get("/batch")
        assert (await c.post("/register-env", json=env_body(group_size=2))).status_code == 200
        p1 = producer(c, "p1")
        await p1.open("g", 2, env_id=0, deadline_s=600.0, task=task_to_wire(env.name, TASK))
        stats = RunnerStats()
        poster = Poster(p1, "g", stats)
        await poster(0, Rollout([1, 2, 3], [1, 2, 3], [-0.5] * 3, [], False, "stop", {}, score=1.0))
        for turn in range(2):
            await p1.turn("g", 1, turn, [4 + turn], [4 + turn], inference_logprobs=[-0.5])
        posting = Posting(p1, [env], lambda i: 0, stats, Tally([env.name], stats, FailurePolicy()), no_end, None)
        assert await posting.sealed(0, "g", poster)
        view = (await c.get("/rollouts/group", params={"group_id": "g"})).json()
        assert view["state"] == "open" and view["turns"]["1"]["n"] == 2, view
        await p1.aclose()
