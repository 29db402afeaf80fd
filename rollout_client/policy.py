"""Policies: what generates completions. `OpenAIPolicy` talks to any OpenAI-compatible server (vLLM, SGLang)
and takes token ids and logprobs from it; `ScriptedPolicy` is deterministic, for tests and the demo.

A policy works on token ids. The server's own tokenizer turns text into ids (`tokenize`), and completions
come back as ids with their logprobs, so the trainer sees exactly the tokens that were sampled: nothing is
re-tokenised by guesswork.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from client_core.config import auth_headers
from client_core.errors import parse_retry_after
from client_core.retry import RetryPolicy
from rollout_client.breaker import Breaker
from rollout_client.errors import InferenceError, PromptTooLong

log = logging.getLogger("rollout_client.policy")

INFERENCE_RETRY_S = 120.0
"""Default: how long one inference request is retried (connection errors, 429, 5xx): long enough to ride
out a vLLM restart or a weight reload."""


@dataclass(frozen=True, slots=True)
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    """One per token: the sampling logprob under the weights that generated it."""
    text: str
    finish_reason: str | None = None
    context_full: bool = False
    """The completion stopped because prompt + completion filled the model's context: the episode is truncated."""


class Policy(Protocol):
    """What a rollout generates with. Implementations must be safe to call concurrently."""

    async def tokenize(self, text: str) -> list[int]: ...

    async def generate(
        self, prompt_ids: list[int], *, max_tokens: int, token_limit: int | None = None, seed: int | None = None
    ) -> Completion:
        """Continue `prompt_ids` by at most `max_tokens`, clipped so prompt + completion <= `token_limit` and
        the model's context; PromptTooLong when no token fits."""
        ...


def clip_max_tokens(prompt_len: int, max_tokens: int, *limits: int | None) -> int:
    """The most tokens a completion may have so that prompt + completion stays within every limit.

    Raises PromptTooLong when the prompt alone already reaches the tightest limit.
    """
    bounds = [lim for lim in limits if lim is not None]
    if not bounds:
        return max_tokens
    room = min(bounds) - prompt_len
    if room <= 0:
        raise PromptTooLong(prompt_len, min(bounds))
    return min(max_tokens, room)


# ------------------------------------------------------------------------------------------- scripted


class TextCodec(Protocol):
    """Text to token ids and back: all a scripted policy needs of a tokenizer."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class CharTokenizer:
    """A deterministic byte-level tokenizer: one token per UTF-8 byte (ids 0-255). A stand-in for a real
    tokenizer in tests and the demo; it needs no download."""

    @staticmethod
    def encode(text: str) -> list[int]:
        return list(text.encode())

    @staticmethod
    def decode(ids: list[int]) -> str:
        return bytes(ids).decode(errors="replace")


def stable_unit(*parts: object) -> float:
    """A deterministic number in [0, 1) from its arguments (stable across processes, unlike hash()): the
    scripted policy's and example envs' only source of variety."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


class ScriptedPolicy:
    """Answers with `script(prompt_text, seed)`, tokenised by `CharTokenizer`, with deterministic logprobs.

    The same prompt and seed always give the same completion, so groups are reproducible; different seeds
    (the runner gives each rollout of a group its own) let a script answer differently within a group.
    """

    def __init__(self, script: Callable[[str, int], str], tokenizer: TextCodec | None = None) -> None:
        self.script = script
        self.tokenizer: TextCodec = tokenizer or CharTokenizer()
        """`CharTokenizer` by default; a chat model's tokenizer (its special tokens decoded as text) for a
        scripted chat policy."""
        self.context_length: int | None = None

    async def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    async def generate(
        self, prompt_ids: list[int], *, max_tokens: int, token_limit: int | None = None, seed: int | None = None
    ) -> Completion:
        budget = clip_max_tokens(len(prompt_ids), max_tokens, token_limit, self.context_length)
        seed = 0 if seed is None else seed
        ids = self.tokenizer.encode(self.script(self.tokenizer.decode(prompt_ids), seed))
        finish = "stop"
        if len(ids) > budget:
            ids, finish = ids[:budget], "length"
        logprobs = [-stable_unit(seed, len(prompt_ids), i) for i in range(len(ids))]
        return Completion(ids, logprobs, self.tokenizer.decode(ids), finish)


# ------------------------------------------------------------------------------------------- OpenAI


TOKEN_ID_PREFIX = "token_id:"
"""vLLM/SGLang spell sampled tokens as `token_id:<id>` with `return_tokens_as_token_ids`."""


CONTEXT_IN_400 = re.compile(r"maximum context length is (\d+)")
"""How vLLM (and SGLang, OpenAI) name the model's context in the 400 for a request past it."""


def parse_completion(body: dict[str, Any], max_tokens: int | None = None) -> Completion:
    """Token ids and logprobs from a completions reply made with `logprobs` and `return_tokens_as_token_ids`.

    Refuses (InferenceError, status None) a reply whose tokens are not ids (guessing ids back from text is how
    training data goes wrong), a null or non-finite logprob (stored as a number it would be a lie: 0.0 is
    probability 1), and more tokens than `max_tokens` asked for.
    """
    try:
        choice = body["choices"][0]
        lp = choice["logprobs"]
        tokens: list[str] = lp["tokens"]
        logprobs: list[float | None] = lp["token_logprobs"]
    except (KeyError, IndexError, TypeError) as exc:
        raise InferenceError(f"not a completions reply with logprobs: missing {exc}") from None
    ids = []
    for tok in tokens:
        if not isinstance(tok, str) or not tok.startswith(TOKEN_ID_PREFIX):
            raise InferenceError(
                f"token {tok!r} is not an id: the server must support return_tokens_as_token_ids (vLLM, SGLang)"
            )
        ids.append(int(tok[len(TOKEN_ID_PREFIX) :]))
    if len(logprobs) != len(ids):
        raise InferenceError(f"{len(ids)} tokens but {len(logprobs)} logprobs")
    if max_tokens is not None and len(ids) > max_tokens:
        raise InferenceError(f"{len(ids)} tokens in a completion asked for at most {max_tokens}")
    values = []
    for i, x in enumerate(logprobs):
        if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
            raise InferenceError(f"logprob {x!r} at generated position {i}: not a finite number")
        values.append(float(x))
    return Completion(ids, values, choice.get("text", ""), choice.get("finish_reason"))


def _inference_retryable(exc: BaseException) -> bool:
    """The inference server's own rule (InferenceError.retryable): connection errors, 429 and 5xx."""
    return isinstance(exc, InferenceError) and exc.retryable


class _ContextLearned(Exception):
    """A 400 named the model's context, which the server did not list: clip to it and send again."""


class OpenAIPolicy:
    """A policy served by an OpenAI-compatible completions API (vLLM, SGLang), reached with httpx.

    Prompts go out as token ids (`prompt: [ids]`), completions come back as ids with logprobs
    (`logprobs: 1`, `return_tokens_as_token_ids: true`); text is tokenised by the server's `/tokenize`.
    The model's context length comes from `context_length`, the server (`max_model_len` of /v1/models), or
    the first 400 that names it. Connection errors, 429 (after its Retry-After) and 5xx are retried with
    backoff until `retry_deadline` (and `max_attempts`, if set); another 4xx never is. `timeout` bounds one
    HTTP request; the runner's `timeouts.turn` bounds a whole turn, retries included.

    `breaker` opens on a connection failure and closes on the next reply; while it is open one probe (a
    one-token completion, with backoff: the engine must answer, not only its API) looks for the server, and
    `on_reachability(up)` is told of each change (the runner holds dispatch meanwhile).
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        temperature: float = 1.0,
        context_length: int | None = None,
        api_key: str | None = None,
        timeout: float = 300.0,
        http_client: httpx.AsyncClient | None = None,
        extra_body: dict[str, Any] | None = None,
        max_attempts: int | None = None,
        retry_deadline: float = INFERENCE_RETRY_S,
    ) -> None:
        self._http = http_client or httpx.AsyncClient(base_url=base_url, timeout=timeout, headers=auth_headers(api_key))
        self.model = model
        self.temperature = temperature
        self.context_length = context_length
        self.extra_body = extra_body or {}
        self.max_attempts = max_attempts
        """Tries per request (the first included), None: as many as `retry_deadline` allows."""
        self.retry_deadline = retry_deadline
        self._probed = context_length is not None
        self.breaker = Breaker()
        self.on_reachability: Callable[[bool], None] | None = None
        self._probe: asyncio.Task[None] | None = None
        self._probe_prompt: list[int] = [0]
        """What the breaker's probe asks to continue: the first id of the last prompt sent (a valid id)."""

    def _reached(self) -> None:
        if self.breaker.success(time.monotonic()):
            log.warning("inference server %s reachable again", self._http.base_url)
            if self.on_reachability is not None:
                self.on_reachability(True)

    def _unreachable(self, exc: BaseException, sent: float) -> None:
        if self.breaker.failure(time.monotonic(), sent):
            log.warning(
                "inference server %s unreachable (%s: %s): holding new groups until it answers",
                self._http.base_url,
                type(exc).__name__,
                exc,
            )
            if self.on_reachability is not None:
                self.on_reachability(False)
            if self._probe is None or self._probe.done():
                self._probe = asyncio.get_running_loop().create_task(self._probe_until_reached())

    async def _probe_until_reached(self) -> None:
        """While the breaker is open: a one-token completion, with backoff, until the engine answers it. Not
        GET /v1/models: a server whose engine hangs still lists its models, and the breaker would flap
        (reachable, unreachable, ...) until the outage ended the run."""
        policy = RetryPolicy(self.retry_deadline)
        attempt = 0
        while not self.breaker.closed:
            attempt += 1
            await asyncio.sleep(policy.delay(attempt, None))
            body = {"model": self.model, "prompt": self._probe_prompt, "max_tokens": 1, "temperature": 0.0}
            try:
                await self._http.post("/v1/completions", json=body)
            except httpx.TransportError:
                continue
            self._reached()

    async def _post_once(self, path: str, body: dict[str, Any]) -> Any:
        sent = time.monotonic()
        try:
            r = await self._http.post(path, json=body)
        except httpx.TransportError as exc:
            self._unreachable(exc, sent)
            raise InferenceError(f"POST {path}: {type(exc).__name__}: {exc}", transport=True) from exc
        self._reached()
        if r.status_code >= 400:
            if r.status_code == 400 and (m := CONTEXT_IN_400.search(r.text)) and path == "/v1/completions":
                learned = int(m.group(1))
                if len(body["prompt"]) + body["max_tokens"] > learned:  # this request asked past it: clip, again
                    if self.context_length is None or learned < self.context_length:
                        log.warning("inference server: the model's context is %d tokens (from a 400)", learned)
                        self.context_length = learned
                    raise _ContextLearned()
            raise InferenceError(
                f"POST {path}: HTTP {r.status_code}: {r.text[:500]}",
                r.status_code,
                retry_after=parse_retry_after(r.headers.get("Retry-After")),
            )
        try:
            return r.json()
        except ValueError:
            raise InferenceError(f"POST {path}: HTTP {r.status_code} but not JSON: {r.text[:200]!r}") from None

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        """`_post_once`, retried on connection errors and 5xx with backoff (full jitter) up to `max_attempts`
        tries within `retry_deadline` s; a 4xx is raised at once. The last error is raised as itself."""
        policy = RetryPolicy(self.retry_deadline, max_attempts=self.max_attempts, retry_on=_inference_retryable)
        async for attempt in policy.aretrying(reraise=True):
            with attempt:
                return await self._post_once(path, body)
        raise AssertionError("unreachable: tenacity either returns or re-raises")

    async def context(self) -> int | None:
        """The model's context length, asked of the server once (None when it does not say)."""
        if not self._probed:
            self._probed = True
            try:
                r = await self._http.get("/v1/models")
                models = r.json().get("data", []) if r.status_code == 200 else []
            except (httpx.TransportError, ValueError):
                models = []
            for m in models:
                if m.get("id") == self.model and isinstance(m.get("max_model_len"), int):
                    self.context_length = m["max_model_len"]
        return self.context_length

    async def tokenize(self, text: str) -> list[int]:
        body = await self._post("/tokenize", {"model": self.model, "prompt": text, "add_special_tokens": False})
        return [int(t) for t in body["tokens"]]

    async def generate(
        self, prompt_ids: list[int], *, max_tokens: int, token_limit: int | None = None, seed: int | None = None
    ) -> Completion:
        try:
            return await self._generate(prompt_ids, max_tokens, token_limit, seed)
        except _ContextLearned:  # clipped to the context the 400 named (PromptTooLong if nothing fits)
            return await self._generate(prompt_ids, max_tokens, token_limit, seed)

    async def _generate(
        self, prompt_ids: list[int], max_tokens: int, token_limit: int | None, seed: int | None
    ) -> Completion:
        context = await self.context()
        budget = clip_max_tokens(len(prompt_ids), max_tokens, token_limit, context)
        self._probe_prompt = prompt_ids[:1] or self._probe_prompt
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt_ids,
            "max_tokens": budget,
            "temperature": self.temperature,
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
            **self.extra_body,
        }
        if seed is not None:
            body["seed"] = seed
        out = parse_completion(await self._post("/v1/completions", body), budget)
        if context is not None and out.finish_reason == "length" and len(prompt_ids) + len(out.token_ids) >= context:
            out = Completion(out.token_ids, out.logprobs, out.text, out.finish_reason, context_full=True)
        return out

    async def aclose(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe
        await self._http.aclose()
