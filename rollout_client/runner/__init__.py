"""`RolloutRunner` and the policies it runs by, one module each so that each can be read and tested alone.

`runner` orchestrates; `execution` runs one group (its attempts, its timeout, on which worker) and `inflight`
holds the rollout slots; `accounting` counts how each group ended and `failures` judges it; `pacing`,
`backpressure`, `watching` and `watch` decide what to hold back from the server's view of the run, and
`following` takes the trainer's weights from it and heartbeats; `per_rollout` and `siblings` post per-rollout
groups and finish other producers'; `coalescing` sends groups that end together in one request;
`registration` registers each env again when the server lost it; `lifecycle` stops on signals;
`timeouts` and `deprecated` are the runner's keywords; `stats` what it reports; `handle` runs it in a thread
for a synchronous trainer.
"""

from rollout_client.runner.runner import RolloutRunner

__all__ = ["RolloutRunner"]
