"""The hand-off between the event loop and a store's writer thread, shared by the SQL backends.

A caller's function travels to the writer thread as a `_Job`; its result travels back to the caller's own
event loop, which may be closed by then (the caller gave up): that is not the writer's problem.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from api.store.base import Txn


@dataclass(slots=True)
class Job:
    fn: Callable[[Txn], Any]
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop
    replies: Sequence[str] = ()
    """Idempotency keys `fn` will look up (`Store.transact`)."""


@dataclass(slots=True)
class Stop:
    """Asks the writer thread to finish what it holds and exit; `done` resolves once it has."""

    done: Future[None]


def _settle(future: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if future.done():  # the caller was cancelled meanwhile
        return
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)


def deliver(job: Job, ok: bool, value: Any) -> None:
    """Hand a result (ok) or an exception back to the job's caller, from any thread."""
    try:
        job.loop.call_soon_threadsafe(_settle, job.future, ok, value)
    except RuntimeError:  # that event loop is closed: nobody waits for the answer any more
        pass
