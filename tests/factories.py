"""Builders for request bodies shaped like the ones Atropos clients send."""

from __future__ import annotations

from typing import Any

import numpy as np

REGISTRATION: dict[str, Any] = {
    "wandb_group": "g",
    "wandb_project": "p",
    "batch_size": 16,
    "max_token_len": 512,
    "checkpoint_dir": "ckpt",
    "save_checkpoint_interval": 10,
    "starting_step": 0,
    "num_steps": 100,
}


def registration(**overrides: Any) -> dict[str, Any]:
    return {**REGISTRATION, **overrides}


def env(name: str = "math", group_size: int = 4, weight: float = 1.0, **extra: Any) -> dict[str, Any]:
    return {"max_token_length": 512, "desired_name": name, "weight": weight, "group_size": group_size, **extra}


def group(
    n: int = 4,
    length: int | list[int] = 8,
    env_id: int | None = 0,
    *,
    seed: int = 0,
    scores: list[float] | None = None,
    logprobs: bool = True,
    **extra: Any,
) -> dict[str, Any]:
    """A scored group: masks are -100 over a prompt prefix, then the token ids (as Atropos tokenizes)."""
    rng = np.random.default_rng(seed)
    lengths = length if isinstance(length, list) else [length] * n
    tokens, masks, lps = [], [], []
    for L in lengths:
        t = rng.integers(0, 150_000, L)
        m = t.copy()
        m[: L // 2] = -100
        tokens.append(t.tolist())
        masks.append(m.tolist())
        lp = np.ones(L, dtype=np.float32)
        lp[L // 2 :] = -rng.exponential(0.5, L - L // 2).astype(np.float32)
        lps.append(lp.astype(np.float64).tolist())
    body: dict[str, Any] = {
        "tokens": tokens,
        "masks": masks,
        "scores": scores if scores is not None else [float(i % 2) for i in range(len(lengths))],
        "env_id": env_id,
        **extra,
    }
    if logprobs:
        body["inference_logprobs"] = lps
    return body
