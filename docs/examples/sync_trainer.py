"""A synchronous trainer that runs its producer in a background thread and pauses it around each weight sync
(docs/rollout-client-runner.md, "A synchronous trainer"). The environment is docs/examples/sums.py, beside this file."""

import itertools
import os

from sums import INFERENCE_URL, MODEL, ROLLBUF_URL, Sums, sum_task

from rollout_client import OpenAIPolicy, RolloutRunner, Tasks
from rollout_client.runner.handle import run_in_thread
from trainer_client import TrainerClient

STEPS = int(os.environ.get("STEPS", "4"))
SYNC_EVERY = 2  # steps between weight syncs


def train_on(batch) -> None:  # your optimizer step; here, a look at what it would train on
    assert batch.padded().trained.any()


def main() -> None:
    with TrainerClient(ROLLBUF_URL) as trainer:
        trainer.register(batch_size=8, max_token_len=256)
        runner = RolloutRunner(
            ROLLBUF_URL, [(Sums(), Tasks(sum_task))], OpenAIPolicy(INFERENCE_URL, MODEL), max_in_flight=16
        )
        with run_in_thread(runner) as handle:  # stop() and join() on exit
            # no handle.wait_ready() here: the runner registers once the trainer has asked for a batch
            for batch in itertools.islice(trainer.batches(start_step=0), STEPS):
                train_on(batch)
                if (batch.step + 1) % SYNC_EVERY == 0:
                    handle.pause(timeout=30)  # no generation in flight while the weights change
                    trainer.announce_weights(batch.step + 1)  # sync the weights, then say so: groups follow them
                    handle.resume()
                h = handle.health()  # RunnerHealth: a consistent snapshot
                print(batch.step, batch.n_seqs, h.failed_total, h.lag)
        stats = handle.join()  # raises RunFailed if the run ended for errors
        print(f"{stats.accepted} groups accepted")


if __name__ == "__main__":
    main()
