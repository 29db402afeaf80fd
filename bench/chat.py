"""Client CPU per turn of a tool-using chat rollout (rollout_client.chat), against the same conversation done
by hand on a plain `Session` (each turn's text rendered by the caller and observed), as conversations grow.

The chat session renders the whole conversation with the template twice per turn (once for the prompt, once
to check the sampled answer against it), so its cost per turn grows with the conversation; this measures by
how much, with Qwen2.5's template on the local byte-level tokenizer and a policy that answers at once (the
inference server's time is not counted). Run: `python -m bench.chat [--turns 1 8 32] [--reps 20]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from rollout_client import Completion, Session
from rollout_client.chat import ChatSession
from rollout_client.chat.examples import ByteChatCodec, calculate, local_tokenizer, tool_call_text

CALL = "Let me compute. " + tool_call_text("hermes", "calculate", {"a": 12, "op": "*", "b": 34}) + "<|im_end|>"
ANSWER = "The answer is 408.<|im_end|>"


class Instant:
    """Answers `turns - 1` tool calls, then the answer; no waiting."""

    def __init__(self, turns: int) -> None:
        self.left = turns

    async def tokenize(self, text: str) -> list[int]:
        return ByteChatCodec.encode(text)

    async def generate(
        self, prompt_ids: list[int], *, max_tokens: int, token_limit: int | None = None, seed: int | None = None
    ) -> Completion:
        self.left -= 1
        ids = ByteChatCodec.encode(CALL if self.left > 0 else ANSWER)
        return Completion(ids, [-0.5] * len(ids), "", "stop")


async def chat_rollout(turns: int) -> Session:
    session = Session(Instant(turns), max_tokens=512)
    chat = ChatSession(session, local_tokenizer(), tools=[calculate])
    chat.add({"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "Q: 12 * 34 ="})
    while not (await chat.step()).calls == []:
        pass
    return session


async def by_hand(turns: int, prompt: str) -> Session:
    """What an environment did before: its own rendering as text, observed, the calls regexed out."""
    session = Session(Instant(turns), max_tokens=512)
    await session.observe(prompt)
    while True:
        out = await session.generate()
        text = ByteChatCodec.decode(out.token_ids)
        if "<tool_call>" not in text:
            return session
        result = calculate(12, "*", 34)
        await session.observe(
            f"\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        )


def measure(turns: int, reps: int) -> dict[str, Any]:
    tok: Any = local_tokenizer()
    prompt = tok.apply_chat_template(
        [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "Q: 12 * 34 ="}],
        tools=[ChatSession(Session(Instant(1)), tok, tools=[calculate]).schemas[0]],
        add_generation_prompt=True,
        tokenize=False,
    )
    out: dict[str, Any] = {"bench": "chat", "turns": turns}
    for name, run in (("chat", lambda: chat_rollout(turns)), ("by_hand", lambda: by_hand(turns, prompt))):
        per_turn = []
        for _ in range(reps):
            t0 = time.perf_counter()
            session = asyncio.run(run())
            per_turn.append((time.perf_counter() - t0) / turns)
        out[f"{name}_us_per_turn"] = round(statistics.median(per_turn) * 1e6, 1)
        out[f"{name}_tokens"] = len(session.tokens)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--turns", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    local_tokenizer()  # built once, outside the timings
    for turns in args.turns:
        r = measure(turns, args.reps)
        print(json.dumps(r))
        print(
            f"  {turns:3d} turns ({r['chat_tokens']} tokens): chat session {r['chat_us_per_turn']:8.0f} us/turn, "
            f"by hand {r['by_hand_us_per_turn']:8.0f} us/turn"
        )


if __name__ == "__main__":
    main()
