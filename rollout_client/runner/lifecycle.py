"""A run's edges, apart from what it runs: stop on SIGINT/SIGTERM, give up a step when a stop comes first,
disconnect every env within what is left of the shutdown's time. Generic over what is stopped, so the
runner's own code is only its orchestration."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from rollout_client.client import RolloutClient
from rollout_client.errors import RetriesExhausted

log = logging.getLogger("rollout_client.runner")  # the runner's records, wherever the code lives


def stop_on_signals(loop: asyncio.AbstractEventLoop, stop: Callable[[], None]) -> list[int]:
    """Call `stop` on SIGINT and SIGTERM; the signals handled, for `loop.remove_signal_handler` after the run.
    Only the main thread can take signals: elsewhere (a `RunnerHandle`'s thread) none is handled."""
    if threading.current_thread() is not threading.main_thread():
        return []
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop)
    return [signal.SIGINT, signal.SIGTERM]


async def unless_stopped(stopping: asyncio.Event, coro: Coroutine[Any, Any, None]) -> bool:
    """Run `coro` unless `stopping` is set first (then cancel it): True if it finished."""
    work = asyncio.create_task(coro)
    stopped = asyncio.create_task(stopping.wait())
    try:
        await asyncio.wait([work, stopped], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
    if work.cancelled():
        return False
    work.result()  # re-raise its error
    return True


async def disconnect_all(clients: list[RolloutClient], deadline: float) -> None:
    """Disconnect every registered env at once, within what is left until `deadline` (a hung server cannot
    hold the shutdown past it), then close the connections."""
    loop = asyncio.get_running_loop()

    async def one(client: RolloutClient) -> None:
        try:
            await client.disconnect()
        except RetriesExhausted as exc:
            log.warning("disconnecting env %s: %s", client.env_id, exc)

    left = max(0.0, deadline - loop.time())
    tasks = [asyncio.create_task(one(c)) for c in clients if c.env_id is not None]
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=left)
        for t in pending:
            t.cancel()
        if pending:
            log.warning("%d envs not disconnected within shutdown_timeout: the server did not answer", len(pending))
            await asyncio.wait(pending)
    for client in clients:
        await client.aclose()
