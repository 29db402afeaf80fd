"""A stand-in inference server: no model, no GPU, answers at once. It speaks what rollbuf's examples and tests
ask of vLLM: the OpenAI completions protocol as vLLM serves it (`/v1/models` with `max_model_len`, `/tokenize`,
`/v1/completions` with `return_tokens_as_token_ids`), tokenising byte by byte and answering with
`arithmetic_script` (the scripted policy of the example envs), and vLLM's token-in/token-out
`/inference/v1/generate` (what verifiers' train client calls). It stands in for `vllm serve ...` in
docs/bring-your-environment.md's four-process layout, so that the layout runs on any machine, and the tests drive
it to misbehave on request.

    rollbuf standin-inference --port 9000        (or: python -m demos.standin_inference --port 9000)

Faults, set with POST /control (JSON, any subset) and counted in GET /stats:
- `fail_every` N: every Nth completion request answers 503;
- `reject_marker`: a prompt containing it answers 400 (as vLLM does for a bad request);
- `hang_marker`: a prompt containing it never gets an answer;
- `hang_all`: no completion request gets an answer;
- `rate_limit_every` N: every Nth completion request answers 429 with `Retry-After: 0.2`;
- `context` N with `advertise_context` false: the model's context is N tokens, not listed in /v1/models;
  a request past it answers vLLM's 400 ("This model's maximum context length is N tokens...");
  `context` alone: listed and enforced (a completion stops at it, finish_reason "length");
- `null_logprob_marker` / `nan_logprob_marker` / `overlong_marker`: a prompt containing it gets a null
  logprob / a NaN logprob / 5 tokens more than `max_tokens`.
- `weights` N: the weights version it serves (a trainer's weight sync sets it); every completion's logprobs
  are `weights_logprob(N)`, so the trainer can read which weights generated each token;
- `latency` S: each completion answers after S seconds (a model that takes time: the syncs' benchmark).
- `generate_echo`: `/inference/v1/generate` always says the word (no reward variance within a group);
  `generate_text`: it always answers this text (for other environments); `reject_marker` and `hang_all`
  apply there too.

Chat mode, also set with /control: `chat` "hermes" | "llama3" | "mistral" makes it a tool-calling chat model
(`rollout_client.chat.examples.chat_script`) on `local_tokenizer()`'s ids (bytes, then special tokens from 256,
decoded and encoded with `ByteChatCodec`), writing its tool calls in that family's format and ending each turn
with `chat_stop` (default: the family's own end-of-turn token). GET /stats counts each answer's text under
`answers`. With `chat_cut_first` the first tool call it writes is cut short whatever the request's seed (the
script cuts a quarter of first attempts by seed, and 16 rollouts then cut none once in 100 runs).

It also serves a capped sandbox pool, as an environment server would (POST /sandbox/acquire, /release,
/open, /close): `sandboxes` N is its capacity (default 8); with `sandbox_exhausted` true an acquire past it
answers 429 `{"error": "exhausted"}` at once, else it waits until one is released (a blocking pool). Counted
in /stats: `sandbox_acquired`, `sandbox_exhausted`, `sandbox_max_held`, `sandbox_held` (now), and
`sandbox_opened` / `sandbox_closed` (per-process clients of the pool saying hello and goodbye). With
`sandbox_delay` S an acquire takes its sandbox, then answers S seconds later (a client that gives up
meanwhile leaves it held unless it waits for the answer and releases it).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
from collections import Counter
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rollout_client.chat.examples import CUT_SHORT, ByteChatCodec, chat_script
from rollout_client.examples import arithmetic_script
from rollout_client.policy import stable_unit

MODEL = "fake"
"""The one model it serves (`/v1/models`): what a policy names in its requests."""
CONTEXT = 1 << 20


GENERATE_END = 258
"""The end-of-turn id of `/inference/v1/generate`'s replies: `<|im_end|>` of a byte-level tokenizer with ChatML's
special tokens from 256 (the tests' tiny verifiers environment)."""


def generate_reply(prompt: str, nth: int) -> list[int]:
    """`/inference/v1/generate`'s completion (byte ids, then the end of turn) for the `nth` request with this
    prompt: for "Say <word>." the word on odd requests and "no" on even ones, so G rollouts of a task score
    half 1.0 and half 0.0 under a reward for saying the word."""
    word = prompt.rsplit("Say ", 1)[-1].split(".", 1)[0] if "Say " in prompt else "ok"
    return [*(word if nth % 2 else "no").encode(), GENERATE_END]


def generate_logprob(i: int) -> float:
    """The logprob `/inference/v1/generate` reports at completion position `i` (exact in float32)."""
    return -(i + 1) / 64


def weights_logprob(version: int) -> float:
    """The logprob of every token sampled with weights `version` (exact in float32 up to 2^16 versions)."""
    return -(version + 1) / 256


def weights_of(logprob: float) -> int:
    """The weights version a token was sampled with, from its logprob (`weights_logprob`'s inverse)."""
    return round(-logprob * 256) - 1


def create_app() -> Starlette:
    faults: dict[str, Any] = {
        "fail_every": 0,
        "reject_marker": None,
        "hang_marker": None,
        "hang_all": False,
        "rate_limit_every": 0,
        "context": CONTEXT,
        "advertise_context": True,
        "null_logprob_marker": None,
        "nan_logprob_marker": None,
        "overlong_marker": None,
        "chat": None,
        "chat_stop": None,
        "sandboxes": 8,
        "sandbox_exhausted": False,
        "sandbox_delay": 0.0,
        "generate_echo": False,
        "generate_text": None,
        "weights": None,
        "latency": 0.0,
        "chat_cut_first": False,
    }
    stats: Counter[str] = Counter()
    prompts: Counter[str] = Counter()
    answers: Counter[str] = Counter()
    """Chat mode: each completion's text, as sampled."""
    forever = asyncio.Event()

    async def models(request: Request) -> JSONResponse:
        model: dict[str, Any] = {"id": MODEL, "object": "model"}
        if faults["advertise_context"]:
            model["max_model_len"] = faults["context"]
        return JSONResponse({"object": "list", "data": [model]})

    async def tokenize(request: Request) -> JSONResponse:
        body = await request.json()
        ids = list(body["prompt"].encode())
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": CONTEXT})

    async def completions(request: Request) -> Response:
        body = await request.json()
        stats["requests"] += 1
        chat = faults["chat"]
        text = ByteChatCodec.decode(body["prompt"]) if chat else bytes(body["prompt"]).decode(errors="replace")
        prompts[text] += 1
        if faults["hang_all"] or (faults["hang_marker"] and faults["hang_marker"] in text):
            stats["hung"] += 1
            await forever.wait()
        if faults["reject_marker"] and faults["reject_marker"] in text:
            stats["400"] += 1
            return JSONResponse({"object": "error", "message": "bad request", "code": 400}, status_code=400)
        if faults["fail_every"] and stats["requests"] % faults["fail_every"] == 0:
            stats["503"] += 1
            return JSONResponse({"object": "error", "message": "engine overloaded"}, status_code=503)
        if faults["rate_limit_every"] and stats["requests"] % faults["rate_limit_every"] == 0:
            stats["429"] += 1
            return JSONResponse(
                {"object": "error", "message": "rate limited"}, status_code=429, headers={"Retry-After": "0.2"}
            )
        context = faults["context"]
        asked = len(body["prompt"]) + body["max_tokens"]
        if not faults["advertise_context"] and asked > context:
            stats["400_context"] += 1
            message = (
                f"This model's maximum context length is {context} tokens. However, you requested "
                f"{asked} tokens ({len(body['prompt'])} in the messages, {body['max_tokens']} in the "
                "completion). Please reduce the length of the messages or completion."
            )
            return JSONResponse({"object": "error", "message": message, "code": 400}, status_code=400)
        seed = body.get("seed") or 0
        if chat and faults["chat_cut_first"] and not stats["chat_cut"]:
            stats["chat_cut"] += 1  # the first request is a conversation's first turn: a seed that cuts its call
            seed = next(s for s in itertools.count() if stable_unit(text, s) < CUT_SHORT)
        if chat:
            ids = ByteChatCodec.encode(chat_script(text, seed, chat, faults["chat_stop"]))
        else:
            ids = list(arithmetic_script(text, seed).encode())
        finish = "stop"
        room = min(body["max_tokens"], context - len(body["prompt"]))
        if len(ids) > room:
            ids, finish = ids[:room], "length"
        if faults["latency"]:
            await asyncio.sleep(faults["latency"])  # the model's time: what a weight sync meets in flight
        logprobs: list[float | None] = [-stable_unit(seed, i) for i in range(len(ids))]
        if faults["weights"] is not None:
            logprobs = [weights_logprob(faults["weights"])] * len(ids)
        if faults["overlong_marker"] and faults["overlong_marker"] in text:
            ids = ids + [32] * (body["max_tokens"] + 5 - len(ids))
            logprobs = [-0.5] * len(ids)
        if faults["null_logprob_marker"] and faults["null_logprob_marker"] in text and logprobs:
            logprobs[-1] = None
        if faults["nan_logprob_marker"] and faults["nan_logprob_marker"] in text and logprobs:
            logprobs[-1] = float("nan")
        choice: dict[str, Any] = {
            "index": 0,
            "text": ByteChatCodec.decode(ids) if chat else bytes(ids).decode(errors="replace"),
            "finish_reason": finish,
            "logprobs": {"tokens": [f"token_id:{t}" for t in ids], "token_logprobs": logprobs},
        }
        stats["200"] += 1
        if chat:
            answers[choice["text"]] += 1
        reply = {"id": "cmpl", "object": "text_completion", "model": MODEL, "choices": [choice]}
        return Response(json.dumps(reply), media_type="application/json")  # NaN as vLLM writes it, not refused

    held: set[int] = set()
    released = asyncio.Condition()

    async def sandbox_acquire(request: Request) -> JSONResponse:
        async with released:
            while len(held) >= faults["sandboxes"]:
                if faults["sandbox_exhausted"]:
                    stats["sandbox_exhausted"] += 1
                    return JSONResponse({"error": "exhausted"}, status_code=429)
                await released.wait()
            stats["sandbox_acquired"] += 1
            sandbox = stats["sandbox_acquired"]
            held.add(sandbox)
            stats["sandbox_max_held"] = max(stats["sandbox_max_held"], len(held))
            stats["sandbox_held"] = len(held)
        if faults["sandbox_delay"]:  # taken, the reply still on its way: a client that gives up now leaks it
            await asyncio.sleep(faults["sandbox_delay"])
        return JSONResponse({"id": sandbox})

    async def sandbox_release(request: Request) -> JSONResponse:
        body = await request.json()
        async with released:
            held.discard(body["id"])
            stats["sandbox_held"] = len(held)
            released.notify_all()
        return JSONResponse({"held": len(held)})

    async def sandbox_hello(request: Request) -> JSONResponse:
        stats["sandbox_opened" if request.url.path.endswith("open") else "sandbox_closed"] += 1
        return JSONResponse({})

    async def generate(request: Request) -> JSONResponse:
        """vLLM's token-in/token-out `/inference/v1/generate` (what verifiers' train client calls): the
        prompt's ids in, `generate_reply`'s completion ids out with a logprob per token."""
        body = await request.json()
        stats["generate"] += 1
        prompt = bytes(t for t in body["token_ids"] if t < 256).decode(errors="replace")
        prompts[prompt] += 1
        if faults["hang_all"]:
            stats["hung"] += 1
            await forever.wait()
        if faults["reject_marker"] and faults["reject_marker"] in prompt:
            stats["400"] += 1
            return JSONResponse({"object": "error", "message": "bad request", "code": 400}, status_code=400)
        nth = 1 if faults["generate_echo"] else prompts[prompt]
        reply = (
            [*faults["generate_text"].encode(), GENERATE_END]
            if faults["generate_text"]
            else generate_reply(prompt, nth)
        )
        ids = reply[: body["sampling_params"].get("max_tokens") or 1 << 20]
        content = [{"token": f"token_id:{t}", "logprob": generate_logprob(i)} for i, t in enumerate(ids)]
        choice = {
            "index": 0,
            "token_ids": ids,
            "finish_reason": "stop" if ids[-1:] == [GENERATE_END] else "length",
            "logprobs": {"content": content},
        }
        return JSONResponse({"request_id": f"gen-{stats['generate']}", "choices": [choice]})

    async def control(request: Request) -> JSONResponse:
        faults.update(await request.json())
        return JSONResponse(faults)

    async def get_stats(request: Request) -> JSONResponse:
        return JSONResponse({**stats, "prompts": dict(prompts), "answers": dict(answers)})

    return Starlette(
        routes=[
            Route("/v1/models", models),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/inference/v1/generate", generate, methods=["POST"]),
            Route("/control", control, methods=["POST"]),
            Route("/sandbox/acquire", sandbox_acquire, methods=["POST"]),
            Route("/sandbox/release", sandbox_release, methods=["POST"]),
            Route("/sandbox/open", sandbox_hello, methods=["POST"]),
            Route("/sandbox/close", sandbox_hello, methods=["POST"]),
            Route("/stats", get_stats),
        ]
    )


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    ap = argparse.ArgumentParser(
        prog="rollbuf standin-inference",
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: %(default)s)")
    ap.add_argument("--port", type=int, default=9000, help="the port to listen on (default: %(default)s)")
    args = ap.parse_args(argv)
    uvicorn.run(create_app(), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
