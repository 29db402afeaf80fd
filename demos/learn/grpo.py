"""The update: PPO-clip on GRPO advantages, with the sampler's logprobs as the old policy. Pure torch.

Alignment is the whole game: the logits at position `t` predict the token at `t + 1`, while a batch's
per-token arrays (`masks`, `inference_logprobs`, `advantages`) sit at the token they describe. So the
loss compares `logits[:, :-1]` against everything else at `[:, 1:]`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CLIP = 0.2
"""PPO's trust region: the ratio new / old policy counts only within [1 - CLIP, 1 + CLIP]."""


@dataclass(frozen=True)
class Stats:
    loss: float
    clip_fraction: float
    """Share of trained tokens whose ratio was clipped: how far the sampler's weights lag the trainer's."""
    ratio_mean: float


def ppo_clip_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip: float = CLIP,
) -> tuple[torch.Tensor, Stats]:
    """Token-mean PPO-clip loss. `logits` `[B, T, V]` from the tokens; the rest `[B, T]` at the token they
    describe: `labels` int64 (the token ids), `loss_mask` bool (trained positions), `old_logprobs` (the
    sampler's), `advantages`."""
    logp = torch.log_softmax(logits[:, :-1].float(), -1)
    target = labels[:, 1:].clamp(min=0)
    new = logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    mask = loss_mask[:, 1:]
    old = torch.where(mask, old_logprobs[:, 1:], 0.0)
    adv = advantages[:, 1:]
    ratio = torch.exp(new - old)
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip, 1 + clip) * adv
    per_token = -torch.minimum(unclipped, clipped)
    n = mask.sum().clamp(min=1)
    loss = (per_token * mask).sum() / n
    with torch.no_grad():
        was_clipped = ((ratio - 1).abs() > clip) & mask
        stats = Stats(float(loss), float(was_clipped.sum() / n), float((ratio * mask).sum() / n))
    return loss, stats
