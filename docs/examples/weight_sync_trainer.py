"""A trainer that syncs its weights inside `weight_sync` (docs/trainer-client.md, "Weight syncs that drain"): the
producers of `on_new_weights="drain"` envs finish their episodes in flight before the push, and start again,
stamped with the new weights, once it is announced. `push_weights` and the training step are stand-ins for yours."""

import itertools
import os

from trainer_client import TrainerClient

URL = os.environ.get("ROLLBUF_URL", "http://127.0.0.1:8000")


def push_weights(step: int) -> None:  # yours: vLLM's update_weights_from_disk, an NCCL broadcast, ...
    print(f"pushed the weights for step {step}")


with TrainerClient(URL) as rb:
    rb.register(batch_size=8, max_token_len=64)
    for batch in itertools.islice(rb.batches(start_step=0), 2):
        # train(batch): forward, loss, backward, optimizer step
        with rb.weight_sync(batch.step + 1, timeout=60) as drained:  # POST /weights/pending, wait for drain producers
            push_weights(step=batch.step + 1)  # no drain env's episode is in flight now (unless drained is False)
        # announced (POST /weights): producers start again, stamped with the new weights
        print(f"step {batch.step}: drained {drained}, weights of step {rb.status().weights_step} live")
