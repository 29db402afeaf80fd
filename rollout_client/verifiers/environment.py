"""Any verifiers v1 environment as a rollbuf producer (`pip install rollbuf[verifiers]`).

`VerifiersEnvironment` is a rollbuf `Environment` whose rollout is one verifiers episode: run in this process
(`env.slots` / `env.run_slot` inside `env.serving()`), or by verifiers' own env-server pool
(`serve_env(max_workers=N)` in a child process, driven by `EnvClient.run`). Each episode's trainable branches
become the group's sequences (`rollout_client.verifiers.mapping`), recorded with `Session.record_sequences`;
rollbuf's `RolloutRunner` runs it like any environment: weighted pick, backpressure, staleness, timeouts,
the failure policy, stats and bounded shutdown (docs/bring-your-environment.md).

verifiers is imported here only, lazily: `rollout_client` itself never needs it.

    async with VerifiersEnvironment(env_config, client=..., model="my-model") as env:
        runner = RolloutRunner(url, [(env, verifiers_tasks(env_config))], policy=ExternalInference())
        await runner.run()
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from rollout_client.env import Environment, ExternalSequence, Session, Task
from rollout_client.errors import EpisodeFailed
from rollout_client.policy import Completion
from rollout_client.tasks import Tasks
from rollout_client.verifiers.mapping import episode_failure, failure_detail, group_verdict, map_episode
from rollout_client.verifiers.pool import Delta, Pool, resolve

TASK_KEY = "verifiers_task"
"""Where a rollbuf `Task` carries the verifiers task's wire data (`TaskData.model_dump(mode="json")`)."""


class ExternalInference:
    """The runner's policy for an environment whose harness calls inference itself (verifiers): nothing
    generates through it. It exists because the runner takes a policy; a call to it is a wiring error."""

    async def tokenize(self, text: str) -> list[int]:
        raise RuntimeError("ExternalInference: this environment's harness tokenizes and generates itself")

    async def generate(
        self, prompt_ids: list[int], *, max_tokens: int, token_limit: int | None = None, seed: int | None = None
    ) -> Completion:
        raise RuntimeError("ExternalInference: this environment's harness tokenizes and generates itself")


def verifiers_tasks(env_config: Mapping[str, Any], *, cycle: bool = True, limit: int | None = None) -> Tasks:
    """The environment's taskset as rollbuf tasks: id = the task's stable key, prompt = its prompt text, the
    wire data under `meta["verifiers_task"]`. A finite taskset is loaded once and cycled by default (RL samples
    forever); an infinite one (`Taskset.INFINITE`, generated on demand) is read lazily, as it goes."""
    from verifiers.v1.utils.loaders import load_taskset

    taskset = load_taskset(resolve(env_config).taskset)
    if limit is not None:
        taskset = taskset.take(limit)
    tasks = (
        Task(id=str(t.key), prompt=t.data.prompt_text, meta={TASK_KEY: t.data.model_dump(mode="json")}) for t in taskset
    )
    return Tasks(list(tasks), cycle=cycle) if taskset.bounded else Tasks(tasks)


@dataclass
class LiveRollout:
    """One rollout in flight, for an operator's view: in process from its live traces, through the pool from
    its `on_delta` stream."""

    task_id: str
    started: float = field(default_factory=time.monotonic)
    deltas: int = 0
    """Deltas received (pool mode)."""
    traces: int = 0
    sampled_turns: int = 0
    """Sampled turns seen in the stream (pool mode); see `turns()`."""
    watched: list[Any] = field(default_factory=list, repr=False)
    """The episode's live traces (in process)."""

    def turns(self) -> int:
        """Sampled turns so far, over the episode's traces."""
        return self.sampled_turns + sum(int(t.num_turns) for t in self.watched)


class InProcess:
    """Episodes run in this process: the env is built once and served (`env.serving()`) until `aclose`."""

    def __init__(self, env_config: Mapping[str, Any], context: Any) -> None:
        from verifiers.v1.utils.loaders import load_environment

        self.env = load_environment(resolve(env_config))
        self.context = context
        task_cls = type(self.env.taskset).task_type()
        self._task_cls, self._data_cls = task_cls, task_cls.data_type()
        self._stack = AsyncExitStack()

    async def start(self) -> None:
        await self._stack.enter_async_context(self.env.serving())

    async def run(self, task_data: dict[str, Any], live: LiveRollout, on_delta: Delta | None) -> Any:
        task = self._task_cls(self._data_cls.model_validate(task_data), self.env.config.taskset.task)
        (slot,) = self.env.slots(task)

        def minted(trace: Any) -> None:
            live.traces += 1
            live.watched.append(trace)

        return await self.env.run_slot(slot, self.context, on_trace=minted)

    async def aclose(self) -> None:
        await self._stack.aclose()


class VerifiersEnvironment(Environment):
    """A verifiers v1 environment (its env config, as `--env.*`/TOML would give it) as a rollbuf environment.

    `workers=0` runs episodes in this process; `workers=N` runs them in verifiers' env-server pool of up to N
    processes (`pool` is passed on to `serve_env`: `elastic`, `multiplex`). `client` is verifiers' client
    config (a train client on the inference server's `/inference/v1/generate`), `model` and `sampling` what
    each episode samples with. Use it as an async context manager around the run (it builds and tears down
    the env or the pool); it does not pickle: use it with the runner's `num_workers=0` (verifiers' pool is the
    parallelism). `require_reward_variance`: a group whose sequences all score the same is counted
    (`skipped["no_reward_variance"]`), not submitted. `on_delta(task_id, delta)`: each verifiers
    delta, relayed (pool mode: the env server streams each trace turn by turn; in process there is no stream).

    A pool process that dies (a worker killed -9: verifiers' broker neither notices nor replaces it) is
    logged, counted (`pool_worker_deaths`), fails the episodes in flight at the pool at once (counted as
    failures, `pool_worker_died`) and the pool is restarted (`pool_restarts`); past `MAX_RESTARTS` deaths in
    `RESTART_WINDOW_S`, or when a restart fails, episodes fail as `pool_down` and the run ends with RunFailed
    (rollout_client/verifiers/pool.py).
    """

    variable_group_size = True  # a group holds each episode's trainable branches: not always G sequences

    def __init__(
        self,
        env_config: Mapping[str, Any],
        *,
        client: Mapping[str, Any],
        model: str,
        sampling: Mapping[str, Any] | None = None,
        name: str = "verifiers",
        group_size: int = 4,
        weight: float = 1.0,
        workers: int = 0,
        pool: Mapping[str, Any] | None = None,
        require_reward_variance: bool = False,
        on_delta: Delta | None = None,
    ) -> None:
        self.env_config = dict(env_config)
        self.client_config, self.model, self.sampling = dict(client), model, dict(sampling or {})
        self.name, self.group_size, self.weight = name, group_size, weight
        self.workers, self.pool = workers, dict(pool or {})
        self.require_reward_variance = require_reward_variance
        self.on_delta = on_delta
        self.running = 0
        """Episodes running now (in this process or at the pool): 0 once a `pause()` has returned True."""
        self.live: dict[int, LiveRollout] = {}
        """Rollouts in flight, by rollout: task, start, traces and sampled turns so far."""
        self._backend: InProcess | Pool | None = None
        self._pool: Pool | None = None  # kept after aclose, for its counts

    @property
    def pool_worker_deaths(self) -> int:
        """verifiers' pool processes that died while serving this env (0 in process)."""
        return self._pool.worker_deaths if self._pool is not None else 0

    @property
    def pool_restarts(self) -> int:
        """Times verifiers' pool was restarted after one of its processes died."""
        return self._pool.restarts if self._pool is not None else 0

    def __reduce__(self) -> Any:
        raise TypeError(
            "VerifiersEnvironment does not pickle (it holds a live env or env-server pool): use RolloutRunner's "
            "num_workers=0; verifiers' pool (workers=N) is the parallelism"
        )

    # ------------------------------------------------------------------------------------------- lifecycle

    def _context(self) -> Any:
        from verifiers.v1.clients import ModelContext
        from verifiers.v1.configs.client import TrainClientConfig
        from verifiers.v1.types import SamplingConfig

        return ModelContext(
            model=self.model, client=TrainClientConfig(**self.client_config), sampling=SamplingConfig(**self.sampling)
        )

    async def start(self) -> None:
        """Build the env in this process, or start verifiers' env-server pool (bounded by `POOL_START_S`)."""
        if self._backend is not None:
            return
        backend: InProcess | Pool
        if self.workers > 0:
            backend = self._pool = Pool(self.env_config, self._context(), self.workers, **self.pool)
        else:
            backend = InProcess(self.env_config, self._context())
        await backend.start()
        self._backend = backend

    async def aclose(self) -> None:
        backend, self._backend = self._backend, None
        if backend is not None:
            await backend.aclose()

    async def __aenter__(self) -> VerifiersEnvironment:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    # ------------------------------------------------------------------------------------------- rollout

    async def rollout(self, task: Task, session: Session) -> None:
        """One verifiers episode of `task`, its sequences recorded on `session`.

        The episode holds the runner's generation gate while it runs: a `pause()` waits for running episodes
        (up to its timeout, then cancels them) and none starts until `resume()`. A failed episode raises
        EpisodeFailed (the group fails, counted under its reason)."""
        if self._backend is None:
            raise RuntimeError("VerifiersEnvironment: use it as `async with env:` (or await start()) first")
        data = task.meta.get(TASK_KEY)
        if not isinstance(data, dict):
            raise ValueError(f"task {task.id!r} has no meta[{TASK_KEY!r}]: make tasks with verifiers_tasks()")
        key = id(session)
        live = self.live[key] = LiveRollout(task.id)
        loop = asyncio.get_running_loop()
        remaining = None
        if session.deadline is not None and not session.gate.is_open and (when := session.deadline.when()):
            remaining = when - loop.time()  # as in Session.generate: a paused rollout's clock stops
            session.deadline.reschedule(None)
        try:
            async with session.gate.generation(session.owner):
                if remaining is not None and session.deadline is not None:
                    session.deadline.reschedule(loop.time() + remaining)
                self.running += 1
                try:
                    episode = await self._backend.run(data, live, self.on_delta)
                finally:
                    self.running -= 1
        finally:
            self.live.pop(key, None)
        failure = episode_failure(episode)
        # A failed episode fails this rollout; its group keeps the others while `min_group_size` of them succeed.
        if failure is not None:
            raise EpisodeFailed(failure, failure_detail(episode))
        mapped = map_episode(episode, session.token_limit)
        session.left_out.update(mapped.left_out)
        session.record_sequences(
            ExternalSequence(seq.tokens, seq.masks, seq.logprobs, seq.score, seq.overrides, seq.weight_versions)
            for seq in mapped.sequences
        )

    def score(self, task: Task, session: Session) -> float:
        """Not used for the group (each recorded sequence carries its trace's reward); the mean, for logs."""
        scores = [s.score for s in session.external or []]
        return sum(scores) / len(scores) if scores else 0.0

    def skip_reason(self, sequences: int, scores: list[float]) -> str | None:
        return group_verdict(scores, require_variance=self.require_reward_variance)


__all__ = ["ExternalInference", "LiveRollout", "VerifiersEnvironment", "verifiers_tasks"]
