"""Test doubles that let TRL's `AsyncGRPOTrainer` run on a CPU-only machine without the Hugging Face Hub, named
as such and used only by the TRL tests (tests/trl_trainer.py). Real training runs on a GPU, where neither is used.

- `CpuFlashAttn`: a stand-in for the CUDA-only flash-attention 3 kernel TRL's tree attention loads from the Hub
  (`kernels-community/flash-attn3`): the same `flash_attn_varlen_func`, computed segment by segment with PyTorch's
  scaled-dot-product attention (causal, aligned bottom-right as flash-attention aligns unequal lengths).
- `install()`: puts it in place, and answers `torch.cuda.get_device_name` (TRL asks it for its MFU figures) with
  a CPU name.
"""

from __future__ import annotations

from typing import Any

import torch


class CpuFlashAttn:
    """Test double of the flash-attn3 kernel's varlen entry point, on CPU."""

    @staticmethod
    def flash_attn_varlen_func(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: Any,
        max_seqlen_k: Any,
        softmax_scale: float | None = None,
        causal: bool = True,
        window_size: tuple[int, int] = (-1, -1),
        **_: Any,
    ) -> torch.Tensor:
        """q [Tq, H, D], k and v [Tk, Hkv, D]; segment i is q[cu_q[i]:cu_q[i+1]] over k[cu_k[i]:cu_k[i+1]]."""
        heads, kv_heads = q.shape[1], k.shape[1]
        out = torch.empty_like(q)
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        for i in range(len(cq) - 1):
            qs = q[cq[i] : cq[i + 1]].transpose(0, 1)  # [H, Lq, D]
            ks = k[ck[i] : ck[i + 1]].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
            vs = v[ck[i] : ck[i + 1]].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
            lq, lk = qs.shape[1], ks.shape[1]
            mask = None
            if causal:  # query j sees keys up to j + (lk - lq), as flash-attention aligns them
                mask = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
            att = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=softmax_scale)
            out[cq[i] : cq[i + 1]] = att.transpose(0, 1)
        return out


def install() -> None:
    """Put the doubles in place (before the trainer is built)."""
    from trl.experimental.async_grpo import packing

    setattr(packing, "_flash_attn", lambda: CpuFlashAttn)  # noqa: B010  (a module function, replaced)
    torch.cuda.get_device_name = lambda *args, **kwargs: "cpu (test double)"
