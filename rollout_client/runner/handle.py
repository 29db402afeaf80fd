"""`RunnerHandle`: a RolloutRunner on its own event loop in a background thread, driven by blocking,
thread-safe calls, for synchronous trainers (a training loop that is not async). The handle is built from a
runner, never the other way round: the runner knows nothing of threads.

```python
with run_in_thread(runner) as handle:
    handle.wait_ready(60)
    for step in range(steps):
        batch = trainer.next_batch()
        ...
        handle.pause(timeout=30)           # nothing at the inference server from here...
        sync_weights()
        handle.resume()                    # ...until the new weights are loaded
        if handle.health().error_rate > 0.2: ...
stats = handle.join()                      # RunFailed if the run ended for errors
```
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import threading
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any, TypeVar

from rollout_client.runner.runner import RolloutRunner
from rollout_client.runner.stats import RunnerHealth, RunnerStats

T = TypeVar("T")

START_TIMEOUT_S = 30.0
"""How long the constructor waits for the runner's thread to start its event loop."""


def run_in_thread(runner: RolloutRunner, max_groups: int | None = None) -> RunnerHandle:
    """Start `runner.run(max_groups)` on its own event loop in a background thread and return a blocking,
    thread-safe handle to it (pause, resume, health, stop, join): for synchronous trainers."""
    return RunnerHandle(runner, max_groups)


class RunnerHandle:
    """Runs `runner.run(max_groups)` in a daemon thread (from its constructor, as `run_in_thread` does); every
    method may be called from any thread."""

    def __init__(self, runner: RolloutRunner, max_groups: int | None = None) -> None:
        self.runner = runner
        self._max_groups = max_groups
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = threading.Event()
        self._stats: RunnerStats | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="rollout-runner", daemon=True)
        self._thread.start()
        if not self._started.wait(START_TIMEOUT_S):
            raise RuntimeError("the runner's thread did not start its event loop")

    def _main(self) -> None:
        try:
            self._stats = asyncio.run(self._run())
        except BaseException as exc:  # thread boundary: join() re-raises it in the caller's thread
            self._error = exc

    async def _run(self) -> RunnerStats:
        self._loop = asyncio.get_running_loop()
        self._started.set()
        return await self.runner.run(self._max_groups)

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        loop = self._loop
        if loop is None or loop.is_closed() or not self._thread.is_alive():
            coro.close()
            raise RuntimeError("the runner is not running")
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError("the runner did not answer in time") from None

    def _on_loop(self, fn: Callable[[], T]) -> T:
        async def call() -> T:
            return fn()

        return self._call(call())

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until every env is registered and the workers are started (False after `timeout` s, or if
        the run ended first). An env registers only once the trainer has asked for its first batch: a trainer
        must not wait here, in its own thread, before that request."""

        async def ready() -> None:
            await self.runner.ready.wait()

        try:
            self._call(ready(), timeout)
        except (TimeoutError, RuntimeError):
            return False
        return True

    def pause(self, timeout: float | None = None) -> bool:
        """Block until no generation request is in flight (see `RolloutRunner.pause`): True if everything
        stopped in time, False if groups still generating after `timeout` s were cancelled and counted."""
        bound = self.runner.timeouts.pause if timeout is None else timeout
        wait = None if math.isinf(bound) else bound + 10.0  # the runner bounds itself; this guards a dead loop
        return self._call(self.runner.pause(timeout), wait)

    def resume(self, policy_step: int | None = None) -> None:
        """Restart generation (see `RolloutRunner.resume`); returns once the runner has taken it in."""
        self._on_loop(lambda: self.runner.resume(policy_step))

    def health(self) -> RunnerHealth:
        """A consistent snapshot: alive workers, in flight, failures, error rate, staleness lag."""
        if not self.running:
            return self.runner.health()
        try:
            return self._on_loop(self.runner.health)
        except RuntimeError:  # the run ended meanwhile
            return self.runner.health()

    def stop(self) -> None:
        """Ask the run to stop (returns at once; `join()` waits for it)."""
        self.runner.stop()

    def join(self, timeout: float | None = None) -> RunnerStats:
        """Wait for the run to end: its stats, or the error it ended with (RunFailed...)."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the runner is still running after {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._stats is not None
        return self._stats

    def __enter__(self) -> RunnerHandle:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
        self._thread.join()
        if exc is None and self._error is not None:
            raise self._error
