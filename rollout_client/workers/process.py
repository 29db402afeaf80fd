"""What runs inside a worker process (`worker_main`), and what both sides share (`PolicySpec`, `make_policy`,
`close_policy`). The pool that starts and feeds these processes is `rollout_client.workers.pool`, whose docstring
lists the messages between the two.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import signal
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection
from typing import Any

from rollout_client.aio import bounded_close
from rollout_client.env import Environment, Gate, Task, enter_worker_setup
from rollout_client.episodes import Prefix, Resumes
from rollout_client.errors import WorkerFailed, exited
from rollout_client.group import GroupOutcome, Limits, Rollout, run_group, run_rollout
from rollout_client.policy import Policy
from rollout_client.resources import takes_turns
from rollout_client.workers.ipc import Channel, ChannelClosed
from rollout_client.workers.recycling import MEMORY_ERROR, RecyclePolicy, rss_bytes
from rollout_client.workers.turns import REPLY, RelayedTurns

log = logging.getLogger("rollout_client.workers")

CANCEL_GRACE_S = 2.0
"""After a pause runs out of time: how long the cancelled groups may take to let go of the gate."""
PAUSE_TIMEOUT = "pause_timeout"
LARGE_GROUP_TOKENS = 16_384
"""A finished group with this many tokens or more is pickled in a thread (a few ms and up of CPU); smaller
ones inline, where a thread hop would cost more than the pickling."""
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def ignoring_stop_signals() -> Iterator[None]:
    """Ignore SIGINT and SIGTERM while a worker is started, so that it starts ignoring them (an ignored signal
    stays ignored across exec) before it has imported anything; restore this process's handlers after. Only
    the main thread can change handlers: from another thread, a worker is exposed until worker_main runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = [(sig, signal.signal(sig, signal.SIG_IGN)) for sig in STOP_SIGNALS]
    try:
        yield
    finally:
        for sig, handler in saved:
            signal.signal(sig, handler)


PolicySpec = Policy | Callable[[], Policy]


async def close_policy(policy: Any) -> None:
    """Close what a policy holds (OpenAIPolicy's HTTP connections), if it can be closed."""
    aclose = getattr(policy, "aclose", None)
    if aclose is not None:
        await aclose()


def make_policy(spec: PolicySpec) -> Policy:
    """A policy instance from an instance or a zero-argument factory (workers need something that pickles)."""
    return spec if hasattr(spec, "generate") else spec()  # type: ignore[return-value]


# ------------------------------------------------------------------------------------------- worker side


def size(outcome: GroupOutcome | Rollout) -> int:
    """Tokens in a finished group or rollout: what its pickling costs."""
    if isinstance(outcome, Rollout):
        return len(outcome.tokens)
    return sum(map(len, outcome.group.tokens)) if outcome.group is not None else 0


def worker_main(
    conn: Connection,
    envs: Sequence[Environment],
    policy: PolicySpec,
    limits: Limits,
    recycle: RecyclePolicy = RecyclePolicy(),  # noqa: B008 (frozen)
) -> None:
    """Entry point of a worker process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C and a group-wide SIGTERM go to the runner, which
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stops its workers in order (or they see its pipe close)
    asyncio.run(_serve(conn, envs, policy, limits, recycle))


def portable(exc: BaseException) -> BaseException:
    """`exc` itself if it survives pickling (so the parent can catch it by type), else a WorkerFailed naming
    it; either way with the worker's traceback attached as a note."""
    exc.add_note(f"raised in rollout worker pid {os.getpid()}:\n{''.join(traceback.format_exception(exc))}")
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return WorkerFailed(f"{type(exc).__name__}: {exc}\n" + "\n".join(getattr(exc, "__notes__", [])))
    return exc


async def _serve(
    conn: Connection, envs: Sequence[Environment], spec: PolicySpec, limits: Limits, recycle: RecyclePolicy
) -> None:
    loop = asyncio.get_running_loop()
    channel = await Channel.open(conn.fileno())
    conn.close()
    gate = Gate()
    jobs: dict[int, asyncio.Task[None]] = {}
    dropped: dict[int, str] = {}
    relays: dict[int, RelayedTurns] = {}
    retiring = False

    def send(msg: tuple[Any, ...]) -> None:
        try:
            channel.send(msg)
        except ChannelClosed:
            pass  # the parent is gone; the reader below sees it and ends the loop

    shared = contextlib.AsyncExitStack()
    try:
        policy = make_policy(spec)
        for i, env in enumerate(envs):
            send(("setup", i))  # out before the setup runs: the parent bounds a setup that blocks this loop
            await enter_worker_setup(shared, env)
    except BaseException as exc:  # the parent carries it in the run's error (it is not only on stderr)
        send(("fatal", portable(exc if isinstance(exc, Exception) else exited(exc))))
        await bounded_close(shared, limits.release_timeout)
        await channel.aclose()
        return
    if hasattr(policy, "on_reachability"):  # OpenAIPolicy's circuit breaker: the parent holds dispatch
        policy.on_reachability = lambda up: send(("inference", up))
    send(("ready",))

    def retire(reason: str) -> None:
        nonlocal retiring
        if not retiring or reason == MEMORY_ERROR:  # the group that hit it never answers: the parent must kill
            retiring = True
            send(("retire", reason))

    async def run(
        job: int,
        env_index: int,
        task: Task,
        key: str,
        index: int | None = None,
        turns: bool = False,
        prefix: Prefix | None = None,
        mode: Resumes = "restart",
    ) -> None:
        outcome: GroupOutcome | Rollout
        sink = None
        if turns:  # its turns go to the runner, which posts them (rollout_client.workers.turns)
            held = (0, 0) if prefix is None else (prefix.turns, len(prefix.tokens))
            sink = relays[job] = RelayedTurns(job, send, *held)
        try:
            if index is None:
                acquired = (lambda: send(("acquired", job))) if takes_turns(envs[env_index]) else None
                outcome = await run_group(
                    envs[env_index],
                    task,
                    policy,
                    gate=gate,
                    group_key=key,
                    on_rollout_end=lambda: send(("ended", job)),
                    on_acquired=acquired,
                    **limits.kwargs(),
                )
            else:
                outcome = await run_rollout(
                    envs[env_index],
                    task,
                    policy,
                    index,
                    gate=gate,
                    group_key=key,
                    turn_sink=sink,
                    prefix=prefix,
                    mode=mode,
                    **limits.kwargs(),
                )
        except asyncio.CancelledError:
            reason = dropped.pop(job, None)
            send(("dropped", job, reason) if reason else ("cancelled", job))
            raise
        except MemoryError:  # this heap is suspect: the parent kills this worker and runs the group elsewhere
            retire(MEMORY_ERROR)
        except Exception as exc:  # process boundary: report to the parent, which counts it there
            send(("error", job, portable(exc)))
        except BaseException as exc:  # exit() in an env's code outside a rollout: its group fails, not the worker
            send(("error", job, portable(exited(exc))))
        else:
            jobs.pop(job, None)
            try:
                if size(outcome) >= LARGE_GROUP_TOKENS:
                    await channel.send_large(("done", job, outcome))  # pickled off the loop
                else:
                    channel.send(("done", job, outcome))
            except ChannelClosed:
                pass
            if reason := recycle.reason(rss_bytes()):
                retire(reason)
        finally:
            jobs.pop(job, None)
            relays.pop(job, None)

    async def pause(token: int, timeout: float | None) -> None:
        drained = await gate.drained(timeout)  # shut when the message came: a "resume" read since has opened it
        if not drained and not gate.is_open:
            cancelled = []
            for job, t in list(jobs.items()):
                if t in gate.holders():
                    dropped[job] = PAUSE_TIMEOUT
                    t.cancel()
                    cancelled.append(t)
            if cancelled:  # their "dropped" goes out before "paused": counted by the time pause() returns
                await asyncio.wait(cancelled, timeout=CANCEL_GRACE_S)
        send(("paused", token, drained))

    while True:
        try:
            msg = await channel.recv()
        except ChannelClosed:
            break
        kind = msg[0]
        if kind in ("run", "run_one"):
            jobs[msg[1]] = loop.create_task(run(*msg[1:]))
        elif kind == REPLY and msg[1] in relays:
            relays[msg[1]].answered(msg)
        elif kind == "cancel" and msg[1] in jobs:
            jobs[msg[1]].cancel()
        elif kind == "pause":  # shut in message order: a "resume" right behind it (a replacement started
            gate.shut()  # during a pause reads both at once) must leave the gate open, not closed for good
            loop.create_task(pause(msg[1], msg[2]))
        elif kind == "resume":
            gate.open()
        elif kind == "weights":
            gate.weights = msg[1]
        elif kind == "stop":
            break
    for t in list(jobs.values()):
        t.cancel()
    await asyncio.gather(*jobs.values(), return_exceptions=True)
    try:
        await bounded_close(shared, limits.release_timeout)
    except Exception:  # a teardown that fails must not keep the worker from exiting
        log.exception("an environment's worker_setup failed to exit")
    await close_policy(policy)
    await channel.aclose()
