"""The sampler: a copy of the policy that rollouts generate with, through `rollout_client`'s `Policy`
interface, as they would with vLLM through `OpenAIPolicy`.

Concurrent `generate` calls (the G rollouts of a group, and every group in flight) are gathered for a
couple of milliseconds and sampled in one batched forward pass per step, the way an inference server
batches requests. Each sampled token comes back with its logprob under the weights that sampled it: the
old policy of the PPO ratio. New weights arrive through `load_weights` while the runner is paused.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from demos.learn.model import DigitTokenizer, TinyGPT, sample
from rollout_client import Completion, clip_max_tokens

GATHER_S = 0.002
"""How long the first request of a batch waits for others to join it."""


@dataclass
class _Request:
    prompt: list[int]
    budget: int
    future: asyncio.Future[Completion]


class TorchPolicy:
    """Samples from `model` at `temperature`; one torch generator seeded `seed` (per-request seeds are not
    honoured: requests share a batch)."""

    def __init__(self, model: TinyGPT, *, temperature: float = 1.0, seed: int = 0) -> None:
        self.model = model.eval()
        self.tokenizer = DigitTokenizer()
        self.temperature = temperature
        self.context_length = model.context
        device = next(model.parameters()).device
        self.generator = torch.Generator(device).manual_seed(seed)
        self._pending: list[_Request] = []

    async def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    async def generate(
        self, prompt_ids: list[int], *, max_tokens: int, token_limit: int | None = None, seed: int | None = None
    ) -> Completion:
        budget = clip_max_tokens(len(prompt_ids), max_tokens, token_limit, self.context_length)
        loop = asyncio.get_running_loop()
        request = _Request(list(prompt_ids), budget, loop.create_future())
        if not self._pending:
            loop.call_later(GATHER_S, self._flush)
        self._pending.append(request)
        return await request.future

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy the trainer's weights in; call only while no generation is in flight (`runner.pause()`)."""
        self.model.load_state_dict(state)

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        buckets: defaultdict[tuple[int, int], list[_Request]] = defaultdict(list)
        for r in pending:
            if not r.future.done():  # a cancelled rollout (stale, stopping) needs nothing
                buckets[len(r.prompt), r.budget].append(r)
        device = next(self.model.parameters()).device
        for (_, budget), requests in buckets.items():
            prompts = torch.tensor([r.prompt for r in requests], dtype=torch.int64, device=device)
            tokens, logprobs = sample(self.model, prompts, budget, self.generator, self.temperature)
            for r, ids, lps in zip(requests, tokens.tolist(), logprobs.tolist(), strict=True):
                r.future.set_result(Completion(ids, lps, self.tokenizer.decode(ids), "length"))
