"""rollout_client.chat on a tokenizer built locally with `tokenizers` carrying Qwen2.5's real chat template: the
trained mask covers exactly the sampled ids (hypothesis), the tokens are the template's rendering of the
conversation, malformed and failing calls go back to the model as tool turns and are counted, and a template
that renders the assistant's turn differently from what was sampled is flagged."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from api.wire.rules import MASK_IGNORE
from rollout_client import Completion, EpisodeTruncated, Session
from rollout_client.chat import ChatSession
from rollout_client.chat.examples import (
    LLAMA3_TEMPLATE,
    LLAMA31_JSON_TEMPLATE,
    SPECIAL_TOKENS,
    ByteChatCodec,
    calculate,
    local_tokenizer,
    tool_call_text,
)
from rollout_client.chat.tools import Tool
from rollout_client.env import PROMPT_LOGPROB
from rollout_client.policy import clip_max_tokens


class Replies:
    """A policy that answers with the given texts in turn (ids through the local tokenizer), recording the ids it
    sampled; logprobs -0.5 so that they differ from the prompt sentinel."""

    def __init__(self, texts: list[str]) -> None:
        self.texts = list(texts)
        self.sampled: list[list[int]] = []

    async def tokenize(self, text: str) -> list[int]:
        return ByteChatCodec.encode(text)

    async def generate(
        self, prompt_ids: list[int], *, max_tokens: int, token_limit: int | None = None, seed: int | None = None
    ) -> Completion:
        ids = ByteChatCodec.encode(self.texts.pop(0))
        budget = clip_max_tokens(len(prompt_ids), max_tokens, token_limit)
        finish = "stop"
        if len(ids) > budget:
            ids, finish = ids[:budget], "length"
        self.sampled.append(ids)
        return Completion(ids, [-0.5] * len(ids), ByteChatCodec.decode(ids), finish)


def run(texts: list[str], tools: list[Callable[..., Any]], **kw: Any) -> tuple[ChatSession, Replies]:
    policy = Replies(texts)
    tokenizer = kw.pop("tokenizer", None) or local_tokenizer()
    session = Session(policy, max_tokens=kw.pop("max_tokens", 400), token_limit=kw.pop("token_limit", None))
    chat = ChatSession(session, tokenizer, tools=tools, **kw)

    async def go() -> None:
        chat.add({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q: 12 * 34 ="})
        while policy.texts:
            try:
                await chat.step()
            except EpisodeTruncated:  # as the runner does: the rollout ends where it is
                return

    asyncio.run(go())
    return chat, policy


def check_masks(chat: ChatSession, policy: Replies) -> None:
    s = chat.session
    trained = [t for t, m in zip(s.tokens, s.masks, strict=True) if m != MASK_IGNORE]
    assert trained == [i for ids in policy.sampled for i in ids]  # exactly the sampled ids, in order
    assert all(m in (MASK_IGNORE, t) for t, m in zip(s.tokens, s.masks, strict=True))
    assert all((lp == PROMPT_LOGPROB) == (m == MASK_IGNORE) for lp, m in zip(s.logprobs, s.masks, strict=True))


def the_template_renders(chat: ChatSession) -> list[int]:
    tok: Any = chat.tokenizer
    text = tok.apply_chat_template(chat.messages, tools=chat.schemas, tokenize=False, **chat.template_kwargs)
    return list(tok.encode(text, add_special_tokens=False))


prose = st.text(st.characters(codec="utf-8", exclude_characters="<[\x00"), max_size=30)
arguments = st.dictionaries(st.sampled_from(["a", "op", "b", "c"]), st.integers(-99, 99) | st.sampled_from(["+", "*"]))


@st.composite
def turns(draw: st.DrawFn) -> list[str]:
    """Assistant turns: prose with or without a tool call (good, unknown tool, bad arguments, unreadable)."""
    out = []
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["good", "unknown", "args", "unreadable"]))
        args = {"a": 3, "op": "+", "b": 4} if kind == "good" else draw(arguments)
        call = tool_call_text("hermes", "calculate" if kind != "unknown" else "search", args)
        if kind == "unreadable":
            call = call.replace("}\n</tool_call>", "\n</tool_call>")
        out.append(draw(prose) + call + "<|im_end|>")
    return [*out, draw(prose) + "<|im_end|>"]


@settings(max_examples=40, deadline=None)
@given(turns())
def test_the_trained_mask_covers_exactly_the_sampled_tokens(texts: list[str]) -> None:
    chat, policy = run(texts, [calculate])
    check_masks(chat, policy)
    assert chat.session.tokens == the_template_renders(chat)  # no turn re-tokenised, no token off the template
    assert chat.mismatches == 0 and all(t["template_mismatch"] == 0 for t in chat.session.turns)
    calls = sum(t["tool_calls"] for t in chat.session.turns)
    assert calls == sum(1 for m in chat.messages if m["role"] == "tool") == len(texts) - 1
    errors = [m for m in chat.messages if m["role"] == "tool" and m["content"].startswith("Error:")]
    rec = chat.session.tools.get("calculate", {})
    assert chat.malformed == sum(t["malformed"] for t in chat.session.turns) == len(errors) - rec.get("failures", 0)
    assert rec.get("calls", 0) + chat.malformed == calls


def test_a_tool_using_conversation_renders_as_qwen_does() -> None:
    answer = "The answer is 408.<|im_end|>"
    chat, policy = run(
        [
            "Let me compute. " + tool_call_text("hermes", "calculate", {"a": 12, "op": "*", "b": 34}) + "<|im_end|>",
            answer,
        ],
        [calculate],
    )
    text = ByteChatCodec.decode(chat.session.tokens)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions")
    assert '{"type": "function", "function": {"name": "calculate", "description": "Compute a + b or a * b' in text
    assert text.endswith(
        '<|im_start|>user\nQ: 12 * 34 =<|im_end|>\n<|im_start|>assistant\nLet me compute. <tool_call>\n{"name": '
        '"calculate", "arguments": {"a": 12, "op": "*", "b": 34}}\n</tool_call><|im_end|>\n<|im_start|>user\n'
        "<tool_response>\nRESULT 408\n</tool_response><|im_end|>\n<|im_start|>assistant\nThe answer is 408."
        "<|im_end|>\n"
    )
    check_masks(chat, policy)
    # the template's own tokens after a sampled stop token ("\n" after <|im_end|>) are observed, not trained
    s = chat.session
    end = s.tokens.index(SPECIAL_TOKENS.index("<|im_end|>") + 256, len(s.tokens) - len(policy.sampled[-1]) - 1)
    assert s.masks[end] == s.tokens[end] and s.masks[end + 1] == MASK_IGNORE and s.tokens[end + 1] == ord("\n")
    assert chat.last_content == "The answer is 408."
    assert s.tools["calculate"]["calls"] == 1 and s.tools["calculate"]["failures"] == 0
    assert [t["tool_calls"] for t in s.turns] == [1, 0]


def test_bad_calls_are_told_to_the_model_and_counted() -> None:
    def boom(x: int) -> str:
        """Always fails."""
        raise RuntimeError("disk full")

    async def slow_add(a: int, b: int) -> int:
        """Adds, asynchronously."""
        await asyncio.sleep(0)
        return a + b

    calls = [
        tool_call_text("hermes", "nope", {}),
        tool_call_text("hermes", "slow_add", {"a": 1}),
        '<tool_call>\n{"name": "slow_add", "arguments": {"a": 1</tool_call>',
        tool_call_text("hermes", "boom", {"x": 1}),
        tool_call_text("hermes", "slow_add", {"a": 1, "b": 2}),
    ]
    chat, policy = run(["".join(calls) + "<|im_end|>", "Done.<|im_end|>"], [boom, slow_add])
    replies = [m["content"] for m in chat.messages if m["role"] == "tool"]
    assert replies[0] == "Error: there is no tool named 'nope'. The tools are: boom, slow_add."
    assert replies[1].startswith("Error: bad arguments: slow_add: missing a required argument: 'b'")
    assert replies[2].startswith("Error: the tool call could not be read: not valid JSON")
    assert replies[3] == "Error: RuntimeError: disk full"
    assert replies[4] == "3"
    turn = chat.session.turns[0]
    assert (turn["tool_calls"], turn["malformed"], chat.malformed) == (5, 3, 3)
    assert chat.session.tools == {
        "slow_add": {"calls": 1, "failures": 0, "seconds": chat.session.tools["slow_add"]["seconds"], "malformed": 1},
        "boom": {"calls": 1, "failures": 1, "seconds": chat.session.tools["boom"]["seconds"], "malformed": 0},
    }
    check_masks(chat, policy)
    assert chat.session.tokens == the_template_renders(chat)


@pytest.mark.parametrize("parser", ["llama3", "mistral"])
def test_each_family_s_calls_are_parsed_and_run(parser: str) -> None:
    call = tool_call_text(parser, "calculate", {"a": 2, "op": "+", "b": 2})
    chat, policy = run([call + "<|im_end|>", "4<|im_end|>"], [calculate], parser=parser)
    assert [m["content"] for m in chat.messages if m["role"] == "tool"] == ["RESULT 4"]
    check_masks(chat, policy)


@pytest.mark.parametrize("calls_as", ["tool_calls", "text"])
def test_llama31_writes_the_calls_itself_from_the_message(calls_as: str) -> None:
    """Llama 3.1's template renders a call from the message's `tool_calls` and tool results as `ipython` turns:
    with the calls parsed into the message, the conversation renders as exactly the tokens sampled."""
    tok = local_tokenizer(LLAMA31_JSON_TEMPLATE, "<|eot_id|>")
    call = tool_call_text("llama3", "calculate", {"a": 12, "op": "*", "b": 34})
    chat, policy = run(
        [call + "<|eot_id|>", "The answer is 408.<|eot_id|>"],
        [calculate],
        tokenizer=tok,
        parser="llama3",
        calls_as=calls_as,
        template_kwargs={"date_string": "26 Jul 2024"},
    )
    check_masks(chat, policy)
    assert chat.mismatches == 0 and chat.session.tokens == the_template_renders(chat)
    assert ("tool_calls" in chat.messages[2]) == (calls_as == "tool_calls")
    text = ByteChatCodec.decode(chat.session.tokens)
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n{"output": "RESULT 408"}<|eot_id|>' in text
    assert "Today Date: 26 Jul 2024" in text


def test_a_template_that_rewrites_the_assistant_turn_is_flagged() -> None:
    """Llama 3's template trims each message: a sampled leading space is not what it renders. The tokens trained
    on stay the sampled ones; the turn is flagged and counted, and so is the next one (its prompt holds the
    untrimmed answer, where the template would have the trimmed one)."""
    tok = local_tokenizer(LLAMA3_TEMPLATE, "<|eot_id|>")
    chat, policy = run([" 408<|eot_id|>", "Sure.<|eot_id|>"], [], tokenizer=tok)
    check_masks(chat, policy)
    assert [t["template_mismatch"] for t in chat.session.turns] == [1, 1] and chat.mismatches == 2
    assert ByteChatCodec.decode(chat.session.tokens).startswith("<|begin_of_text|><|start_header_id|>system")


def test_a_stop_at_max_tokens_is_closed_by_the_template_and_the_budget_holds() -> None:
    chat, policy = run(["x" * 50, "fine<|im_end|>"], [calculate], max_tokens=10)
    assert policy.sampled[0] == [ord("x")] * 10
    check_masks(chat, policy)
    assert chat.session.tokens == the_template_renders(chat)
    budget = len(chat.session.tokens) - 5
    chat, policy = run(
        [
            "Let me see. " + tool_call_text("hermes", "calculate", {"a": 1, "op": "+", "b": 1}) + "<|im_end|>",
            "2<|im_end|>",
        ],
        [calculate],
        token_limit=budget,
    )
    assert len(chat.session.tokens) <= budget and chat.session.truncated
    check_masks(chat, policy)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(SPECIAL_TOKENS) | st.text(max_size=8), max_size=8).map("".join))
def test_the_light_codec_is_the_local_tokenizer(text: str) -> None:
    tok: Any = local_tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    assert ByteChatCodec.encode(text) == ids
    assert ByteChatCodec.decode(ids) == tok.decode(ids, skip_special_tokens=False) == text


def test_tool_results_are_json_unless_text() -> None:
    def listing() -> list[int]:
        """Numbers."""
        return [1, 2]

    chat, _ = run([tool_call_text("hermes", "listing", {}) + "<|im_end|>", "ok<|im_end|>"], [listing])
    assert [m["content"] for m in chat.messages if m["role"] == "tool"] == [json.dumps([1, 2])]


class ChatML:
    """Not a transformers tokenizer: a ChatML formatter over `ByteChatCodec`, as any tokenizer object may be."""

    eos_token_id = 256 + SPECIAL_TOKENS.index("<|im_end|>")

    def apply_chat_template(self, conversation: list[dict[str, Any]], **kw: Any) -> str:
        out = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in conversation)
        return out + ("<|im_start|>assistant\n" if kw.get("add_generation_prompt") else "")

    def encode(self, text: str, **kw: Any) -> list[int]:
        return ByteChatCodec.encode(text)

    def decode(self, token_ids: list[int], **kw: Any) -> str:
        return ByteChatCodec.decode(token_ids)


def test_any_object_with_a_chat_template_will_do() -> None:
    call = tool_call_text("hermes", "calculate", {"a": 1, "op": "+", "b": 2})
    chat, policy = run([call + "<|im_end|>", "3<|im_end|>"], [calculate], tokenizer=ChatML())
    check_masks(chat, policy)
    assert chat.mismatches == 0 and chat.session.tokens == the_template_renders(chat)
    assert [m["content"] for m in chat.messages if m["role"] == "tool"] == ["RESULT 3"]


class Qwen3Like(ChatML):
    """Qwen 3's rule: an assistant turn before the last user message is rendered without its reasoning."""

    def apply_chat_template(self, conversation: list[dict[str, Any]], **kw: Any) -> str:
        last_user = max((i for i, m in enumerate(conversation) if m["role"] == "user"), default=-1)
        out = ""
        for i, m in enumerate(conversation):
            content = m["content"]
            if m["role"] == "assistant" and i < last_user and "</think>" in content:
                content = content.split("</think>", 1)[1].lstrip("\n")
            out += f"<|im_start|>{m['role']}\n{content}<|im_end|>\n"
        return out + ("<|im_start|>assistant\n" if kw.get("add_generation_prompt") else "")


def test_a_template_that_drops_earlier_reasoning_is_flagged_not_an_error() -> None:
    """A second user message makes a Qwen 3-style template drop the first answer's reasoning. Before:
    ChatTemplateError, every multi-user-turn rollout failed; now the turn is flagged, the sampled tokens kept,
    and the new user turn is what the template adds after the earlier ones."""
    policy = Replies(["<think>\nsum it\n</think>\n\n408<|im_end|>", "<think>\nagain\n</think>\n\n409<|im_end|>"])
    chat = ChatSession(Session(policy, max_tokens=400), Qwen3Like())

    async def go() -> None:
        chat.add({"role": "user", "content": "Q: 12 * 34 ="})
        await chat.step()
        chat.add({"role": "user", "content": "And plus one?"})
        await chat.step()

    asyncio.run(go())
    check_masks(chat, policy)
    assert chat.mismatches == 1 and [t["template_mismatch"] for t in chat.session.turns] == [0, 1]
    text = ByteChatCodec.decode(chat.session.tokens)
    assert text.endswith(
        "408<|im_end|>\n<|im_start|>user\nAnd plus one?<|im_end|>\n<|im_start|>assistant\n"
        "<think>\nagain\n</think>\n\n409<|im_end|>\n"
    )
    assert text.count("sum it") == 1, "the sampled reasoning is kept in the tokens"


def test_a_lone_surrogate_in_tool_output_does_not_fail_the_rollout() -> None:
    """A tool echoing undecodable bytes (`surrogateescape`) returned a lone surrogate; tokenising it
    raised and failed the rollout. Now it reaches the model as U+FFFD."""

    def echo(text: str) -> str:
        """Echo."""
        return b"caf\xe9".decode("utf-8", "surrogateescape") + text

    chat, policy = run([tool_call_text("hermes", "echo", {"text": "!"}) + "<|im_end|>", "ok<|im_end|>"], [echo])
    check_masks(chat, policy)
    assert [m["content"] for m in chat.messages if m["role"] == "tool"] == ["caf\ufffd!"]


def test_a_tool_that_hangs_is_stopped_at_its_timeout_and_the_model_told() -> None:
    """Without a per-tool timeout a hung tool would hold the rollout until rollout_timeout. The
    call is cancelled at `tool_timeout` (or the tool's own `timeout`), told to the model, counted as a failure."""

    async def hang() -> str:
        """Never answers."""
        await asyncio.Event().wait()
        return ""

    for kw, tools in (({"tool_timeout": 0.05}, [hang]), ({}, [Tool(hang, timeout=0.05)])):
        chat, policy = run([tool_call_text("hermes", "hang", {}) + "<|im_end|>", "ok<|im_end|>"], tools, **kw)
        check_masks(chat, policy)
        assert [m["content"] for m in chat.messages if m["role"] == "tool"] == [
            "Error: hang took more than 0.05 s and was stopped."
        ]
        assert chat.session.tools["hang"]["failures"] == 1


class SmallContext(Replies):
    context_length = 900
    """As OpenAIPolicy reads it from the server: the model's context, smaller than the trainer's budget."""


def test_tool_output_is_clipped_to_the_model_s_context_not_the_trainer_s_budget() -> None:
    """A 1,103-token tool output in a 900-token context was clipped to the trainer's 4,096 budget
    (the next turn could never be sampled: the context was overfull). Now at the context, marked truncated."""

    def dump() -> str:
        """A long output."""
        return "x" * 1103

    policy = SmallContext([tool_call_text("hermes", "dump", {}) + "<|im_end|>", "never<|im_end|>"])
    session = Session(policy, max_tokens=100, token_limit=4096)
    chat = ChatSession(session, local_tokenizer(), tools=[dump])

    async def go() -> None:
        chat.add({"role": "user", "content": "Q: 12 * 34 ="})
        with pytest.raises(EpisodeTruncated):
            while True:
                await chat.step()

    asyncio.run(go())
    assert len(session.tokens) == 900 and session.truncated
    assert len(policy.sampled) == 1, "no turn sampled past the context"
