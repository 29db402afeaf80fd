"""Small, deterministic environments for the demo, the tests and the benchmark (no GPU, no download).

`Arithmetic`: single-turn sums and products with an exact-match verifier. `Calculator`: two turns, the
policy calls a calculator tool and then answers (the tool output is not trained on). `Synthetic`: a
fixed ~50 ms wait plus ~5 ms of CPU per step, to measure the runner. `Walk` (and `SnapshotWalk`, `RestartWalk`):
a multi-turn episode with a deterministic tool, posted turn by turn and resumed by another producer
(docs/episodes.md). `arithmetic_script` is the scripted
policy that plays them: right with a probability that falls with the operands' size, deterministic per seed.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from dataclasses import dataclass
from typing import Any

from rollout_client.env import Environment, EpisodeEnvironment, Session, Task
from rollout_client.episodes import Resumes
from rollout_client.policy import stable_unit

_QUESTION = re.compile(r"Q: (\d+) ([+*]) (\d+) =")
_CALC = re.compile(r"CALC (\d+) ([+*]) (\d+)")
_RESULT = re.compile(r"RESULT (\d+)")


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a * b


def arithmetic_script(prompt: str, seed: int) -> str:
    """The scripted policy for the example envs: calls the calculator when told to, then reads its result;
    otherwise answers directly, right with probability 1 / (1 + digits / 4), else off by a little."""
    if (result := _RESULT.findall(prompt)) and "calculator" in prompt:
        return f" A: {result[-1]}\n"
    q = _QUESTION.search(prompt)
    if q is None:
        return " A: ?\n"
    a, op, b = int(q.group(1)), q.group(2), int(q.group(3))
    if "calculator" in prompt:  # mistypes an operand 30% of the time: the tool is only as good as its input
        return f" CALC {a} {op} {b if stable_unit(prompt, seed) < 0.7 else b + 1}\n"
    digits = len(str(a)) + len(str(b))
    right = stable_unit(prompt, seed) < 1.0 / (1.0 + digits / 4)
    answer = _apply(a, op, b) + (0 if right else 1 + seed % 3)
    return f" A: {answer}\n"


def _answer(text: str) -> str | None:
    m = re.search(r"A: (-?\d+)", text)
    return m.group(1) if m else None


def arithmetic_task(i: int, digits: int = 2, op: str = "+") -> Task:
    rng = random.Random(i * 7919 + digits)
    a, b = rng.randrange(10 ** (digits - 1), 10**digits), rng.randrange(10 ** (digits - 1), 10**digits)
    return Task(id=f"{op}{digits}-{i}", prompt=f"Q: {a} {op} {b} =", answer=str(_apply(a, op, b)))


@dataclass
class Arithmetic(Environment):
    """One turn: the question, the policy's answer, exact match against the true result."""

    name: str = "arithmetic"
    group_size: int = 4
    weight: float = 1.0
    max_tokens: int = 16

    async def rollout(self, task: Task, session: Session) -> None:
        await session.observe(task.prompt)
        await session.generate()

    def score(self, task: Task, session: Session) -> float:
        return 1.0 if _answer(session.last_text) == task.answer else 0.0


@dataclass
class Calculator(Environment):
    """Two turns: the policy asks the calculator tool, the tool answers (masked), the policy answers."""

    name: str = "calculator"
    group_size: int = 8
    weight: float = 1.0
    max_tokens: int = 24

    async def rollout(self, task: Task, session: Session) -> None:
        await session.observe(f"{task.prompt} (use the calculator)")
        for _ in range(3):
            reply = await session.generate()
            call = _CALC.search(reply.text)
            if call is None:
                return  # done: the policy answered
            async with session.tool("calculator"):  # timed, failures counted, in the sequence's overrides
                result = _apply(int(call.group(1)), call.group(2), int(call.group(3)))
            await session.observe(f"RESULT {result}\n")

    def score(self, task: Task, session: Session) -> float:
        return 1.0 if _answer(session.last_text) == task.answer else 0.0


def busy(seconds: float) -> None:
    """Spin the CPU (holding the GIL) for `seconds`: stands in for tokenisation, parsing, verification."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@dataclass
class Synthetic(Environment):
    """`steps` steps of `wait_s` waiting (a tool, an inference call) plus `cpu_s` of CPU each."""

    name: str = "synthetic"
    group_size: int = 8
    steps: int = 1
    wait_s: float = 0.05
    cpu_s: float = 0.005
    max_tokens: int = 8

    async def rollout(self, task: Task, session: Session) -> None:
        await session.observe(task.prompt)
        for _ in range(self.steps):
            await asyncio.sleep(self.wait_s)
            busy(self.cpu_s)
            await session.generate()

    def score(self, task: Task, session: Session) -> float:
        return float((session.seed or 0) % 2)


_MOVE = re.compile(r"MOVE (\d+)")


def walk_script(prompt: str, seed: int) -> str:
    """The scripted policy for `Walk`: a move of 1 to 9, deterministic per prompt and seed."""
    return f" MOVE {1 + int(stable_unit(prompt, seed) * 9)}\n"


class WalkEpisode:
    """A walk of `turns` steps: each completion names a move, the tool (deterministic) answers the new position."""

    def __init__(self, turns: int, position: int = 0, turn: int = 0) -> None:
        self.turns, self.position, self.turn = turns, position, turn

    def start(self) -> str:
        return f"Walk {self.turns} steps. POS {self.position}\n"

    def step(self, completion: str) -> tuple[str | None, bool]:
        move = _MOVE.search(completion)
        self.position += int(move.group(1)) if move else 0
        self.turn += 1
        return f"POS {self.position}\n", self.turn >= self.turns

    def score(self) -> float:
        return 1.0 if self.position % 2 == 0 else 0.0


class Walk(EpisodeEnvironment):
    """A multi-turn tool episode whose tool is deterministic (`resumes = "replay"`): a producer that continues
    a slot runs its steps again against the recorded moves. Scored and posted rollout by rollout."""

    name = "walk"
    group_size = 4
    max_tokens = 12
    max_turns = 64
    scores_each_rollout = True
    posts_each_rollout = True
    resumes: Resumes = "replay"
    turns = 6

    def episode(self, task: Task) -> WalkEpisode:
        return WalkEpisode(self.turns)


class SnapshotWalk(Walk):
    """`Walk` resumed from the episode's state after each step (`resumes = "snapshot"`): `snapshot` and
    `restore` carry it as JSON."""

    name = "walk_snapshot"
    resumes: Resumes = "snapshot"

    def snapshot(self, task: Task, session: Session) -> bytes:
        episode: WalkEpisode = session.state["episode"]
        return json.dumps({"turns": episode.turns, "position": episode.position, "turn": episode.turn}).encode()

    def restore(self, task: Task, snapshot: bytes | str) -> dict[str, Any]:
        assert isinstance(snapshot, bytes), "sent inline"
        return {"episode": WalkEpisode(**json.loads(snapshot))}


class RestartWalk(Walk):
    """`Walk` that can neither restore nor replay (`resumes = "restart"`, the default): a slot whose producer
    died starts again from the prompt, and no turn is posted."""

    name = "walk_restart"
    resumes: Resumes = "restart"
