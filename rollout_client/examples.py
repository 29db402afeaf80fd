"""Small, deterministic environments for the demo, the tests and the benchmark (no GPU, no download).

`Arithmetic`: single-turn sums and products with an exact-match verifier. `Calculator`: two turns, the
policy calls a calculator tool and then answers (the tool output is not trained on). `Synthetic`: a
fixed ~50 ms wait plus ~5 ms of CPU per step, to measure the runner. `arithmetic_script` is the scripted
policy that plays them: right with a probability that falls with the operands' size, deterministic per seed.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from dataclasses import dataclass

from rollout_client.env import Environment, Session, Task
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
