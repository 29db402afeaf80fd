"""TRL's `AsyncGRPOTrainer` on rollbuf batches: the pieces beside `RollbufRolloutWorker` (`trl_worker`) that need
TRL (the `rollbuf[trl]` extra, pinned to the versions tested): a weight-transfer object that needs no vLLM, a
checkpoint callback that commits rollbuf's step, and `align`, which refuses at start what cannot line up.

Steps: with `token_budget=0` and `per_device_train_batch_size x gradient_accumulation_steps x world_size` equal to
rollbuf's `batch_size`, rollbuf batch `starting_step + k` is optimizer step `k + 1` (TRL's `global_step` counts
them), so the checkpoint at `global_step = g` resumes at rollbuf step `starting_step + g`: the callback commits
that step once the checkpoint is saved, and on a resume starts the worker there. See docs/trl.md.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
from collections.abc import Callable, Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from trainer_client.client import TrainerClient
from trainer_client.protocol import DRAIN_TIMEOUT_S
from trainer_client.trl_worker import RollbufRolloutWorker

log = logging.getLogger("trainer_client")

TESTED_TRL = ("1.16",)
"""TRL releases whose async GRPO seam (`RolloutWorkerProtocol`, `WeightTransferProtocol`, `RolloutSample`, the
fixed-count batcher) this module was tested with."""
SUPPORTED_TRL = ((1, 16), (1, 18))
"""[from, to): the releases with that seam, as the `trl` extra pins them (`trl>=1.16,<1.18`). TRL 1.18 removed
the `rollout_worker=` / `weight_transfer=` arguments and the experimental modules this adapter imports."""


def check_trl_version(trl_version: str) -> None:
    """Misaligned, naming the supported range, for a TRL release outside it."""
    m = re.match(r"(\d+)\.(\d+)", trl_version)
    at = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
    low, high = SUPPORTED_TRL
    if at >= high:
        raise Misaligned(
            f"trl {trl_version}: TRL 1.18 removed the AsyncGRPOTrainer's rollout_worker= / weight_transfer= seam "
            "(and the trl.experimental.async_grpo modules) this adapter plugs into; install 'trl>=1.16,<1.18' "
            "(pip install 'rollbuf[trl]')"
        )
    if at < low:
        raise Misaligned(
            f"trl {trl_version} predates the async GRPO seam this adapter uses; install "
            "'trl>=1.16,<1.18' (pip install 'rollbuf[trl]')"
        )
    if not trl_version.startswith(TESTED_TRL):
        log.warning(
            "trl %s: within the supported range (>=1.16,<1.18) but not the tested release (%s.x)",
            trl_version,
            ", ".join(TESTED_TRL),
        )


STATE_FILE = "rollbuf_state.json"
"""Written into each checkpoint: the rollbuf step it resumes at, and the run's starting step."""


class Misaligned(ValueError):
    """The TRL configuration and the rollbuf run cannot map one batch to one optimizer step."""


def align(
    args: Any,
    *,
    batch_size: int,
    max_staleness: int | None = None,
    max_batch_tokens: int | None = None,
    world_size: int = 1,
    read_ahead_bound: int | None = None,
    buffered_batches: int = 2,
) -> None:
    """Check (and, for the staleness bound, set) `args`, an `AsyncGRPOConfig`, against the rollbuf run; raise
    `Misaligned` naming what to change. Staleness stays rollbuf's job: TRL's `max_staleness` is set above
    rollbuf's (counted in weight syncs), so TRL drops nothing rollbuf already let through."""
    check_trl_version(version("trl"))
    if max_batch_tokens is not None:
        raise Misaligned(
            "the rollbuf run is token-budgeted (max_batch_tokens): its batches hold varying numbers of sequences, "
            "which TRL's fixed-count batcher would split across optimizer steps; register without max_batch_tokens"
        )
    if args.token_budget != 0:
        raise Misaligned(
            f"token_budget={args.token_budget}: TRL would re-batch rollbuf's batches by tokens; set token_budget=0 "
            "so that one rollbuf batch is one optimizer step (rollbuf budgets tokens itself: max_batch_tokens)"
        )
    per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * world_size
    if per_step != batch_size:
        raise Misaligned(
            f"per_device_train_batch_size x gradient_accumulation_steps x world_size = {per_step}, but rollbuf's "
            f"batch_size is {batch_size}: make them equal so that one rollbuf batch is one optimizer step"
        )
    if args.max_steps <= 0:
        raise Misaligned("set max_steps: rollbuf's batches do not end, so TRL's epoch count cannot stop the run")
    save_strategy = getattr(args.save_strategy, "value", args.save_strategy)
    if read_ahead_bound is not None and save_strategy != "no":
        if save_strategy != "steps":
            raise Misaligned(f"save_strategy={args.save_strategy}: use 'steps', so that commits come every save_steps")
        if args.save_steps + buffered_batches >= read_ahead_bound:
            raise Misaligned(
                f"save_steps={args.save_steps}: batches are committed at each checkpoint, and the server serves at "
                f"most {read_ahead_bound} uncommitted (the worker buffers {buffered_batches}); save at least every "
                f"{read_ahead_bound - buffered_batches - 1} steps, or raise the server's max_read_ahead_batches"
            )
    syncs = None if max_staleness is None else -(-max_staleness // args.weight_sync_steps)
    args.max_staleness = 2**31 if syncs is None else syncs + 1


class RollbufWeightSync:
    """TRL's `WeightTransferProtocol` without vLLM: the hook where a deployment pushes its weights to its inference
    servers. `push` receives `(name, tensor)` pairs (full tensors on rank 0); without one, the weights are only
    walked (every rank must walk them: FSDP gathers collectively). Producers in other processes learn that new
    weights are live from rollbuf: TRL tells the worker after each sync (`update_model_version`), and
    `RollbufRolloutWorker` announces that step (POST /weights), which producers stamp on new groups and pace
    by. `pause`/`resume` are for a producer in this process that drains around syncs (`RolloutRunner.pause`);
    `client` and `step`, when given, announce `step()` at `resume` instead, for loops without the worker; with
    `drain=True` too, `pause` begins the sync through rollbuf and waits (at most `drain_timeout` s) until every
    live producer of an `on_new_weights="drain"` env in any process has finished its episodes in flight
    (`TrainerClient.weight_sync`'s handshake). `syncs` counts completed syncs."""

    def __init__(
        self,
        push: Callable[[Iterator[tuple[str, Any]]], None] | None = None,
        *,
        pause: Callable[[], None] | None = None,
        resume: Callable[[], None] | None = None,
        client: TrainerClient | None = None,
        step: Callable[[], int] | None = None,
        drain: bool = False,
        drain_timeout: float | None = DRAIN_TIMEOUT_S,
    ) -> None:
        if (client is None) != (step is None):
            raise ValueError("client and step go together: the step of the weights to announce, and where")
        if drain and client is None:
            raise ValueError("drain=True needs client and step: producers drain for a sync begun through rollbuf")
        self._drain = drain
        self._drain_timeout = drain_timeout
        self._push = push
        self._pause = pause
        self._resume = resume
        self._client = client
        self._step = step
        self.syncs = 0

    def init_weight_transfer(self) -> None:
        return None

    def pause(self) -> None:
        if self._pause is not None:
            self._pause()
        if self._drain and self._client is not None and self._step is not None:
            step = self._step()
            self._client.begin_weights(step)
            self._client.wait_drained(step, self._drain_timeout)

    def send_weights(self, iterator: Iterator[tuple[str, Any]]) -> None:
        if self._push is not None:
            self._push(iterator)
        else:
            for _ in iterator:
                pass
        self.syncs += 1

    def resume(self) -> None:
        if self._resume is not None:
            self._resume()
        if self._client is not None and self._step is not None:
            self._client.announce_weights(self._step())

    def destroy(self) -> None:
        return None


class RollbufCheckpoints(TrainerCallback):
    """Resumes the worker at the right rollbuf step and commits rollbuf's step at every checkpoint.

    On train begin (after a resume has restored `global_step`), it refuses a configuration that cannot map one
    batch to one optimizer step (`align`), and the worker starts at `starting_step + global_step`. After each
    checkpoint is saved, its step is written into it (`rollbuf_state.json`) and then committed: every batch before
    it is trained and saved, so rollbuf frees them. From rank 0 only."""

    def __init__(self, worker: RollbufRolloutWorker, client: TrainerClient, starting_step: int = 0) -> None:
        self.worker = worker
        self.client = client
        self.starting_step = starting_step
        self.committed: list[int] = []

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        info = self.client.info()
        checked = copy.copy(args)  # TRL read its staleness bound already: `align` before building the trainer sets it
        align(
            checked,
            batch_size=info.batch_size,
            world_size=args.world_size,
            read_ahead_bound=info.max_read_ahead_batches,
            buffered_batches=self.worker.buffered_batches,
        )
        resume = self.starting_step + state.global_step
        saved = _saved_step(getattr(args, "resume_from_checkpoint", None))
        if saved is not None and saved != resume:
            raise Misaligned(f"the checkpoint says rollbuf step {saved}, the trainer's global_step {resume}")
        self.worker.start_step = resume
        log.info("rollbuf: training from step %d (global_step %d)", resume, state.global_step)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        step = self.starting_step + state.global_step
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if folder.is_dir():
            tmp = folder / (STATE_FILE + ".tmp")
            tmp.write_text(json.dumps({"rollbuf_step": step, "starting_step": self.starting_step}))
            os.replace(tmp, folder / STATE_FILE)
        self.client.commit(step)
        self.committed.append(step)


def _saved_step(checkpoint: str | None) -> int | None:
    if not checkpoint:
        return None
    path = Path(checkpoint) / STATE_FILE
    if not path.exists():
        return None
    return int(json.loads(path.read_text())["rollbuf_step"])
