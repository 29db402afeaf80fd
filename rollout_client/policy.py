"""Policies: what generates completions. `OpenAIPolicy` talks to any OpenAI-compatible server (vLLM, SGLang)
and takes token ids and logprobs from it; `ScriptedPolicy` is deterministic, for tests and the demo.

A policy works on token ids. The server's own tokenizer turns text into ids (`tokenize`), and completions
come back as ids with their logprobs, so the trainer sees exactly the tokens that were sampled: nothing is
re-tokenised by guesswork.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from client_core.config import auth_headers
from client_core.retry import RetryPolicy
from rollout_client.errors import InferenceError, PromptTooLong


@dataclass(frozen=True, slots=True)
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    """One per token: the sampling logprob under the weights that generated it."""
    text: str
    finish_reason: str | None = None


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

    def __init__(self, script: Callable[[str, int], str]) -> None:
        self.script = script
        self.tokenizer = CharTokenizer()
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


def parse_completion(body: dict[str, Any]) -> Completion:
    """Token ids and logprobs from a completions reply made with `logprobs` and `return_tokens_as_token_ids`.

    Refuses a reply whose tokens are not ids: guessing ids back from text is how training data goes wrong.
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
    return Completion(ids, [float(x) if x is not None else 0.0 for x in logprobs], choice.get("text", ""),
                      choice.get("finish_reason"))  # fmt: skip


def _inference_retryable(exc: BaseException) -> bool:
    """The inference server's own rule (InferenceError.retryable): connection errors and 5xx, never a 4xx."""
    return isinstance(exc, InferenceError) and exc.retryable


class OpenAIPolicy:
    """A policy served by an OpenAI-compatible completions API (vLLM, SGLang), reached with httpx.

    Prompts go out as token ids (`prompt: [ids]`), completions come back as ids with logprobs
    (`logprobs: 1`, `return_tokens_as_token_ids: true`); text is tokenised by the server's `/tokenize`.
    The model's context length comes from `context_length` or the server (`max_model_len` of /v1/models).
    Connection errors and 5xx are retried with backoff (`max_attempts`, `retry_deadline`); a 4xx never is.
    `timeout` bounds one HTTP request; the runner's `turn_timeout` bounds a whole turn, retries included.
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
        max_attempts: int = 5,
        retry_deadline: float = 60.0,
    ) -> None:
        self._http = http_client or httpx.AsyncClient(base_url=base_url, timeout=timeout, headers=auth_headers(api_key))
        self.model = model
        self.temperature = temperature
        self.context_length = context_length
        self.extra_body = extra_body or {}
        self.max_attempts = max_attempts
        """Tries per request (the first included) on connection errors and 5xx; a 4xx is never retried."""
        self.retry_deadline = retry_deadline
        self._probed = context_length is not None

    async def _post_once(self, path: str, body: dict[str, Any]) -> Any:
        try:
            r = await self._http.post(path, json=body)
        except httpx.TransportError as exc:
            raise InferenceError(f"POST {path}: {type(exc).__name__}: {exc}", transport=True) from exc
        if r.status_code >= 400:
            raise InferenceError(f"POST {path}: HTTP {r.status_code}: {r.text[:500]}", r.status_code)
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
        budget = clip_max_tokens(len(prompt_ids), max_tokens, token_limit, await self.context())
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
        return parse_completion(await self._post("/v1/completions", body))

    async def aclose(self) -> None:
        await self._http.aclose()
