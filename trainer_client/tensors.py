"""Batches as torch tensors in the dtypes a training step uses as they come: token ids and labels as int64
(what `nn.Embedding` and `cross_entropy` take), masks as bool, per-token floats as float32.

On a CUDA device the narrow numpy arrays (int32 ids) are staged in pinned host memory and copied with
`non_blocking=True`, then widened and turned into labels on the device: half the bytes cross PCIe, and
the host does one copy. On the CPU, ids are widened and labels derived in numpy, one pass each, and
torch shares the results. torch is imported only here, and only when tensors are asked for.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from api.wire.rules import MASK_IGNORE

I64 = np.dtype(np.int64)

WIDE = frozenset({"tokens", "labels", "position_ids", "segment_ids", "offsets", "group_index", "env_ids"})
"""Integer arrays that torch indexes with or takes as targets: int64 on arrival."""


def torch_module() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise ImportError("torch tensors need PyTorch: `pip install torch` (numpy arrays work without it)") from exc
    return torch


def to_tensors(arrays: Mapping[str, np.ndarray], device: Any = None, *, non_blocking: bool = True) -> dict[str, Any]:
    """`arrays` as tensors on `device` (None: the CPU), with `labels` (the token id where trained on, -100
    elsewhere: `cross_entropy`'s `ignore_index`) and `trained` (bool) derived from `tokens` and `masks`;
    `masks` itself is not repeated. Ids in `WIDE` become int64; the rest keep their numpy dtype."""
    torch = torch_module()
    target = torch.device("cpu") if device is None else torch.device(device)
    if target.type == "cpu":
        return {k: torch.from_numpy(v) for k, v in _on_host(arrays).items()}
    moved = {k: _to_device(torch, _writable(v), target, non_blocking) for k, v in arrays.items()}
    out = {k: t.long() if k in WIDE and t.dtype != torch.int64 else t for k, t in moved.items() if k != "masks"}
    if "masks" in moved and "tokens" in moved:
        out["trained"] = moved["masks"] != MASK_IGNORE
        out["labels"] = torch.where(out["trained"], out["tokens"], MASK_IGNORE)
    return out


def _on_host(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The CPU path in numpy: one single-threaded pass per derived array (torch's elementwise kernels are
    no faster on a few cores and slower on a busy machine); torch then shares the results without a copy."""
    out = {k: (v.astype(I64) if k in WIDE else _writable(v)) for k, v in arrays.items() if k != "masks"}
    if "masks" in arrays and "tokens" in arrays:
        trained = arrays["masks"] != MASK_IGNORE
        out["trained"] = trained
        out["labels"] = np.where(trained, arrays["tokens"], I64.type(MASK_IGNORE))
    return out


def _writable(arr: np.ndarray) -> np.ndarray:
    """torch refuses to share read-only memory (arrays over a received buffer): those are copied once."""
    return arr if arr.flags.writeable else arr.copy()


def _to_device(torch: Any, arr: np.ndarray, device: Any, non_blocking: bool) -> Any:
    src = torch.from_numpy(arr)
    if device.type == "cpu":
        return src
    if device.type == "cuda":
        staged = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        staged.copy_(src)
        return staged.to(device, non_blocking=non_blocking)
    return src.to(device)
