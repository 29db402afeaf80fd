"""A trainer process, as a deployment runs one apart from its producers: it registers the run, trains on rollbuf
batches (here: reads which weights generated each token), and after each step syncs its weights to the
inference server (the fake vLLM's `weights`) and announces them through rollbuf (`announce_weights`), after
every step or every `--sync-every` steps (a trainer whose syncs cost more than a step). Writes
what it saw as JSON; a `NoProgress` (rollbuf said nothing can arrive, for `--no-progress-timeout` s) is written
there too, with exit status 3.

    python -m tests.trainer_process --server URL --inference URL --steps 20 --out result.json
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from tests.fake_vllm import weights_of
from trainer_client import NoProgress, TrainerClient


def sync(inference: str, rb: TrainerClient, step: int, drain: bool) -> bool:
    """Push the weights of `step` to the inference server, then tell rollbuf they are live; with `drain`, inside
    `weight_sync` (drain envs' producers finish their episodes first). Whether every drain producer drained."""
    if drain:
        with rb.weight_sync(step, timeout=30.0) as drained:
            httpx.post(inference + "/control", json={"weights": step}, timeout=10).raise_for_status()
        return drained
    httpx.post(inference + "/control", json={"weights": step}, timeout=10).raise_for_status()
    rb.announce_weights(step)
    return True


def groups_of(batch: Any) -> list[dict[str, Any]]:
    """Per group: its stamp, the range it says it spanned, and the weights its trained tokens came from."""
    out = []
    lp = batch.floats["inference_logprobs"]
    trained = batch.trained
    for g in range(len(batch.group_ids)):
        seqs = np.flatnonzero(batch.group_index == g)
        versions: set[int] = set()
        for i in seqs.tolist():
            a, b = int(batch.offsets[i]), int(batch.offsets[i + 1])
            versions |= {weights_of(float(x)) for x in lp[a:b][trained[a:b]]}
        meta = batch.meta[g].get("generation_params") or {}
        out.append({"policy_step": int(batch.policy_steps[seqs[0]]), "weight_versions": meta.get("weight_versions"),
                    "exact": meta.get("weight_versions_exact"), "generated_with": sorted(versions)})  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--server", required=True)
    ap.add_argument("--inference", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--max-staleness", type=int, default=None)
    ap.add_argument("--sync-every", type=int, default=1, help="sync the weights after every N steps")
    ap.add_argument("--no-progress-timeout", type=float, default=600.0)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--drain", action="store_true", help="sync inside weight_sync (drain envs wait it out)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    started = time.monotonic()
    result: dict[str, Any] = {"steps": [], "error": None, "undrained_syncs": 0}
    with TrainerClient(args.server) as rb:
        rb.register(batch_size=args.batch_size, max_token_len=256, max_staleness=args.max_staleness)
        sync(args.inference, rb, 0, args.drain)
        try:
            batches = rb.batches(start_step=0, wait=2.0, no_progress_timeout=args.no_progress_timeout)
            for batch in batches:
                assert batch.step is not None
                result["steps"].append({"step": batch.step, "groups": groups_of(batch),
                                        "at": time.monotonic() - started})  # fmt: skip
                if batch.step + 1 >= args.steps:
                    break
                # trained on batch N: the weights of step N + 1, synced every `--sync-every` steps
                if (batch.step + 1) % args.sync_every == 0:
                    result["undrained_syncs"] += not sync(args.inference, rb, batch.step + 1, args.drain)
        except NoProgress as exc:
            result["error"] = str(exc)
        result["elapsed"] = time.monotonic() - started
    args.out.write_text(json.dumps(result))
    raise SystemExit(3 if result["error"] else 0)


if __name__ == "__main__":
    main()
