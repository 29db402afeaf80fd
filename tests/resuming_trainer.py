"""A trainer that reads ahead and commits at its checkpoints, for the crash/resume tests: a stand-in for a real
training loop (TRL's: a data loader that prefetches, a checkpoint every few steps, then a commit), which the
tests kill -9 anywhere and start again.

    python -m tests.resuming_trainer URL CHECKPOINT STEPS [--commit-url URL] [--prefetch 2] [--every 2]
        [--acknowledge next] [--batch-size 8] [--until PATH]

"Training" on a batch records its group ids with its step, in memory, and takes `--train-s`; only a checkpoint
(written atomically: a temporary file, fsync, rename) makes it durable, and the commit follows the checkpoint.
A restart resumes from the checkpoint's step, as a real trainer does from its last checkpoint. Exits 0 once
`STEPS` batches are trained and checkpointed, or, with `--until PATH`, the number of batches PATH names once the
file appears (a run whose length its driver learns at the end). The checkpoint is also the crash matrix's record
of what was trained (crash/records.py): beside each step's group ids, when it was trained and the digests of
each group's sequences.

`--acknowledge next` (Atropos's default) acknowledges batch N by asking for N + 1, so such a trainer cannot
read ahead and stay exactly-once: it trains, checkpoints every step and only then asks for the next batch (no
loader thread; `--prefetch` and `--every` are ignored).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

from crash.records import digest
from trainer_client import Batch, TrainerClient

REGISTRATION: dict[str, Any] = {"batch_size": 8, "max_token_len": 64, "acknowledge": "commit"}


def load(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {"step": 0, "trained": []}
    return dict(json.loads(path.read_text()))


def save(path: Path, checkpoint: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as f:
        json.dump(checkpoint, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def seqs_of(batch: Batch) -> dict[str, list[str]]:
    """Each group's sequences, as digests of their tokens (what a per-rollout producer posted)."""
    out: dict[str, list[str]] = {}
    for i in range(batch.n_seqs):
        gid = batch.group_ids[int(batch.group_index[i])]
        tokens = batch.tokens[int(batch.offsets[i]) : int(batch.offsets[i + 1])]
        out.setdefault(str(gid), []).append(digest(tokens.tolist()))
    return out


def until(path: Path | None) -> int | None:
    """The number of batches the driver says the run has, once it wrote it."""
    if path is None or not path.exists():
        return None
    text = path.read_text().strip()
    return int(text) if text else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("steps", type=int)
    parser.add_argument("--commit-url", help="commit through another replica (default: url)")
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--train-s", type=float, default=0.02)
    parser.add_argument("--acknowledge", choices=["commit", "next"], default="commit")
    parser.add_argument("--batch-size", type=int, default=REGISTRATION["batch_size"])
    parser.add_argument("--max-token-len", type=int, default=REGISTRATION["max_token_len"])
    parser.add_argument("--until", type=Path, default=None, help="train the number of batches this file names")
    args = parser.parse_args()

    checkpoint = load(args.checkpoint)
    rb = TrainerClient(args.url)
    committer = TrainerClient(args.commit_url) if args.commit_url else rb
    rb.register(
        **{
            **REGISTRATION,
            "batch_size": args.batch_size,
            "acknowledge": args.acknowledge,
            "max_token_len": args.max_token_len,
        }
    )
    step = checkpoint["step"]
    trained: list[Any] = list(checkpoint["trained"])
    at: list[float] = list(checkpoint.get("at", []))
    seqs: list[dict[str, list[str]]] = list(checkpoint.get("seqs", []))
    args.checkpoint.with_suffix(f".ready-{os.getpid()}").touch()  # the test kills it from here on

    def train(batch: Batch) -> None:
        nonlocal step
        assert batch.step == step, (batch.step, step)
        time.sleep(args.train_s)  # the training step
        trained.append([step, batch.group_ids])
        at.append(time.time())
        seqs.append(seqs_of(batch))
        step += 1

    def done() -> bool:
        final = until(args.until)
        return bool(step >= (args.steps if final is None else min(final, args.steps)))

    if args.acknowledge == "next":
        stop = threading.Event()

        def watch() -> None:  # the last batch asked for may never come: end from here once the run is done
            while not (done() or stop.is_set()):
                time.sleep(0.1)  # polling interval for the driver's file
            stop.set()

        threading.Thread(target=watch, daemon=True).start()
        if not done():
            for batch in rb.batches(start_step=step, wait=1, stop=stop):
                train(batch)
                save(args.checkpoint, {"step": step, "trained": trained, "at": at, "seqs": seqs})
                if done():
                    break
        os._exit(0)

    loaded: queue.Queue[Batch] = queue.Queue(maxsize=args.prefetch)  # the loader reads this far ahead

    def loader() -> None:
        for batch in rb.batches(start_step=checkpoint["step"], wait=5):
            loaded.put(batch)

    threading.Thread(target=loader, daemon=True).start()
    saved = step
    while not done():
        try:
            batch = loaded.get(timeout=0.2)  # at most this long between looks at the driver's file
        except queue.Empty:
            continue
        train(batch)
        if step % args.every == 0 or done():
            save(args.checkpoint, {"step": step, "trained": trained, "at": at, "seqs": seqs})
            committer.commit(step)
            saved = step
    if saved < step:  # the driver named a step the last checkpoint did not reach
        save(args.checkpoint, {"step": step, "trained": trained, "at": at, "seqs": seqs})
        committer.commit(step)
    os._exit(0)  # the loader thread may be blocked on a long-poll


if __name__ == "__main__":
    main()
