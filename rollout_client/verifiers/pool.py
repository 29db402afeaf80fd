"""verifiers' env-server pool in a child process, watched: a pool worker that dies is reported, the episodes
in flight at the pool fail at once (`pool_worker_died`), and the pool is restarted.

verifiers' broker (`serve_env(max_workers=N)`) has no restart-on-death (a TODO in verifiers/v1/serve/pool.py):
a worker killed -9 keeps its requests pending at the broker for ever and the broker goes on dispatching to
it, so its episodes hang until a pause or a rollout timeout. The broker cannot be asked which worker holds
which request, so the producer watches the broker's child processes by pid (Linux's /proc) and, when one
dies (or the broker itself), fails every episode in flight, stops the pool and starts a fresh one. Past
`MAX_RESTARTS` deaths within `RESTART_WINDOW_S`, or when a restart fails, it stops restarting: each
episode then fails at once as `pool_down` with the reason, and the runner's failure policy ends the run.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import queue as queue_module
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout_client.errors import EpisodeFailed

log = logging.getLogger("rollout_client.verifiers")

POOL_START_S = 120.0
"""Bound on the env-server pool's start (its first worker imports verifiers and builds the env)."""
POOL_STOP_S = 30.0
"""Bound on the pool's graceful stop (SIGTERM) before it is killed."""
WATCH_S = 0.25
"""How often the pool's processes are looked at."""
MAX_RESTARTS = 3
"""Restarts allowed within `RESTART_WINDOW_S`; one more death means something systematic: no more restarts."""
RESTART_WINDOW_S = 600.0
WORKER_DIED = "pool_worker_died"
"""The failure reason of an episode in flight when a pool process died."""
POOL_DOWN = "pool_down"
"""The failure reason of an episode started once the pool could not be restarted."""
Delta = Callable[[str, dict[str, Any]], None]
"""An `on_delta` relay: (the rollbuf task id, one verifiers delta as `EnvClient` decoded it)."""


def resolve(env_config: Mapping[str, Any]) -> Any:
    """The env config, as verifiers narrows it (`--env.*`/TOML data in, its config object out)."""
    from verifiers.v1.utils.loaders import resolve_env_config

    return resolve_env_config(dict(env_config))


def _state(pid: int) -> str | None:
    """A process's state letter from /proc (Z: a zombie, dead), or None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def children(pid: int) -> set[int] | None:
    """The live (not zombie) child processes of `pid`, or None where /proc cannot say."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
        found = {int(c) for t in tasks for c in (t / "children").read_text().split()}
    except (OSError, ValueError):
        return None
    return {c for c in found if _state(c) not in (None, "Z")}


@dataclass
class Life:
    """One start of the pool: its broker process, the client to it, and whether a pool process died."""

    proc: Any
    client: Any
    down: asyncio.Event = field(default_factory=asyncio.Event)
    why: str = ""
    closed: bool = False
    """Stopped on purpose (`aclose` while episodes ran), not by a death."""


class Pool:
    """Episodes run by verifiers' env-server pool, `serve_env(max_workers=N)` in a spawned child process,
    through one `EnvClient`; the pool balances each rollout onto its least busy worker. A pool process that
    dies is noticed within `WATCH_S`, logged, counted (`worker_deaths`), fails the episodes in flight and
    restarts the pool (`restarts`)."""

    def __init__(self, env_config: Mapping[str, Any], context: Any, max_workers: int, **pool: Any) -> None:
        self.env_config, self.context, self.max_workers, self.pool = dict(env_config), context, max_workers, pool
        self.life: Life | None = None
        self.worker_deaths = 0
        """Pool processes (workers, or the broker) that died while it served."""
        self.restarts = 0
        self.broken: str | None = None
        """Why the pool is down for good (not restarted), or None."""
        self._ready = asyncio.Event()
        self._deaths: deque[float] = deque()
        self._watcher: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.life = await self._launch()
        self._ready.set()
        self._watcher = asyncio.create_task(self._watch())

    async def _launch(self) -> Life:
        """Start the broker (bounded by `POOL_START_S`) and connect a client to it."""
        from verifiers.v1.serve import EnvClient, env_config_data, serve_env

        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        proc = ctx.Process(
            target=serve_env,
            kwargs={
                "max_workers": self.max_workers,
                "address": "tcp://127.0.0.1:0",
                "address_queue": queue,
                "config_data": env_config_data(resolve(self.env_config)),
                **self.pool,
            },
            daemon=False,
        )
        proc.start()
        life = Life(proc, None)
        try:
            loop = asyncio.get_running_loop()
            give_up = loop.time() + POOL_START_S
            address = None
            while address is None:  # its address, or its exit (a config error) as soon as it happens
                try:
                    address = await loop.run_in_executor(None, lambda: queue.get(timeout=0.5))
                except queue_module.Empty:
                    if not proc.is_alive() or loop.time() > give_up:
                        code = proc.exitcode
                        why = f"exited with {code}" if code is not None else f"did not start within {POOL_START_S} s"
                        raise RuntimeError(f"verifiers' env server {why} (its log: stderr)") from None
            life.client = EnvClient(address)
            await life.client.wait_for_server_startup(timeout=POOL_START_S)
        except BaseException:
            await _stop(life)
            raise
        return life

    async def _watch(self) -> None:
        """Wait for a pool process to die; then fail what runs at the pool and restart it (or give up)."""
        loop = asyncio.get_running_loop()
        while self.life is not None:
            life = self.life
            why = await _death(life.proc)
            self.worker_deaths += 1
            self._ready.clear()
            life.why = why
            life.down.set()
            log.error("verifiers' env-server pool: %s; the episodes in flight at the pool fail (%s)", why, WORKER_DIED)
            await _stop(life)
            now = loop.time()
            self._deaths.append(now)
            while self._deaths and self._deaths[0] < now - RESTART_WINDOW_S:
                self._deaths.popleft()
            if len(self._deaths) > MAX_RESTARTS:
                self._give_up(f"{len(self._deaths)} pool processes died within {RESTART_WINDOW_S:.0f} s ({why})")
                return
            try:
                self.life = await self._launch()
            except Exception as exc:
                self._give_up(f"the pool could not be restarted after {why}: {exc}")
                return
            self.restarts += 1
            log.warning("verifiers' env-server pool restarted (%d restarts so far)", self.restarts)
            self._ready.set()

    def _give_up(self, why: str) -> None:
        self.broken = f"verifiers' env-server pool is down, not restarted: {why}"
        self.life = None
        log.error("%s; every episode now fails as %s", self.broken, POOL_DOWN)
        self._ready.set()

    async def run(self, task_data: dict[str, Any], live: Any, on_delta: Delta | None) -> Any:
        """One episode at the pool; EpisodeFailed(`pool_worker_died`) as soon as a pool process dies under it."""
        await self._ready.wait()  # a restart in progress
        life = self.life
        if life is None:
            raise EpisodeFailed(POOL_DOWN, self.broken or "the pool is closed")

        def relay(delta: dict[str, Any]) -> None:
            # verifiers' stream: per trace, `open` (its header) once, then appended `nodes`/`calls` and `set`
            live.deltas += 1
            live.traces += int("open" in delta) - int(bool(delta.get("discard")))
            live.sampled_turns += sum(1 for n in delta.get("nodes") or [] if isinstance(n, dict) and n.get("sampled"))
            if on_delta is not None:
                on_delta(live.task_id, delta)

        ctx = self.context
        call = asyncio.ensure_future(life.client.run(ctx.client, ctx.model, ctx.sampling, task_data, on_delta=relay))
        down = asyncio.ensure_future(life.down.wait())
        try:
            await asyncio.wait({call, down}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            down.cancel()
            if not call.done():
                call.cancel()
                await asyncio.gather(call, return_exceptions=True)
        if call.done() and not call.cancelled() and (call.exception() is None or not life.down.is_set()):
            return call.result()
        raise EpisodeFailed(POOL_DOWN if life.closed else WORKER_DIED, life.why)

    async def aclose(self) -> None:
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        life, self.life = self.life, None
        if life is not None:
            life.why, life.closed = "the pool was closed while episodes ran", True
            life.down.set()
            await _stop(life)


async def _death(proc: Any) -> str:
    """Return once the broker or one of its children (the pool's workers) has died: which one, and how."""
    seen: set[int] = set()
    while True:
        if not proc.is_alive():
            return f"its broker (pid {proc.pid}) exited with {proc.exitcode}"
        now = children(proc.pid)
        if now is not None:
            gone = seen - now
            if gone and proc.is_alive():
                return f"pool worker pid {', '.join(map(str, sorted(gone)))} died"
            seen |= now
        await asyncio.sleep(WATCH_S)


async def _stop(life: Life) -> None:
    """Close the client, then stop the broker: SIGTERM (its workers are stopped with it), then SIGKILL."""
    if life.client is not None:
        await life.client.close()
        life.client = None
    proc = life.proc
    loop = asyncio.get_running_loop()
    if proc.is_alive():
        proc.terminate()  # SIGTERM: verifiers' servers unwind their serving() and stop their workers
        await loop.run_in_executor(None, proc.join, POOL_STOP_S)
    if proc.is_alive():
        proc.kill()
        await loop.run_in_executor(None, proc.join, POOL_STOP_S)
