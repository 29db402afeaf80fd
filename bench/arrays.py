"""The trainer's side after the wire: a decoded batch to padded / packed arrays and to torch tensors, in
process (no HTTP), against one copy of the output bytes (the least any builder must do).

1024 sequences with inference logprobs, all 2048 tokens long (padded() is a reshape) or 1024-2048 long
(row-wise copies).

    python -m bench.arrays
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from api.wire.records import GroupRecord
from trainer_client.arrays import Batch, from_records

SEQS, SEQ_LEN, GROUP = 1024, 2048, 8
REPS = 7


def make_batch(ragged: bool) -> Batch:
    rng = np.random.default_rng(0)
    records = []
    for g in range(SEQS // GROUP):
        lengths = rng.integers(SEQ_LEN // 2, SEQ_LEN + 1, GROUP) if ragged else np.full(GROUP, SEQ_LEN)
        total = int(lengths.sum())
        tokens = rng.integers(0, 150_000, total).astype(np.int32)
        records.append(
            GroupRecord(
                env_id=0,
                lengths=lengths.astype(np.int32),
                tokens=tokens,
                masks=np.where(rng.random(total) < 0.25, -100, tokens).astype(np.int32),
                scores=rng.integers(0, 2, GROUP).astype(np.float64),
                policy_step=0,
                group_id=f"g{g}",
                floats={"inference_logprobs": -rng.random(total, np.float32)},
                meta={},
            )
        )
    return from_records(records, step=0)


def _median_ms(fn: Callable[[], Any]) -> float:
    times = []
    for _ in range(REPS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _copy(nbytes: int) -> Callable[[], Any]:
    src = np.ones(nbytes, np.uint8)
    return lambda: np.copyto(np.empty_like(src), src)


def _padded_tensors(batch: Batch) -> Any:
    return batch.padded().to_torch()


def run() -> list[dict[str, Any]]:
    out = []
    for ragged in (False, True):
        batch = make_batch(ragged)
        p = batch.padded()
        nbytes = sum(a.nbytes for a in (p.tokens, p.masks, p.attention_mask, p.advantages, *p.floats.values()))
        row: dict[str, Any] = {
            "bench": "arrays",
            "lengths": "1024-2048" if ragged else "2048",
            "tokens": batch.n_tokens,
            "out_mb": nbytes / 1e6,
            "copy_ms": _median_ms(_copy(nbytes)),
            "padded_ms": _median_ms(batch.padded),
            "packed_ms": _median_ms(partial(batch.packed, SEQ_LEN)),
        }
        try:
            import torch  # noqa: F401

            row["padded_to_torch_ms"] = _median_ms(partial(_padded_tensors, batch))
        except ImportError:
            pass
        out.append(row)
    return out


def report(results: list[dict[str, Any]]) -> str:
    rows = [r for r in results if r.get("bench") == "arrays"]
    lines = [f"batch -> arrays in process, {SEQS} sequences with logprobs (median ms):"] if rows else []
    for r in rows:
        torch = f" | padded().to_torch() {r['padded_to_torch_ms']:.1f}" if "padded_to_torch_ms" in r else ""
        lines.append(
            f"  lengths {r['lengths']:>9}: padded() {r['padded_ms']:.1f} | packed({SEQ_LEN}) "
            f"{r['packed_ms']:.1f}{torch} | one copy of the {r['out_mb']:.0f} MB output "
            f"{r['copy_ms']:.1f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(run()))
