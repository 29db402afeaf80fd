"""Group mechanics: all-or-nothing resources, the generation gate, per-rollout isolation."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import pytest

from rollout_client import (
    Environment,
    Episode,
    EpisodeEnvironment,
    Gate,
    ScriptedPolicy,
    Session,
    Task,
    acquire_all,
    run_group,
)
from rollout_client.examples import Synthetic
from rollout_client.group import acquire_resources

pytestmark = pytest.mark.anyio


class Pool:
    """A resource pool that records what is held; `fail_at` makes that acquisition raise."""

    def __init__(self, fail_at: set[int] | None = None) -> None:
        self.held: set[int] = set()
        self.fail_at = fail_at or set()
        self.started = 0

    @asynccontextmanager
    async def get(self, i: int, delay: float = 0.0) -> AsyncIterator[int]:
        self.started += 1
        await asyncio.sleep(delay)
        if i in self.fail_at:
            raise OSError(f"sandbox {i} failed to start")
        self.held.add(i)
        try:
            yield i
        finally:
            self.held.discard(i)


async def test_acquire_all_holds_everything_or_nothing() -> None:
    pool = Pool()
    values, stack = await acquire_all([pool.get(i) for i in range(4)])
    assert values == [0, 1, 2, 3] and pool.held == {0, 1, 2, 3}
    await stack.aclose()
    assert pool.held == set()

    failing = Pool(fail_at={2})
    cms = [failing.get(i, delay=0.0 if i < 2 else 0.01) for i in range(2)] + [failing.get(2, 0.01), failing.get(3, 5.0)]
    with pytest.raises(OSError, match="sandbox 2 failed"):  # the real error, not the cancellations it caused
        await acquire_all(cms)
    assert failing.held == set(), "what was acquired is released"


class Counting(Environment):
    name = "counting"
    group_size = 5

    def resource(self, task: Task) -> AbstractAsyncContextManager[Any]:
        return POOL.get(id(object()))

    async def rollout(self, task: Task, session: Session) -> None:
        await session.observe(task.prompt)
        session.mine = []  # type: ignore[attr-defined]
        for _ in range(3):
            out = await session.generate()
            session.mine.append(out.text)  # type: ignore[attr-defined]
            await asyncio.sleep(0)
            await session.observe(" ok\n")

    def score(self, task: Task, session: Session) -> float:
        return float(len(session.mine) == 3 and session.resource in POOL.held)  # type: ignore[attr-defined]


POOL = Pool()


async def test_rollouts_are_isolated_and_share_the_prompt() -> None:
    pol = ScriptedPolicy(lambda prompt, seed: f" {seed % 1000}")
    out = await run_group(Counting(), Task("t", "Q:"), pol, group_key="g")
    assert out.group is not None
    g = out.group
    assert g.scores == [1.0] * 5, "each session saw its own 3 turns and held its own resource while scored"
    assert POOL.held == set()
    assert len({tuple(t) for t in g.tokens}) == 5, "rollouts of a group differ (own seeds), nothing shared"
    assert all(t[:2] == list(b"Q:") for t in g.tokens)
    assert g.overrides is not None and all(len(o["turns"]) == 3 for o in g.overrides)


async def test_gate_close_waits_for_requests_in_flight_and_blocks_new_ones() -> None:
    gate = Gate()
    log: list[str] = []
    release = asyncio.Event()

    async def request(name: str) -> None:
        async with gate.generation():
            log.append(f"start {name}")
            await release.wait()
            log.append(f"end {name}")

    first = asyncio.create_task(request("a"))
    await asyncio.sleep(0)
    closing = asyncio.create_task(gate.close())
    await asyncio.sleep(0)
    second = asyncio.create_task(request("b"))
    await asyncio.sleep(0)
    assert not closing.done() and log == ["start a"]
    release.set()
    await closing
    assert log == ["start a", "end a"], "closed: nothing in flight, b waits"
    gate.open()
    await asyncio.gather(first, second)
    assert log[-2:] == ["start b", "end b"]


class Guess:
    """Guess the secret 0-9; told higher or lower after each wrong guess."""

    def __init__(self, secret: int) -> None:
        self.secret = secret
        self.guesses: list[int] = []

    def start(self) -> str:
        return "Guess 0-9:"

    def step(self, completion: str) -> tuple[str | None, bool]:
        guess = int(completion.strip()[-1])
        self.guesses.append(guess)
        if guess == self.secret:
            return None, True
        return (" higher:" if guess < self.secret else " lower:"), False

    def score(self) -> float:
        return 1.0 / len(self.guesses) if self.guesses[-1] == self.secret else 0.0


class GuessEnv(EpisodeEnvironment):
    name = "guess"
    group_size = 4
    max_turns = 10

    def episode(self, task: Task) -> Episode:
        return Guess(int(task.answer))


def guesser(prompt: str, seed: int) -> str:
    """Starts at seed % 10 and walks one step at a time in the direction it is told."""
    history = prompt.split()[2:]  # "Guess 0-9:" then guess, feedback, guess, feedback, ...
    if not history:
        return f" {seed % 10}"
    last, feedback = int(history[-2]), history[-1]
    return f" {last + 1 if feedback == 'higher:' else last - 1}"


async def test_episode_environment_steps_until_done_with_state_per_rollout() -> None:
    out = await run_group(GuessEnv(), Task("t", "", answer=7), ScriptedPolicy(guesser), group_key="guess")
    assert out.group is not None and out.group.overrides is not None
    turns = [len(o["turns"]) for o in out.group.overrides]
    assert all(s > 0 for s in out.group.scores) and out.group.scores == [1.0 / t for t in turns]
    assert len(set(turns)) > 1, "each rollout played its own episode from its own first guess"
    for tokens, masks in zip(out.group.tokens, out.group.masks, strict=True):
        text = bytes(t for t, m in zip(tokens, masks, strict=True) if m == -100).decode()
        assert "Guess 0-9:" in text and ("higher" in text or "lower" in text or len(text) == len("Guess 0-9:"))
        assert all(m in (-100, t) for t, m in zip(tokens, masks, strict=True))


async def test_resources_are_entered_unless_the_env_has_none() -> None:
    """An env that keeps Environment.resource gets a None per rollout without entering anything; one whose
    resource is its own, on the class or set on the instance, gets what each entered context yields."""
    plain = Synthetic(group_size=3)
    values, stack = await acquire_resources(plain, Task(id="t", prompt="p"), 3)
    assert values == [None, None, None]
    await stack.aclose()
    entered: list[int] = []

    @asynccontextmanager
    async def sandbox(task: Task) -> AsyncIterator[int]:
        entered.append(len(entered))
        yield len(entered)

    own = Synthetic(group_size=2)
    own.resource = sandbox  # type: ignore[method-assign]
    values, stack = await acquire_resources(own, Task(id="t", prompt="p"), 2)
    assert sorted(values) == [1, 2] and len(entered) == 2
    await stack.aclose()
