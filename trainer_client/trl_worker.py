"""`RollbufRolloutWorker`: TRL's async GRPO rollout worker (`RolloutWorkerProtocol`) fed by rollbuf batches,
so `AsyncGRPOTrainer` trains on rollbuf's durable, mixed, token-budgeted batches instead of generating itself.

A thread reads `TrainerClient.batches()` from the step to train next and puts one sample per sequence in
`rollout_buffer`, in batch order, so TRL's fixed-count batcher (`token_budget=0`) makes one optimizer step of
each rollbuf batch when `per_device_train_batch_size x gradient_accumulation_steps x world_size` equals rollbuf's
`batch_size` (`trainer_client.async_grpo.check_alignment` refuses what does not line up). No TRL import here:
samples are TRL's `RolloutSample` when TRL is installed, else `rollout_samples.Sample` (the same training fields).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from trainer_client.client import TrainerClient
from trainer_client.protocol import NO_PROGRESS_S, READ_MARGIN_S
from trainer_client.rollout_samples import Sample, samples_of, version_offset

if TYPE_CHECKING:
    from multiprocessing.queues import Queue as ProcessQueue

log = logging.getLogger("trainer_client")

BUFFERED_BATCHES = 2
"""Batches of samples `rollout_buffer` holds ahead of training (the reader waits beyond them)."""
PUT_POLL_S = 0.2
"""How often a reader waiting for room in the buffer checks whether it was stopped."""
STEPS_KEPT = 1024
"""Recent steps `steps_read` remembers."""


Convert = Callable[[Sample, float], Any]
"""Turns a `Sample` and the time it was enqueued into what goes into `rollout_buffer`."""


def to_trl_sample() -> Convert:
    """TRL's `RolloutSample` when TRL is installed (what its trainer expects), else the `Sample` itself."""
    try:
        from trl.experimental.async_grpo.async_rollout_worker import RolloutSample
    except ImportError:
        return lambda sample, enqueued_at: sample

    def convert(sample: Sample, enqueued_at: float) -> Any:
        fields = {name: getattr(sample, name) for name in Sample.__dataclass_fields__}
        return RolloutSample(prompt=[], completion=[], enqueued_at=enqueued_at, **fields)

    return convert


class RolloutWorkerDied(RuntimeError):
    """The reader stopped on an error (`__cause__`): the server refused a batch (BatchGone: the step was
    committed already), a batch could not be used, or the server stayed unreachable past the retry deadline."""


class RolloutWorkerStale(TimeoutError):
    """No batch for longer than the trainer's `stale_after_s`; the message says what rollbuf reported."""


class RollbufRolloutWorker:
    """TRL's `RolloutWorkerProtocol` over a `TrainerClient`, made once the run is registered (`acknowledge=
    "commit"`): TRL takes `rollout_buffer` when the trainer is built, and its bound is counted in batches.

    `start_step` is the rollbuf step to train next (the resumed checkpoint's); `RollbufCheckpoints` sets it on
    train begin. `sync_every` is TRL's `weight_sync_steps`: versions count weight syncs. `wait` is the long-poll,
    which bounds `stop()` (plus a margin for the reply). `convert`: what a sample becomes in the buffer (TRL's
    `RolloutSample` by default)."""

    def __init__(
        self,
        client: TrainerClient,
        *,
        start_step: int = 0,
        sync_every: int = 1,
        wait: float = 5.0,
        buffered_batches: int = BUFFERED_BATCHES,
        convert: Convert | None = None,
        announce_weights: bool = True,
        no_progress_timeout: float | None = NO_PROGRESS_S,
    ) -> None:
        self.client = client
        self.start_step = start_step
        self.sync_every = sync_every
        self.wait = wait
        self._convert = convert
        self.buffered_batches = buffered_batches
        batch_size = client.info().batch_size
        if batch_size <= 0:
            raise RuntimeError("no trainer is registered on the server: register the run before making the worker")
        # Typed as TRL's protocol declares them, so the worker type-checks as a `RolloutWorkerProtocol`.
        self.rollout_buffer: queue.Queue[Any] | ProcessQueue[Any] = queue.Queue(maxsize=batch_size * buffered_batches)
        self.metrics_queue: queue.Queue[Any] | ProcessQueue[Any] = queue.Queue()
        self.steps_read: deque[int] = deque(maxlen=STEPS_KEPT)
        """The last `STEPS_KEPT` rollbuf steps read, in order (what the trainer was fed lately): bounded, as a
        run reads steps for days."""
        self.first_step_read: int | None = None
        """The first step read: where the run resumed."""
        self.trainer_version: int | None = None
        self.announce_weights = announce_weights
        """Announce each weight sync to rollbuf (POST /weights), so producers stamp and pace by it."""
        self.no_progress_timeout = no_progress_timeout
        """The reader stops with `NoProgress` (`check_health` raises it) once rollbuf has said this long that
        nothing can arrive (no live producer, every one held back); None: it waits on."""
        self.weights_step: int | None = None
        """The rollbuf step of the weights last synced (announced when `announce_weights`)."""
        self._first_version = 0
        self._offset = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._progress_at = time.monotonic()

    # ------------------------------------------------------------------------------ RolloutWorkerProtocol

    def start(self) -> None:
        """Start reading at `start_step` (TRL calls it on train begin, after the first weight sync)."""
        if self._thread is not None:
            return
        self._progress_at = time.monotonic()
        self._thread = threading.Thread(target=self._read, name="rollbuf-reader", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop reading; returns within the long-poll bound (`wait` plus a margin), even mid-request."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.wait + READ_MARGIN_S)
            if self._thread.is_alive():
                log.warning("rollbuf reader still in a request after %.0f s; left to end on its own", self.wait)

    def update_model_version(self, model_version: int) -> None:
        """TRL's weight-sync counter, told right after each sync. The first value (the cold sync, before `start`)
        lines absolute versions up with it: the weights of `start_step` get this version. Each sync's weights step
        (`start_step` plus `sync_every` per sync since) is announced to rollbuf (POST /weights), which producers
        follow."""
        if self.trainer_version is None:
            self._offset = version_offset(model_version, self.start_step, self.sync_every)
            self._first_version = model_version
        self.trainer_version = model_version
        self.weights_step = self.start_step + (model_version - self._first_version) * self.sync_every
        if self.announce_weights:
            try:
                self.client.announce_weights(self.weights_step)
            except Exception as exc:  # training goes on; producers then pace by the trainer's step (and say so)
                log.error("announcing the weights of step %d to rollbuf failed: %s", self.weights_step, exc)

    def check_health(self, stale_after_s: float) -> None:
        """Raise with the cause when the reader died, or when no batch came for `stale_after_s`."""
        if self._error is not None:
            raise RolloutWorkerDied(f"the rollbuf reader stopped: {self._error}") from self._error
        if self._thread is not None and not self._thread.is_alive() and not self._stop.is_set():
            raise RolloutWorkerDied("the rollbuf reader exited without an error")
        idle = time.monotonic() - self._progress_at
        if idle > stale_after_s:
            why = self._reason() or "no reason reported"
            raise RolloutWorkerStale(f"no rollbuf batch for {idle:.0f} s (stale_after_s={stale_after_s:g}): {why}")

    # ------------------------------------------------------------------------------ the reader

    def _read(self) -> None:
        convert = self._convert or to_trl_sample()
        try:
            batches = self.client.batches(
                start_step=self.start_step,
                wait=self.wait,
                stop=self._stop,
                no_progress_timeout=self.no_progress_timeout,
            )
            for batch in batches:
                assert batch.step is not None
                samples = samples_of(batch, sync_every=self.sync_every, offset=self._offset)
                enqueued = time.time()
                for s in samples:
                    if not self._put(convert(s, enqueued)):
                        return
                if self.first_step_read is None:
                    self.first_step_read = batch.step
                self.steps_read.append(batch.step)
                self._progress_at = time.monotonic()
                staleness = [s.metrics["rollbuf/staleness"] for s in samples]
                self.metrics_queue.put(
                    {
                        "rollbuf/step": float(batch.step),
                        "rollbuf/groups": float(batch.n_groups),
                        "rollbuf/staleness_mean": sum(staleness) / max(1, len(staleness)),
                        "rollbuf/staleness_max": max(staleness, default=0.0),
                    }
                )
                if self._stop.is_set():
                    return
        except BaseException as exc:  # kept for check_health, which TRL calls from its training loop
            if not self._stop.is_set():
                self._error = exc
                log.error("rollbuf reader stopped: %s", exc)

    def _put(self, sample: Any) -> bool:
        """Wait for room in the buffer; False once stopped."""
        while not self._stop.is_set():
            try:
                self.rollout_buffer.put(sample, timeout=PUT_POLL_S)
                return True
            except queue.Full:
                self._progress_at = time.monotonic()  # training is the bottleneck, not rollbuf
        return False

    def _reason(self) -> str | None:
        try:
            status = self.client.status()
        except Exception as exc:  # the reason is a courtesy: the health verdict stands without it
            return f"/status unreachable ({exc})"
        return (
            status.blocked_reason
            or status.stall_reason
            or f"current step {status.current_step}, {status.queue_size} groups queued"
        )
