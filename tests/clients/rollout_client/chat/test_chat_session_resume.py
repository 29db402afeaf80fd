"""A chat env resumed from its turns (rollout_client/chat/session.py, `ChatSession.resume`; docs/agentic.md), against
the in-process app, with the stand-in tokenizer the chat tests use (`local_tokenizer`, Qwen2.5's template): a
producer posts a tool-using chat episode's turns and stops after any of them; another takes the slot and continues
it, replaying the tools against the recorded assistant turns or rebuilding the conversation from the turns and the
env's snapshot, without generating the prefix again. The sealed rollout equals the uninterrupted one token for
token, mask for mask, logprob for logprob. A replay that diverges, and a prefix whose log was forged, restart
the slot from the prompt."""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import Any

import pytest

from rollout_client import Session, Task
from rollout_client.chat.examples import ByteChatCodec, ToolChat, tool_call_text
from rollout_client.group import Rollout, run_rollout
from rollout_client.runner.per_rollout import Poster, task_to_wire
from rollout_client.runner.stats import RunnerStats
from tests.clients.rollout_client.runner.test_runner_turns import (
    Stalling,
    app,
    executor,
    lease_of,
    producer,
    siblings,
    turns_in,
)

pytestmark = pytest.mark.anyio

TASK = Task("c", "Q: 12 * 34 =", answer="0")
CALLS = 4
"""Tool calls an episode makes before it answers: 4 turns posted, the answer with the final post."""


def script(prompt: str, seed: int) -> str:
    """Adds up: each turn asks the calculator to add the last result and a number from the seed and the turn."""
    results = re.findall(r"RESULT (-?\d+)", prompt)
    if len(results) >= CALLS:
        return f"The answer is {results[-1]}.<|im_end|>"
    last = int(results[-1]) if results else 0
    call = tool_call_text("hermes", "calculate", {"a": last, "op": "+", "b": (seed + 7 * len(results)) % 10})
    return f"Step {len(results)}. {call}<|im_end|>"


@dataclass
class Steps(ToolChat):
    """A chat of `CALLS` tool turns, resumed by replaying its calculator (deterministic)."""

    name: str = "steps"
    group_size: int = 1
    max_turns: int = 8
    scores_each_rollout: bool = True
    posts_each_rollout: bool = True
    resumes: Any = "replay"


@dataclass
class SnapshotSteps(Steps):
    """The same chat resumed from snapshots: its state outside the conversation (here how many tools ran)."""

    name: str = "steps_snapshot"
    resumes: Any = "snapshot"

    def snapshot(self, task: Task, session: Session) -> bytes:
        return json.dumps({"ran": len(session.turns)}).encode()

    def restore(self, task: Task, snapshot: bytes | str) -> dict[str, Any]:
        assert isinstance(snapshot, bytes)
        return {"ran": json.loads(snapshot)["ran"]}


def policy(stall_at: int | None = None) -> Stalling:
    out = Stalling(stall_at, script)
    out.tokenizer = ByteChatCodec()
    return out


async def cut_and_resumed(env: Steps, cut: int, forge: bool = False) -> tuple[Rollout, RunnerStats, int]:
    """p1 runs the episode until its generation `cut + 1` (after `cut` turns), then stops as a kill would; p2
    continues the slot. The resumed rollout (sealed), p2's stats, and p2's generations."""
    async with app(max_token_len=4096) as c:
        p1 = producer(c, "p1")
        await p1.open("g1", 1, env_id=0, deadline_s=600.0, task=task_to_wire(env.name, TASK))
        first = policy(stall_at=cut + 1)
        run = asyncio.create_task(executor(env, first, p1, RunnerStats()).run_slot(0, TASK, "g1", 0))
        while first.calls <= cut or await turns_in(c, "g1") < cut:
            if run.done():
                run.result()  # its error, if it failed
                raise AssertionError("the episode ended before the cut")
            await asyncio.sleep(0.01)
        run.cancel()
        await p1.aclose()
        p2, stats, second = producer(c, "p2"), RunnerStats(), policy()
        lease = await lease_of(p2)
        assert lease.prefix is not None and lease.prefix.turns == cut
        if forge:  # the log says the turns called no tool (a forged or foreign log): not the tokens' story
            for item in lease.prefix.items:
                item.tool_results = [e for e in item.tool_results or [] if "tool" not in e]
        rollout = await siblings(p2, env, second, stats)._resumed(0, TASK, "g1", 0, lease.prefix)
        await Poster(p2, "g1", stats, 0)(0, rollout)
        await p2.aclose()
        batch = (await c.get("/batch")).json()["batch"]
        assert batch is not None
        assert (batch[0]["tokens"], batch[0]["masks"]) == ([rollout.tokens], [rollout.masks]), "sealed as resumed"
        return rollout, stats, second.calls


@pytest.mark.parametrize("cut", range(1, CALLS))
@pytest.mark.parametrize("env_type", [Steps, SnapshotSteps])
async def test_a_chat_cut_after_any_turn_resumes_token_exact(env_type: type[Steps], cut: int) -> None:
    env = env_type()
    whole = await run_rollout(env, TASK, policy(), 0, group_key="g1")
    assert len(whole.turns) == CALLS + 1
    rollout, stats, generated = await cut_and_resumed(env, cut)
    assert (stats.slots_resumed, stats.slots_restarted) == (1, 0)
    assert generated == CALLS + 1 - cut, "the prefix is not generated again"
    assert rollout.tokens == whole.tokens and rollout.masks == whole.masks
    assert rollout.logprobs == whole.logprobs
    assert rollout.resumed_tokens > 0 and rollout.score == whole.score


@pytest.mark.parametrize("env_type", [Steps, SnapshotSteps])
async def test_a_chat_whose_log_was_forged_restarts_from_the_prompt(env_type: type[Steps]) -> None:
    """(Replay: the tools' answers land where the prefix has other tokens; snapshot: the rebuilt conversation
    does not render as the prefix.)"""
    env = env_type()
    whole = await run_rollout(env, TASK, policy(), 0, group_key="g1")
    rollout, stats, generated = await cut_and_resumed(env, 2, forge=True)
    if env.resumes == "snapshot":
        assert (stats.slots_resumed, stats.slots_restarted) == (0, 1)
        assert generated == CALLS + 1 and rollout.tokens == whole.tokens, "from the prompt, whole"
    else:  # replay does not read the tool results from the log: the calculator answers again, the same
        assert (stats.slots_resumed, stats.slots_restarted) == (1, 0) and rollout.tokens == whole.tokens
