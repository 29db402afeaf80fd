"""An example trainer, run apart from its producers as a deployment runs one (docs/bring-your-environment.md, "The
four-process layout"): it registers the run with rollbuf, reads its batches through `trainer_client`, and after
each step pushes its weights to the inference server (here the stand-in's `/control`: no model is trained, the
stand-in marks each token with the weights that sampled it) and announces them through rollbuf, after every step
or every `--sync-every` steps. It ends when the run is finished (every dataset feeding it done: `/batch` says
`finished`) or after `--steps` steps, and exits 0; told by rollbuf that nothing can arrive for
`--no-progress-timeout` s (`NoProgress`), it exits 3. With `--out` it writes what it saw as JSON: per step, each
group's stamp and the weights that sampled its trained tokens.

    rollbuf example-trainer --server URL --inference URL [--steps N] [--out trainer.json]
        (or: python -m demos.example_trainer ...)
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

from client_core.retry import RetryPolicy
from demos.standin_inference import weights_of
from trainer_client import NoProgress, TrainerClient

PUSH_DEADLINE_S = 60.0
"""How long a weight push rides out an inference server that is not up yet (all four processes started at once)."""


def push(inference: str, step: int) -> None:
    """Give the inference server the weights of `step` (the stand-in's `weights`), retried while it cannot be
    reached or answers 5xx."""
    for attempt in RetryPolicy(PUSH_DEADLINE_S, retry_on=_retryable).retrying(reraise=True):
        with attempt:
            httpx.post(inference + "/control", json={"weights": step}, timeout=10).raise_for_status()


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, httpx.HTTPStatusError):
        return exc.response.status_code >= 500
    return isinstance(exc, httpx.TransportError)


def sync(inference: str, rb: TrainerClient, step: int, drain: bool) -> bool:
    """Push the weights of `step` to the inference server, then tell rollbuf they are live; with `drain`, inside
    `weight_sync` (drain envs' producers finish their episodes first). Whether every drain producer drained."""
    if drain:
        with rb.weight_sync(step, timeout=30.0) as drained:
            push(inference, step)
        return drained
    push(inference, step)
    rb.announce_weights(step)
    return True


def groups_of(batch: Any) -> list[dict[str, Any]]:
    """Per group: its stamp, the range it says it spanned, the weights its trained tokens came from, and how many
    of those tokens the per-token versions served beside them (`token_weight_versions`) name otherwise (None: the
    group was served without them)."""
    out = []
    lp = batch.floats["inference_logprobs"]
    trained = batch.trained
    served = batch.weight_versions
    for g in range(len(batch.group_ids)):
        seqs = np.flatnonzero(batch.group_index == g)
        versions: set[int] = set()
        mismatched: int | None = None if served is None or (served[batch.offsets[seqs[0]]] < 0) else 0
        for i in seqs.tolist():
            a, b = int(batch.offsets[i]), int(batch.offsets[i + 1])
            sampled_by = [weights_of(float(x)) for x in lp[a:b][trained[a:b]]]
            versions |= set(sampled_by)
            if mismatched is not None and served is not None:
                mismatched += int(np.count_nonzero(served[a:b][trained[a:b]] != np.asarray(sampled_by, np.int64)))
        meta = batch.meta[g].get("generation_params") or {}
        out.append(
            {
                "policy_step": int(batch.policy_steps[seqs[0]]),
                "weight_versions": meta.get("weight_versions"),
                "exact": meta.get("weight_versions_exact"),
                "generated_with": sorted(versions),
                "token_mismatches": mismatched,
            }
        )
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="rollbuf example-trainer",
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--server", required=True, metavar="URL", help="rollbuf's URL")
    ap.add_argument("--inference", required=True, metavar="URL", help="the inference server's URL (the stand-in's)")
    ap.add_argument(
        "--steps", type=int, default=None, metavar="N", help="stop after N steps (default: when the run is finished)"
    )
    ap.add_argument("--batch-size", type=int, default=4, metavar="N", help="sequences a batch (default: %(default)s)")
    ap.add_argument("--max-staleness", type=int, default=None, metavar="N", help="steps a group may lag the trainer")
    ap.add_argument("--sync-every", type=int, default=1, metavar="N", help="sync the weights after every N steps")
    ap.add_argument(
        "--no-progress-timeout", type=float, default=600.0, metavar="S", help="seconds told nothing can arrive"
    )
    ap.add_argument("--out", type=Path, default=None, metavar="PATH", help="write what it saw here, as JSON")
    ap.add_argument("--drain", action="store_true", help="sync inside weight_sync (drain envs wait it out)")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request: the clients log what matters
    started = time.monotonic()
    result: dict[str, Any] = {"steps": [], "error": None, "undrained_syncs": 0, "finished": False}
    with TrainerClient(args.server) as rb:
        rb.register(batch_size=args.batch_size, max_token_len=256, max_staleness=args.max_staleness)
        sync(args.inference, rb, 0, args.drain)
        try:
            batches = rb.batches(start_step=0, wait=2.0, no_progress_timeout=args.no_progress_timeout)
            for batch in batches:
                assert batch.step is not None
                result["steps"].append(
                    {"step": batch.step, "groups": groups_of(batch), "at": time.monotonic() - started}
                )
                if args.steps is not None and batch.step + 1 >= args.steps:
                    break
                # trained on batch N: the weights of step N + 1, synced every `--sync-every` steps
                if (batch.step + 1) % args.sync_every == 0:
                    result["undrained_syncs"] += not sync(args.inference, rb, batch.step + 1, args.drain)
            else:
                result["finished"] = True  # the iterator ended on its own: the server said the run is finished
        except NoProgress as exc:
            result["error"] = str(exc)
        result["elapsed"] = time.monotonic() - started
    if args.out is not None:
        args.out.write_text(json.dumps(result))
    summary = f"example-trainer: {len(result['steps'])} steps in {result['elapsed']:.1f} s"
    if result["finished"]:
        summary += ", and the run is finished"
    print(summary + (f"; {result['error']}" if result["error"] else ""))
    raise SystemExit(3 if result["error"] else 0)


if __name__ == "__main__":
    main()
