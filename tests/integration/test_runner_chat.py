"""A tool-using chat environment end to end: `ToolChat` on a tokenizer built locally, with Qwen2.5's real template
(Hermes calls, and Mistral's calls in Qwen's turns) and Llama 3.1's (JSON calls, written by the template from
the message's `tool_calls`), sampled through `OpenAIPolicy` from the fake inference server answering in that
family's format, run by `RolloutRunner` against a real rollbuf server process and read back from /batch: the
tokens are the template's rendering of the conversation, the trained ones exactly what the server sampled,
everything else masked with the logprob sentinel, and the tool metrics in each sequence's overrides."""

from __future__ import annotations

import asyncio
import itertools
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from api.wire.rules import MASK_IGNORE
from demos.standin_inference import MODEL
from rollout_client import OpenAIPolicy, RolloutRunner, Session, Tasks
from rollout_client.chat.examples import LLAMA31_JSON_TEMPLATE, QWEN25_TEMPLATE, ByteChatCodec, ToolChat
from rollout_client.env import PROMPT_LOGPROB
from rollout_client.examples import arithmetic_task
from tests.runs import HANG_GUARD_S, drain, start_trainer
from tests.servers import running_server
from tests.standin import running_standin
from tests.unit.rollout_client.chat.test_chat_session import Replies

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

QWEN = {"template": QWEN25_TEMPLATE, "eos": "<|im_end|>"}
LLAMA31 = {
    "template": LLAMA31_JSON_TEMPLATE,
    "eos": "<|eot_id|>",
    "calls_as": "tool_calls",
    "template_vars": {"date_string": "26 Jul 2024"},
}


def trained_runs(tokens: list[int], masks: list[int]) -> list[list[int]]:
    """The maximal runs of trained positions: one per sampled turn."""
    runs = []
    for trained, group in itertools.groupby(zip(tokens, masks, strict=True), key=lambda tm: tm[1] != MASK_IGNORE):
        if trained:
            runs.append([t for t, _ in group])
    return runs


async def check_sequence(
    env: ToolChat,
    tokens: list[int],
    masks: list[int],
    logprobs: list[float],
    overrides: dict[str, Any],
    answers: dict[str, int],
    task_id: str,
) -> int:
    """Checks one served sequence; returns how many malformed calls it had."""
    assert all(m in (MASK_IGNORE, t) for t, m in zip(tokens, masks, strict=True))
    assert all((lp == PROMPT_LOGPROB) == (m == MASK_IGNORE) for lp, m in zip(logprobs, masks, strict=True))
    assert all(-1.0 < lp <= 0.0 for lp, m in zip(logprobs, masks, strict=True) if m != MASK_IGNORE)
    turns = [ByteChatCodec.decode(run) for run in trained_runs(tokens, masks)]
    assert turns and all(t in answers and t.endswith(env.eos) for t in turns), "trained = exactly what was sampled"
    # the same conversation in process, answered with those turns: the same tokens and masks, which are the
    # template's own rendering of the messages
    index = int(task_id.rsplit("-", 1)[1])
    task = arithmetic_task(index, digits=2, op="*")
    assert task.id == task_id
    session = Session(Replies(turns), max_tokens=env.max_tokens)
    await env.rollout(task, session)
    assert (session.tokens, session.masks) == (tokens, masks)
    chat = env.chat(session)
    tok: Any = chat.tokenizer
    text = tok.apply_chat_template(chat.messages, tools=chat.schemas, tokenize=False, **env.template_kwargs())
    assert tokens == tok.encode(text, add_special_tokens=False)
    # metrics: per turn and per tool, as the server stored them
    answered = [m["content"] for m in chat.messages if m["role"] == "tool"]
    assert overrides["num_turns"] == len(turns) == len(overrides["turns"])
    assert all(t["template_mismatch"] == 0 for t in overrides["turns"])
    assert sum(t["tool_calls"] for t in overrides["turns"]) == len(answered)
    malformed = sum(t["malformed"] for t in overrides["turns"])
    assert malformed == sum(a.startswith("Error: the tool call could not be read") for a in answered)
    calc = overrides["tools"]["calculate"]
    assert calc["calls"] == sum(a.startswith("RESULT") for a in answered) and calc["failures"] == calc["malformed"] == 0
    return malformed


@pytest.mark.parametrize(
    ("fmt", "template", "workers"),
    [("hermes", QWEN, 1), ("llama3", LLAMA31, 0), ("mistral", QWEN, 0)],  # Mistral's calls in Qwen's turns
)
async def test_a_tool_using_chat_rollout_reaches_the_trainer_token_exact(
    tmp_path: Path, fmt: str, template: dict[str, Any], workers: int
) -> None:
    with running_server("memory://", tmp_path / "s.log") as server, running_standin(tmp_path / "v.log") as vllm:
        env = ToolChat(group_size=4, parser=fmt, **template)
        vllm.control(chat=fmt, chat_stop=env.eos, chat_cut_first=True)
        start_trainer(server.url, batch_size=8, max_token_len=2048)
        tasks = Tasks(partial(arithmetic_task, digits=2, op="*"))
        runner = RolloutRunner(
            server.url,
            [(env, tasks)],
            partial(OpenAIPolicy, vllm.url, MODEL, max_attempts=3),
            max_in_flight=8,
            num_workers=workers,
        )
        stats = await asyncio.wait_for(runner.run(max_groups=4), HANG_GUARD_S)
        assert stats.accepted == 4 and not stats.failed and not stats.skipped
        answers = vllm.stats()["answers"]
        served = drain(server.url)
        assert len(served) == 4
        malformed = 0
        for g in served:
            for tokens, masks, logprobs, overrides in zip(
                g["tokens"], g["masks"], g["inference_logprobs"], g["overrides"], strict=True
            ):
                malformed += await check_sequence(
                    env, tokens, masks, logprobs, overrides, answers, g["group_overrides"]["task_id"]
                )
        assert malformed > 0, "some calls were malformed, answered to the model, and the rollouts went on"
