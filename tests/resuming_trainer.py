"""A trainer that reads ahead and commits at its checkpoints, for the crash/resume tests: a stand-in for a real
training loop (TRL's: a data loader that prefetches, a checkpoint every few steps, then a commit), which the
tests kill -9 anywhere and start again.

    python -m tests.resuming_trainer URL CHECKPOINT STEPS [--commit-url URL] [--prefetch 2] [--every 2]

"Training" on a batch records its group ids with its step, in memory, and takes `--train-s`; only a checkpoint
(written atomically: a temporary file, fsync, rename) makes it durable, and the commit follows the checkpoint.
A restart resumes from the checkpoint's step, as a real trainer does from its last checkpoint. Exits 0 once
`STEPS` batches are trained and checkpointed.
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("steps", type=int)
    parser.add_argument("--commit-url", help="commit through another replica (default: url)")
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--train-s", type=float, default=0.02)
    args = parser.parse_args()

    checkpoint = load(args.checkpoint)
    rb = TrainerClient(args.url)
    committer = TrainerClient(args.commit_url) if args.commit_url else rb
    rb.register(**REGISTRATION)
    loaded: queue.Queue[Batch] = queue.Queue(maxsize=args.prefetch)  # the loader reads this far ahead

    def loader() -> None:
        for batch in rb.batches(start_step=checkpoint["step"], wait=5):
            loaded.put(batch)

    threading.Thread(target=loader, daemon=True).start()
    args.checkpoint.with_suffix(f".ready-{os.getpid()}").touch()  # the test kills it from here on
    step = checkpoint["step"]
    trained: list[Any] = list(checkpoint["trained"])
    while step < args.steps:
        batch = loaded.get()
        assert batch.step == step, (batch.step, step)
        time.sleep(args.train_s)  # the training step
        trained.append([step, batch.group_ids])
        step += 1
        if step % args.every == 0 or step == args.steps:
            save(args.checkpoint, {"step": step, "trained": trained})
            committer.commit(step)
    os._exit(0)  # the loader thread may be blocked on a long-poll


if __name__ == "__main__":
    main()
