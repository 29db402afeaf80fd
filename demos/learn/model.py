"""The learner: a tiny causal transformer over a 12-symbol vocabulary, randomly initialised, with its own
tokenizer. Small enough to sample and train on a CPU in milliseconds; nothing is downloaded."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = "0123456789>|"
"""Digits, `>` (the prompt ends: answer now) and `|` (unused by the task, one more way to be wrong)."""


class DigitTokenizer:
    """One token per character of `VOCAB`; anything else is refused (the task never produces it)."""

    ids = {c: i for i, c in enumerate(VOCAB)}

    def encode(self, text: str) -> list[int]:
        try:
            return [self.ids[c] for c in text]
        except KeyError as exc:
            raise ValueError(f"{exc.args[0]!r} is not in the vocabulary {VOCAB!r}") from None

    def decode(self, ids: list[int]) -> str:
        return "".join(VOCAB[i] for i in ids)


class Block(nn.Module):
    """Pre-norm attention + MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


class TinyGPT(nn.Module):
    """`logits = model(tokens)`: next-token logits at every position, `[B, T, len(VOCAB)]`."""

    def __init__(self, *, dim: int = 64, layers: int = 2, heads: int = 4, context: int = 32) -> None:
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(len(VOCAB), dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, len(VOCAB))
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=1 / math.sqrt(p.shape[-1]))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """`tokens` int64 `[B, T]`, right-padded: causal attention keeps every real position from seeing the
        padding after it, so no attention mask is needed."""
        t = tokens.shape[1]
        x = self.embed(tokens) + self.pos(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits


@torch.no_grad()
def sample(
    model: TinyGPT, prompts: torch.Tensor, new_tokens: int, generator: torch.Generator, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Continue every row of `prompts` (int64 `[B, P]`, same length) by `new_tokens` sampled tokens: the
    tokens `[B, new_tokens]` and their logprobs under the sampling distribution (float32, same shape)."""
    seq = prompts
    out_lp = []
    for _ in range(new_tokens):
        logits = model(seq)[:, -1].float() / temperature
        logp = torch.log_softmax(logits, -1)
        nxt = torch.multinomial(logp.exp(), 1, generator=generator)
        out_lp.append(logp.gather(1, nxt))
        seq = torch.cat([seq, nxt], 1)
    return seq[:, prompts.shape[1] :], torch.cat(out_lp, 1)
