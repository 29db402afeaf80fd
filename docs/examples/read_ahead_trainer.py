"""A trainer that reads ahead and commits at every checkpoint (docs/training.md, "A trainer that reads ahead").
The model, its training step, its weight push and its checkpoint are stand-ins for yours (a JSON file holding
the step to train next). Kill it anywhere and run it again: it resumes at its checkpoint's step, and rollbuf
serves the batches from there again, byte for byte."""

import json
import os
import queue
import threading
from pathlib import Path
from types import SimpleNamespace

from trainer_client import TrainerClient

URL = os.environ.get("ROLLBUF_URL", "http://127.0.0.1:8000")
num_steps = int(os.environ.get("NUM_STEPS", "6"))
checkpoint_every = 2
CHECKPOINT = Path("checkpoint.json")
model, optimizer = None, None  # yours


def has_checkpoint() -> bool:
    return CHECKPOINT.exists()


def load_checkpoint() -> SimpleNamespace:
    return SimpleNamespace(**json.loads(CHECKPOINT.read_text()))


def save_checkpoint(model: object, optimizer: object, step: int) -> None:
    CHECKPOINT.with_suffix(".tmp").write_text(json.dumps({"step": step}))
    CHECKPOINT.with_suffix(".tmp").replace(CHECKPOINT)  # the old checkpoint or the new one, never half of one


def train(batch) -> None:  # yours: forward, loss, backward, optimizer step
    print(f"step {batch.step}: {batch.n_seqs} sequences, token sum {int(batch.tokens.sum())}")


def push_weights(model: object) -> None:  # yours: vLLM's update_weights_from_disk, an NCCL broadcast, ...
    pass


rb = TrainerClient(URL)
rb.register(batch_size=8, max_token_len=64, acknowledge="commit")
start = load_checkpoint().step if has_checkpoint() else 0  # the step to train next

loaded: queue.Queue = queue.Queue(maxsize=2)  # the loader reads two batches ahead
threading.Thread(target=lambda: [loaded.put(b) for b in rb.batches(start_step=start)], daemon=True).start()

step = start
while step < num_steps:
    batch = loaded.get()  # batch.step == step
    train(batch)
    step += 1
    push_weights(model)  # the inference servers sample with the weights trained on every batch before `step`
    rb.announce_weights(step)  # producers stamp `step` from here on and judge their max_staleness against it
    if step % checkpoint_every == 0:
        save_checkpoint(model, optimizer, step=step)  # durable first (rank 0, after the barrier)
        rb.commit(step)  # then: every batch before `step` is trained
