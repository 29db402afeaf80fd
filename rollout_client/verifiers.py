"""Any verifiers v1 environment as a rollbuf producer (`pip install rollbuf[verifiers]`).

`VerifiersEnvironment` is a rollbuf `Environment` whose rollout is one verifiers episode: run in this process
(`env.slots` / `env.run_slot` inside `env.serving()`), or by verifiers' own env-server pool
(`serve_env(max_workers=N)` in a child process, driven by `EnvClient.run`). Each episode's trainable branches
become the group's sequences (`rollout_client.verifiers_mapping`), recorded with `Session.record_sequences`;
rollbuf's `RolloutRunner` runs it like any environment: weighted pick, backpressure, staleness, timeouts,
the failure policy, stats and bounded shutdown (docs/bring-your-environment.md).

verifiers is imported here only, lazily: `rollout_client` itself never needs it.

    async with VerifiersEnvironment(env_config, client=..., model="my-model") as env:
        runner = RolloutRunner(url, [(env, verifiers_tasks(env_config))], policy=ExternalInference())
        await runner.run()
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import queue as queue_module
import time
from collections.abc import Callable, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from rollout_client.env import Environment, ExternalSequence, Session, Task
from rollout_client.errors import EpisodeFailed
from rollout_client.policy import Completion
from rollout_client.tasks import Tasks
from rollout_client.verifiers_mapping import episode_failure, failure_detail, group_verdict, map_episode

TASK_KEY = "verifiers_task"
"""Where a rollbuf `Task` carries the verifiers task's wire data (`TaskData.model_dump(mode="json")`)."""
POOL_START_S = 120.0
"""Bound on the env-server pool's start (its first worker imports verifiers and builds the env)."""
POOL_STOP_S = 30.0
"""Bound on the pool's graceful stop (SIGTERM) before it is killed."""
Delta = Callable[[str, dict[str, Any]], None]
"""An `on_delta` relay: (the rollbuf task id, one verifiers delta as `EnvClient` decoded it)."""


class ExternalInference:
    """The runner's policy for an environment whose harness calls inference itself (verifiers): nothing
    generates through it. It exists because the runner takes a policy; a call to it is a wiring error."""

    async def tokenize(self, text: str) -> list[int]:
        raise RuntimeError("ExternalInference: this environment's harness tokenizes and generates itself")

    async def generate(
        self, prompt_ids: list[int], *, max_tokens: int, token_limit: int | None = None, seed: int | None = None
    ) -> Completion:
        raise RuntimeError("ExternalInference: this environment's harness tokenizes and generates itself")


def _resolve(env_config: Mapping[str, Any]) -> Any:
    from verifiers.v1.utils.loaders import resolve_env_config

    return resolve_env_config(dict(env_config))


def verifiers_tasks(env_config: Mapping[str, Any], *, cycle: bool = True, limit: int | None = None) -> Tasks:
    """The environment's taskset as rollbuf tasks: id = the task's stable key, prompt = its prompt text, the
    wire data under `meta["verifiers_task"]`. A finite taskset is loaded once and cycled by default (RL samples
    forever); an infinite one (`Taskset.INFINITE`, generated on demand) is read lazily, as it goes."""
    from verifiers.v1.utils.loaders import load_taskset

    taskset = load_taskset(_resolve(env_config).taskset)
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

        self.env = load_environment(_resolve(env_config))
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


class Pool:
    """Episodes run by verifiers' env-server pool, `serve_env(max_workers=N)` in a spawned child process,
    through one `EnvClient`; the pool balances each rollout onto its least busy worker."""

    def __init__(self, env_config: Mapping[str, Any], context: Any, max_workers: int, **pool: Any) -> None:
        self.env_config, self.context, self.max_workers, self.pool = dict(env_config), context, max_workers, pool
        self.proc: Any = None
        self.client: Any = None

    async def start(self) -> None:
        from verifiers.v1.serve import EnvClient, env_config_data, serve_env

        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        self.proc = ctx.Process(
            target=serve_env,
            kwargs={"max_workers": self.max_workers, "address": "tcp://127.0.0.1:0", "address_queue": queue,
                    "config_data": env_config_data(_resolve(self.env_config)), **self.pool},
            daemon=False,
        )  # fmt: skip
        self.proc.start()
        loop = asyncio.get_running_loop()
        give_up = loop.time() + POOL_START_S
        address = None
        while address is None:  # its address, or its exit (a config error) as soon as it happens
            try:
                address = await loop.run_in_executor(None, lambda: queue.get(timeout=0.5))
            except queue_module.Empty:
                if not self.proc.is_alive() or loop.time() > give_up:
                    code = self.proc.exitcode
                    await self.aclose()
                    why = f"exited with {code}" if code is not None else f"did not start within {POOL_START_S} s"
                    raise RuntimeError(f"verifiers' env server {why} (its log: stderr)") from None
        self.client = EnvClient(address)
        await self.client.wait_for_server_startup(timeout=POOL_START_S)

    async def run(self, task_data: dict[str, Any], live: LiveRollout, on_delta: Delta | None) -> Any:
        def relay(delta: dict[str, Any]) -> None:
            # verifiers' stream: per trace, `open` (its header) once, then appended `nodes`/`calls` and `set`
            live.deltas += 1
            live.traces += int("open" in delta) - int(bool(delta.get("discard")))
            live.sampled_turns += sum(1 for n in delta.get("nodes") or [] if isinstance(n, dict) and n.get("sampled"))
            if on_delta is not None:
                on_delta(live.task_id, delta)

        ctx = self.context
        return await self.client.run(ctx.client, ctx.model, ctx.sampling, task_data, on_delta=relay)

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.close()
            self.client = None
        proc, self.proc = self.proc, None
        if proc is None:
            return
        loop = asyncio.get_running_loop()
        if proc.is_alive():
            proc.terminate()  # SIGTERM: verifiers' servers unwind their serving() and stop their workers
            await loop.run_in_executor(None, proc.join, POOL_STOP_S)
        if proc.is_alive():
            proc.kill()
            await loop.run_in_executor(None, proc.join, POOL_STOP_S)


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

        return ModelContext(model=self.model, client=TrainClientConfig(**self.client_config),
                            sampling=SamplingConfig(**self.sampling))  # fmt: skip

    async def start(self) -> None:
        """Build the env in this process, or start verifiers' env-server pool (bounded by `POOL_START_S`)."""
        if self._backend is not None:
            return
        backend: InProcess | Pool
        if self.workers > 0:
            backend = Pool(self.env_config, self._context(), self.workers, **self.pool)
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
            ExternalSequence(seq.tokens, seq.masks, seq.logprobs, seq.score, seq.overrides) for seq in mapped.sequences
        )

    def score(self, task: Task, session: Session) -> float:
        """Not used for the group (each recorded sequence carries its trace's reward); the mean, for logs."""
        scores = [s.score for s in session.external or []]
        return sum(scores) / len(scores) if scores else 0.0

    def skip_reason(self, sequences: int, scores: list[float]) -> str | None:
        return group_verdict(scores, require_variance=self.require_reward_variance)


__all__ = ["ExternalInference", "LiveRollout", "VerifiersEnvironment", "verifiers_tasks"]
