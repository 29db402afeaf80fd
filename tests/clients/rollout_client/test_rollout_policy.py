"""OpenAIPolicy against a small OpenAI-compatible completions server (in-process ASGI, speaking vLLM's shape:
`/v1/models` with `max_model_len`, `/tokenize`, `/v1/completions` with `return_tokens_as_token_ids`)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from api.wire.rules import MASK_IGNORE
from rollout_client import OpenAIPolicy, PromptTooLong, Session, Task, run_group
from rollout_client.examples import Arithmetic
from rollout_client.group import PROMPT_TOO_LONG

pytestmark = pytest.mark.anyio

MODEL = "tiny"
CONTEXT = 64
ANSWER = " A: 42\n"


def fake_inference(calls: list[dict[str, Any]]) -> Starlette:
    """Byte-level tokens; the completion is ANSWER's bytes, cut at max_tokens; 400 beyond the context, as vLLM."""

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": CONTEXT}]})

    async def tokenize(request: Request) -> JSONResponse:
        body = await request.json()
        ids = list(body["prompt"].encode())
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": CONTEXT})

    async def completions(request: Request) -> JSONResponse:
        body = await request.json()
        calls.append(body)
        prompt = body["prompt"]
        if not isinstance(prompt, list) or len(prompt) + body["max_tokens"] > CONTEXT:
            return JSONResponse({"error": {"message": "maximum context length exceeded"}}, status_code=400)
        ids = list(ANSWER.encode())[: body["max_tokens"]]
        seed = body.get("seed") or 0
        logprobs = [-((seed + i) % 7) / 8 for i in range(len(ids))]
        choice = {
            "index": 0,
            "text": bytes(ids).decode(),
            "finish_reason": "stop" if len(ids) == len(ANSWER) else "length",
            "logprobs": {"tokens": [f"token_id:{t}" for t in ids], "token_logprobs": logprobs},
        }
        return JSONResponse({"id": "cmpl-1", "object": "text_completion", "model": MODEL, "choices": [choice]})

    routes = [
        Route("/v1/models", models),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
    return Starlette(routes=routes)


def policy(calls: list[dict[str, Any]], **kw: Any) -> OpenAIPolicy:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=fake_inference(calls)), base_url="http://vllm.test")
    return OpenAIPolicy("http://vllm.test", MODEL, http_client=http, **kw)


async def test_ids_and_logprobs_come_from_the_server_and_max_tokens_is_clipped() -> None:
    calls: list[dict[str, Any]] = []
    pol = policy(calls)
    session = Session(pol, token_limit=40, max_tokens=100, seed=3)
    prompt = await session.observe("Q: 20 + 22 =")
    out = await session.generate()
    assert calls[-1]["prompt"] == prompt and calls[-1]["return_tokens_as_token_ids"] is True
    assert calls[-1]["max_tokens"] == 40 - len(prompt), "clipped to the trainer's max_token_len"
    assert out.token_ids == list(ANSWER.encode()) and out.logprobs == [-((3 + i) % 7) / 8 for i in range(7)]
    assert session.masks == [MASK_IGNORE] * len(prompt) + out.token_ids
    assert session.tokens == prompt + out.token_ids

    long_prompt = [1] * 60  # under the trainer limit of 100, but the model's context (64) leaves 4 tokens
    cut = await pol.generate(long_prompt, max_tokens=100, token_limit=100)
    assert calls[-1]["max_tokens"] == 4 and cut.finish_reason == "length" and len(cut.token_ids) == 4
    await pol.aclose()


async def test_a_prompt_that_fills_the_budget_is_never_sent() -> None:
    calls: list[dict[str, Any]] = []
    pol = policy(calls, context_length=CONTEXT)
    with pytest.raises(PromptTooLong) as info:
        await pol.generate([1] * 30, max_tokens=8, token_limit=30)
    assert (info.value.prompt_tokens, info.value.limit) == (30, 30) and calls == []
    await pol.aclose()


async def test_a_group_from_the_server_and_a_skipped_one() -> None:
    calls: list[dict[str, Any]] = []
    pol = policy(calls)
    env = Arithmetic(group_size=3)
    outcome = await run_group(env, Task("t", "Q: 20 + 22 =", "42"), pol, token_limit=48, group_key="k")
    assert outcome.group is not None
    g = outcome.group
    assert g.scores == [1.0, 1.0, 1.0]
    prompts = [c["prompt"] for c in calls]
    assert prompts == [prompts[0]] * 3, "every rollout of a group gets the same prompt"
    assert len({c["seed"] for c in calls}) == 3, "each rollout samples with its own seed"
    assert g.inference_logprobs is not None
    for tokens, masks, lps in zip(g.tokens, g.masks, g.inference_logprobs, strict=True):
        n = len(prompts[0])
        assert masks[:n] == [MASK_IGNORE] * n and masks[n:] == tokens[n:] and len(lps) == len(tokens)

    calls.clear()
    skipped = await run_group(env, Task("t", "Q: " + "9" * 60 + " + 1 =", "x"), pol, token_limit=48)
    assert (skipped.group, skipped.skipped, calls) == (None, PROMPT_TOO_LONG, [])
    await pol.aclose()
